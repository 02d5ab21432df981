//! The parent's side: [`Zygote`], the handle on a running zygote. It starts the zygote,
//! sends it requests in batches, adopts the children it makes into the caller's group, and
//! tells a zygote that died, stopped or stopped answering from one that is merely slow.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use crate::attrs::Attributes;
use crate::blanks::reserve::Reserve;
use crate::channel::{Endpoint, Recv};
use crate::error::Error;
use crate::group::{Exit, Group, WaitFor};
use crate::launch::LaunchSpec;
use crate::memfd::payload_memfd;
use crate::proc::{describe_state, process_state};
use crate::warden::request::Adoption;
use crate::warden::thread::follow_blanks;
use crate::zygote::wire::{Common, Order, Reply};

/// Ranks per message: the zygote holds at most this many report pipes at once.
const BATCH: usize = 32;
/// How long a reply may keep the parent waiting before the zygote counts as not answering.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopped zygote (SIGSTOP, a debugger) is given before the start fails.
const STOPPED_PATIENCE: Duration = Duration::from_secs(1);
/// How often a waiting parent checks on the zygote.
const CHECK_EVERY: Duration = Duration::from_millis(250);
/// The environment variable that names the zygote's two fds ("request,notices").
pub const FDS_ENV: &str = "TETHER_ZYGOTE_FDS";
/// The type name of the report of a zygote that declines to serve (its text is the reason,
/// one sentence, shown as it is).
pub const DECLINED: &str = "tether.ZygoteDeclined";

/// What a start asks of the zygote.
#[derive(Debug)]
pub struct ForkRequest<'a> {
    pub ranks: &'a [u32],
    /// Fds every child inherits, and the number each gets in the child.
    pub shared: &'a [(BorrowedFd<'a>, i32)],
    /// The prepared work, opaque here (read by the child with [`Job::read_payload`]).
    pub payload: &'a [u8],
    /// The caller's attributes, read when the request is made.
    pub attrs: Attributes,
}

/// The parent's handle on a running zygote.
#[derive(Debug)]
pub struct Zygote {
    process: Group,
    request: Endpoint,
    reserve: Reserve,
    /// The attributes the zygote was started with (its resource limits bound its children's).
    started_with: Attributes,
    ready: Option<Vec<u8>>,
    broken: Option<String>,
    vanished: bool,
}

impl Zygote {
    /// Starts the zygote process from `spec` (its program calls [`serve`] with the fds named
    /// by [`FDS_ENV`]). Returns at once: the zygote gets ready in the background.
    pub fn start(mut spec: LaunchSpec) -> Result<Zygote, Error> {
        let started_with = Attributes::of_caller()?;
        let (request, theirs) = Endpoint::pair()?;
        let (notices, their_notices) = Endpoint::pair()?;
        let fds = [
            theirs.as_fd().as_raw_fd(),
            their_notices.as_fd().as_raw_fd(),
        ];
        spec.env.push((
            FDS_ENV.into(),
            OsString::from(format!("{},{}", fds[0], fds[1])),
        ));
        spec.keep_fds.extend(fds);
        spec.report = true;
        let process = Group::new();
        process.launch(vec![spec])?;
        drop((theirs, their_notices));
        let reserve = Reserve::new();
        log::info!(target: "tether::zygote", "started the zygote: pid {}", process.pid(0).unwrap_or(0));
        let zygote = Zygote {
            process,
            request,
            reserve,
            started_with,
            ready: None,
            broken: None,
            vanished: false,
        };
        follow_blanks(&zygote.reserve, notices)?;
        Ok(zygote)
    }

    pub fn pid(&self) -> i32 {
        self.process.pid(0).unwrap_or(0)
    }

    /// The zygote's exit, once it has exited.
    pub fn exit(&self) -> Option<Exit> {
        self.process.exit(0)
    }

    /// The pids of the blank children waiting.
    pub fn blanks(&self) -> Vec<i32> {
        self.reserve.pids()
    }

    /// Whether it can serve a request from a caller with `attrs`: running, answering, and
    /// started with resource limits no lower than the caller's.
    pub fn usable(&self, attrs: &Attributes) -> bool {
        self.broken.is_none() && self.exit().is_none() && self.started_with.limits_allow(attrs)
    }

    /// Why it is unusable, if it failed.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The fd to poll while the zygote gets ready: readable once it has said it is ready
    /// (then [`Zygote::wait_ready`] returns at once) or has gone away.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.request.as_fd()
    }

    /// Waits until the zygote is ready (its imports done); returns what it said then.
    pub fn wait_ready(&mut self) -> Result<&[u8], Error> {
        if self.ready.is_none() {
            match self.reply(None)? {
                Reply::Ready(body) => {
                    log::info!(target: "tether::zygote", "zygote pid {} is ready", self.pid());
                    self.ready = Some(body)
                }
                _ => return Err(self.fail(Fault::Unexpected)),
            }
        }
        Ok(self.ready.as_deref().unwrap_or_default())
    }

    /// Starts one child per rank in `group` (member n runs `ranks[n]`). On an error, every
    /// child of the call is stopped and reaped, every fd made for it closed.
    pub fn fork(&mut self, request: &ForkRequest<'_>, group: &Group) -> Result<Vec<usize>, Error> {
        let first = group.len();
        let result = self.fork_batches(request, group);
        if result.is_err() {
            let started: Vec<usize> = (first..group.len()).collect();
            for &i in &started {
                let _ = group.signal(i, libc::SIGKILL);
            }
            group.wait(Some(&started), WaitFor::AllExited, None);
        }
        result
    }

    fn fork_batches(
        &mut self,
        request: &ForkRequest<'_>,
        group: &Group,
    ) -> Result<Vec<usize>, Error> {
        self.wait_ready()?;
        let payload = payload_memfd(request.payload)
            .map_err(|e| Error::resource("cannot hold the payload for the zygote", e))?;
        let common = Common {
            targets: request.shared.iter().map(|&(_, t)| t).collect(),
            attrs: request.attrs.clone(),
        }
        .encode();
        let mut indices = Vec::with_capacity(request.ranks.len());
        for (n, ranks) in request.ranks.chunks(BATCH).enumerate() {
            let pipes = report_pipes(ranks)?;
            let order = match n {
                0 => Order::Start {
                    ranks: request.ranks.to_vec(),
                    shared: request.shared.len() as u32,
                    common: common.clone(),
                    batch: ranks.len() as u32,
                },
                _ => Order::Batch {
                    batch: ranks.len() as u32,
                },
            };
            let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
            if n == 0 {
                fds.push(payload.as_fd());
                fds.extend(request.shared.iter().map(|&(fd, _)| fd));
            }
            fds.extend(pipes.iter().map(|(_, w)| w.as_fd()));
            self.send(&order.encode(), &fds)?;
            drop(fds);
            let reads = pipes.into_iter().map(|(r, _)| r).collect();
            indices.extend(self.take_batch(ranks, reads, group)?);
        }
        Ok(indices)
    }

    /// Reads the zygote's answer for a batch and adopts the children it made.
    fn take_batch(
        &mut self,
        ranks: &[u32],
        reads: Vec<OwnedFd>,
        group: &Group,
    ) -> Result<Vec<usize>, Error> {
        let reply = self.reply(Some(ANSWER_TIMEOUT))?;
        let (made, error) = match reply {
            Reply::Started(made) => (made, None),
            Reply::Failed {
                errno,
                message,
                made,
            } => {
                let source = io::Error::from_raw_os_error(errno);
                let what = format!("the tether zygote (pid {}): {message}", self.pid());
                let err = match errno {
                    0 => Error::Zygote(what),
                    _ => Error::Resource { what, source },
                };
                (made, Some(err))
            }
            Reply::Ready(_) | Reply::Kept(_) => return Err(self.fail(Fault::Unexpected)),
        };
        let mut reads: Vec<Option<OwnedFd>> = reads.into_iter().map(Some).collect();
        let children = made
            .iter()
            .map(|m| Adoption {
                pid: m.pid,
                report: ranks
                    .iter()
                    .position(|&r| r == m.rank)
                    .and_then(|i| reads[i].take()),
                reserve: m.blank.then(|| self.reserve.clone()),
            })
            .collect();
        let indices = group.adopt_all(children)?;
        match error {
            None => Ok(indices),
            Some(err) => Err(err),
        }
    }

    /// Tells the zygote that the caller is about to set its soft `RLIMIT_NPROC` to `limit`
    /// (`None`: unlimited), and returns once the zygote holds no more blanks than the room
    /// it leaves allows (see [`crate::blanks`]): how many it holds then. Call it before the
    /// limit is set, so that the caller's next thread or process finds the room. A zygote
    /// still importing has no blank yet (it reads the caller's limit before it forks any):
    /// nothing is asked of it; one that is broken or gone holds none.
    pub fn make_room(&mut self, limit: Option<u64>) -> Result<usize, Error> {
        if self.broken.is_some() || self.exit().is_some() {
            return Ok(0);
        }
        if self.ready.is_none() {
            let said = self.request.readable_within(Duration::ZERO);
            if !said.map_err(|e| Error::resource("cannot poll the zygote", e))? {
                return Ok(0);
            }
            self.wait_ready()?;
        }
        self.send(&Order::Room { limit }.encode(), &[])?;
        match self.reply(Some(ANSWER_TIMEOUT))? {
            Reply::Kept(held) => Ok(held as usize),
            _ => Err(self.fail(Fault::Unexpected)),
        }
    }

    fn send(&mut self, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), Error> {
        let mut silent = Duration::ZERO;
        loop {
            match self.request.send(data, fds, Some(CHECK_EVERY)) {
                Ok(true) => return Ok(()),
                Ok(false) => self.check(&mut silent, Some(ANSWER_TIMEOUT))?,
                Err(err) if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
                    return Err(self.fail(Fault::WentAway))
                }
                Err(err) => {
                    return Err(Error::resource("cannot send a request to the zygote", err))
                }
            }
        }
    }

    /// The next reply, waiting while the zygote lives and answers within `patience` (for
    /// ever while it runs when `None`).
    fn reply(&mut self, patience: Option<Duration>) -> Result<Reply, Error> {
        let mut silent = Duration::ZERO;
        loop {
            match self.request.recv(Some(CHECK_EVERY)) {
                Ok(Recv::Message(m)) => {
                    return Reply::decode(&m.data).map_err(|_| self.fail(Fault::Malformed))
                }
                Ok(Recv::Timeout) => self.check(&mut silent, patience)?,
                Ok(Recv::Closed) => return Err(self.fail(Fault::WentAway)),
                // A zygote that died with a message of ours unread resets the channel.
                Err(err) if err.raw_os_error() == Some(libc::ECONNRESET) => {
                    return Err(self.fail(Fault::WentAway))
                }
                Err(err) => return Err(Error::resource("cannot read the zygote's reply", err)),
            }
        }
    }

    /// After a silent slice: fails when the zygote died, is stopped, or was silent too long.
    fn check(&mut self, silent: &mut Duration, patience: Option<Duration>) -> Result<(), Error> {
        *silent += CHECK_EVERY;
        if self.exit().is_some() {
            return Err(self.fail(Fault::WentAway));
        }
        let state = process_state(self.pid());
        if matches!(state, Some('T') | Some('t')) && *silent >= STOPPED_PATIENCE {
            return Err(self.fail(Fault::Stopped(state)));
        }
        if patience.is_some_and(|p| *silent >= p) {
            return Err(self.fail(Fault::Silent(*silent, state)));
        }
        Ok(())
    }

    /// Marks the zygote broken and stops it (its blanks exit with it); the error says why.
    /// When its end of the channel closed ([`Fault::WentAway`]) it died on its own, and the
    /// error shows how it ended and what it reported.
    fn fail(&mut self, fault: Fault) -> Error {
        let pid = self.pid();
        let one_second = Some(Duration::from_secs(1));
        self.vanished = matches!(fault, Fault::WentAway)
            && self.process.wait(None, WaitFor::AllExited, one_second);
        self.process.terminate(libc::SIGKILL, Duration::ZERO);
        // Its blanks would only exit once they noticed: nothing of it is left running.
        self.reserve.stop_all(Duration::from_secs(1));
        let who = format!("the tether zygote (pid {pid})");
        let mut message = format!("{who} {fault}");
        if let (true, Some(exit)) = (self.vanished, self.exit()) {
            message = exit.status.died(&who);
            let report = self
                .process
                .with_member(0, |m| crate::report::decode(m.report()));
            match report {
                // A zygote that declines to serve says why in a sentence of its own.
                Some(Some(report)) if report.type_name == DECLINED => {
                    message = String::from_utf8_lossy(&report.text).trim().to_string();
                }
                Some(Some(report)) => {
                    message += &format!(":\n{}", String::from_utf8_lossy(&report.text));
                }
                _ => {}
            }
        }
        self.broken = Some(message.clone());
        Error::Zygote(message)
    }

    /// Whether it died on its own (rather than being stopped for not answering).
    pub fn vanished(&self) -> bool {
        self.vanished
    }

    /// Stops the zygote: it exits at the end of its request channel, and its blanks at the
    /// end of theirs; after `grace`, SIGKILL.
    pub fn close(&mut self, grace: Duration) {
        log::info!(target: "tether::zygote", "closing zygote pid {}", self.pid());
        let _ = rustix::net::shutdown(&self.request, rustix::net::Shutdown::Write);
        if !self.process.wait(None, WaitFor::AllExited, Some(grace)) {
            self.process.terminate(libc::SIGKILL, Duration::ZERO);
        }
        // Idle, they exit at the end of their channels; none is left once this returns.
        self.reserve.stop_all(grace.max(Duration::from_secs(1)));
        self.broken
            .get_or_insert_with(|| "the tether zygote was closed".into());
    }
}

/// Why a zygote stopped serving, as its client found it.
enum Fault {
    /// Its end of the channel closed, or it exited: it died on its own.
    WentAway,
    Unexpected,
    Malformed,
    /// Stopped (SIGSTOP, a debugger) for longer than the client waits; its /proc state.
    Stopped(Option<char>),
    /// Silent for this long; its /proc state.
    Silent(Duration, Option<char>),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fault::WentAway => write!(f, "went away"),
            Fault::Unexpected => write!(f, "sent an unexpected message"),
            Fault::Malformed => write!(f, "sent a malformed reply"),
            Fault::Stopped(state) => write!(f, "is stopped (state {})", describe_state(*state)),
            Fault::Silent(silent, state) => write!(
                f,
                "has not answered for {} s (state {})",
                silent.as_secs(),
                describe_state(*state)
            ),
        }
    }
}

fn report_pipes(ranks: &[u32]) -> Result<Vec<(OwnedFd, OwnedFd)>, Error> {
    ranks
        .iter()
        .map(|rank| {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| {
                Error::resource(format!("cannot make the report pipe of rank {rank}"), e)
            })
        })
        .collect()
}
