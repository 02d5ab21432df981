//! A thread waiting for one task takes its result from the worker's socket itself.
//!
//! Without this, a result travels worker -> polling thread -> waiting thread: two wake-ups
//! after the worker's. [`WorkerSet::wait_for`] lends the socket of the worker that holds the
//! task to the waiting thread (the set's poller stops watching it meanwhile), so the
//! result wakes the waiter alone. Whatever else arrives on that socket is handed to the
//! polling thread as events; a worker that dies is left to the polling thread, which sees
//! its pidfd.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};

use super::error::WorkersError;
use super::set::WorkerSet;
use super::table::ctl_token;
use super::types::{Event, Outcome};

/// What [`WorkerSet::wait_for`] found.
#[derive(Debug)]
pub enum Waited {
    /// The task's result.
    Outcome(Outcome),
    /// Nothing before the timeout.
    Timeout,
    /// The result is not for this thread to take (the task is not in a worker's hands,
    /// another thread waits on that worker, or the worker died): it comes from `poll`.
    Elsewhere,
}

impl WorkerSet {
    /// Waits up to `timeout` (polling first, see [`super::spin`]) for the result of task
    /// `id`, taken here rather than by [`WorkerSet::poll`].
    pub fn wait_for(&self, id: u64, timeout: Option<Duration>) -> Result<Waited, WorkersError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let Some((slot, generation, ctl)) = self.lend(id)? else {
            return Ok(Waited::Elsewhere);
        };
        let got = self.watch_lent(slot, generation, ctl.as_fd(), id, deadline);
        self.give_back(slot, generation);
        got
    }

    /// Takes the socket of the worker holding task `id` out of the set's poller; a duplicate
    /// of its fd for this thread (the worker's own may close meanwhile).
    fn lend(&self, id: u64) -> Result<Option<(usize, u64, OwnedFd)>, WorkersError> {
        let poller = self.poller()?;
        let mut state = self.lock();
        let Some(slot) = state.holder_of(id) else {
            return Ok(None);
        };
        let Some(w) = state.workers[slot].as_mut() else {
            return Ok(None);
        };
        if w.lent || !w.ctl_open {
            return Ok(None);
        }
        let ctl = w.ctl.as_fd().try_clone_to_owned()?;
        poller.set_readable(ctl_token(w.generation), w.ctl.as_fd(), false)?;
        w.lent = true;
        Ok(Some((slot, w.generation, ctl)))
    }

    fn give_back(&self, slot: usize, generation: u64) {
        let Ok(poller) = self.poller() else {
            return;
        };
        let mut state = self.lock();
        let Some(w) = state.workers.get_mut(slot).and_then(Option::as_mut) else {
            return;
        };
        if w.generation != generation {
            return;
        }
        w.lent = false;
        if w.ctl_open {
            let _ = poller.set_readable(ctl_token(generation), w.ctl.as_fd(), true);
        }
    }

    fn watch_lent(
        &self,
        slot: usize,
        generation: u64,
        ctl: BorrowedFd<'_>,
        id: u64,
        deadline: Option<Instant>,
    ) -> Result<Waited, WorkersError> {
        let mut polled = false;
        loop {
            match self.read_lent(slot, generation, id)? {
                Lent::Mine(outcome) => return Ok(Waited::Outcome(outcome)),
                Lent::Gone => return Ok(Waited::Elsewhere),
                Lent::Nothing => {}
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                return Ok(Waited::Timeout);
            }
            if !polled {
                polled = true;
                let ready = || wait_readable(ctl, Some(Duration::ZERO)).map(|r| r.then_some(()));
                if self.wait_spin.poll(ready)?.is_some() {
                    continue;
                }
            }
            wait_readable(ctl, left)?;
        }
    }

    /// Reads what the lent socket holds: this thread's result, if it came; the rest goes
    /// to the polling thread.
    fn read_lent(&self, slot: usize, generation: u64, id: u64) -> Result<Lent, WorkersError> {
        let poller = self.poller()?;
        let mut state = self.lock();
        if state.closed {
            return Ok(Lent::Gone);
        }
        let Some(w) = state.workers.get_mut(slot).and_then(Option::as_mut) else {
            return Ok(Lent::Gone);
        };
        if w.generation != generation {
            return Ok(Lent::Gone);
        }
        let mut events = Vec::new();
        let open = w.read(slot, &mut events);
        if !open {
            w.ctl_open = false;
            let _ = poller.remove(w.ctl.as_fd());
        }
        let mine = take_outcome(&mut events, id);
        if !events.is_empty() {
            state.deferred.append(&mut events);
            let _ = poller.wake();
        }
        state.dispatch(&self.config);
        Ok(match mine {
            Some(outcome) => Lent::Mine(outcome),
            None if !open => Lent::Gone,
            None => Lent::Nothing,
        })
    }
}

enum Lent {
    Mine(Outcome),
    Nothing,
    Gone,
}

/// Removes the outcome of task `id` from `events`.
fn take_outcome(events: &mut Vec<Event>, id: u64) -> Option<Outcome> {
    let mut found = None;
    for event in events.iter_mut() {
        if let Event::Results { outcomes, .. } = event {
            if let Some(at) = outcomes.iter().position(|o| o.id == id) {
                found = Some(outcomes.remove(at));
            }
        }
    }
    events.retain(|e| !matches!(e, Event::Results { outcomes, .. } if outcomes.is_empty()));
    found
}

/// Waits up to `timeout` (for ever when None) for `fd` to be readable; whether it is.
fn wait_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<bool, WorkersError> {
    let timeout = timeout.map(|t| Timespec {
        tv_sec: t.as_secs() as i64,
        tv_nsec: t.subsec_nanos() as i64,
    });
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    match rustix::event::poll(&mut fds, timeout.as_ref()) {
        Ok(n) => Ok(n > 0),
        Err(rustix::io::Errno::INTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}
