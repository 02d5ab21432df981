//! The node's place in each round, and what the rounds mean. A fixed membership (the static
//! form, one node) knows the place from the start: a failure restarts this node's ranks, and
//! nothing moves on from elsewhere. A dynamic one (torch's rendezvous, `--rdzv-backend c10d`
//! and the others on several nodes or an elastic `--nnodes`) asks the node's rendezvous
//! helper ([`helper`]) for it round after round: a failure on any node, a node that joins or
//! one that goes starts a new round on every node, and the first failure in time ends the job
//! on every node (a node publishes a failure the moment it sees it, before it stops its other
//! ranks; the helper's `_rendezvous_end` chooses the earliest). A node that was away
//! (stopped, or cut off from the store) and finds that the job went on without it stops its
//! ranks and says what happened.

use std::os::fd::BorrowedFd;

use rustix::event::{PollFd, PollFlags};
use tether_core::signal_name;

use super::node::Node;
use super::report::{cause_code, render_cause, Failure};
use super::warm::Warm;
use crate::clock;
use crate::config::{nodes_spec, Place, Rendezvous};
use crate::output;

mod helper;

pub use helper::let_the_helper_leave;
use helper::{Helper, Message};

/// How the job moved on while the ranks ran; the ranks were stopped.
pub enum Moved {
    /// Nodes wait to join, or a node is gone: a new round, which is no restart.
    Round(String),
    /// A node is gone and the nodes left are fewer than MIN: a new round only once a node
    /// joins again (a restart of the lost one), which this node waits for only while it has a
    /// restart left.
    Short(String),
    /// Another node ended the job; its root cause.
    Ended(serde_json::Value),
    /// The job moved on while this node was away: what happened, and the root cause if the
    /// job ended.
    Away(String, serde_json::Value),
}

pub enum Membership {
    /// The place is known from the start (the configuration's).
    Fixed(Place),
    /// torch's rendezvous, through the node's helper; the round the ranks run in.
    Dynamic { helper: Helper, round: u64 },
}

/// How waiting for the helper ended.
enum Heard {
    Said(Message),
    /// A stop signal arrived first.
    Signal(i32),
}

impl Membership {
    /// The membership of `node`'s run: for a dynamic rendezvous, its helper is started (a fork
    /// of the zygote where it can be) and the node says it joins; `Err` holds the exit status.
    pub fn start(node: &Node, warm: &mut Warm) -> Result<Membership, i32> {
        let cfg = &node.cfg;
        let Some(rdzv) = &cfg.rendezvous else {
            return Ok(Membership::Fixed(cfg.place.clone()));
        };
        let helper = match start_helper(node, rdzv, warm) {
            Ok(helper) => helper,
            Err(err) => {
                output::message(&format!(
                    "tether: cannot start the rendezvous helper ({} -m tether.run.rendezvous): {}",
                    cfg.rendezvous_python.to_string_lossy(),
                    tether_core::strerror(&err)
                ));
                return Err(1);
            }
        };
        output::message(&format!(
            "tether: joining run {} at {} ({}, --nnodes {}) as a node of {} rank(s)",
            rdzv.run_id,
            rdzv.endpoint,
            rdzv.backend.name(),
            nodes_spec(rdzv.min_nodes, rdzv.max_nodes),
            rdzv.nproc
        ));
        Ok(Membership::Dynamic { helper, round: 0 })
    }

    /// The rendezvous helper's pid, which only the membership reaps.
    pub fn pid(&self) -> Option<i32> {
        match self {
            Membership::Fixed(_) => None,
            Membership::Dynamic { helper, .. } => Some(helper.pid()),
        }
    }

    /// What the node does on a stop signal between attempts.
    pub fn on_stop(&self) -> &'static str {
        match self {
            Membership::Fixed(_) => "not restarting",
            Membership::Dynamic { .. } => "leaving the job",
        }
    }

    /// Whose ranks a limit of the run stopped.
    pub fn whose_ranks(&self) -> &'static str {
        match self {
            Membership::Fixed(_) => "every rank was",
            Membership::Dynamic { .. } => "this node's ranks were",
        }
    }

    /// This node's place in the next round: the fixed one, or the one the rendezvous gives
    /// (announced); `Err` holds the exit status when the job cannot go on.
    pub fn place(&mut self, node: &Node, warm: &Warm) -> Result<Place, i32> {
        match self {
            Membership::Fixed(place) => return Ok(place.clone()),
            Membership::Dynamic { helper, .. } => helper.next_round(),
        }
        loop {
            match self.hear(node, warm) {
                Heard::Said(Message::Round(place, round)) => {
                    announce(node, &place, round);
                    if let Membership::Dynamic { round: now, .. } = self {
                        *now = round;
                    }
                    return Ok(place);
                }
                Heard::Said(Message::Ended(cause) | Message::Cause(cause)) => {
                    return Err(report_cause(&cause))
                }
                Heard::Said(Message::Away { why, cause }) => return Err(away(&why, &cause)),
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

    /// The fd to poll, beside the ranks, for the rendezvous moving on.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        match self {
            Membership::Fixed(_) => None,
            Membership::Dynamic { helper, .. } => Some(helper.fd()),
        }
    }

    /// Whether something the rendezvous said is already read and waits (poll would not say
    /// so).
    pub fn has_buffered(&self) -> bool {
        matches!(self, Membership::Dynamic { helper, .. } if helper.has_buffered())
    }

    /// Reads what the rendezvous said while the ranks ran (its fd is ready): whether the
    /// running ranks' round moved on, or the job ended.
    pub fn moved_on(&mut self) -> Option<Moved> {
        let Membership::Dynamic { helper, round } = self else {
            return None;
        };
        match helper.read() {
            Message::Restart {
                round: of,
                why,
                short,
            } if of == *round => Some(match short {
                true => Moved::Short(why),
                false => Moved::Round(why),
            }),
            Message::Ended(cause) | Message::Cause(cause) => Some(Moved::Ended(cause)),
            Message::Away { why, cause } => Some(Moved::Away(why, cause)),
            Message::Error(message) => {
                output::message(&format!("tether: {message}; the ranks go on"));
                None
            }
            _ => None,
        }
    }

    /// The ranks were stopped because the job moved on: a new round (`None`), or the exit
    /// status of a job that ended elsewhere, or of one that cannot go on (`restarts_left`:
    /// whether this node may wait for a lost node to come back).
    pub fn moved(&self, moved: Moved, node: &Node, restarts_left: bool) -> Option<i32> {
        match moved {
            Moved::Short(why) if !restarts_left => Some(too_few_nodes(&why, node)),
            Moved::Short(why) => {
                output::message(&format!(
                    "tether: {why}: this node's ranks were stopped; fewer nodes than --nnodes' \
                     MIN are left, so they start again once a node joins (a restart of the lost \
                     one), for at most the rendezvous' join_timeout (not counted as a restart)"
                ));
                None
            }
            Moved::Round(why) => {
                output::message(&format!(
                    "tether: {why}: this node's ranks were stopped; they start again in a new \
                     round (not counted as a restart)"
                ));
                None
            }
            Moved::Ended(cause) => Some(report_cause(&cause)),
            Moved::Away(why, cause) => Some(away(&why, &cause)),
        }
    }

    /// This node's ranks failed with a restart left (restart `restart` of `max`): says so
    /// (and tells the other nodes, which start a new round too).
    pub fn restart(&mut self, failure: &Failure, node: &Node, restart: u32, max: u32) {
        let root = &failure.root;
        match self {
            Membership::Fixed(_) => output::message(&format!(
                "tether: attempt {} failed at {}: rank {} (pid {}) ended with {}; restarting all \
                 {} ranks (restart {restart} of {max})",
                failure.attempt,
                clock::local_iso(failure.ended_at),
                root.rank,
                root.pid,
                root.status,
                node.cfg.nproc,
            )),
            Membership::Dynamic { helper, .. } => {
                output::message(&format!(
                    "tether: rank {} (pid {}) ended with {}; restarting every node's ranks in \
                     a new round (this node's restart {restart} of {max})",
                    root.rank, root.pid, root.status,
                ));
                helper.failed(failure.record(), false);
            }
        }
    }

    /// This node's failure with no restart left ends the job (on every node): reports the
    /// job's root cause (another node's, when it failed first, else this one) and returns
    /// the exit status.
    pub fn failed(&mut self, failure: &Failure, node: &Node, warm: &Warm) -> i32 {
        let Membership::Dynamic { helper, .. } = self else {
            output::message(&failure.render());
            return failure.root.status.as_shell_code();
        };
        helper.failed(failure.record(), true);
        // What the watch said while the ranks were stopping (a node gone, a new round) is
        // over: the job ends.
        let mut heard = self.hear(node, warm);
        while let Heard::Said(Message::Restart { .. } | Message::Bye | Message::Round(..)) = heard {
            heard = self.hear(node, warm);
        }
        match heard {
            Heard::Said(Message::Cause(cause) | Message::Ended(cause))
                if !is_own(&cause, &failure.record(), &node.cfg.place) =>
            {
                report_cause(&cause)
            }
            Heard::Said(Message::Away { why, cause }) => {
                output::message(&failure.render());
                away(&why, &cause)
            }
            Heard::Said(Message::Cause(cause) | Message::Ended(cause)) => {
                output::message(&failure.render_in_job(&cause));
                failure.root.status.as_shell_code()
            }
            _ => {
                output::message(&failure.render());
                failure.root.status.as_shell_code()
            }
        }
    }

    /// A rank failed: in a dynamic rendezvous, the other nodes get its record (`record`) at
    /// once, before this node's other ranks are stopped (the first failure in time is the
    /// job's root cause).
    pub fn publish_failure(&mut self, record: impl FnOnce() -> Option<serde_json::Value>) {
        if let Membership::Dynamic { helper, .. } = self {
            if let Some(record) = record() {
                helper.failing(record);
            }
        }
    }

    /// This node's ranks succeeded. In a dynamic rendezvous, waits, as torchrun's exit
    /// barrier does, for the other nodes (the node hosting the store keeps it for them);
    /// another node's final failure ends the job with its code.
    pub fn succeeded(&mut self, node: &Node, warm: &Warm) -> i32 {
        let Membership::Dynamic { helper, .. } = self else {
            return 0;
        };
        helper.done();
        match self.hear(node, warm) {
            Heard::Said(Message::Ended(cause)) => report_cause(&cause),
            Heard::Said(Message::Away { why, cause }) => away(&why, &cause),
            Heard::Signal(sig) => 128 + sig,
            Heard::Said(_) => 0,
        }
    }

    /// The node leaves the job (the others start a new round without it), at the end of
    /// the run.
    pub fn leave(&mut self) {
        if let Membership::Dynamic { helper, .. } = self {
            helper.leave();
        }
    }

    /// The helper's next message, or the stop signal that came first; stack signals and
    /// SIGCHLD are handled on the way.
    fn hear(&mut self, node: &Node, warm: &Warm) -> Heard {
        let Membership::Dynamic { helper, .. } = self else {
            return Heard::Said(Message::Error("no rendezvous helper".into()));
        };
        loop {
            let mut own = warm.pids();
            own.insert(helper.pid());
            if helper.has_buffered() {
                return Heard::Said(helper.read());
            }
            let mut fds = [
                PollFd::new(&node.signals, PollFlags::IN),
                PollFd::from_borrowed_fd(helper.fd(), PollFlags::IN),
            ];
            let _ = rustix::event::poll(&mut fds, None);
            let helper_ready = !fds[1].revents().is_empty();
            if let Some(sig) = node.next_stop(&own) {
                return Heard::Signal(sig);
            }
            if helper_ready {
                return Heard::Said(helper.read());
            }
        }
    }
}

/// The node's rendezvous helper: a fork of the zygote while it serves and has imported what
/// the helper needs, else a new interpreter (`python -m tether.run.rendezvous`).
fn start_helper(node: &Node, rdzv: &Rendezvous, warm: &mut Warm) -> std::io::Result<Helper> {
    if let Some(zygote) = warm.helper_host() {
        match Helper::fork(zygote, rdzv) {
            Ok(helper) => return Ok(helper),
            Err(err) => warm.off(&err.to_string()),
        }
    }
    Helper::spawn(&node.cfg.rendezvous_python, rdzv)
}

fn announce(node: &Node, place: &Place, round: u64) {
    let n = node.cfg.nproc;
    output::message(&format!(
        "tether: round {round} of run {}: node rank {} of {} node(s), ranks {}..{} of a world \
         of {}; MASTER_ADDR={} MASTER_PORT={}",
        node.cfg.run_id,
        place.node_rank,
        place.nnodes,
        place.rank_base,
        place.rank_base + n.saturating_sub(1),
        place.world_size,
        place.master_addr,
        place.master_port
    ));
}

/// Whether the job's root cause is this node's own failure (`own`, its record).
fn is_own(cause: &serde_json::Value, own: &serde_json::Value, place: &Place) -> bool {
    cause["node_rank"].as_u64() == Some(place.node_rank as u64)
        && cause["rank"] == own["rank"]
        && cause["pid"] == own["pid"]
}

/// The job moved on while this node was away: says what happened, then the job's root cause
/// if it ended; returns the exit status (the root cause's, else 1: the job went on without
/// this node).
fn away(why: &str, cause: &serde_json::Value) -> i32 {
    output::message(&format!("tether: {why}; this node's ranks were stopped"));
    if cause.is_null() {
        output::message(
            "tether: the job went on without this node; it leaves the job with exit status 1",
        );
        return 1;
    }
    report_cause(cause)
}

/// A node is gone (`why`), the nodes left are fewer than MIN, and this node has no restart
/// left: the job cannot go on. Says so, as the root cause; the exit status (1).
fn too_few_nodes(why: &str, node: &Node) -> i32 {
    let cfg = &node.cfg;
    let min = cfg.rendezvous.as_ref().map_or(0, |r| r.min_nodes);
    output::message(&format!(
        "tether: the job ends: {why}, and the nodes left are fewer than --nnodes' MIN ({min}) \
         with no restart left on this node (--max-restarts {}); root cause: the lost node. \
         This node's {} rank(s) were stopped (ranks {}..{}); exit status 1",
        cfg.max_restarts,
        cfg.nproc,
        cfg.place.rank_base,
        cfg.place.rank_base + cfg.nproc.saturating_sub(1),
    ));
    1
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
