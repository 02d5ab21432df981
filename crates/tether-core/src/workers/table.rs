//! The table of workers: each worker's link, what is in flight to it, and the queue of
//! tasks not sent yet, spread over the free workers in batches sized to the backlog.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::gate::{Claim, Gate};
use super::lease::Lease;
use super::types::{Config, Event, Task};
use super::wire;
use crate::channel::Endpoint;
use crate::group::Group;

/// A message in flight to a worker.
#[derive(Debug)]
pub(super) enum Sent {
    Batch {
        tasks: Vec<(u32, Task)>,
        answered: usize,
    },
    Lease,
}

#[derive(Debug)]
pub(super) struct Worker {
    pub(super) pid: i32,
    pub(super) generation: u64,
    pub(super) ctl: Endpoint,
    pub(super) ctl_open: bool,
    pub(super) pidfd: OwnedFd,
    pub(super) gate: Gate,
    pub(super) group: Group,
    pub(super) member: usize,
    pub(super) ready: bool,
    pub(super) lease: Option<Arc<Lease>>,
    pub(super) reserved: bool,
    /// A send found its socket full: no more until the worker answers.
    pub(super) congested: bool,
    /// A waiting thread reads its socket (see [`wait`]).
    pub(super) lent: bool,
    pub(super) inflight: VecDeque<Sent>,
    pub(super) seq: u32,
    /// The highest id among the tasks it answered (0 before any).
    pub(super) done: u64,
}

pub(super) fn ctl_token(generation: u64) -> u64 {
    generation << 1
}

pub(super) fn pidfd_token(generation: u64) -> u64 {
    (generation << 1) | 1
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) workers: Vec<Option<Worker>>,
    pub(super) by_generation: HashMap<u64, usize>,
    pub(super) next_generation: u64,
    pub(super) pending: VecDeque<Task>,
    /// Events read by a thread waiting on a lent socket (see [`wait`]), for `poll`.
    pub(super) deferred: Vec<Event>,
    pub(super) closed: bool,
    /// The highest id among the tasks that dead workers started.
    pub(super) started_by_dead: u64,
}

/// A worker's process, as its launch left it.
pub(super) struct Process {
    pub(super) pid: i32,
    pub(super) pidfd: OwnedFd,
    pub(super) group: Group,
    pub(super) member: usize,
}

impl Worker {
    pub(super) fn new(process: Process, generation: u64, ctl: Endpoint, gate: Gate) -> Worker {
        let Process {
            pid,
            pidfd,
            group,
            member,
        } = process;
        Worker {
            pid,
            generation,
            ctl,
            ctl_open: true,
            pidfd,
            gate,
            group,
            member,
            ready: false,
            lease: None,
            reserved: false,
            congested: false,
            lent: false,
            inflight: VecDeque::new(),
            seq: 0,
            done: 0,
        }
    }

    pub(super) fn is_free(&self) -> bool {
        self.lease.is_none() && !self.reserved
    }

    /// Whether tasks may go to it now: free, ready (a worker still starting would hold
    /// them while the others idle), with room in its window.
    pub(super) fn schedulable(&self, window: usize) -> bool {
        self.is_free() && self.ready && !self.congested && self.inflight.len() < window
    }

    /// The tasks sent and not answered, with their sequence numbers.
    pub(super) fn unanswered(&self) -> impl Iterator<Item = (u32, &Task)> {
        self.inflight
            .iter()
            .flat_map(|sent| match sent {
                Sent::Batch { tasks, answered } => tasks[*answered..].iter(),
                Sent::Lease => [].iter(),
            })
            .map(|(seq, task)| (*seq, task))
    }

    /// Sends one message without blocking; false when the socket is full. A worker that
    /// is gone counts as sent: its death returns what it held.
    pub(super) fn send(&mut self, data: &[u8], fds: &[BorrowedFd<'_>]) -> bool {
        !matches!(self.ctl.send(data, fds, Some(Duration::ZERO)), Ok(false))
    }

    /// Sends a batch; gives the tasks back when the socket is full.
    pub(super) fn send_batch(&mut self, tasks: Vec<Task>) -> Result<(), Vec<Task>> {
        let first = self.seq;
        let head: Vec<(u64, u32, &[u8], usize)> = tasks
            .iter()
            .enumerate()
            .map(|(n, t)| {
                (
                    t.id,
                    first.wrapping_add(n as u32),
                    t.data.as_slice(),
                    t.fds.len(),
                )
            })
            .collect();
        for &(_, seq, _, _) in &head {
            self.gate.arm(seq);
        }
        let data = wire::encode_batch(&head);
        let fds: Vec<BorrowedFd<'_>> = tasks
            .iter()
            .flat_map(|t| t.fds.iter().map(AsFd::as_fd))
            .collect();
        if !self.send(&data, &fds) {
            self.congested = true;
            return Err(tasks);
        }
        self.seq = first.wrapping_add(tasks.len() as u32);
        let tasks = tasks
            .into_iter()
            .enumerate()
            .map(|(n, t)| (first.wrapping_add(n as u32), t))
            .collect();
        self.inflight.push_back(Sent::Batch { tasks, answered: 0 });
        Ok(())
    }
}

impl State {
    /// The slot of the worker that holds task `id` unanswered.
    pub(super) fn holder_of(&self, id: u64) -> Option<usize> {
        self.workers.iter().position(|w| {
            w.as_ref()
                .is_some_and(|w| w.unanswered().any(|(_, task)| task.id == id))
        })
    }

    /// Sends queued tasks to the free workers with room, the least busy first.
    pub(super) fn dispatch(&mut self, config: &Config) {
        while !self.pending.is_empty() {
            let schedulable = self
                .workers
                .iter()
                .flatten()
                .filter(|w| w.is_free())
                .count()
                .max(1);
            let Some(w) = self
                .workers
                .iter_mut()
                .flatten()
                .filter(|w| w.schedulable(config.window))
                .min_by_key(|w| w.inflight.len())
            else {
                return;
            };
            let backlog = self.pending.len().div_ceil(config.window * schedulable);
            let size = backlog.clamp(1, config.max_batch);
            let batch: Vec<Task> = self.pending.drain(..size.min(self.pending.len())).collect();
            if let Err(batch) = w.send_batch(batch) {
                for task in batch.into_iter().rev() {
                    self.pending.push_front(task);
                }
            }
        }
    }

    /// Withdraws, the latest first, every task submitted after the last one a worker
    /// started (task ids grow in submission order), and stops at the first task a worker
    /// started meanwhile: every task before it runs, so that the tasks that run are the
    /// first ones submitted, as with `ProcessPoolExecutor`'s queue. Returns their ids.
    pub(super) fn cancel_after_started(&mut self) -> Vec<u64> {
        let mut floor = self.started_by_dead;
        // (id, where: None for the queue here, else the worker's slot and the task's seq)
        let mut waiting: Vec<(u64, Option<(usize, u32)>)> = Vec::new();
        for (slot, w) in self.workers.iter().enumerate() {
            let Some(w) = w else { continue };
            floor = floor.max(w.done);
            waiting.extend(w.unanswered().map(|(seq, t)| (t.id, Some((slot, seq)))));
        }
        waiting.extend(self.pending.iter().map(|t| (t.id, None)));
        waiting.sort_unstable_by_key(|w| std::cmp::Reverse(w.0));
        let mut cancelled = Vec::new();
        for (id, at) in waiting {
            if id <= floor {
                break;
            }
            let Some((slot, seq)) = at else {
                cancelled.push(id);
                continue;
            };
            let Some(w) = self.workers[slot].as_ref() else {
                continue;
            };
            match w.gate.claim(seq) {
                Claim::Cancelled => {}
                Claim::Queued if w.gate.cancel(seq) => cancelled.push(id),
                Claim::Queued | Claim::Started => break,
            }
        }
        let withdrawn: HashSet<u64> = cancelled.iter().copied().collect();
        self.pending.retain(|task| !withdrawn.contains(&task.id));
        cancelled
    }

    /// Withdraws the unstarted tasks whose ids `wanted` accepts.
    pub(super) fn cancel(&mut self, wanted: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut cancelled = Vec::new();
        self.pending.retain(|task| {
            let keep = !wanted(task.id);
            if !keep {
                cancelled.push(task.id);
            }
            keep
        });
        for w in self.workers.iter().flatten() {
            for (seq, task) in w.unanswered() {
                if wanted(task.id) && w.gate.claim(seq) == Claim::Queued && w.gate.cancel(seq) {
                    cancelled.push(task.id);
                }
            }
        }
        cancelled
    }
}
