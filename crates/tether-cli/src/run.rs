//! The run: one loop, as torch's elastic agent has. The supervisor process
//! ([`supervisor`]) sets itself up and hands the launcher its node ([`node`]); the node's
//! zygote starts first ([`warm`]); then each round asks the membership ([`membership`]:
//! fixed for the static and one-node forms, torch's rendezvous through the helper for the
//! dynamic ones) for the node's place, runs an attempt ([`attempt`]: wire, start, supervise,
//! conclude) and applies the restart policy: a failure with restarts left starts the next
//! round; success, the last failure, a stop signal or a limit ends the run with its report.

use std::path::PathBuf;

use tether_core::signal_name;

use crate::config::Config;
use crate::output;
use crate::signalfd::SignalFd;
use crate::stacks::hangs;

mod abandon;
mod attempt;
mod env;
mod error;
mod membership;
mod node;
mod report;
mod supervisor;
mod temp;
mod warm;
mod zygote;

pub use supervisor::supervisor_main;
pub use temp::TempDir;

use attempt::{Attempt, AttemptEnd};
use membership::Membership;
use node::Node;
use warm::Warm;

/// The launcher of this node's ranks: the node, its warm zygote and its membership.
struct Launcher {
    node: Node,
    warm: Warm,
    membership: Membership,
}

/// Runs every round of `cfg` on this node; returns the launcher's exit status. `tmp` holds
/// the ranks' error files, `logs` is the run's log directory.
fn launch(cfg: Config, signals: SignalFd, tmp: PathBuf, logs: Option<PathBuf>) -> i32 {
    let node = Node::new(cfg, signals, tmp, logs);
    let mut warm = Warm::start(&node);
    let membership = warm
        .ready(&node)
        .and_then(|()| Membership::start(&node, &mut warm));
    let code = match membership {
        Ok(membership) => {
            let mut launcher = Launcher {
                node,
                warm,
                membership,
            };
            let code = launcher.rounds();
            launcher.membership.leave();
            warm = launcher.warm;
            code
        }
        Err(code) => code,
    };
    warm.close();
    code
}

impl Launcher {
    /// Every round until the run ends; returns the launcher's exit status.
    fn rounds(&mut self) -> i32 {
        // This node's own failures, as torchrun counts them: a new round for a change of
        // membership does not count.
        let mut failures = 0;
        loop {
            let own = self
                .warm
                .pids()
                .into_iter()
                .chain(self.membership.pid())
                .collect();
            if let Some(sig) = self.node.pending_stop(&own) {
                output::message(&format!(
                    "tether: got {}; {}",
                    signal_name(sig),
                    self.membership.on_stop()
                ));
                return 128 + sig;
            }
            match self.membership.place(&self.node, &self.warm) {
                Ok(place) => self.node.cfg.place = place,
                Err(code) => return code,
            }
            let attempt = Attempt {
                node: &self.node,
                warm: &mut self.warm,
                membership: &mut self.membership,
                number: failures,
            };
            let end = match attempt.run() {
                Ok(end) => end,
                Err(err) => {
                    output::message(&format!("tether: {err}"));
                    return err.exit_code();
                }
            };
            if let Some(code) = self.policy(end, &mut failures) {
                return code;
            }
        }
    }

    /// The restart policy: what follows an attempt's end. `None` when a new round starts;
    /// else the exit status of the run, after its report.
    fn policy(&mut self, end: AttemptEnd, failures: &mut u32) -> Option<i32> {
        let max = self.node.cfg.max_restarts;
        match end {
            AttemptEnd::Success => Some(self.membership.succeeded(&self.node, &self.warm)),
            AttemptEnd::Interrupted(sig) => Some(128 + sig),
            AttemptEnd::TimedOut(limit) => {
                output::message(&format!(
                    "tether: {} stopped: {}; exit status {}",
                    self.membership.whose_ranks(),
                    limit.describe(),
                    hangs::TIMED_OUT
                ));
                Some(hangs::TIMED_OUT)
            }
            AttemptEnd::Moved(moved) => self.membership.moved(moved, &self.node, *failures < max),
            AttemptEnd::Failed(failure) if *failures < max => {
                *failures += 1;
                self.membership
                    .restart(&failure, &self.node, *failures, max);
                None
            }
            AttemptEnd::Failed(failure) => {
                Some(self.membership.failed(&failure, &self.node, &self.warm))
            }
        }
    }
}
