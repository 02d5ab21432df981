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
//!   rank that asks after the builder has exited still maps the same copy. When the last
//!   holder exits, the name and the memfd go with it: nothing is left behind.
//! - a builder that dies hangs up on its waiters ([`Outcome::BuilderDied`], with how it
//!   ended when `/proc` still tells); the name is free again, and the first waiter to claim
//!   it builds instead.
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

use crate::channel::{Endpoint, Recv};
use crate::proc::{stat, Of};
use crate::status::ExitStatus;
use crate::wire::{Reader, Writer};

/// The variable that names a job to its ranks (set by `tether run` and `tether.spawn`): the
/// meeting points of a job are named after it.
pub const JOB_ENV: &str = "TETHER_JOB_ID";

/// How long [`claim`] keeps trying when the name is bound but nobody listens yet (a builder
/// between `bind` and `listen`) before it gives up with an error.
const CLAIM_LIMIT: Duration = Duration::from_secs(10);
/// The most connections waiting to be answered.
const BACKLOG: i32 = 1024;
/// How long an answer may wait for room in a waiter's socket.
const SEND_LIMIT: Duration = Duration::from_secs(5);

const BUILDING: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;

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
                }));
            }
            // Nobody holds the name, or the holder's backlog is full (it will drain).
            Err(Errno::CONNREFUSED | Errno::NOENT | Errno::AGAIN | Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        match bind(&sock, &addr) {
            Ok(()) => {
                listen(&sock, BACKLOG)?;
                return Meeting::start(sock, me, Phase::Building).map(Claim::Build);
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
fn same_user(fd: BorrowedFd<'_>) -> io::Result<()> {
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
            Phase::Building => conn.send(&message(BUILDING, self.me, b""), &[], Some(SEND_LIMIT)),
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

/// A meeting point this process holds, answered by a thread of its own until it is
/// dropped (in the process that made it) or the process ends.
#[derive(Debug)]
pub struct Meeting {
    inner: Arc<Inner>,
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
    owner: u32,
}

impl Meeting {
    fn start(listener: OwnedFd, me: Who, phase: Phase) -> io::Result<Meeting> {
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let inner = Arc::new(Inner {
            listener: AtomicI32::new(listener.as_raw_fd()),
            me,
            state: Mutex::new((phase, Vec::new())),
        });
        std::mem::forget(listener); // owned by `inner.listener` from here
        let (served, stop) = (inner.clone(), wake.try_clone()?);
        let thread = std::thread::Builder::new()
            .name("tether-share".into())
            .spawn(move || serve(&served, &stop))?;
        Ok(Meeting {
            inner,
            wake,
            thread: Some(thread),
            owner: std::process::id(),
        })
    }

    /// Holds a meeting point received from another holder (the listening socket and the
    /// memfd of the data), answering with the data.
    pub fn hold(listener: OwnedFd, memfd: OwnedFd, me: Who) -> io::Result<Meeting> {
        Meeting::start(listener, me, Phase::Ready(memfd))
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
        let fd = self.inner.listener.swap(-1, Ordering::AcqRel);
        if fd >= 0 {
            // SAFETY: the fd was this object's own (swapped out above, so closed once).
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
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
        self.close_after_fork();
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
                        status: exit_status(builder.pid),
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
                    _ => Err(crate::wire::malformed("meeting point message")),
                }
            }
            _ => Err(crate::wire::malformed("meeting point message")),
        }
    }
}

/// How a process that just hung up ended: the exit status the kernel keeps in
/// `/proc/PID/stat` (field 52) from the moment it exits until it is reaped. Waits briefly
/// for it to finish exiting; `None` when it was reaped already, or does not exit.
fn exit_status(pid: u32) -> Option<ExitStatus> {
    let pid = i32::try_from(pid).ok()?;
    let deadline = Instant::now() + Duration::from_millis(200);
    loop {
        let stat = stat(Of::Pid(pid))?;
        let state = stat.field(3)?.chars().next()?;
        if matches!(state, 'Z' | 'X') || Instant::now() >= deadline {
            if !matches!(state, 'Z' | 'X') {
                return None;
            }
            let code = stat.number(52)? as i32;
            return Some(match code & 0x7f {
                0 => ExitStatus::Exited((code >> 8) & 0xff),
                signal => ExitStatus::Signaled {
                    signal,
                    core_dumped: code & 0x80 != 0,
                },
            });
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests;
