//! [`Group`]: a set of children started and watched together (a `ProcessContext`, a pool
//! worker, a launcher's ranks), and what is asked of them: wait, signal, the first failure
//! in time, and termination with a grace period.
//!
//! The warden thread ([`crate::warden`]) starts the members ([`Group::launch`] and
//! [`Group::adopt_all`] are its) and fills in each member's exit and report; everything here
//! only reads that state under the group's lock and waits on its condvar. Their stacks are
//! asked for by [`crate::stacks`] ([`Group::stacks`]).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use crate::report::Report;
use crate::status::ExitStatus;

/// When and how a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    pub status: ExitStatus,
    /// `CLOCK_MONOTONIC` time at which the warden saw the exit (comparable with
    /// Python's `time.monotonic()` and across processes).
    pub at: Duration,
}

/// One child of a [`Group`].
#[derive(Debug)]
pub struct Member {
    pub pid: i32,
    /// The child's pidfd (readable once it has exited); for a child whose pid was already
    /// gone when it was adopted, a pipe at end of file (always readable).
    pub(crate) sentinel: OwnedFd,
    pub(crate) exit: Option<Exit>,
    pub(crate) report: Report,
}

impl Member {
    pub(crate) fn new(pid: i32, sentinel: OwnedFd, report: Report) -> Member {
        Member {
            pid,
            sentinel,
            exit: None,
            report,
        }
    }

    pub fn exit(&self) -> Option<Exit> {
        self.exit
    }

    /// When a whole failure report had arrived (`CLOCK_MONOTONIC`).
    pub fn reported_at(&self) -> Option<Duration> {
        self.report.complete_at()
    }

    /// When the member failed: its report's arrival, or its failing exit (a non-zero code or
    /// a signal; an exit status nobody could read is not a failure).
    pub fn failed_at(&self) -> Option<Duration> {
        let failed_exit = self.exit.filter(|e| e.status.failure()).map(|e| e.at);
        match (self.reported_at(), failed_exit) {
            (Some(r), Some(e)) => Some(r.min(e)),
            (r, e) => r.or(e),
        }
    }

    /// Everything the member wrote to its report pipe so far (up to the report limit).
    pub fn report(&self) -> &[u8] {
        self.report.bytes()
    }

    /// True while the member is in the middle of writing its failure report.
    pub fn writing_report(&self) -> bool {
        self.exit.is_none() && self.report.writing()
    }

    /// An fd that becomes readable once the child has exited; open as long as the group.
    pub fn sentinel(&self) -> RawFd {
        self.sentinel.as_raw_fd()
    }
}

#[derive(Debug, Default)]
pub(crate) struct GroupState {
    pub(crate) members: Vec<Member>,
}

#[derive(Debug, Default)]
pub(crate) struct GroupInner {
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl GroupInner {
    pub(crate) fn lock(&self) -> MutexGuard<'_, GroupState> {
        // A panic while holding the lock leaves consistent data behind: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn notify(&self) {
        self.changed.notify_all();
    }
}

/// A set of children started together and watched together.
#[derive(Debug, Clone, Default)]
pub struct Group {
    pub(crate) inner: Arc<GroupInner>,
}

/// A [`Group`] held without keeping it: gone once its last holder drops it.
#[derive(Debug, Clone, Default)]
pub struct WeakGroup(Weak<GroupInner>);

impl WeakGroup {
    /// The group, while someone else still holds it.
    pub fn upgrade(&self) -> Option<Group> {
        self.0.upgrade().map(|inner| Group { inner })
    }
}

/// What [`Group::wait`] waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitFor {
    /// Every chosen member has exited.
    AllExited,
    /// Every chosen member has exited, or one of them failed (exited non-zero, was killed,
    /// or sent a whole failure report).
    AllExitedOrFailure,
    /// Any chosen member has exited.
    AnyExited,
    /// No chosen member is in the middle of writing its failure report.
    NoneWriting,
}

/// Between slices of a wait, asked whether to give up waiting (a caller's interruption).
pub type Interrupted<'a> = &'a mut dyn FnMut() -> bool;

/// A signal that [`Group::terminate_escalating`] sends to the members still running `after`
/// the first one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Escalation {
    pub signal: i32,
    pub after: Duration,
}

/// How often [`Group::terminate`] asks its caller whether it was interrupted.
const INTERRUPT_CHECK: Duration = Duration::from_millis(50);

impl Group {
    pub fn new() -> Group {
        Group::default()
    }

    /// This group, held without keeping it.
    pub fn downgrade(&self) -> WeakGroup {
        WeakGroup(Arc::downgrade(&self.inner))
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

    /// The member that failed first in time (see [`Member::failed_at`]), if any has.
    pub fn first_failure(&self) -> Option<usize> {
        let state = self.inner.lock();
        let failures = state.members.iter().enumerate();
        failures
            .filter_map(|(i, m)| m.failed_at().map(|at| (at, i)))
            .min()
            .map(|(_, i)| i)
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
        let name = crate::status::signal_name(signal);
        log::info!(target: "tether::warden", "sent {name} to pid {}", member.pid);
        Ok(signal_tree(member.pid, signal))
    }

    /// Sends `signal` to every member still running; returns how many were signalled.
    pub fn signal_all(&self, signal: i32) -> usize {
        let state = self.inner.lock();
        let live = state.members.iter().filter(|m| m.exit.is_none());
        let sent: Vec<i32> = live
            .filter(|m| signal_tree(m.pid, signal))
            .map(|m| m.pid)
            .collect();
        if !sent.is_empty() {
            let name = crate::status::signal_name(signal);
            log::info!(target: "tether::warden", "sent {name} to pids {sent:?}");
        }
        sent.len()
    }

    /// Waits until the condition holds for the members in `which` (all members when `None`)
    /// or until `timeout` passes. Returns whether the condition holds.
    pub fn wait(&self, which: Option<&[usize]>, until: WaitFor, timeout: Option<Duration>) -> bool {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
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

    /// Waits like [`Group::wait`] in slices, asking `interrupted` between them; returns
    /// `Some(held)` at the end, or `None` when `interrupted` said so.
    pub fn wait_interruptibly(
        &self,
        which: Option<&[usize]>,
        until: WaitFor,
        timeout: Option<Duration>,
        interrupted: Interrupted<'_>,
    ) -> Option<bool> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let slice = match deadline {
                None => INTERRUPT_CHECK,
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(INTERRUPT_CHECK),
            };
            if self.wait(which, until, Some(slice)) {
                return Some(true);
            }
            if interrupted() {
                return None;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Some(false);
            }
        }
    }

    /// Stops every running member: lets those in the middle of writing a failure report
    /// finish it (up to `grace`), sends `signal` (SIGTERM) to every process group, waits up
    /// to `grace` for them to exit, then SIGKILL; returns once every member has been reaped.
    /// When `interrupted` says so during a wait, SIGKILL goes out at once.
    pub fn terminate_with(&self, signal: i32, grace: Duration, interrupted: Interrupted<'_>) {
        self.terminate_escalating(signal, None, grace, interrupted, &mut |_, _| {});
    }

    /// [`Group::terminate_with`] with one more step: members still running `then.after`
    /// the first signal get `then.signal` (SIGINT, then SIGTERM, as a terminal's user
    /// expects of a Ctrl-C); SIGKILL still comes at the end of `grace`, counted from the
    /// first signal. `sent(signal, count)` is told of each signal sent after the first,
    /// with the number of members it went to (SIGKILL only when the grace period ran out,
    /// not when `interrupted` cut it short).
    pub fn terminate_escalating(
        &self,
        signal: i32,
        then: Option<Escalation>,
        grace: Duration,
        interrupted: Interrupted<'_>,
        sent: &mut dyn FnMut(i32, usize),
    ) {
        let mut timed_out = false;
        let graceful = self
            .wait_interruptibly(None, WaitFor::NoneWriting, Some(grace), interrupted)
            .is_some()
            && self.signal_all(signal) > 0
            && match self.exits_within(then, grace, interrupted, sent) {
                Some(ended) => {
                    timed_out = !ended;
                    ended
                }
                None => false,
            };
        if !graceful {
            let killed = self.signal_all(libc::SIGKILL);
            if killed > 0 && timed_out {
                log::warn!(target: "tether::warden", "escalated to SIGKILL after {grace:?}");
                sent(libc::SIGKILL, killed);
            }
        }
        while !self.wait(None, WaitFor::AllExited, Some(Duration::from_secs(1))) {
            self.signal_all(libc::SIGKILL);
        }
    }

    /// Waits up to `grace` for every member to exit, sending `then` on the way; `None` when
    /// `interrupted` cut the wait.
    fn exits_within(
        &self,
        then: Option<Escalation>,
        grace: Duration,
        interrupted: Interrupted<'_>,
        sent: &mut dyn FnMut(i32, usize),
    ) -> Option<bool> {
        let began = Instant::now();
        if let Some(step) = then.filter(|step| step.after < grace) {
            let all = Some(step.after);
            match self.wait_interruptibly(None, WaitFor::AllExited, all, interrupted) {
                Some(false) => sent(step.signal, self.signal_all(step.signal)),
                ended => return ended,
            }
        }
        let left = Some(grace.saturating_sub(began.elapsed()));
        self.wait_interruptibly(None, WaitFor::AllExited, left, interrupted)
    }

    /// [`Group::terminate_with`] with no interruption.
    pub fn terminate(&self, signal: i32, grace: Duration) {
        self.terminate_with(signal, grace, &mut || false);
    }
}

fn holds(members: &[Member], which: Option<&[usize]>, until: WaitFor) -> bool {
    let chosen: Box<dyn Iterator<Item = &Member>> = match which {
        None => Box::new(members.iter()),
        Some(indices) => Box::new(indices.iter().filter_map(|&i| members.get(i))),
    };
    let mut chosen = chosen;
    match until {
        WaitFor::AllExited => chosen.all(|m| m.exit.is_some()),
        WaitFor::AnyExited => chosen.any(|m| m.exit.is_some()),
        WaitFor::NoneWriting => !chosen.any(|m| m.writing_report()),
        WaitFor::AllExitedOrFailure => {
            let mut all = true;
            for m in chosen {
                if m.failed_at().is_some() {
                    return true;
                }
                all &= m.exit.is_some();
            }
            all
        }
    }
}

/// Signals the process group led by `pid`, or `pid` alone if it left that group.
pub(crate) fn signal_tree(pid: i32, signal: i32) -> bool {
    // SAFETY: plain system calls on ids this process owns (see `Group::signal`).
    unsafe { libc::killpg(pid, signal) == 0 || libc::kill(pid, signal) == 0 }
}
