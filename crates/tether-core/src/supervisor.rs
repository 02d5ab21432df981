//! The supervisor: one long-lived thread per process that launches children, waits for
//! them with pidfds and epoll, drains their report pipes and feeds their payloads, records
//! when each one exited, and reaps every one of them, the zygote's blank children included.
//!
//! It installs no SIGCHLD handler and never calls `waitpid(-1)`: tether lives inside other
//! people's processes and touches only the children it started.
//!
//! Children are launched from this thread because the kernel ties the parent-death signal to
//! the thread that forked: a child started from a short-lived thread would be killed when
//! that thread ended.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::buffer::spare_capacity;
use rustix::event::{epoll, eventfd, EventfdFlags};
use rustix::io::Errno;

use crate::channel::{Endpoint, Recv};
use crate::group::{signal_tree, Exit, Group, GroupInner, Member, WaitFor};
use crate::launch::{self, LaunchSpec, PAYLOAD_FD_ENV, REPORT_FD_ENV};
use crate::report::Report;
use crate::stacks::{self, Channel};
use crate::status::ExitStatus;
use crate::zygote::Notice;
use crate::error::Error;

/// A child of this process started some other way than [`Group::launch`], for
/// [`Group::adopt_all`].
#[derive(Debug)]
pub struct Adoption {
    pub pid: i32,
    /// The read end of its report pipe (the group takes it over).
    pub report: Option<OwnedFd>,
    /// The reserve that has watched it until now (a zygote's blank child).
    pub reserve: Option<Reserve>,
}

impl Adoption {
    /// A child forked by this process (or for it), unknown to the supervisor so far.
    pub fn forked(pid: i32, report: Option<OwnedFd>) -> Adoption {
        Adoption {
            pid,
            report,
            reserve: None,
        }
    }
}

/// Children forked ahead of time (a zygote's blanks), announced on a notice channel: the
/// supervisor watches each one from its announcement, reaps it at once if it dies, and
/// hands it to a group when a request takes it ([`Adoption::reserve`]).
#[derive(Debug, Clone, Default)]
pub struct Reserve {
    inner: Arc<ReserveInner>,
}

#[derive(Debug, Default)]
struct ReserveInner {
    blanks: Mutex<HashMap<i32, Blank>>,
    /// The supervisor token of the notice channel, while it is watched.
    notices: Mutex<Option<u64>>,
}

#[derive(Debug)]
enum Blank {
    /// `retired`: the zygote found it dead and will never hand it out.
    Waiting {
        pidfd: OwnedFd,
        token: u64,
        retired: bool,
    },
    /// Dead before a request took it; kept in case a request did take it at the last moment.
    Exited { exit: Exit, pidfd: OwnedFd },
}

impl Reserve {
    pub fn new() -> Reserve {
        Reserve::default()
    }

    fn blanks(&self) -> MutexGuard<'_, HashMap<i32, Blank>> {
        self.inner.blanks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pids of the blank children alive and waiting.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .blanks()
            .iter()
            .filter(|(_, b)| matches!(b, Blank::Waiting { .. }))
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Kills every blank child still waiting (its zygote is gone, or closing) and waits up
    /// to `limit` for the supervisor to reap them.
    pub fn stop_all(&self, limit: Duration) {
        {
            let blanks = self.blanks();
            // Not reaped while the lock is held (see `on_blank_exit`): the pids are theirs.
            for (&pid, blank) in blanks.iter() {
                if matches!(blank, Blank::Waiting { .. }) {
                    signal_tree(pid, libc::SIGKILL);
                }
            }
        }
        let deadline = Instant::now() + limit;
        while !self.pids().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Has the supervisor read `notices` (the zygote's announcements of blank children) as
    /// they arrive.
    pub fn watch(&self, notices: Endpoint) -> Result<(), Error> {
        let reserve = self.clone();
        call(|reply| Request::Watch {
            reserve,
            notices,
            reply,
        })
    }
}

/// Starts `specs` in `group` (see [`Group::launch`]).
pub(crate) fn launch(group: &Group, specs: Vec<LaunchSpec>) -> Result<Vec<usize>, Error> {
    let inner = group.inner.clone();
    let result = call(|reply| Request::Launch {
        group: inner,
        specs,
        reply,
    });
    settle(group, result)
}

/// Adopts `children` into `group` (see [`Group::adopt_all`]).
pub(crate) fn adopt(group: &Group, children: Vec<Adoption>) -> Result<Vec<usize>, Error> {
    let inner = group.inner.clone();
    let result = call(|reply| Request::Adopt {
        group: inner,
        children,
        reply,
    });
    settle(group, result)
}

/// On a failed launch or adoption, waits until the children of the call that did start
/// (already sent SIGKILL by the supervisor) are reaped.
fn settle(group: &Group, result: Result<Added, Error>) -> Result<Vec<usize>, Error> {
    let added = result?;
    match added.error {
        None => Ok(added.indices),
        Some(err) => {
            group.wait(Some(&added.indices), WaitFor::AllExited, None);
            Err(err)
        }
    }
}

/// Sends a request to the supervisor thread and waits for its reply.
fn call<T>(
    request: impl FnOnce(mpsc::SyncSender<Result<T, Error>>) -> Request,
) -> Result<T, Error> {
    let (reply, rx) = mpsc::sync_channel(1);
    supervisor()?.send(request(reply))?;
    rx.recv().map_err(|_| Error::SupervisorGone)?
}

/// The members a request added, and the error that stopped it (those members are then
/// being killed).
struct Added {
    indices: Vec<usize>,
    error: Option<Error>,
}

fn now_monotonic() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

enum Request {
    Launch {
        group: Arc<GroupInner>,
        specs: Vec<LaunchSpec>,
        reply: mpsc::SyncSender<Result<Added, Error>>,
    },
    Adopt {
        group: Arc<GroupInner>,
        children: Vec<Adoption>,
        reply: mpsc::SyncSender<Result<Added, Error>>,
    },
    Watch {
        reserve: Reserve,
        notices: Endpoint,
        reply: mpsc::SyncSender<Result<(), Error>>,
    },
}

/// The per-process supervisor. It records the pid that made it, so that a process forked
/// from this one (whose copy of the supervisor has no thread) makes its own.
struct Supervisor {
    pid: u32,
    wake: OwnedFd,
    /// The stacks channel of this process: its children's dumps arrive here.
    stacks: Channel,
    queue: Mutex<Vec<Request>>,
    /// Set when its thread could not be started: requests are refused (their callers get
    /// `SupervisorGone`) and the next call makes a new supervisor.
    failed: AtomicBool,
}

static CURRENT: AtomicPtr<Supervisor> = AtomicPtr::new(std::ptr::null_mut());

fn supervisor() -> Result<&'static Supervisor, Error> {
    let pid = std::process::id();
    let current = CURRENT.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in CURRENT comes from `Box::leak` and is never freed.
    if let Some(sup) = unsafe { current.as_ref() } {
        if sup.pid == pid && !sup.failed.load(Ordering::Acquire) {
            return Ok(sup);
        }
    }
    let fresh = Box::into_raw(Box::new(Supervisor {
        pid,
        wake: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
        stacks: Channel::new()?,
        queue: Mutex::new(Vec::new()),
        failed: AtomicBool::new(false),
    }));
    match CURRENT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // SAFETY: `fresh` was just leaked into CURRENT and lives for ever.
            let sup: &'static Supervisor = unsafe { &*fresh };
            match sup.start_thread() {
                Ok(()) => Ok(sup),
                Err(err) => {
                    sup.failed.store(true, Ordering::Release);
                    sup.refuse_queued();
                    Err(err)
                }
            }
        }
        Err(_) => {
            // Another thread made one first: use it.
            // SAFETY: `fresh` was never shared; reclaim it.
            drop(unsafe { Box::from_raw(fresh) });
            supervisor()
        }
    }
}

impl Supervisor {
    fn start_thread(&'static self) -> Result<(), Error> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        epoll::add(
            &epoll,
            &self.wake,
            epoll::EventData::new_u64(WAKE),
            epoll::EventFlags::IN,
        )?;
        epoll::add(
            &epoll,
            self.stacks.receiver(),
            epoll::EventData::new_u64(STACKS),
            epoll::EventFlags::IN,
        )?;
        std::thread::Builder::new()
            .name("tether-supervisor".into())
            .spawn(move || Loop::new(self, epoll).run())?;
        Ok(())
    }

    fn queue(&self) -> MutexGuard<'_, Vec<Request>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the queued requests: their callers' replies fail with `SupervisorGone`.
    fn refuse_queued(&self) {
        drop(std::mem::take(&mut *self.queue()));
    }

    fn send(&self, request: Request) -> Result<(), Error> {
        self.queue().push(request);
        if self.failed.load(Ordering::Acquire) {
            self.refuse_queued();
            return Err(Error::SupervisorGone);
        }
        rustix::io::write(&self.wake, &1u64.to_ne_bytes())?;
        Ok(())
    }
}

const WAKE: u64 = 0;
/// The token of the stacks channel.
const STACKS: u64 = 1;

/// This process's stacks channel (the supervisor's, started if need be).
pub(crate) fn stacks_channel() -> Result<&'static Channel, Error> {
    Ok(&supervisor()?.stacks)
}

enum Watch {
    /// The pidfd of member `index`; `report` and `payload` are the tokens of its pipes.
    Exit {
        group: Arc<GroupInner>,
        index: usize,
        report: Option<u64>,
        payload: Option<u64>,
    },
    Report {
        group: Arc<GroupInner>,
        index: usize,
        fd: OwnedFd,
    },
    Payload {
        fd: OwnedFd,
        data: Vec<u8>,
        written: usize,
    },
    /// The pidfd of a blank child (held by the reserve).
    Blank { reserve: Reserve, pid: i32 },
    /// A zygote's notice channel.
    Notices { reserve: Reserve, notices: Endpoint },
}

struct Loop {
    sup: &'static Supervisor,
    epoll: OwnedFd,
    watches: HashMap<u64, Watch>,
    next_token: u64,
}

impl Loop {
    fn new(sup: &'static Supervisor, epoll: OwnedFd) -> Loop {
        Loop {
            sup,
            epoll,
            watches: HashMap::new(),
            next_token: STACKS + 1,
        }
    }

    fn run(mut self) {
        let mut events = Vec::with_capacity(64);
        loop {
            events.clear();
            match epoll::wait(&self.epoll, spare_capacity(&mut events), None) {
                Ok(_) | Err(Errno::INTR) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
            for event in events.drain(..) {
                let token = event.data.u64();
                if token == WAKE {
                    self.serve_requests();
                } else if token == STACKS {
                    self.sup.stacks.drain();
                } else {
                    self.on_ready(token);
                }
            }
        }
    }

    fn serve_requests(&mut self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.sup.wake, &mut buf);
        let requests = std::mem::take(&mut *self.sup.queue());
        for request in requests {
            // Each reply goes out only once the request's hold on its group is dropped: the
            // caller may drop the group (and expect its fds closed) as soon as it has it.
            match request {
                Request::Launch {
                    group,
                    specs,
                    reply,
                } => {
                    let added = self.launch_all(&group, specs);
                    drop(group);
                    let _ = reply.send(Ok(added));
                }
                Request::Adopt {
                    group,
                    children,
                    reply,
                } => {
                    let added = self.adopt_all(&group, children);
                    drop(group);
                    let _ = reply.send(Ok(added));
                }
                Request::Watch {
                    reserve,
                    notices,
                    reply,
                } => {
                    let _ = reply.send(self.watch_notices(reserve, notices));
                }
            }
        }
    }

    /// Starts each spec; at the first error, kills those started (the caller waits for
    /// their exits) and stops.
    fn launch_all(&mut self, group: &Arc<GroupInner>, specs: Vec<LaunchSpec>) -> Added {
        let mut indices = Vec::with_capacity(specs.len());
        for spec in specs {
            match self.launch(group, spec) {
                Ok(index) => indices.push(index),
                Err(err) => return kill_added(group, indices, err),
            }
        }
        Added {
            indices,
            error: None,
        }
    }

    fn launch(&mut self, group: &Arc<GroupInner>, mut spec: LaunchSpec) -> Result<usize, Error> {
        let mut extra_keep = Vec::new();
        let report = if spec.report {
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            spec.env
                .push((REPORT_FD_ENV.into(), write.as_raw_fd().to_string().into()));
            extra_keep.push(write.as_raw_fd());
            Some((read, write))
        } else {
            None
        };
        if spec.stacks {
            let sender = self.sup.stacks.sender().as_raw_fd();
            let value = stacks::handler::env_value(sender, self.sup.stacks.inode());
            spec.env.push((stacks::FD_ENV.into(), value.into()));
            extra_keep.push(sender);
        }
        let payload = match spec.payload.take() {
            Some(data) => {
                let (ours, theirs) = rustix::net::socketpair(
                    rustix::net::AddressFamily::UNIX,
                    rustix::net::SocketType::STREAM,
                    rustix::net::SocketFlags::CLOEXEC,
                    None,
                )?;
                spec.env
                    .push((PAYLOAD_FD_ENV.into(), theirs.as_raw_fd().to_string().into()));
                extra_keep.push(theirs.as_raw_fd());
                Some((ours, theirs, data))
            }
            None => None,
        };
        let child = launch::command(&spec, &extra_keep)?
            .spawn()
            .map_err(|e| Error::Launch {
                program: spec
                    .argv
                    .first()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                source: e,
            })?;
        let pid = child.id() as i32;
        drop(child);
        log::info!(target: "tether::supervisor", "started pid {pid}: {:?}", spec.argv);
        let report = report.map(|(read, _write)| read);
        let payload = payload.map(|(ours, _theirs, data)| (ours, data));
        let found = self.find(pid, None)?;
        self.take(group, pid, found, report, payload)
    }

    /// Takes each child into the group; at the first error, kills the rest of the call's
    /// children (reaping those it never registered) and stops.
    fn adopt_all(&mut self, group: &Arc<GroupInner>, children: Vec<Adoption>) -> Added {
        let mut indices = Vec::with_capacity(children.len());
        for reserve in children.iter().filter_map(|c| c.reserve.as_ref()) {
            // The zygote announced each blank before it handed it out: take in those notices.
            self.drain_notices(reserve);
        }
        let mut children = children.into_iter();
        while let Some(child) = children.next() {
            match self.adopt(group, child) {
                Ok(index) => indices.push(index),
                Err(err) => {
                    for rest in children {
                        match rest.reserve {
                            // Still the reserve's: its watch reaps it.
                            Some(_) => drop(signal_tree(rest.pid, libc::SIGKILL)),
                            None => kill_and_reap(rest.pid),
                        }
                    }
                    return kill_added(group, indices, err);
                }
            }
        }
        Added {
            indices,
            error: None,
        }
    }

    fn adopt(&mut self, group: &Arc<GroupInner>, child: Adoption) -> Result<usize, Error> {
        let found = self.find(child.pid, child.reserve.as_ref())?;
        let how = if child.reserve.is_some() {
            "a blank"
        } else {
            "a fork"
        };
        log::info!(target: "tether::supervisor", "adopted pid {} ({how})", child.pid);
        self.take(group, child.pid, found, child.report, None)
    }

    /// The pidfd of our child `pid` (from the reserve that watched it, or a new one) and its
    /// exit if it has already been reaped; a child that cannot be watched is killed and
    /// reaped.
    fn find(
        &mut self,
        pid: i32,
        reserve: Option<&Reserve>,
    ) -> Result<(OwnedFd, Option<Exit>), Error> {
        match reserve.and_then(|r| r.blanks().remove(&pid)) {
            Some(Blank::Waiting { pidfd, token, .. }) => {
                self.watches.remove(&token);
                // SAFETY: `pidfd` is open.
                let _ = epoll::delete(&self.epoll, unsafe {
                    BorrowedFd::borrow_raw(pidfd.as_raw_fd())
                });
                Ok((pidfd, None))
            }
            Some(Blank::Exited { exit, pidfd }) => Ok((pidfd, Some(exit))),
            None => match open_pidfd(pid) {
                Ok(Some(fd)) => Ok((fd, None)),
                // Gone already: something else reaped it (SIGCHLD ignored).
                Ok(None) => Ok((ended_sentinel()?, Some(unknown_exit()))),
                Err(err) => Err(unwatched(pid, err)),
            },
        }
    }

    /// Makes our child a member of the group: watched from now on, or, when it has already
    /// been reaped, with its exit and what its report pipe holds.
    fn take(
        &mut self,
        group: &Arc<GroupInner>,
        pid: i32,
        (pidfd, exit): (OwnedFd, Option<Exit>),
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<usize, Error> {
        let mut member = Member::new(pid, pidfd, report_state(&report));
        let Some(exit) = exit else {
            return self.register(group, member, report, payload);
        };
        if let Some(fd) = &report {
            drain_into(fd.as_fd(), &mut member.report);
        }
        member.report.close();
        member.exit = Some(exit);
        Ok(push_member(group, member))
    }

    /// Adds the member to the group and watches its pidfd and pipes. A member that cannot be
    /// watched is killed and reaped here: unwatched, nobody would reap it.
    fn register(
        &mut self,
        group: &Arc<GroupInner>,
        member: Member,
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<usize, Error> {
        let (pid, pidfd) = (member.pid, member.sentinel.as_raw_fd());
        let index = push_member(group, member);
        match self.watch_member(group, index, pidfd, report, payload) {
            Ok(()) => Ok(index),
            Err(err) => {
                let mut state = group.lock();
                let member = &mut state.members[index];
                // SAFETY: the member's pidfd stays open while the group lives.
                let pidfd = unsafe { BorrowedFd::borrow_raw(pidfd) };
                signal_tree(pid, libc::SIGKILL);
                let status = reap_now(pidfd, pid);
                member.exit = Some(Exit {
                    status,
                    at: now_monotonic(),
                });
                member.report.close();
                drop(state);
                group.notify();
                Err(err)
            }
        }
    }

    /// Watches the member's pipes and its pidfd.
    fn watch_member(
        &mut self,
        group: &Arc<GroupInner>,
        index: usize,
        pidfd: RawFd,
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<(), Error> {
        let report = match report {
            Some(fd) => {
                let raw = fd.as_raw_fd();
                let watch = Watch::Report {
                    group: group.clone(),
                    index,
                    fd,
                };
                Some(self.add_watch(raw, epoll::EventFlags::IN, watch)?)
            }
            None => None,
        };
        let payload = match payload {
            Some((fd, data)) => {
                let raw = fd.as_raw_fd();
                let watch = Watch::Payload {
                    fd,
                    data,
                    written: 0,
                };
                Some(self.add_watch(raw, epoll::EventFlags::OUT, watch)?)
            }
            None => None,
        };
        let watch = Watch::Exit {
            group: group.clone(),
            index,
            report,
            payload,
        };
        self.add_watch(pidfd, epoll::EventFlags::IN, watch)?;
        Ok(())
    }

    fn watch_notices(&mut self, reserve: Reserve, notices: Endpoint) -> Result<(), Error> {
        let raw = notices.as_fd().as_raw_fd();
        let watch = Watch::Notices {
            reserve: reserve.clone(),
            notices,
        };
        let token = self.add_watch(raw, epoll::EventFlags::IN, watch)?;
        *reserve
            .inner
            .notices
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(token);
        Ok(())
    }

    /// Adds `fd` (non-blocking) to the epoll set under a new token for `watch`, which owns
    /// the fd or keeps alive what owns it.
    fn add_watch(
        &mut self,
        fd: RawFd,
        flags: epoll::EventFlags,
        watch: Watch,
    ) -> Result<u64, Error> {
        // SAFETY: `watch` keeps `fd` open (see above) for as long as it is in the set.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        rustix::io::ioctl_fionbio(fd, true)?;
        self.next_token += 1;
        let token = self.next_token;
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?;
        self.watches.insert(token, watch);
        Ok(token)
    }

    fn on_ready(&mut self, token: u64) {
        let open = match self.watches.get_mut(&token) {
            Some(Watch::Report { group, index, fd }) => drain(fd.as_fd(), group, *index),
            Some(Watch::Payload { fd, data, written }) => feed(fd.as_fd(), data, written),
            Some(Watch::Exit { .. }) => return self.on_exit(token),
            Some(Watch::Blank { reserve, pid }) => {
                let (reserve, pid) = (reserve.clone(), *pid);
                return self.on_blank_exit(token, &reserve, pid);
            }
            Some(Watch::Notices { reserve, .. }) => {
                let reserve = reserve.clone();
                return self.drain_notices(&reserve);
            }
            None => return,
        };
        if !open {
            self.unwatch(token);
        }
    }

    /// Removes a watch and its fd from the epoll set.
    fn unwatch(&mut self, token: u64) -> Option<Watch> {
        let watch = self.watches.remove(&token)?;
        let fd: RawFd = match &watch {
            Watch::Report { fd, .. } | Watch::Payload { fd, .. } => fd.as_raw_fd(),
            Watch::Notices { notices, .. } => notices.as_fd().as_raw_fd(),
            Watch::Exit { group, index, .. } => group.lock().members[*index].sentinel(),
            Watch::Blank { reserve, pid } => match reserve.blanks().get(pid) {
                Some(Blank::Waiting { pidfd, .. }) => pidfd.as_raw_fd(),
                _ => -1,
            },
        };
        if fd < 0 {
            return Some(watch);
        }
        // SAFETY: the fd is open: its owner is `watch` or is kept alive by it.
        let _ = epoll::delete(&self.epoll, unsafe { BorrowedFd::borrow_raw(fd) });
        Some(watch)
    }

    /// The child behind `token` is ready to be waited for: drain its report, kill what it
    /// left in its process group, reap it, and record its exit.
    fn on_exit(&mut self, token: u64) {
        let Some(Watch::Exit {
            group,
            index,
            report,
            payload,
        }) = self.unwatch(token)
        else {
            return;
        };
        if let Some(Watch::Report { fd, .. }) = report.and_then(|t| self.unwatch(t)) {
            drain(fd.as_fd(), &group, index);
        }
        if let Some(t) = payload {
            self.unwatch(t);
        }
        let mut state = group.lock();
        let member = &mut state.members[index];
        let status = reap_now(member.sentinel.as_fd(), member.pid);
        member.exit = Some(Exit {
            status,
            at: now_monotonic(),
        });
        member.report.close();
        log::info!(target: "tether::supervisor", "pid {} exited: {status}", member.pid);
        drop(state);
        group.notify();
    }

    fn on_blank_exit(&mut self, token: u64, reserve: &Reserve, pid: i32) {
        let mut blanks = reserve.blanks();
        let Some(Blank::Waiting { pidfd, retired, .. }) = blanks.remove(&pid) else {
            return;
        };
        drop(blanks);
        // SAFETY: `pidfd` is open until dropped below.
        let _ = epoll::delete(&self.epoll, unsafe {
            BorrowedFd::borrow_raw(pidfd.as_raw_fd())
        });
        self.watches.remove(&token);
        let exit = Exit {
            status: reap_now(pidfd.as_fd(), pid),
            at: now_monotonic(),
        };
        log::info!(target: "tether::supervisor", "blank pid {pid} exited: {}", exit.status);
        if !retired {
            reserve.blanks().insert(pid, Blank::Exited { exit, pidfd });
        }
    }

    /// Takes in every notice waiting on the reserve's channel.
    fn drain_notices(&mut self, reserve: &Reserve) {
        let Some(token) = *reserve
            .inner
            .notices
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        else {
            return;
        };
        loop {
            let got = match self.watches.get(&token) {
                Some(Watch::Notices { notices, .. }) => notices.recv(Some(Duration::ZERO)),
                _ => return,
            };
            match got {
                Ok(Recv::Message(message)) => match Notice::decode(&message.data) {
                    Some(Notice::Blank(pid)) => self.watch_blank(reserve, pid),
                    Some(Notice::Retired(pid)) => retire(reserve, pid),
                    None => {}
                },
                Ok(Recv::Timeout) => return,
                Ok(Recv::Closed) | Err(_) => {
                    self.unwatch(token);
                    *reserve
                        .inner
                        .notices
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = None;
                    return;
                }
            }
        }
    }

    /// Watches a blank child from its announcement; one that cannot be watched is killed.
    fn watch_blank(&mut self, reserve: &Reserve, pid: i32) {
        let pidfd = match open_pidfd(pid) {
            Ok(Some(fd)) => fd,
            Ok(None) => return,
            Err(_) => return kill_and_reap(pid),
        };
        let raw = pidfd.as_raw_fd();
        let watch = Watch::Blank {
            reserve: reserve.clone(),
            pid,
        };
        match self.add_watch(raw, epoll::EventFlags::IN, watch) {
            Ok(token) => {
                let blank = Blank::Waiting {
                    pidfd,
                    token,
                    retired: false,
                };
                reserve.blanks().insert(pid, blank);
                log::debug!(target: "tether::supervisor", "watching blank pid {pid}");
            }
            Err(_) => {
                signal_tree(pid, libc::SIGKILL);
                reap_now(pidfd.as_fd(), pid);
            }
        }
    }
}

/// The zygote has given up on a dead blank: its status will never be asked for.
fn retire(reserve: &Reserve, pid: i32) {
    let mut blanks = reserve.blanks();
    match blanks.get_mut(&pid) {
        Some(Blank::Waiting { retired, .. }) => *retired = true,
        Some(Blank::Exited { .. }) => drop(blanks.remove(&pid)),
        None => {}
    }
}

fn push_member(group: &Arc<GroupInner>, member: Member) -> usize {
    let mut state = group.lock();
    state.members.push(member);
    state.members.len() - 1
}

fn report_state(report: &Option<OwnedFd>) -> Report {
    match report {
        Some(_) => Report::default(),
        None => Report::none(),
    }
}

/// Kills the members a failed request had added (the caller waits for their exits).
fn kill_added(group: &Arc<GroupInner>, indices: Vec<usize>, error: Error) -> Added {
    let state = group.lock();
    for &i in &indices {
        if state.members[i].exit.is_none() {
            signal_tree(state.members[i].pid, libc::SIGKILL);
        }
    }
    Added {
        indices,
        error: Some(error),
    }
}

/// The error for a child that could not be watched (it has been killed and reaped).
fn unwatched(pid: i32, err: Errno) -> Error {
    kill_and_reap(pid);
    Error::Resource {
        what: format!("cannot watch child process {pid}"),
        source: io::Error::from(err),
    }
}

/// Kills a child of ours that no watch holds, and reaps it.
fn kill_and_reap(pid: i32) {
    // SAFETY: plain system calls on our own child's pid, which stays reserved until reaped
    // here.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        while libc::waitpid(pid, std::ptr::null_mut(), libc::__WALL) < 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
        {}
    }
}

/// A pidfd for `pid`, or `None` when no such process exists any more.
fn open_pidfd(pid: i32) -> Result<Option<OwnedFd>, Errno> {
    let Some(raw) = rustix::process::Pid::from_raw(pid) else {
        return Ok(None);
    };
    match rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::SRCH) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A sentinel that is readable at once: the read end of a pipe whose write end is closed.
fn ended_sentinel() -> Result<OwnedFd, Error> {
    let (read, _write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    Ok(read)
}

fn unknown_exit() -> Exit {
    Exit {
        status: ExitStatus::Unknown,
        at: now_monotonic(),
    }
}

/// Observes the exit of our child `pid` without reaping it, kills what it left in its
/// process group (the unreaped leader keeps that group id reserved), then reaps it. An
/// exit status that something else took is [`ExitStatus::Unknown`].
fn reap_now(pidfd: BorrowedFd<'_>, pid: i32) -> ExitStatus {
    let mut ready = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let _ = rustix::event::poll(&mut ready, None);
    let status = match waitid(pidfd, libc::WNOWAIT) {
        Ok(Some(status)) => status,
        Ok(None) | Err(_) => ExitStatus::Unknown,
    };
    // SAFETY: killpg on a group id owned by our unreaped child (or nobody's).
    unsafe { libc::killpg(pid, libc::SIGKILL) };
    let _ = waitid(pidfd, 0);
    status
}

/// Reads whatever the report pipe holds into member `index`'s report; returns false at end
/// of file or on error.
fn drain(fd: BorrowedFd<'_>, group: &GroupInner, index: usize) -> bool {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match rustix::io::read(fd, &mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                let complete = group.lock().members[index]
                    .report
                    .push(&buf[..n], now_monotonic());
                if complete {
                    group.notify();
                }
            }
            Err(Errno::AGAIN) => return true,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
}

/// Reads a pipe whose writer is gone to its end into `report`.
fn drain_into(fd: BorrowedFd<'_>, report: &mut Report) {
    let _ = rustix::io::ioctl_fionbio(fd, true);
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n @ 1..) = rustix::io::read(fd, &mut buf) {
        report.push(&buf[..n], now_monotonic());
    }
}

/// Writes what the payload socket takes; returns false once all is written or on error.
fn feed(fd: BorrowedFd<'_>, data: &[u8], written: &mut usize) -> bool {
    while *written < data.len() {
        match rustix::net::send(fd, &data[*written..], rustix::net::SendFlags::NOSIGNAL) {
            Ok(n) => *written += n,
            Err(Errno::AGAIN) => return true,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
    false
}

/// The status of an exited child (`None` while it runs); with `WNOWAIT` it stays unreaped.
pub(crate) fn waitid(
    pidfd: BorrowedFd<'_>,
    options: libc::c_int,
) -> Result<Option<ExitStatus>, Errno> {
    loop {
        // SAFETY: siginfo_t is plain data; zeroed is a valid value for waitid to fill.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid on our own child's pidfd, writing into `info`.
        let rc = unsafe {
            libc::waitid(
                libc::P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                options | libc::WEXITED | libc::WNOHANG,
            )
        };
        if rc != 0 {
            match Errno::from_io_error(&io::Error::last_os_error()) {
                Some(Errno::INTR) => continue,
                Some(errno) => return Err(errno),
                None => return Err(Errno::INVAL),
            }
        }
        // SAFETY: waitid succeeded, so the child fields of `info` are initialised.
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        return Ok(ExitStatus::from_siginfo(info.si_code, status));
    }
}
