//! The supervisor: one long-lived thread per process that launches children, waits for
//! them with pidfds and epoll, drains their report pipes and feeds their payloads, records
//! when each one exited, and reaps every one of them.
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
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::buffer::spare_capacity;
use rustix::event::{epoll, eventfd, EventfdFlags};
use rustix::io::Errno;

use crate::launch::{self, LaunchSpec, PAYLOAD_FD_ENV, REPORT_FD_ENV};
use crate::status::ExitStatus;
use crate::Error;

/// Reports larger than this are cut (the child is still drained, so it never blocks).
const REPORT_LIMIT: usize = 64 << 20;

/// A child's failure report is one frame: a little-endian u64 length, then that many bytes.
/// The moment a whole frame has arrived the child counts as failed, even while it is still
/// shutting down (an interpreter with torch loaded takes most of a second to exit).
fn complete_frame(report: &[u8]) -> bool {
    let Some(header) = report.get(..8) else {
        return false;
    };
    let mut len = [0u8; 8];
    len.copy_from_slice(header);
    let len = u64::from_le_bytes(len);
    (report.len() as u64 - 8) >= len || report.len() >= REPORT_LIMIT
}

/// When and how a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub status: ExitStatus,
    /// `CLOCK_MONOTONIC` time at which the supervisor saw the exit (comparable with
    /// Python's `time.monotonic()` and across processes).
    pub at: Duration,
}

/// One child of a [`Group`].
#[derive(Debug)]
pub struct Member {
    pub pid: i32,
    pidfd: OwnedFd,
    exit: Option<Exit>,
    report: Vec<u8>,
    reported_at: Option<Duration>,
}

impl Member {
    pub fn exit(&self) -> Option<Exit> {
        self.exit
    }
    /// When a whole failure report had arrived (`CLOCK_MONOTONIC`).
    pub fn reported_at(&self) -> Option<Duration> {
        self.reported_at
    }
    /// When the member failed: its report's arrival, or its non-zero exit.
    pub fn failed_at(&self) -> Option<Duration> {
        let failed_exit = self.exit.filter(|e| !e.status.success()).map(|e| e.at);
        match (self.reported_at, failed_exit) {
            (Some(r), Some(e)) => Some(r.min(e)),
            (r, e) => r.or(e),
        }
    }
    pub fn report(&self) -> &[u8] {
        &self.report
    }
    /// The pidfd: readable once the child has exited; open as long as the group lives.
    pub fn sentinel(&self) -> RawFd {
        self.pidfd.as_raw_fd()
    }
}

#[derive(Debug, Default)]
struct GroupState {
    members: Vec<Member>,
}

#[derive(Debug, Default)]
struct GroupInner {
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl GroupInner {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        // A panic while holding the lock leaves consistent data behind: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A set of children started together and watched together: the Rust face of a
/// `ProcessContext`, a pool's workers, or a launcher's ranks.
#[derive(Debug, Clone, Default)]
pub struct Group {
    inner: Arc<GroupInner>,
}

/// What [`Group::wait`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFor {
    /// Every chosen member has exited.
    AllExited,
    /// Every chosen member has exited, or one of them failed (exited non-zero, or sent a
    /// whole failure report).
    AllExitedOrFailure,
    /// Any chosen member has exited.
    AnyExited,
}

impl Group {
    pub fn new() -> Group {
        Group::default()
    }

    /// Starts one child per spec, all from the supervisor thread, and returns their indices
    /// in this group. On an error, the children of this call that did start are killed.
    pub fn launch(&self, specs: Vec<LaunchSpec>) -> Result<Vec<usize>, Error> {
        let (reply, rx) = mpsc::sync_channel(1);
        supervisor()?.send(Request::Launch {
            group: self.inner.clone(),
            specs,
            reply,
        })?;
        rx.recv().map_err(|_| Error::SupervisorGone)?
    }

    /// Takes on a child this process forked itself (`pid`), and optionally the read end of
    /// its report pipe. Returns its index in this group.
    pub fn adopt(&self, pid: i32, report: Option<OwnedFd>) -> Result<usize, Error> {
        let (reply, rx) = mpsc::sync_channel(1);
        supervisor()?.send(Request::Adopt {
            group: self.inner.clone(),
            pid,
            report,
            reply,
        })?;
        rx.recv().map_err(|_| Error::SupervisorGone)?
    }

    pub fn len(&self) -> usize {
        self.inner.lock().members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f` with member `index`.
    pub fn with_member<R>(&self, index: usize, f: impl FnOnce(&Member) -> R) -> Option<R> {
        self.inner.lock().members.get(index).map(f)
    }

    pub fn pid(&self, index: usize) -> Option<i32> {
        self.with_member(index, |m| m.pid)
    }

    pub fn exit(&self, index: usize) -> Option<Exit> {
        self.with_member(index, |m| m.exit).flatten()
    }

    /// Sends `signal` to the process group of member `index` (and to the member itself,
    /// should it have left its group). Returns false when the member had already exited.
    ///
    /// A member's exit is observed without reaping it, its group is emptied, and only then is
    /// it reaped, all under the group's lock: so a group id signalled here can never belong to
    /// an unrelated, newer process group.
    pub fn signal(&self, index: usize, signal: i32) -> io::Result<bool> {
        let state = self.inner.lock();
        let Some(member) = state.members.get(index) else {
            return Err(io::Error::new(io::ErrorKind::NotFound, "no such member"));
        };
        if member.exit.is_some() {
            return Ok(false);
        }
        Ok(signal_tree(member.pid, signal))
    }

    /// Sends `signal` to every member still running; returns how many were signalled.
    pub fn signal_all(&self, signal: i32) -> usize {
        let state = self.inner.lock();
        state
            .members
            .iter()
            .filter(|m| m.exit.is_none())
            .filter(|m| signal_tree(m.pid, signal))
            .count()
    }

    /// Waits until the condition holds for the members in `which` (all members when `None`)
    /// or until `timeout` passes. Returns whether the condition holds.
    pub fn wait(&self, which: Option<&[usize]>, until: WaitFor, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut state = self.inner.lock();
        loop {
            if holds(&state.members, which, until) {
                return true;
            }
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return false,
                },
            };
            state = self
                .inner
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops every running member: `signal` (SIGTERM) to its process group, up to `grace`
    /// for it to exit, then SIGKILL; returns once every member has been reaped.
    pub fn terminate(&self, signal: i32, grace: Duration) {
        if self.signal_all(signal) > 0 && !self.wait(None, WaitFor::AllExited, Some(grace)) {
            self.signal_all(libc::SIGKILL);
        }
        self.wait(None, WaitFor::AllExited, None);
    }
}

fn holds(members: &[Member], which: Option<&[usize]>, until: WaitFor) -> bool {
    let chosen: Box<dyn Iterator<Item = &Member>> = match which {
        None => Box::new(members.iter()),
        Some(indices) => Box::new(indices.iter().filter_map(|&i| members.get(i))),
    };
    let mut all = true;
    for m in chosen {
        if until == WaitFor::AllExitedOrFailure && m.reported_at.is_some() {
            return true;
        }
        match m.exit {
            None => all = false,
            Some(e) if until == WaitFor::AllExitedOrFailure && !e.status.success() => return true,
            Some(_) if until == WaitFor::AnyExited => return true,
            Some(_) => {}
        }
    }
    all && until != WaitFor::AnyExited
}

/// Signals the process group led by `pid`, or `pid` alone if it left that group.
fn signal_tree(pid: i32, signal: i32) -> bool {
    // SAFETY: plain system calls on ids this process owns (see `Group::signal`).
    unsafe { libc::killpg(pid, signal) == 0 || libc::kill(pid, signal) == 0 }
}

fn now_monotonic() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

enum Request {
    Launch {
        group: Arc<GroupInner>,
        specs: Vec<LaunchSpec>,
        reply: mpsc::SyncSender<Result<Vec<usize>, Error>>,
    },
    Adopt {
        group: Arc<GroupInner>,
        pid: i32,
        report: Option<OwnedFd>,
        reply: mpsc::SyncSender<Result<usize, Error>>,
    },
}

/// The per-process supervisor. It records the pid that made it, so that a process forked
/// from this one (whose copy of the supervisor has no thread) makes its own.
struct Supervisor {
    pid: u32,
    wake: OwnedFd,
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
            next_token: WAKE + 1,
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
            match request {
                Request::Launch {
                    group,
                    specs,
                    reply,
                } => {
                    let _ = reply.send(self.launch_all(&group, specs));
                }
                Request::Adopt {
                    group,
                    pid,
                    report,
                    reply,
                } => {
                    let _ = reply.send(self.adopt(&group, pid, report));
                }
            }
        }
    }

    fn launch_all(
        &mut self,
        group: &Arc<GroupInner>,
        specs: Vec<LaunchSpec>,
    ) -> Result<Vec<usize>, Error> {
        let mut started = Vec::with_capacity(specs.len());
        for spec in specs {
            match self.launch(group, spec) {
                Ok(index) => started.push(index),
                Err(err) => {
                    let state = group.lock();
                    for &i in &started {
                        signal_tree(state.members[i].pid, libc::SIGKILL);
                    }
                    return Err(err);
                }
            }
        }
        Ok(started)
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
        let report = report.map(|(read, _write)| read);
        let payload = payload.map(|(ours, _theirs, data)| (ours, data));
        self.register(group, pid, report, payload)
    }

    fn adopt(
        &mut self,
        group: &Arc<GroupInner>,
        pid: i32,
        report: Option<OwnedFd>,
    ) -> Result<usize, Error> {
        self.register(group, pid, report, None)
    }

    fn register(
        &mut self,
        group: &Arc<GroupInner>,
        pid: i32,
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<usize, Error> {
        let raw = rustix::process::Pid::from_raw(pid)
            .ok_or(Error::Io(io::Error::from_raw_os_error(libc::ESRCH)))?;
        let pidfd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty())?;
        let pidfd_raw = pidfd.as_raw_fd();
        let index = {
            let mut state = group.lock();
            state.members.push(Member {
                pid,
                pidfd,
                exit: None,
                report: Vec::new(),
                reported_at: None,
            });
            state.members.len() - 1
        };
        match self.watch_member(group, index, pidfd_raw, report, payload) {
            Ok(()) => Ok(index),
            Err(err) => {
                // Unwatched, nobody would reap it: stop it and reap it now. Watches already
                // added for its pipes end by themselves once it is gone.
                let mut state = group.lock();
                let member = &mut state.members[index];
                signal_tree(member.pid, libc::SIGKILL);
                let mut ready = [rustix::event::PollFd::new(
                    &member.pidfd,
                    rustix::event::PollFlags::IN,
                )];
                let _ = rustix::event::poll(&mut ready, None);
                let status = waitid(&member.pidfd, 0)
                    .ok()
                    .flatten()
                    .unwrap_or(ExitStatus::Unknown);
                member.exit = Some(Exit {
                    status,
                    at: now_monotonic(),
                });
                drop(state);
                group.changed.notify_all();
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

    /// Adds `fd` (non-blocking) to the epoll set under a new token for `watch`, which owns
    /// the fd or keeps alive the group whose member owns it.
    fn add_watch(
        &mut self,
        fd: RawFd,
        flags: epoll::EventFlags,
        watch: Watch,
    ) -> Result<u64, Error> {
        // SAFETY: `watch` keeps `fd` open (see above) for as long as it is in the set.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        rustix::io::ioctl_fionbio(fd, true)?;
        let token = self.token();
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?;
        self.watches.insert(token, watch);
        Ok(token)
    }

    fn token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    fn on_ready(&mut self, token: u64) {
        let open = match self.watches.get_mut(&token) {
            Some(Watch::Report { group, index, fd }) => drain(fd.as_fd(), group, *index),
            Some(Watch::Payload { fd, data, written }) => feed(fd.as_fd(), data, written),
            Some(Watch::Exit { .. }) => return self.on_exit(token),
            None => return,
        };
        if !open {
            self.remove(token);
        }
    }

    fn remove(&mut self, token: u64) -> Option<Watch> {
        let watch = self.watches.remove(&token)?;
        match &watch {
            Watch::Report { fd, .. } | Watch::Payload { fd, .. } => {
                let _ = epoll::delete(&self.epoll, fd);
            }
            Watch::Exit { group, index, .. } => {
                let state = group.lock();
                // SAFETY: the member's pidfd is open (the group is alive through `watch`).
                let fd = unsafe { BorrowedFd::borrow_raw(state.members[*index].pidfd.as_raw_fd()) };
                let _ = epoll::delete(&self.epoll, fd);
            }
        }
        Some(watch)
    }

    /// The child behind `token` is ready to be waited for: observe its status without reaping
    /// it, drain its report, kill what it left in its process group, then reap it.
    fn on_exit(&mut self, token: u64) {
        let Some(Watch::Exit {
            group,
            index,
            report,
            payload,
        }) = self.watches.get(&token)
        else {
            return;
        };
        let (group, index, report, payload) = (group.clone(), *index, *report, *payload);
        let status = {
            let state = group.lock();
            match waitid(&state.members[index].pidfd, libc::WNOWAIT) {
                Ok(Some(status)) => status,
                Ok(None) => return,
                // Somebody else reaped it (SIGCHLD set to SIG_IGN reaps automatically).
                Err(_) => ExitStatus::Unknown,
            }
        };
        let at = now_monotonic();
        if let Some(Watch::Report { fd, .. }) = report.and_then(|t| self.remove(t)) {
            drain(fd.as_fd(), &group, index);
        }
        if let Some(t) = payload {
            self.remove(t);
        }
        self.remove(token);
        let mut state = group.lock();
        let member = &mut state.members[index];
        // The leader is a zombie until reaped below, so its group id is still reserved.
        // SAFETY: killpg on a group id owned by our unreaped child.
        unsafe { libc::killpg(member.pid, libc::SIGKILL) };
        let _ = waitid(&member.pidfd, 0);
        member.exit = Some(Exit { status, at });
        drop(state);
        group.changed.notify_all();
    }
}

/// Reads whatever the report pipe holds; returns false at end of file or on error.
fn drain(fd: BorrowedFd<'_>, group: &GroupInner, index: usize) -> bool {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match rustix::io::read(fd, &mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                let mut state = group.lock();
                let member = &mut state.members[index];
                let room = REPORT_LIMIT.saturating_sub(member.report.len());
                member.report.extend_from_slice(&buf[..n.min(room)]);
                if member.reported_at.is_none() && complete_frame(&member.report) {
                    member.reported_at = Some(now_monotonic());
                    drop(state);
                    group.changed.notify_all();
                }
            }
            Err(Errno::AGAIN) => return true,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
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
pub(crate) fn waitid(pidfd: &OwnedFd, options: libc::c_int) -> Result<Option<ExitStatus>, Errno> {
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
