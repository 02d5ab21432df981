//! One attempt: every local rank plumbed ([`plumbing`]) and started (forks of the warm zygote, or
//! new processes), their output pumped, their exits, the launcher's signals, the run's
//! limits and the membership heeded ([`steer`]) until every rank has ended, whatever
//! they left behind killed, and the outcome concluded: success, or the failure that came
//! first in time, with what the report of it needs.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use tether_core::Group;

use super::abandon::stop_launching;
use super::error::RunError;
use super::membership::{Membership, Moved};
use super::node::Node;
use super::report::{oom_kills, ErrorFile, Failure, RankEnd};
use super::warm::Warm;
use crate::clock;
use crate::output;
use crate::stacks::hangs::Limit;
use crate::watch::Watch;

mod plumbing;
mod steer;

use plumbing::{Plumbed, Sinks};
use steer::{kill_all, Steering, Stop};

/// How an attempt ended.
pub enum AttemptEnd {
    Success,
    Failed(Box<Failure>),
    /// The launcher got this signal and stopped the ranks.
    Interrupted(i32),
    /// The run went past `--timeout` or `--stall-timeout`; the ranks were stopped.
    TimedOut(Limit),
    /// The job moved on (a new round, or its end elsewhere); the ranks were stopped.
    Moved(Moved),
}

/// Attempt `number` of this node's ranks, in the place the membership gave.
pub struct Attempt<'a> {
    pub node: &'a Node,
    pub warm: &'a mut Warm,
    pub membership: &'a mut Membership,
    pub number: u32,
}

impl Attempt<'_> {
    /// Runs the attempt to its end.
    pub fn run(self) -> Result<AttemptEnd, RunError> {
        let launching = stop_launching();
        let node = self.node;
        let logs = node
            .logs
            .as_ref()
            .map(|d| d.join(format!("attempt_{}", self.number)));
        let (mut plumbed, done_rx) = plumb_ranks(node, self.number, logs.as_deref())?;
        let pumps = plumbed.iter().map(|w| w.pumps).sum();
        let specs = plumbed
            .iter_mut()
            .map(|w| std::mem::take(&mut w.spec))
            .collect();
        let oom_before = oom_kills();
        node.deadlines.restart();
        let group = Group::new();
        output::pty::attach(&group);
        let launched = self.warm.start_ranks(&group, specs, &node.cfg.place);
        // The ranks hold their own copies now; the pumps see EOF once the ranks (and what
        // they started) are gone.
        plumbed.iter_mut().for_each(|w| w.write_ends.clear());
        drop(launching);
        let mut steering = Steering {
            node,
            warm: self.warm,
            membership: self.membership,
            group: &group,
        };
        if let Err(err) = launched {
            kill_all(&group);
            steering.cleanup(&done_rx, pumps);
            return Err(RunError::from_launch(err));
        }
        log::info!(
            target: "tether::run",
            "attempt {}: started {} rank(s), pids {:?}",
            self.number,
            node.cfg.nproc,
            (0..group.len()).filter_map(|i| group.pid(i)).collect::<Vec<_>>()
        );
        let number = self.number;
        let record = |g: &Group| record(node, g, number, &plumbed, oom_before, &logs);
        let looking = watch_ranks(node, &group);
        let steered = steering.steer(&record);
        drop(looking);
        if steered.is_err() {
            kill_all(&group);
        }
        let oom = oom_before.zip(oom_kills());
        steering.cleanup(&done_rx, pumps);
        let (stop_mono, stopped) = steered?;
        Ok(match stopped {
            Some(Stop::Signal(sig)) => AttemptEnd::Interrupted(sig),
            Some(Stop::Limit(limit)) => AttemptEnd::TimedOut(limit),
            Some(Stop::Moved(moved)) => AttemptEnd::Moved(moved),
            None => conclude(node, &group, self.number, stop_mono, &plumbed, oom, logs),
        })
    }
}

/// The watch over the attempt's ranks, unless `--no-watch` (or the ranks do not run
/// Python).
fn watch_ranks(node: &Node, group: &Group) -> Option<Watch> {
    let ranks = (0..group.len()).map(|i| node.cfg.global_rank(i)).collect();
    node.cfg.watch.then(|| Watch::start(group, ranks)).flatten()
}

/// Every local rank plumbed for attempt `number`, and the channel on which each pump says
/// it is done.
fn plumb_ranks(
    node: &Node,
    number: u32,
    logs: Option<&Path>,
) -> Result<(Vec<Plumbed>, mpsc::Receiver<()>), RunError> {
    let sinks = Sinks::open(&node.cfg, logs)?;
    let (done_tx, done_rx) = mpsc::channel();
    let plumbed = (0..node.cfg.nproc)
        .map(|local| Plumbed::new(node, local, number, logs, &sinks, &done_tx))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((plumbed, done_rx))
}

/// The record of the attempt's first failure so far (`None` while none failed), which the
/// other nodes get before this node's other ranks are stopped.
fn record(
    node: &Node,
    group: &Group,
    attempt: u32,
    plumbed: &[Plumbed],
    oom_before: Option<u64>,
    logs: &Option<PathBuf>,
) -> Option<serde_json::Value> {
    let oom = oom_before.zip(oom_kills());
    match conclude(node, group, attempt, None, plumbed, oom, logs.clone()) {
        AttemptEnd::Failed(failure) => Some(failure.record()),
        _ => None,
    }
}

/// How each rank ended, and when (monotonic clock); `stop_mono` is when the stopping began.
fn rank_ends(node: &Node, group: &Group, stop_mono: Option<Duration>) -> Vec<(RankEnd, Duration)> {
    (0..group.len())
        .filter_map(|i| {
            let exit = group.exit(i)?;
            let end = RankEnd {
                rank: node.cfg.global_rank(i),
                local_rank: i,
                pid: group.pid(i).unwrap_or(0),
                status: exit.status,
                stopped: stop_mono.is_some_and(|t| exit.at > t),
            };
            Some((end, exit.at))
        })
        .collect()
}

/// The attempt's outcome: success, or the failure that came first in time.
fn conclude(
    node: &Node,
    group: &Group,
    attempt: u32,
    stop_mono: Option<Duration>,
    plumbed: &[Plumbed],
    oom: Option<(u64, u64)>,
    logs: Option<PathBuf>,
) -> AttemptEnd {
    let ends = rank_ends(node, group, stop_mono);
    let first = group.first_failure();
    let Some((root, at)) = ends
        .iter()
        .find(|(e, _)| Some(e.local_rank) == first)
        .cloned()
    else {
        return AttemptEnd::Success;
    };
    let rank_io = plumbed.get(root.local_rank);
    AttemptEnd::Failed(Box::new(Failure {
        node_rank: node.cfg.place.node_rank,
        host: node.hostname.clone(),
        attempt,
        ended_at: clock::wall_time_of(at),
        error: rank_io.and_then(|w| ErrorFile::read(&w.error_file)),
        tail: rank_io
            .map(|w| w.tail.lock().unwrap_or_else(|e| e.into_inner()).lines())
            .unwrap_or_default(),
        tail_is_merged: rank_io.is_some_and(|w| w.merged),
        oom,
        others: ends
            .into_iter()
            .map(|(e, _)| e)
            .filter(|e| e.local_rank != root.local_rank)
            .collect(),
        log_dir: logs.map(|p| p.display().to_string()),
        root,
    }))
}
