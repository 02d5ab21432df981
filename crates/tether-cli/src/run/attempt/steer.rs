//! The steering of an attempt's ranks: waiting for their exits, the launcher's signals,
//! the run's limits and the membership moving on; stopping them; and cleaning up what they
//! leave.

use std::collections::HashSet;
use std::os::fd::BorrowedFd;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use tether_core::{signal_name, Escalation, Group, WaitFor};

use crate::clock;
use crate::output;
use crate::reaper;
use crate::run::error::{io_err, RunError};
use crate::run::membership::{Membership, Moved};
use crate::run::node::Node;
use crate::run::warm::Warm;
use crate::stacks::hangs::{self, Limit, Ranks};

/// How long the steering waits for output pipes to drain once every rank has exited, and
/// after which it says which leftovers are slow to die (it waits for them all the same).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// How long the ranks have after a forwarded SIGINT before they get SIGTERM.
const INT_TO_TERM: Duration = Duration::from_secs(3);

/// Why the launcher stopped the ranks of an attempt itself.
pub enum Stop {
    Signal(i32),
    Limit(Limit),
    Moved(Moved),
}

/// The record of the attempt's first failure so far, for the other nodes.
pub type Record<'a> = &'a dyn Fn(&Group) -> Option<serde_json::Value>;

/// What one poll saw: ranks that exited, signals, and how the job moved on.
type Polled = (Vec<usize>, Vec<i32>, Option<Moved>);

/// The steering of one attempt's ranks (`group`).
pub struct Steering<'a> {
    pub node: &'a Node,
    pub warm: &'a Warm,
    pub membership: &'a mut Membership,
    pub group: &'a Group,
}

impl Steering<'_> {
    /// Waits until every rank has exited. On the first failure, on a stop signal to the
    /// launcher, or past a limit (after every rank's stack is shown), stops the others (the
    /// signal, the grace period, SIGKILL). A stack signal prints every rank's stack and the
    /// run goes on. A first failure is published (`record`, through the membership) before
    /// the others are stopped. Returns when the stopping began (monotonic clock) and why the
    /// launcher stopped the ranks itself, if it did.
    pub fn steer(
        &mut self,
        record: Record<'_>,
    ) -> Result<(Option<Duration>, Option<Stop>), RunError> {
        let (node, group) = (self.node, self.group);
        let ranks = self.ranks();
        loop {
            if let Some(first) = group.first_failure() {
                log::info!(target: "tether::run", "rank {first} failed: stopping the others");
                self.membership.publish_failure(|| record(group));
                return Ok((Some(self.stop(libc::SIGTERM)), None));
            }
            let live: Vec<usize> = (0..group.len())
                .filter(|&i| group.exit(i).is_none())
                .collect();
            if live.is_empty() {
                return Ok((None, None));
            }
            if let Some(limit) = node.deadlines.passed() {
                log::info!(target: "tether::run", "past a limit: {limit:?}");
                let python = node.cfg.command.first().filter(|_| node.cfg.python_ranks);
                hangs::print_stacks_at_limit(&ranks, limit, python);
                return Ok((Some(self.stop(libc::SIGTERM)), Some(Stop::Limit(limit))));
            }
            let (ready, signals, moved) = self.poll(&live)?;
            if let Some(moved) = moved {
                return Ok((Some(self.stop(libc::SIGTERM)), Some(Stop::Moved(moved))));
            }
            for sig in signals {
                if sig == libc::SIGCHLD {
                    reaper::reap_orphans(&self.live_pids());
                    continue;
                }
                if node.stack_signals.contains(&sig) {
                    hangs::print_stacks_in_background(&ranks, sig);
                    continue;
                }
                output::message(&self.stopping_words(sig, live.len()));
                return Ok((Some(self.stop(sig)), Some(Stop::Signal(sig))));
            }
            if !ready.is_empty() {
                // The pidfd is readable once the rank exited; the warden thread records
                // the exit right after.
                group.wait(
                    Some(&ready),
                    WaitFor::AllExited,
                    Some(Duration::from_secs(1)),
                );
            }
        }
    }

    /// The ranks with the prefix of each (the default one under `--no-prefix`).
    fn ranks(&self) -> Ranks {
        let prefixes = (0..self.node.cfg.nproc)
            .map(|local| self.node.prefix_or_default(local))
            .collect();
        Ranks {
            group: self.group.clone(),
            prefixes: Arc::new(prefixes),
        }
    }

    /// The pids of running ranks, which only tether-core may reap, and the launcher's own
    /// processes beside the ranks (the rendezvous helper, the zygote and the children it
    /// keeps forked ahead), which are neither leftovers nor for anyone else to reap.
    fn live_pids(&self) -> HashSet<i32> {
        let group = self.group;
        (0..group.len())
            .filter(|&i| group.exit(i).is_none())
            .filter_map(|i| group.pid(i))
            .chain(self.membership.pid())
            .chain(self.warm.pids())
            .collect()
    }

    /// The escalation that follows `sig` when the launcher forwards it: a SIGINT (Ctrl-C) is
    /// followed by SIGTERM after [`INT_TO_TERM`] (or half the grace period, if shorter).
    fn escalation(&self, sig: i32) -> Option<Escalation> {
        (sig == libc::SIGINT).then(|| Escalation {
            signal: libc::SIGTERM,
            after: INT_TO_TERM.min(self.node.cfg.grace / 2),
        })
    }

    /// What the launcher says when it got `sig` and forwards it to `live` ranks.
    fn stopping_words(&self, sig: i32, live: usize) -> String {
        let grace = self.node.cfg.grace;
        let steps = match self.escalation(sig) {
            Some(then) => format!(
                "those still running {:?} later get {}, and SIGKILL {grace:?} after the {}",
                then.after,
                signal_name(then.signal),
                signal_name(sig)
            ),
            None => format!("SIGKILL after {grace:?}"),
        };
        format!(
            "tether: got {}; forwarding it to {live} rank(s); {steps}; press Ctrl-C again to \
             kill them at once",
            signal_name(sig)
        )
    }

    /// Stops every rank with tether-core's termination (`sig`, SIGTERM after a SIGINT, the
    /// grace period, SIGKILL), saying so at each step; meanwhile orphans are reaped, and a
    /// SIGINT kills at once. Returns when it began.
    fn stop(&self, sig: i32) -> Duration {
        let began = clock::monotonic();
        let kill_now = std::cell::Cell::new(false);
        let mut interrupted = || {
            while let Some(got) = crate::signals::next(&self.node.signals) {
                if got == libc::SIGCHLD {
                    reaper::reap_orphans(&self.live_pids());
                } else if got == libc::SIGINT {
                    output::message("tether: SIGINT while stopping: killing every rank now");
                    kill_now.set(true);
                }
            }
            kill_now.get()
        };
        let grace = self.node.cfg.grace;
        let then = self.escalation(sig);
        let mut sent = |signal: i32, count: usize| {
            if signal == libc::SIGKILL {
                output::message(&format!(
                    "tether: {count} rank(s) still running at the end of the grace period \
                     ({grace:?}): SIGKILL"
                ));
            } else if let Some(then) = then {
                output::message(&format!(
                    "tether: {count} rank(s) still running {:?} after {}: {}; SIGKILL in {:?}",
                    then.after,
                    signal_name(sig),
                    signal_name(signal),
                    grace.saturating_sub(then.after),
                ));
            }
        };
        self.group
            .terminate_escalating(sig, then, grace, &mut interrupted, &mut sent);
        began
    }

    /// Polls the signalfd, the pidfds of the `live` ranks and the membership until one is
    /// ready or a limit may have been reached; returns the ranks that exited, the signals
    /// that arrived and how the job moved on.
    fn poll(&mut self, live: &[usize]) -> Result<Polled, RunError> {
        if self.membership.has_buffered() {
            return Ok((Vec::new(), Vec::new(), self.membership.moved_on()));
        }
        let sentinels: Vec<(usize, i32)> = live
            .iter()
            .filter_map(|&i| self.group.with_member(i, |m| (i, m.sentinel())))
            .collect();
        let mut fds = Vec::with_capacity(sentinels.len() + 2);
        fds.push(PollFd::new(&self.node.signals, PollFlags::IN));
        if let Some(fd) = self.membership.fd() {
            fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN));
        }
        let first_rank = fds.len();
        for &(_, raw) in &sentinels {
            // SAFETY: the pidfd belongs to a member of the group, which outlives this poll.
            let fd = unsafe { BorrowedFd::borrow_raw(raw) };
            fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN));
        }
        // A limit is checked at most 10 ms late, and never in a busy loop.
        let timeout = self.node.deadlines.next_check().map(|left| {
            let left = left.max(Duration::from_millis(10));
            rustix::event::Timespec {
                tv_sec: left.as_secs() as _,
                tv_nsec: left.subsec_nanos() as _,
            }
        });
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(io_err("poll")(e.into())),
        }
        let membership_ready = first_rank == 2 && !fds[1].revents().is_empty();
        let ready = fds[first_rank..]
            .iter()
            .zip(&sentinels)
            .filter(|(fd, _)| !fd.revents().is_empty())
            .map(|(_, &(i, _))| i)
            .collect();
        drop(fds);
        let signals = std::iter::from_fn(|| crate::signals::next(&self.node.signals)).collect();
        let moved = match membership_ready {
            true => self.membership.moved_on(),
            false => None,
        };
        Ok((ready, signals, moved))
    }

    /// After every rank has exited: kill and reap what they left behind, every one of them
    /// (the next attempt starts only then), and let the output pumps finish.
    pub fn cleanup(&self, done: &mpsc::Receiver<()>, pumps: usize) {
        let slow = |left: &[i32]| {
            output::message(&format!(
                "tether: {} process(es) that the ranks left are not dead yet after SIGKILL \
                 (pids {left:?}); waiting for them, nothing else starts before they are gone",
                left.len()
            ))
        };
        // A stop signal ends the wait (and the run): no attempt starts after it.
        let stopped = || self.node.stop_noted();
        // The live pids are read at each pass: a blank the zygote forks meanwhile is its own.
        reaper::kill_orphans(|| self.live_pids(), DRAIN_LIMIT, slow, stopped);
        let deadline = Instant::now() + DRAIN_LIMIT;
        for _ in 0..pumps {
            let left = deadline.saturating_duration_since(Instant::now());
            if done.recv_timeout(left).is_err() {
                break;
            }
        }
        reaper::reap_orphans(&self.live_pids());
    }
}

/// SIGKILL to every rank, and a bounded wait for their exits.
pub fn kill_all(group: &Group) {
    group.signal_all(libc::SIGKILL);
    group.wait(None, WaitFor::AllExited, Some(DRAIN_LIMIT));
}
