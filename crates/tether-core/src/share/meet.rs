//! The meeting point of a key: how the ranks of one job on one machine that ask for the
//! same shared dataset find one copy, built once.
//!
//! The meeting point is a listening `SOCK_SEQPACKET` socket in Linux's abstract namespace,
//! named by the caller from the job's id ([`JOB_ENV`], which `tether run` and
//! `tether.spawn` give their ranks) and the key: no file, nothing to clean up, and ranks
//! of other jobs, whose id differs, never find it. [`claim`] binds the name or connects to
//! it, atomically:
//!
//! - the first process binds it ([`Claim::Build`]) and builds; a thread of its own answers
//!   every process that connects meanwhile with [`Phase::Building`] and keeps it waiting,
//!   then sends each the memfd (`SCM_RIGHTS`) once it is built, or the builder's error;
//! - every other process connects ([`Claim::Wait`]) and waits for that answer. With the
//!   memfd comes the listening socket itself: every process that holds the data answers
//!   later askers from the same socket, and the name lives as long as one of them does, so a
//!   rank that asks after the builder has exited still maps the same copy. The builder also
//!   hands both to the job's vault ([`Meeting::hand_over`], see `vault`), which holds them
//!   until the job ends. When the last holder is gone, the name and the memfd go with it:
//!   nothing is left behind.
//! - a builder that dies hangs up on its waiters ([`Outcome::BuilderDied`], with how it
//!   ended: from `/proc` while it is a zombie, from the pidfd it sent once it is reaped);
//!   the name is free again, and the first waiter to claim it builds instead.
//!
//! Both sides check that the other runs as the same user.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    accept_with, bind, connect, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags,
    SocketType,
};
use rustix::process::{pidfd_open, PidfdFlags};

use crate::channel::{Endpoint, Recv};
use crate::codec::{Reader, Writer};
use crate::proc::{stat, Of};
use crate::share::table::key_hash;
use crate::status::ExitStatus;

/// The variable that names a job to its ranks (set by `tether run` and `tether.spawn`): the
/// meeting points of a job are named after it.
pub const JOB_ENV: &str = "TETHER_JOB_ID";

/// The meeting point of `key` in the job `job`: an abstract socket name (without its
/// leading NUL) that holds the job (its id, or a hash of a long or odd one) and a 128-bit
/// hash of the key.
pub fn meeting_name(job: &str, key: &str) -> Vec<u8> {
    let (a, b) = (
        key_hash(key.as_bytes()),
        key_hash(&[&b"\x01"[..], key.as_bytes()].concat()),
    );
    format!("tether-share/{}/{a:016x}{b:016x}", job_part(job)).into_bytes()
}

/// Where the job's vault listens (see `vault`).
pub fn vault_name(job: &str) -> Vec<u8> {
    format!("tether-share/{}/vault", job_part(job)).into_bytes()
}

/// The job's part of a name: its id when short and plain (as tether makes them), else a hash.
fn job_part(job: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.';
    if job.len() <= 48 && job.chars().all(plain) {
        return job.to_string();
    }
    let bytes = job.as_bytes();
    let (a, b) = (key_hash(bytes), key_hash(&[&b"\x01"[..], bytes].concat()));
    format!("{a:016x}{b:016x}")
}

/// How long [`claim`] keeps trying when the name is bound but nobody listens yet (a builder
/// between `bind` and `listen`) before it gives up with an error.
const CLAIM_LIMIT: Duration = Duration::from_secs(10);
/// The most connections waiting to be answered.
const BACKLOG: i32 = 1024;
/// How long an answer may wait for room in a waiter's socket.
pub(crate) const SEND_LIMIT: Duration = Duration::from_secs(5);

const BUILDING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;
/// A holder to the job's vault: hold this meeting point (its name; the fds: the listening
/// socket and the memfd).
pub(crate) const HOLD: u8 = 4;

/// A process at a meeting point: its rank (negative when it has none) and pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Who {
    pub rank: i64,
    pub pid: u32,
}

/// Where a key's build stands, as its holder answers.
#[derive(Debug)]
pub enum Phase {
    Building,
    /// Built: the memfd of the data.
    Ready(OwnedFd),
    /// The build failed: the error, as the builder's caller encoded it.
    Failed(Vec<u8>),
}

/// What [`claim`] found.
#[derive(Debug)]
pub enum Claim {
    /// This process holds the name: it builds, then [`Meeting::publish`]es.
    Build(Meeting),
    /// Another process holds it: wait for its answer.
    Wait(Waiter),
}

/// Binds the meeting point `name` (an abstract socket name, without its leading NUL) or
/// connects to the process that holds it.
pub fn claim(name: &[u8], me: Who) -> io::Result<Claim> {
    let addr = SocketAddrUnix::new_abstract_name(name)?;
    let deadline = Instant::now() + CLAIM_LIMIT;
    loop {
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let sock = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)?;
        match connect(&sock, &addr) {
            Ok(()) => {
                same_user(sock.as_fd())?;
                let conn = Endpoint::from_fd(sock);
                return Ok(Claim::Wait(Waiter {
                    conn,
                    builder: None,
                    builder_pidfd: None,
                }));
            }
            // Nobody holds the name, or the holder's backlog is full (it will drain).
            Err(Errno::CONNREFUSED | Errno::NOENT | Errno::AGAIN | Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        match bind(&sock, &addr) {
            Ok(()) => {
                listen(&sock, BACKLOG)?;
                return Meeting::start(name, sock, me, Phase::Building).map(Claim::Build);
            }
            Err(Errno::ADDRINUSE) => {}
            Err(e) => return Err(e.into()),
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the meeting point of this key is held by a process that does not answer",
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Refuses a peer that runs as another user (abstract sockets have no permissions).
pub(crate) fn same_user(fd: BorrowedFd<'_>) -> io::Result<()> {
    let peer = rustix::net::sockopt::socket_peercred(fd)?;
    if peer.uid != rustix::process::getuid() {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "the meeting point of this key is held by another user's process (pid {})",
                peer.pid.as_raw_nonzero()
            ),
        ));
    }
    Ok(())
}

fn message(kind: u8, who: Who, report: &[u8]) -> Vec<u8> {
    let w = Writer::new().u8(kind).u64(who.rank as u64).u32(who.pid);
    w.bytes(report).finish()
}

/// What a meeting's holder and its serving thread share.
#[derive(Debug)]
struct Inner {
    /// The listening socket; -1 once closed (in a forked child, see `close_after_fork`).
    listener: AtomicI32,
    me: Who,
    /// This process's pidfd, sent with "building".
    pidfd: Option<OwnedFd>,
    state: Mutex<(Phase, Vec<Endpoint>)>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, (Phase, Vec<Endpoint>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers a process that connected: the data, the error, or "building" (it then
    /// waits among `waiting` for the outcome).
    fn answer(&self, conn: OwnedFd) {
        if same_user(conn.as_fd()).is_err() {
            return;
        }
        let conn = Endpoint::from_fd(conn);
        let mut state = self.state();
        let (phase, waiting) = &mut *state;
        if let Phase::Building = phase {
            if self.send(&conn, phase).is_ok() {
                waiting.push(conn);
            }
        } else {
            let _ = self.send(&conn, phase);
        }
    }

    /// Sends `phase` on `conn`: with the memfd and the listening socket when ready.
    fn send(&self, conn: &Endpoint, phase: &Phase) -> io::Result<bool> {
        let listener = self.listener.load(Ordering::Acquire);
        match phase {
            Phase::Building => {
                // With its pidfd: how this builder ends can be read even once it is reaped.
                let fds: Vec<BorrowedFd<'_>> = self.pidfd.iter().map(AsFd::as_fd).collect();
                conn.send(&message(BUILDING, self.me, b""), &fds, Some(SEND_LIMIT))
            }
            Phase::Failed(report) => {
                conn.send(&message(FAILED, self.me, report), &[], Some(SEND_LIMIT))
            }
            Phase::Ready(memfd) if listener >= 0 => {
                // SAFETY: the listener stays open while this holder serves (it is closed
                // only after its serving thread stopped, or in a forked child, which has
                // no such thread and never answers).
                let listener = unsafe { BorrowedFd::borrow_raw(listener) };
                let fds = [memfd.as_fd(), listener];
                conn.send(&message(READY, self.me, b""), &fds, Some(SEND_LIMIT))
            }
            Phase::Ready(_) => Ok(false),
        }
    }

    /// A new phase, told to every process waiting for it.
    fn settle(&self, phase: Phase) {
        let mut state = self.state();
        state.0 = phase;
        let waiting = std::mem::take(&mut state.1);
        if let Phase::Building = state.0 {
            state.1 = waiting;
            return;
        }
        for conn in waiting {
            let _ = self.send(&conn, &state.0);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        close_listener(&self.listener);
    }
}

/// Closes a listening socket kept as a raw fd (-1 once closed, so closed once).
pub(crate) fn close_listener(listener: &AtomicI32) {
    let fd = listener.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: the fd was its holder's own, swapped out above: closed once.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

/// A meeting point this process holds, answered by a thread of its own until it is
/// dropped (in the process that made it) or the process ends.
#[derive(Debug)]
pub struct Meeting {
    name: Vec<u8>,
    inner: Arc<Inner>,
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
    owner: u32,
}

impl Meeting {
    fn start(name: &[u8], listener: OwnedFd, me: Who, phase: Phase) -> io::Result<Meeting> {
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let inner = Arc::new(Inner {
            listener: AtomicI32::new(listener.as_raw_fd()),
            me,
            pidfd: pidfd_open(rustix::process::getpid(), PidfdFlags::empty()).ok(),
            state: Mutex::new((phase, Vec::new())),
        });
        std::mem::forget(listener); // owned by `inner.listener` from here
        let (served, stop) = (inner.clone(), wake.try_clone()?);
        let thread = std::thread::Builder::new()
            .name("tether-share".into())
            .spawn(move || serve(&served, &stop))?;
        Ok(Meeting {
            name: name.to_vec(),
            inner,
            wake,
            thread: Some(thread),
            owner: std::process::id(),
        })
    }

    /// Holds the meeting point `name`, received from another holder (the listening socket
    /// and the memfd of the data), answering with the data.
    pub fn hold(name: &[u8], listener: OwnedFd, memfd: OwnedFd, me: Who) -> io::Result<Meeting> {
        Meeting::start(name, listener, me, Phase::Ready(memfd))
    }

    /// The meeting point's name.
    pub fn name(&self) -> &[u8] {
        &self.name
    }

    /// Hands a duplicate of the listening socket and of the data's memfd to the job's
    /// vault listening at `vault` (see `vault`), which holds them until the job ends;
    /// false when there is no vault, or the data is not built.
    pub fn hand_over(&self, vault: &[u8]) -> io::Result<bool> {
        let addr = SocketAddrUnix::new_abstract_name(vault)?;
        let sock = socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        match connect(&sock, &addr) {
            Ok(()) => same_user(sock.as_fd())?,
            Err(Errno::CONNREFUSED | Errno::NOENT) => return Ok(false),
            Err(e) => return Err(e.into()),
        }
        let state = self.inner.state();
        let raw = self.inner.listener.load(Ordering::Acquire);
        let Phase::Ready(memfd) = &state.0 else {
            return Ok(false);
        };
        if raw < 0 {
            return Ok(false);
        }
        // SAFETY: the listener is open while this holder lives (see `Inner::send`).
        let listener = unsafe { BorrowedFd::borrow_raw(raw) };
        let msg = Writer::new().u8(HOLD).bytes(&self.name).finish();
        Endpoint::from_fd(sock).send(&msg, &[listener, memfd.as_fd()], Some(SEND_LIMIT))
    }

    /// The data is built: every process waiting, and every later one, gets `memfd`.
    pub fn publish(&self, memfd: OwnedFd) {
        self.inner.settle(Phase::Ready(memfd));
    }

    /// The build failed: every process waiting, and every later one, gets `report`.
    pub fn fail(&self, report: Vec<u8>) {
        self.inner.settle(Phase::Failed(report));
    }

    /// This process builds again (after a failure): later askers wait for it.
    pub fn rebuild(&self) {
        self.inner.settle(Phase::Building);
    }

    /// In a child forked from the holder: closes the child's copy of the listening socket,
    /// so that the name goes when the holders go, not when their children do. Takes no
    /// lock (another thread of the parent may have held one at the fork).
    pub fn close_after_fork(&self) {
        close_listener(&self.inner.listener);
    }
}

impl Drop for Meeting {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A forked child: the thread is the parent's, and so is the wake-up (an eventfd
            // both share). Only this copy of the listener goes.
            std::mem::forget(self.thread.take());
            self.close_after_fork();
            return;
        }
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The listener closes with `inner`, now that the thread has let go of it.
    }
}

/// The serving thread: answers every connection to the listener until `stop` is written.
/// Other holders accept on the same socket; whoever accepts a connection answers it.
fn serve(inner: &Inner, stop: &OwnedFd) {
    loop {
        let raw: RawFd = inner.listener.load(Ordering::Acquire);
        if raw < 0 {
            return;
        }
        // SAFETY: open until this thread has stopped (see `Inner::send`).
        let listener = unsafe { BorrowedFd::borrow_raw(raw) };
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(stop, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(_) => return,
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        if fds[0].revents().is_empty() {
            continue;
        }
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        match accept_with(listener, flags) {
            Ok(conn) => inner.answer(conn),
            Err(Errno::AGAIN | Errno::INTR | Errno::CONNABORTED) => {}
            // Out of fds, say: try again a little later rather than spin.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// What a waiting process learns.
#[derive(Debug)]
pub enum Outcome {
    /// The data's memfd, and the listening socket to answer others from.
    Ready {
        memfd: OwnedFd,
        listener: OwnedFd,
        from: Who,
    },
    /// The build failed, with the builder's report.
    Failed { report: Vec<u8>, from: Who },
    /// The builder hung up before it was done (it died, or closed its fds): how it ended,
    /// when `/proc` still tells. The name is free again: claim it anew.
    BuilderDied {
        builder: Who,
        status: Option<ExitStatus>,
    },
    /// The holder that accepted hung up before it answered (it was exiting): claim anew.
    Lost,
}

/// A process waiting at a meeting point for the data.
#[derive(Debug)]
pub struct Waiter {
    conn: Endpoint,
    builder: Option<Who>,
    /// The builder's pidfd, sent with "building".
    builder_pidfd: Option<OwnedFd>,
}

impl Waiter {
    /// The builder, once its holder said the data is being built.
    pub fn builder(&self) -> Option<Who> {
        self.builder
    }

    /// Waits up to `timeout` for the outcome; `None` when it has not come yet.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<Option<Outcome>> {
        let received = match self.conn.recv(Some(timeout)) {
            // Reset: the holder's listener closed with this connection not yet accepted.
            Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => Ok(Recv::Closed),
            other => other,
        };
        let mut msg = match received? {
            Recv::Timeout => return Ok(None),
            Recv::Closed => {
                return Ok(Some(match self.builder {
                    Some(builder) => Outcome::BuilderDied {
                        builder,
                        status: exit_status(builder.pid, self.builder_pidfd.as_ref()),
                    },
                    None => Outcome::Lost,
                }))
            }
            Recv::Message(msg) => msg,
        };
        let mut r = Reader::new(&msg.data, "meeting point message");
        let (kind, rank, pid) = (r.u8()?, r.u64()? as i64, r.u32()?);
        let from = Who { rank, pid };
        match kind {
            BUILDING => {
                self.builder = Some(from);
                self.builder_pidfd = msg.fds.pop();
                Ok(None)
            }
            FAILED => Ok(Some(Outcome::Failed {
                report: r.bytes()?.to_vec(),
                from,
            })),
            READY if msg.fds.len() == 2 => {
                let listener = msg.fds.pop();
                let memfd = msg.fds.pop();
                match (memfd, listener) {
                    (Some(memfd), Some(listener)) => Ok(Some(Outcome::Ready {
                        memfd,
                        listener,
                        from,
                    })),
                    _ => Err(crate::codec::malformed("meeting point message")),
                }
            }
            _ => Err(crate::codec::malformed("meeting point message")),
        }
    }
}

/// How a process that just hung up ended, waiting briefly for it to finish exiting: the
/// status the kernel keeps in `/proc/PID/stat` (field 52) from its exit until it is reaped,
/// then in its pidfd (`PIDFD_INFO_EXIT`, Linux 6.15). `None` when neither tells (an older
/// kernel, a process already reaped, one that does not exit).
fn exit_status(pid: u32, pidfd: Option<&OwnedFd>) -> Option<ExitStatus> {
    let pid = i32::try_from(pid).ok()?;
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        if let Some(code) = pidfd.and_then(exit_code_of_pidfd) {
            return Some(ExitStatus::from_wait_status(code));
        }
        let stat = stat(Of::Pid(pid));
        let state = stat.as_ref().and_then(|s| s.field(3)?.chars().next());
        if let (Some(stat), Some('Z' | 'X')) = (&stat, state) {
            return stat
                .number(52)
                .map(|code| ExitStatus::from_wait_status(code as i32));
        }
        if Instant::now() >= deadline || (stat.is_none() && pidfd.is_none()) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The wait status of a reaped process, from its pidfd; `None` before it is reaped, or
/// where the kernel does not tell.
fn exit_code_of_pidfd(pidfd: &OwnedFd) -> Option<i32> {
    // SAFETY: `pidfd_info` is plain integers, for which zero is a valid value.
    let mut info: libc::pidfd_info = unsafe { std::mem::zeroed() };
    info.mask = u64::from(libc::PIDFD_INFO_EXIT);
    // SAFETY: PIDFD_GET_INFO writes at most `size_of::<pidfd_info>()` bytes (the size is in
    // the request number) into `info`, which lives across the call.
    let done = unsafe {
        libc::ioctl(
            pidfd.as_raw_fd(),
            libc::PIDFD_GET_INFO,
            std::ptr::addr_of_mut!(info),
        )
    };
    (done == 0 && info.mask & u64::from(libc::PIDFD_INFO_EXIT) != 0).then_some(info.exit_code)
}

#[cfg(test)]
mod tests;
