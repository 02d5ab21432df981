//! What the pool reads from its workers: their messages (ready, results, a lease's end)
//! and their deaths, each sorted into [`Event`]s.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::end;
use super::gate::Claim;
use super::lease::{Lease, LeaseEnd};
use super::table::{Sent, State, Worker};
use super::types::{Crash, Death, Event, Outcome, Task};
use super::wire::{self, Kind};
use crate::channel::{Message, Poller, Recv};
use crate::group::{Group, WaitFor};
use crate::status::ExitStatus;
use crate::warden::waitid;

/// How long the burial of a worker that died before it was ready waits for the warden to
/// record its exit, and with it the whole report.
const REPORT_WAIT: Duration = Duration::from_secs(2);

/// The exit code a leased process gets when its worker died: the worker's, in
/// `multiprocessing`'s convention; 255 when something else took the worker's status (it
/// did end, but how is lost).
pub(super) fn lease_code(status: ExitStatus) -> i32 {
    status.as_exitcode().unwrap_or(255)
}

/// The status of an exited worker: its group's record, else a look without reaping it
/// (the warden reaps it), else the record again (it reaped it meanwhile, under the
/// group's lock, so the record is there).
pub(super) fn exit_status(pidfd: &OwnedFd, group: &Group, member: usize) -> ExitStatus {
    if let Some(exit) = group.exit(member) {
        return exit.status;
    }
    match waitid(pidfd.as_fd(), true) {
        Ok(Some(status)) => status,
        _ => group.exit(member).map_or(ExitStatus::Unknown, |e| e.status),
    }
}

impl Worker {
    /// Reads every message waiting on the socket; false once the worker closed it.
    pub(super) fn read(&mut self, slot: usize, events: &mut Vec<Event>) -> bool {
        loop {
            match self.ctl.recv(Some(Duration::ZERO)) {
                Ok(Recv::Message(message)) => {
                    self.congested = false;
                    self.on_message(slot, message, events);
                }
                Ok(Recv::Timeout) => return true,
                // A worker that died with messages unread makes the kernel report
                // ECONNRESET once, before the results it sent: read on.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {}
                Ok(Recv::Closed) | Err(_) => return false,
            }
        }
    }

    pub(super) fn on_message(&mut self, slot: usize, message: Message, events: &mut Vec<Event>) {
        match message.data.first() {
            Some(&wire::RESULTS) => {
                let outcomes = self.on_results(message);
                if !outcomes.is_empty() {
                    events.push(Event::Results {
                        slot,
                        pid: self.pid,
                        outcomes,
                    });
                }
            }
            Some(&wire::DONE) => {
                if let Some(lease) = self.on_done(&message.data) {
                    events.push(Event::LeaseEnded { slot, lease });
                }
            }
            Some(&wire::HELLO) => {
                self.ready = true;
                events.push(Event::Ready {
                    slot,
                    pid: self.pid,
                });
            }
            _ => {}
        }
    }

    /// Matches results with the tasks in flight, in order; skipped tasks end silently.
    pub(super) fn on_results(&mut self, message: Message) -> Vec<Outcome> {
        let Message { data, fds } = message;
        let Ok(records) = wire::decode_results(&data, fds.len()) else {
            return Vec::new();
        };
        let runs = end::split_fds(fds, records.iter().map(|r| r.fds.len()));
        let mut outcomes = Vec::with_capacity(records.len());
        for (record, fds) in records.into_iter().zip(runs) {
            let Some(Sent::Batch { tasks, answered }) = self.inflight.front_mut() else {
                break;
            };
            if tasks.get(*answered).map(|(_, t)| t.id) != Some(record.id) {
                continue; // not what was sent: drop it (its fds close)
            }
            *answered += 1;
            if *answered == tasks.len() {
                self.inflight.pop_front();
            }
            if record.tag != Kind::Skipped {
                self.done = self.done.max(record.id);
                outcomes.push(Outcome {
                    id: record.id,
                    kind: record.tag,
                    data: data[record.bytes].to_vec(),
                    fds,
                });
            }
        }
        outcomes
    }

    pub(super) fn on_done(&mut self, data: &[u8]) -> Option<Arc<Lease>> {
        let (id, code) = wire::decode_done(data).ok()?;
        if !matches!(self.inflight.front(), Some(Sent::Lease)) || self.lease.as_ref()?.id() != id {
            return None;
        }
        self.inflight.pop_front();
        let lease = self.lease.take()?;
        lease.finish(LeaseEnd { code, died: false });
        Some(lease)
    }

    /// Sorts what a dead worker held; the tasks it never started are returned.
    pub(super) fn bury(self, slot: usize) -> (Death, Vec<Task>) {
        let status = exit_status(&self.pidfd, &self.group, self.member);
        let (running, item) = self.gate.running();
        let (mut crashed, mut lost, mut requeue) = (None, Vec::new(), Vec::new());
        for sent in self.inflight {
            let Sent::Batch { tasks, answered } = sent else {
                continue;
            };
            for (seq, task) in tasks.into_iter().skip(answered) {
                match self.gate.claim(seq) {
                    Claim::Queued => requeue.push(task),
                    Claim::Cancelled => {}
                    Claim::Started if task.id == running && crashed.is_none() => {
                        crashed = Some(Crash { id: task.id, item })
                    }
                    Claim::Started => lost.push(task.id),
                }
            }
        }
        if let Some(lease) = &self.lease {
            lease.finish(LeaseEnd {
                code: lease_code(status),
                died: true,
            });
        }
        if !self.ready {
            // Its report (why it could not start) is whole once the warden, which drains
            // the report pipe before it records the exit, has recorded it: this pidfd may
            // have woken us first.
            let member = [self.member];
            self.group
                .wait(Some(&member), WaitFor::AllExited, Some(REPORT_WAIT));
        }
        let report = self
            .group
            .with_member(self.member, |m| m.report().to_vec())
            .unwrap_or_default();
        let death = Death {
            slot,
            pid: self.pid,
            status,
            ready: self.ready,
            crashed,
            lost,
            lease: self.lease,
            report,
        };
        (death, requeue)
    }
}

impl State {
    pub(super) fn on_ready(&mut self, token: u64, poller: &Poller, events: &mut Vec<Event>) {
        let Some(&slot) = self.by_generation.get(&(token >> 1)) else {
            return;
        };
        let Some(w) = self.workers.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if token & 1 == 0 {
            if w.lent {
                return; // a waiting thread reads it (a readiness seen before it was lent)
            }
            if !w.read(slot, events) {
                // The worker closed its end (it is exiting): its pidfd tells the rest.
                w.ctl_open = false;
                let _ = poller.remove(w.ctl.as_fd());
            }
            return;
        }
        let Some(mut w) = self.workers[slot].take() else {
            return;
        };
        self.by_generation.remove(&w.generation);
        if w.ctl_open {
            w.read(slot, events);
            let _ = poller.remove(w.ctl.as_fd());
        }
        let _ = poller.remove(w.pidfd.as_fd());
        let done = w.done;
        let (death, requeue) = w.bury(slot);
        let started = death.crashed.as_ref().map(|c| c.id).into_iter();
        let started = started.chain(death.lost.iter().copied()).chain([done]);
        self.started_by_dead = started.fold(self.started_by_dead, u64::max);
        for task in requeue.into_iter().rev() {
            self.pending.push_front(task);
        }
        events.push(Event::Died(death));
    }
}
