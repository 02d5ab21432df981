//! The attempts of a dynamic rendezvous: each one is a round of torch's rendezvous, which the
//! helper process joins; a failure on any node, a node that joins or one that goes starts a
//! new round on every node, and the first failure in time ends the job on every node.

use rustix::event::{PollFd, PollFlags};
use tether_core::signal_name;

use super::{AttemptEnd, Launcher, Stop};
use crate::hangs;
use crate::output;
use crate::reaper;
use crate::rendezvous::{nodes_spec, Message, Place};
use crate::report::{cause_code, render_cause, Failure};

/// How waiting for the helper ended.
enum Heard {
    Said(Message),
    /// A stop signal arrived first.
    Signal(i32),
}

impl Launcher {
    /// Every round of a dynamic rendezvous; returns the launcher's exit status.
    pub(super) fn run_rounds(&mut self) -> i32 {
        let Some(rdzv) = self.cfg.rendezvous.clone() else {
            return 1;
        };
        if let Err(sig) = self.await_zygote() {
            return 128 + sig;
        }
        match self.start_helper(&rdzv) {
            Ok(helper) => self.helper = Some(helper),
            Err(err) => {
                output::message(&format!(
                    "tether: cannot start the rendezvous helper ({} -m tether._rendezvous): {}",
                    self.cfg.rendezvous_python.to_string_lossy(),
                    tether_core::strerror(&err)
                ));
                return 1;
            }
        }
        output::message(&format!(
            "tether: joining run {} at {} ({}, --nnodes {}) as a node of {} rank(s)",
            rdzv.run_id,
            rdzv.endpoint,
            rdzv.backend.name(),
            nodes_spec(rdzv.min_nodes, rdzv.max_nodes),
            rdzv.nproc
        ));
        let code = self.rounds();
        if let Some(mut helper) = self.helper.take() {
            helper.leave();
        }
        code
    }

    fn rounds(&mut self) -> i32 {
        let max = self.cfg.max_restarts;
        // This node's own failures, as torchrun counts them: a new round for a change of
        // membership does not count.
        let mut failures = 0;
        loop {
            if let Some(sig) = self.pending_stop_signal() {
                output::message(&format!(
                    "tether: got {}; leaving the job",
                    signal_name(sig)
                ));
                return 128 + sig;
            }
            if let Err(code) = self.join() {
                return code;
            }
            let end = match self.attempt(failures) {
                Ok(end) => end,
                Err(err) => {
                    output::message(&format!("tether: {err}"));
                    return err.exit_code();
                }
            };
            match end {
                AttemptEnd::Success => return self.finish(),
                AttemptEnd::Interrupted(sig) => return 128 + sig,
                AttemptEnd::TimedOut(limit) => {
                    output::message(&format!(
                        "tether: this node's ranks were stopped: {}; exit status {}",
                        limit.describe(),
                        hangs::TIMED_OUT
                    ));
                    return hangs::TIMED_OUT;
                }
                AttemptEnd::Membership(why) => output::message(&format!(
                    "tether: {why}: this node's ranks were stopped; they start again in a new \
                     round (not counted as a restart)"
                )),
                AttemptEnd::Ended(cause) => return report_cause(&cause),
                AttemptEnd::Failed(failure) if failures < max => {
                    failures += 1;
                    output::message(&format!(
                        "tether: rank {} (pid {}) ended with {}; restarting every node's ranks in \
                         a new round (this node's restart {failures} of {max})",
                        failure.root.rank, failure.root.pid, failure.root.status,
                    ));
                    if let Some(helper) = &mut self.helper {
                        helper.failed(failure.record(), false);
                    }
                }
                AttemptEnd::Failed(failure) => return self.end_the_job(&failure),
            }
        }
    }

    /// This node's failure with no restart left ends the job on every node: reports the
    /// job's root cause (another node's, when it failed first, else this one) and returns
    /// the exit status.
    fn end_the_job(&mut self, failure: &Failure) -> i32 {
        let Some(helper) = &mut self.helper else {
            return 1;
        };
        helper.failed(failure.record(), true);
        match self.hear() {
            Heard::Said(Message::Cause(cause) | Message::Ended(cause))
                if !is_own(&cause, &failure.record(), &self.cfg.place) =>
            {
                report_cause(&cause)
            }
            _ => {
                output::message(&failure.render());
                failure.root.status.as_shell_code()
            }
        }
    }

    /// Joins the next round and takes this node's place in it; `Err` holds the exit status
    /// when the job cannot go on.
    fn join(&mut self) -> Result<(), i32> {
        let Some(helper) = &mut self.helper else {
            return Err(1);
        };
        helper.next_round();
        loop {
            match self.hear() {
                Heard::Said(Message::Round(place, round)) => {
                    self.announce(&place, round);
                    self.cfg.place = place;
                    self.round = round;
                    return Ok(());
                }
                Heard::Said(Message::Ended(cause) | Message::Cause(cause)) => {
                    return Err(report_cause(&cause))
                }
                Heard::Said(Message::Error(message)) => {
                    output::message(&format!("tether: {message}"));
                    return Err(1);
                }
                // Events of a round that is over.
                Heard::Said(Message::Restart { .. } | Message::Bye) => {}
                Heard::Signal(sig) => {
                    output::message(&format!(
                        "tether: got {} while joining the rendezvous; leaving",
                        signal_name(sig)
                    ));
                    return Err(128 + sig);
                }
            }
        }
    }

    fn announce(&self, place: &Place, round: u64) {
        let n = self.cfg.nproc;
        output::message(&format!(
            "tether: round {round} of run {}: node rank {} of {} node(s), ranks {}..{} of a \
             world of {}; MASTER_ADDR={} MASTER_PORT={}",
            self.cfg.run_id,
            place.node_rank,
            place.nnodes,
            place.rank_base,
            place.rank_base + n.saturating_sub(1),
            place.world_size,
            place.master_addr,
            place.master_port
        ));
    }

    /// This node's ranks succeeded: wait, as torchrun's exit barrier does, for the other
    /// nodes (the node hosting the store keeps it for them); another node's final failure
    /// ends the job with its code.
    fn finish(&mut self) -> i32 {
        let Some(helper) = &mut self.helper else {
            return 0;
        };
        helper.done();
        match self.hear() {
            Heard::Said(Message::Ended(cause)) => report_cause(&cause),
            Heard::Signal(sig) => 128 + sig,
            Heard::Said(_) => 0,
        }
    }

    /// What the running ranks' round means for them: a new round, or the end of the job.
    pub(super) fn moved_on(&self, message: Message) -> Option<Stop> {
        match message {
            Message::Restart { round, why } if round == self.round => Some(Stop::Membership(why)),
            Message::Ended(cause) | Message::Cause(cause) => Some(Stop::Ended(cause)),
            Message::Error(message) => {
                output::message(&format!("tether: {message}; the ranks go on"));
                None
            }
            _ => None,
        }
    }

    /// The helper's next message, or the stop signal that came first; stack signals and
    /// SIGCHLD are handled on the way.
    fn hear(&mut self) -> Heard {
        loop {
            let Some(helper) = self.helper.as_mut() else {
                return Heard::Said(Message::Error("no rendezvous helper".into()));
            };
            if helper.has_buffered() {
                return Heard::Said(helper.read());
            }
            let mut fds = [
                PollFd::new(&self.signals, PollFlags::IN),
                PollFd::from_borrowed_fd(helper.fd(), PollFlags::IN),
            ];
            let _ = rustix::event::poll(&mut fds, None);
            let helper_ready = !fds[1].revents().is_empty();
            while let Some(sig) = self.signals.next() {
                if sig == libc::SIGCHLD {
                    reaper::reap_orphans(&self.own_pids());
                } else if !self.stack_signals.contains(&sig) {
                    return Heard::Signal(sig);
                }
            }
            if helper_ready {
                if let Some(helper) = self.helper.as_mut() {
                    return Heard::Said(helper.read());
                }
            }
        }
    }
}

/// Whether the job's root cause is this node's own failure (`own`, its record).
fn is_own(cause: &serde_json::Value, own: &serde_json::Value, place: &Place) -> bool {
    cause["node_rank"].as_u64() == Some(place.node_rank as u64)
        && cause["rank"] == own["rank"]
        && cause["pid"] == own["pid"]
}

/// Prints the job's root cause; returns the exit status it gives.
fn report_cause(cause: &serde_json::Value) -> i32 {
    if cause.is_null() {
        output::message("tether: another node ended the job");
        return 1;
    }
    output::message(&render_cause(cause));
    cause_code(cause)
}
