//! The zygote's side: [`serve`], its loop. It answers the parent's requests with forks (or
//! blanks forked ahead), keeps its reserve of blanks filled while idle, and collapses its
//! memory into huge pages between requests.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, OwnedFd};
use std::time::Duration;

use crate::blanks::kept::{Kept, ROOM_CHECK};
use crate::channel::{Endpoint, Recv};
use crate::codec::malformed;
use crate::launch;
use crate::zygote::child::{blank_main, Parts, Served, SETUP_FAILED};
use crate::zygote::collapse::Collapser;
use crate::zygote::wire::{job_message, Common, Made, Order, Reply};

/// What the errors of this side call a message.
const WHAT: &str = "zygote message";

/// How long the zygote waits, idle, before it forks blanks to replace those used.
const REPLENISH_DELAY: Duration = Duration::from_millis(50);

/// The fork the embedding supplies: 0 in the child, the child's pid in the zygote. For a
/// Python zygote, [`clone_parent`] wrapped in `PyOS_BeforeFork`/`PyOS_AfterFork_*`.
pub type Fork<'a> = &'a mut dyn FnMut() -> io::Result<i32>;

/// A fork whose child is a child of this process's parent (`clone(CLONE_PARENT | SIGCHLD)`
/// with no new stack: the child goes on from a copy of this one). Returns 0 in the child and
/// the child's pid here.
///
/// # Safety
/// As for `fork`: the process must have a single thread (the zygote has), and the caller
/// does what its runtime needs around a fork.
pub unsafe fn clone_parent() -> io::Result<i32> {
    // SAFETY: the caller's promise above; a null stack makes clone behave like fork.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid as i32)
}

struct Pending {
    ranks: Vec<u32>,
    common_raw: Vec<u8>,
    common: Common,
    payload: OwnedFd,
    shared: Vec<OwnedFd>,
    next: usize,
}

struct Server<'a> {
    request: Endpoint,
    fork: Fork<'a>,
    /// Its blanks, and the channel that announces them to the parent.
    blanks: Kept,
    pending: Option<Pending>,
    /// Its memory still to collapse into huge pages, slice by slice while it is idle.
    collapser: Option<Collapser>,
    /// How long it waits without a request before its idle work (see [`serve`]), and when
    /// it last got one (or started).
    quiet: Duration,
    quiet_since: std::time::Instant,
    /// Set when a fork of the current request met the process limit: how many processes
    /// this zygote held idle then (itself and its blanks, which it dropped before trying
    /// once more).
    held_at_limit: Option<usize>,
}

enum Step {
    Continue,
    Exit,
    Blank(Endpoint),
    Rank(Parts),
}

/// The zygote's loop: tells the parent `ready`, then serves requests from `request` and
/// keeps `blanks` children forked ahead (more when a request was larger, up to
/// [`crate::blanks::MAX_BLANKS`]). Its idle work (collapsing its memory, forking blanks) waits until no
/// request has come for `quiet`, so that the processes it has just started (a job's ranks,
/// which start together) get the CPU first. Returns in each child it makes, and when the
/// parent goes away.
pub fn serve(
    request: OwnedFd,
    notices: OwnedFd,
    parent: i32,
    ready: &[u8],
    (blanks, quiet): (usize, Duration),
    fork: Fork<'_>,
) -> io::Result<Served> {
    let zygote = std::process::id();
    let mut server = Server {
        request: Endpoint::from_fd(request),
        fork,
        blanks: Kept::new(Endpoint::from_fd(notices), blanks, parent),
        pending: None,
        collapser: Some(Collapser::new()),
        quiet,
        quiet_since: std::time::Instant::now(),
        held_at_limit: None,
    };
    server.reply(&Reply::Ready(ready.to_vec()))?;
    loop {
        match server.step()? {
            Step::Continue => {}
            Step::Exit => return Ok(Served::Exit(0)),
            Step::Blank(channel) => {
                // In the new blank: the zygote's fds are closed by number, never dropped.
                std::mem::forget(server);
                return Ok(blank_main(channel, parent, zygote));
            }
            Step::Rank(parts) => {
                std::mem::forget(server);
                if launch::setup_forked_child(parent, true).is_err() {
                    return Ok(Served::Exit(SETUP_FAILED));
                }
                return Ok(parts.become_child());
            }
        }
    }
}

impl Server<'_> {
    fn reply(&self, reply: &Reply) -> io::Result<()> {
        self.request.send(&reply.encode(), &[], None).map(drop)
    }

    fn step(&mut self) -> io::Result<Step> {
        let idle_work = self.collapser.is_some() || self.blanks.wants_more();
        let quiet_left = self.quiet.saturating_sub(self.quiet_since.elapsed());
        let wait = match (idle_work, self.blanks.holds_any()) {
            (true, _) => Some(REPLENISH_DELAY.max(quiet_left)),
            (false, true) => Some(ROOM_CHECK),
            (false, false) => None,
        };
        let idle = match wait {
            Some(wait) => !readable(&self.request, wait)?,
            None => false,
        };
        if idle {
            return self.idle(idle_work);
        }
        let message = match self.request.recv(None) {
            Ok(Recv::Message(m)) => {
                self.quiet_since = std::time::Instant::now();
                m
            }
            Ok(Recv::Timeout) => return Ok(Step::Continue),
            Ok(Recv::Closed) => return Ok(Step::Exit),
            Err(err) => {
                // The message is lost (its fds did not fit): the parent waits for a reply.
                self.pending = None;
                self.fail(&err, "cannot receive a request", Vec::new())?;
                return Ok(Step::Continue);
            }
        };
        let mut fds = message.fds;
        match Order::decode(&message.data) {
            Ok(Order::Start {
                ranks,
                shared,
                common,
                batch,
            }) => self.start(ranks, shared, common, batch, &mut fds),
            Ok(Order::Batch { batch }) => self.batch(batch, &mut fds),
            Ok(Order::Room { limit }) => {
                let held = self.blanks.announce(limit)?;
                self.reply(&Reply::Kept(held as u32))?;
                Ok(Step::Continue)
            }
            Err(err) => {
                self.fail(&err, "cannot read a request", Vec::new())?;
                Ok(Step::Continue)
            }
        }
    }

    /// Its idle work, with no request waiting: keeps its blanks within the caller's room (which
    /// may have shrunk: its limit lowered, its user's other processes grown), then collapses
    /// its memory and forks blanks, stopping when a request comes.
    fn idle(&mut self, idle_work: bool) -> io::Result<Step> {
        self.blanks.fit()?;
        if !idle_work {
            return Ok(Step::Continue);
        }
        if let Some(collapser) = self.collapser.as_mut() {
            while collapser.slice() {
                if readable(&self.request, Duration::ZERO)? {
                    return Ok(Step::Continue);
                }
            }
            self.collapser = None;
        }
        if let Some(step) = self.replenish()? {
            return Ok(step);
        }
        Ok(Step::Continue)
    }

    fn start(
        &mut self,
        ranks: Vec<u32>,
        shared: u32,
        common_raw: Vec<u8>,
        batch: u32,
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<Step> {
        self.pending = None;
        self.held_at_limit = None;
        let expected = 1 + shared as usize + batch as usize;
        let common = match Common::decode(&common_raw) {
            Ok(common) if fds.len() == expected => common,
            Ok(_) => {
                self.fail(
                    &malformed(WHAT),
                    "a request whose fds do not match it",
                    Vec::new(),
                )?;
                return Ok(Step::Continue);
            }
            Err(err) => {
                self.fail(&err, "cannot read a request", Vec::new())?;
                return Ok(Step::Continue);
            }
        };
        self.blanks.expect(ranks.len());
        let reports = fds.split_off(1 + shared as usize);
        let shared_fds = fds.split_off(1);
        let payload = fds.remove(0);
        self.pending = Some(Pending {
            ranks,
            common_raw,
            common,
            payload,
            shared: shared_fds,
            next: 0,
        });
        self.run_batch(reports)
    }

    fn batch(&mut self, batch: u32, fds: &mut Vec<OwnedFd>) -> io::Result<Step> {
        if self.pending.is_none() || fds.len() != batch as usize {
            self.pending = None;
            self.fail(&malformed(WHAT), "a batch without its request", Vec::new())?;
            return Ok(Step::Continue);
        }
        self.run_batch(std::mem::take(fds))
    }

    /// Starts one child per report pipe, for the next ranks of the pending request.
    fn run_batch(&mut self, reports: Vec<OwnedFd>) -> io::Result<Step> {
        let mut made = Vec::with_capacity(reports.len());
        let mut reports = reports.into_iter();
        while let Some(report) = reports.next() {
            let Some(pending) = self.pending.as_mut() else {
                break;
            };
            let Some(&rank) = pending.ranks.get(pending.next) else {
                self.pending = None;
                self.fail(&malformed(WHAT), "more ranks than asked for", made)?;
                return Ok(Step::Continue);
            };
            pending.next += 1;
            match self.make(rank, report) {
                Ok(Ok(child)) => made.push(child),
                Ok(Err(parts)) => {
                    // In the new child: forget the rest of this batch's pipes (closed by
                    // number when its fds are placed).
                    reports.for_each(std::mem::forget);
                    return Ok(Step::Rank(parts));
                }
                Err(err) => {
                    self.pending = None;
                    let what = match self.held_at_limit.take() {
                        Some(1) => format!(
                            "cannot fork rank {rank}, nor on a second try; tether's idle \
                             processes held 1 process of the limit (this zygote, which had no \
                             blank left and keeps none ready until the next start)"
                        ),
                        Some(held) => format!(
                            "cannot fork rank {rank}, nor on a second try once it had given \
                             back the {} blank(s) it kept ready; tether's idle processes held \
                             {held} processes of the limit (this zygote and those blanks; it \
                             keeps none ready until the next start)",
                            held - 1
                        ),
                        None => format!("cannot fork rank {rank}"),
                    };
                    self.fail(&err, &what, made)?;
                    return Ok(Step::Continue);
                }
            }
        }
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.next == p.ranks.len())
        {
            self.pending = None;
        }
        self.reply(&Reply::Started(made))?;
        Ok(Step::Continue)
    }

    /// Starts the child for `rank`: a blank takes it, or a fork. `Ok(Err(parts))` in the
    /// forked child itself.
    fn make(&mut self, rank: u32, report: OwnedFd) -> io::Result<Result<Made, Parts>> {
        if self.pending.is_none() {
            return Err(malformed(WHAT));
        }
        if let Some(pid) = self.activate(rank, &report)? {
            return Ok(Ok(Made {
                rank,
                pid,
                blank: true,
            }));
        }
        let pid = match (self.fork)() {
            Err(err) if err.raw_os_error() == Some(libc::EAGAIN) => {
                // The process limit: give back what is held idle, then once more.
                self.held_at_limit = Some(self.blanks.give_back_all()?);
                (self.fork)()?
            }
            made => made?,
        };
        if pid != 0 {
            return Ok(Ok(Made {
                rank,
                pid,
                blank: false,
            }));
        }
        let Some(pending) = self.pending.as_ref() else {
            return Err(malformed(WHAT));
        };
        Ok(Err(Parts {
            rank,
            common: pending.common.clone(),
            payload: pending.payload.as_raw_fd(),
            shared: pending.shared.iter().map(|fd| fd.as_raw_fd()).collect(),
            report: report.into_raw_fd(),
        }))
    }

    /// Hands `rank` to a waiting blank; `None` when none is left alive.
    fn activate(&mut self, rank: u32, report: &OwnedFd) -> io::Result<Option<i32>> {
        let Some(pending) = self.pending.as_ref() else {
            return Ok(None);
        };
        let message = job_message(rank, &pending.common_raw);
        let mut fds: Vec<BorrowedFd<'_>> = vec![pending.payload.as_fd()];
        fds.extend(pending.shared.iter().map(|fd| fd.as_fd()));
        fds.push(report.as_fd());
        while let Some((pid, channel)) = self.blanks.take() {
            match channel.send(&message, &fds, Some(Duration::from_secs(1))) {
                Ok(true) => return Ok(Some(pid)),
                // Stuck: killed; dead (its channel closed): given back.
                Ok(false) => self.blanks.kill(pid, channel)?,
                Err(_) => self.blanks.give_back(pid, channel)?,
            }
        }
        Ok(None)
    }

    /// Forks blanks up to the target while no request waits (see [`Kept::replenish`]).
    fn replenish(&mut self) -> io::Result<Option<Step>> {
        let request = &self.request;
        let mut interrupted = || readable(request, Duration::ZERO);
        let made = self.blanks.replenish(&mut *self.fork, &mut interrupted)?;
        Ok(made.map(Step::Blank))
    }

    /// Replies that the request failed: `what` failed with `err` (an errno, or a message
    /// when there is none).
    fn fail(&self, err: &io::Error, what: &str, made: Vec<Made>) -> io::Result<()> {
        let (errno, message) = match err.raw_os_error() {
            Some(errno) => (errno, what.to_string()),
            None => (0, format!("{what}: {err}")),
        };
        self.reply(&Reply::Failed {
            errno,
            message,
            made,
        })
    }
}

fn readable(endpoint: &Endpoint, wait: Duration) -> io::Result<bool> {
    endpoint.readable_within(wait)
}
