//! The conclusion of an attempt: success, or the failure that came first in time.

use std::path::PathBuf;
use std::time::Duration;

use tether_core::Group;

use super::{AttemptEnd, Launcher, Wired};
use crate::clock;
use crate::report::{ErrorFile, Failure, RankEnd};

impl Launcher {
    /// How each rank ended, and when (monotonic clock); `stop_mono` is when the stopping
    /// began.
    pub(super) fn rank_ends(
        &self,
        group: &Group,
        stop_mono: Option<Duration>,
    ) -> Vec<(RankEnd, Duration)> {
        (0..group.len())
            .filter_map(|i| {
                let exit = group.exit(i)?;
                let end = RankEnd {
                    rank: self.cfg.global_rank(i),
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
    pub(super) fn conclude(
        &self,
        group: &Group,
        attempt: u32,
        stop_mono: Option<Duration>,
        wired: &[Wired],
        oom: Option<(u64, u64)>,
        logs: Option<PathBuf>,
    ) -> AttemptEnd {
        let ends = self.rank_ends(group, stop_mono);
        let first = group.first_failure();
        let Some((root, at)) = ends
            .iter()
            .find(|(e, _)| Some(e.local_rank) == first)
            .cloned()
        else {
            return AttemptEnd::Success;
        };
        let rank_io = wired.get(root.local_rank);
        AttemptEnd::Failed(Box::new(Failure {
            node_rank: self.cfg.place.node_rank,
            host: self.hostname.clone(),
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
}
