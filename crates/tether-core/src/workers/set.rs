//! [`WorkerSet`]: the table behind one lock, the [`Poller`] that watches every worker's
//! socket and pidfd, and the calls the pool makes from any thread.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use super::error::WorkersError;
use super::gate::{self, Claim};
use super::lease::{Lease, LeaseEnd};
use super::read::{exit_status, lease_code};
use super::spin::Spin;
use super::table::{ctl_token, pidfd_token, Process, Sent, State, Worker};
use super::types::{Closing, Config, Event, Link, Task, WorkerInfo};
use super::wire;
use crate::channel::Poller;
use crate::group::{Group, WaitFor};

/// The worker set (see the module's documentation).
#[derive(Debug)]
pub struct WorkerSet {
    pub(super) config: Config,
    pub(super) state: Mutex<State>,
    /// The poller and its wake-up; dropped at close (a `poll` under way keeps its own
    /// reference until it returns).
    pub(super) poller: Mutex<Option<Arc<Poller>>>,
    /// The polling policies of `poll` and of `wait_for`.
    pub(super) poll_spin: Spin,
    pub(super) wait_spin: Spin,
    /// The process that made the set. A copy inherited through a fork is inert: it must
    /// not signal the workers or take their messages.
    pub(super) owner: u32,
}

impl WorkerSet {
    pub fn new(config: Config) -> Result<WorkerSet, WorkersError> {
        let poller = Poller::new()?;
        let window = config.window.max(1);
        let max_batch = config.max_batch.clamp(1, gate::max_in_flight() / window);
        Ok(WorkerSet {
            config: Config {
                window,
                max_batch,
                spin: config.spin,
            },
            state: Mutex::new(State::default()),
            poller: Mutex::new(Some(Arc::new(poller))),
            poll_spin: Spin::new(config.spin),
            wait_spin: Spin::new(config.spin),
            owner: std::process::id(),
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data behind: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this is the process that made the set (see `owner`).
    pub(super) fn ours(&self) -> bool {
        std::process::id() == self.owner
    }

    /// The poller; `Closed` once the set is closed, or in a process that is not ours.
    pub(super) fn poller(&self) -> Result<Arc<Poller>, WorkersError> {
        if !self.ours() {
            return Err(WorkersError::Closed);
        }
        let poller = self.poller.lock().unwrap_or_else(|e| e.into_inner());
        poller.clone().ok_or(WorkersError::Closed)
    }

    /// Puts the worker started over `link` (member `member` of `group`) in `slot`. The
    /// link's worker ends are closed here (the worker has its copies).
    pub fn add(
        &self,
        slot: usize,
        link: Link,
        group: Group,
        member: usize,
    ) -> Result<i32, WorkersError> {
        let pid = group.pid(member).ok_or(WorkersError::NoWorker(slot))?;
        let pidfd = group
            .with_member(member, |m| {
                // SAFETY: the member's pidfd is open while the group lives (we hold it).
                unsafe { BorrowedFd::borrow_raw(m.sentinel()) }.try_clone_to_owned()
            })
            .ok_or(WorkersError::NoWorker(slot))??;
        let Link { parent, gate, .. } = link;
        let mut state = self.lock();
        if state.closed {
            return Err(WorkersError::Closed);
        }
        if state.workers.get(slot).is_some_and(Option::is_some) {
            return Err(WorkersError::Occupied(slot));
        }
        let generation = state.next_generation;
        state.next_generation += 1;
        let poller = self.poller()?;
        poller.add(ctl_token(generation), parent.as_fd())?;
        if let Err(err) = poller.add(pidfd_token(generation), pidfd.as_fd()) {
            let _ = poller.remove(parent.as_fd());
            return Err(err.into());
        }
        if state.workers.len() <= slot {
            state.workers.resize_with(slot + 1, || None);
        }
        let process = Process {
            pid,
            pidfd,
            group,
            member,
        };
        state.workers[slot] = Some(Worker::new(process, generation, parent, gate));
        state.by_generation.insert(generation, slot);
        state.dispatch(&self.config);
        Ok(pid)
    }

    /// Queues tasks (sending what the free workers can take now).
    pub fn submit(&self, tasks: Vec<Task>) -> Result<(), WorkersError> {
        let mut state = self.lock();
        if state.closed || !self.ours() {
            return Err(WorkersError::Closed);
        }
        state.pending.extend(tasks);
        state.dispatch(&self.config);
        Ok(())
    }

    /// Withdraws the tasks among `ids` that have not started (queued here, or sent to a
    /// worker that has not started them); returns those withdrawn.
    pub fn cancel(&self, ids: &[u64]) -> Vec<u64> {
        let wanted: HashSet<u64> = ids.iter().copied().collect();
        self.lock().cancel(|id| wanted.contains(&id))
    }

    /// Withdraws every task not started; returns their ids.
    pub fn cancel_all(&self) -> Vec<u64> {
        self.lock().cancel(|_| true)
    }

    /// Withdraws every task submitted after the last one a worker started, the latest
    /// first, so that the tasks that run are the first ones submitted; returns their ids.
    pub fn cancel_after_started(&self) -> Vec<u64> {
        self.lock().cancel_after_started()
    }

    /// Whether task `id` was started by a worker and not answered yet.
    pub fn started(&self, id: u64) -> bool {
        let state = self.lock();
        state.workers.iter().flatten().any(|w| {
            w.unanswered()
                .any(|(seq, task)| task.id == id && w.gate.claim(seq) == Claim::Started)
        })
    }

    /// Whether tasks are queued or in flight.
    pub fn busy(&self) -> bool {
        let state = self.lock();
        !state.pending.is_empty()
            || state
                .workers
                .iter()
                .flatten()
                .any(|w| w.unanswered().next().is_some())
    }

    /// How many tasks wait for a worker (queued here, not sent to any).
    pub fn queued(&self) -> usize {
        self.lock().pending.len()
    }

    /// The pids of the workers in the table.
    pub fn pids(&self) -> Vec<i32> {
        self.lock()
            .workers
            .iter()
            .flatten()
            .map(|w| w.pid)
            .collect()
    }

    /// Each worker in the table as its group and member index (to ask it for its stack).
    pub fn members(&self) -> Vec<(Group, usize)> {
        self.lock()
            .workers
            .iter()
            .flatten()
            .map(|w| (w.group.clone(), w.member))
            .collect()
    }

    pub fn workers(&self) -> Vec<WorkerInfo> {
        let state = self.lock();
        state
            .workers
            .iter()
            .enumerate()
            .filter_map(|(slot, w)| {
                w.as_ref().map(|w| WorkerInfo {
                    slot,
                    pid: w.pid,
                    ready: w.ready,
                    lease: w.lease.as_ref().map(|l| l.id()),
                    reserved: w.reserved,
                })
            })
            .collect()
    }

    /// The pool's ends of every worker's socket (a forked child closes its copies).
    pub fn parent_fds(&self) -> Vec<RawFd> {
        let state = self.lock();
        state
            .workers
            .iter()
            .flatten()
            .map(|w| w.ctl.as_fd().as_raw_fd())
            .collect()
    }

    /// Reserves `n` free workers (neither leased nor reserved), those with the least in
    /// flight first: no task is sent to them until they are leased or given back. Returns
    /// their slots, or how many are free when fewer than `n`.
    pub fn reserve(&self, n: usize) -> Result<Vec<usize>, usize> {
        let mut state = self.lock();
        let mut free: Vec<(usize, usize)> = state
            .workers
            .iter()
            .enumerate()
            .filter_map(|(slot, w)| {
                w.as_ref()
                    .filter(|w| w.is_free())
                    .map(|w| (w.inflight.len(), slot))
            })
            .collect();
        if free.len() < n || state.closed {
            return Err(if state.closed { 0 } else { free.len() });
        }
        free.sort_unstable();
        let slots: Vec<usize> = free.into_iter().take(n).map(|(_, slot)| slot).collect();
        for &slot in &slots {
            if let Some(w) = state.workers[slot].as_mut() {
                w.reserved = true;
            }
        }
        Ok(slots)
    }

    /// Gives back reserved workers that were not leased.
    pub fn unreserve(&self, slots: &[usize]) {
        let mut state = self.lock();
        for &slot in slots {
            if let Some(Some(w)) = state.workers.get_mut(slot) {
                w.reserved = false;
            }
        }
        state.dispatch(&self.config);
    }

    /// Leases the worker in `slot` (free, or reserved) to process `id`, whose call is
    /// `data` with `fds`, and sends it there.
    pub fn lease(
        &self,
        slot: usize,
        id: u64,
        data: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<Arc<Lease>, WorkersError> {
        let mut state = self.lock();
        if state.closed || !self.ours() {
            return Err(WorkersError::Closed);
        }
        let w = state
            .workers
            .get_mut(slot)
            .and_then(Option::as_mut)
            .ok_or(WorkersError::NoWorker(slot))?;
        if w.lease.is_some() {
            return Err(WorkersError::Leased(slot));
        }
        let lease = Lease::new(id, slot, w.pid, w.pidfd.as_fd())?;
        if !w.send(&wire::encode_lease(id, data), fds) {
            return Err(WorkersError::Io(io::ErrorKind::WouldBlock.into()));
        }
        w.reserved = false;
        w.lease = Some(lease.clone());
        w.inflight.push_back(Sent::Lease);
        Ok(lease)
    }

    /// Sends the worker in `slot` a note (see [`wire`]), which it reads after what it was
    /// sent before; false when no worker is there, its link is full or the set is closed.
    pub fn note(&self, slot: usize, data: &[u8]) -> bool {
        let mut state = self.lock();
        if state.closed || !self.ours() {
            return false;
        }
        match state.workers.get_mut(slot).and_then(Option::as_mut) {
            Some(w) => w.send(&wire::encode_note(data), &[]),
            None => false,
        }
    }

    /// Sends `signal` to the worker running lease `id`; false when it no longer does.
    pub fn signal_lease(&self, lease: &Lease, signal: i32) -> io::Result<bool> {
        if !self.ours() {
            return Ok(false);
        }
        let state = self.lock();
        match state.workers.get(lease.slot()).and_then(Option::as_ref) {
            Some(w) if w.lease.as_ref().is_some_and(|l| l.id() == lease.id()) => {
                w.group.signal(w.member, signal)
            }
            _ => Ok(false),
        }
    }

    /// Makes a current or the next [`WorkerSet::poll`] return at once.
    pub fn wake(&self) {
        if let Ok(poller) = self.poller() {
            let _ = poller.wake();
        }
    }

    /// Waits up to `timeout` (for ever when None; polling first, see [`spin`]) for
    /// something to happen, handles it and returns the events. Fails with `Closed` once
    /// the set is closed. Meant for one thread.
    pub fn poll(&self, timeout: Option<Duration>) -> Result<Vec<Event>, WorkersError> {
        let poller = self.poller()?;
        let tokens = ready_tokens(&poller, timeout, &self.poll_spin)?;
        let mut state = self.lock();
        if state.closed {
            return Err(WorkersError::Closed);
        }
        let mut events = std::mem::take(&mut state.deferred);
        for token in tokens {
            state.on_ready(token, &poller, &mut events);
        }
        state.dispatch(&self.config);
        Ok(events)
    }

    /// Closes the set: no more tasks or leases, every worker's socket closed (so it exits),
    /// leased workers (or all, with `kill`) sent SIGKILL, and up to `grace` for them to
    /// exit before SIGKILL. Returns the tasks never answered and the leases it ended.
    pub fn close(&self, kill: bool, grace: Duration) -> Closing {
        if !self.ours() {
            return Closing::default();
        }
        let (workers, mut closing) = {
            let mut state = self.lock();
            if state.closed {
                return Closing::default();
            }
            state.closed = true;
            let mut closing = Closing::default();
            closing.tasks.extend(state.pending.drain(..).map(|t| t.id));
            let workers: Vec<Worker> = state.workers.iter_mut().filter_map(Option::take).collect();
            state.by_generation.clear();
            (workers, closing)
        };
        let poller = self.poller.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(poller) = &poller {
            let _ = poller.wake();
        }
        drop(poller);
        for w in &workers {
            closing.tasks.extend(
                w.unanswered()
                    .filter(|(seq, _)| w.gate.claim(*seq) != Claim::Cancelled)
                    .map(|(_, t)| t.id),
            );
        }
        closing.leases = stop(workers, kill, grace);
        closing
    }
}

/// How long closing the set waits for the warden to reap a worker that exited.
const REAP_PATIENCE: Duration = Duration::from_secs(2);

/// Stops the workers of a closed set: their sockets close (so they exit), the leased ones
/// (or all, with `kill`) get SIGKILL at once, the others up to `grace` to exit before it.
/// Returns the leases it ended.
fn stop(workers: Vec<Worker>, kill: bool, grace: Duration) -> Vec<Arc<Lease>> {
    let mut waiting = Vec::with_capacity(workers.len());
    for w in workers {
        if kill || w.lease.is_some() {
            let _ = w.group.signal(w.member, libc::SIGKILL);
        }
        let Worker {
            pidfd,
            group,
            member,
            lease,
            ..
        } = w;
        waiting.push((pidfd, group, member, lease));
    }
    let deadline = Instant::now() + grace;
    let mut ended = Vec::new();
    for (pidfd, group, member, lease) in waiting {
        if !wait_exit(pidfd.as_fd(), Some(deadline)) {
            let _ = group.signal(member, libc::SIGKILL);
            wait_exit(pidfd.as_fd(), Some(Instant::now() + Duration::from_secs(5)));
        }
        // Reaped too (by the warden, which records its exit then), as a joined process is:
        // the set's owner that returns from closing it leaves no zombie behind.
        group.wait(Some(&[member]), WaitFor::AllExited, Some(REAP_PATIENCE));
        if let Some(lease) = lease {
            let code = lease_code(exit_status(&pidfd, &group, member));
            lease.finish(LeaseEnd { code, died: true });
            ended.push(lease);
        }
    }
    ended
}

/// The tokens of the fds that are ready (a wake-up is taken, not returned).
fn ready_tokens(
    poller: &Poller,
    timeout: Option<Duration>,
    spin: &Spin,
) -> Result<Vec<u64>, WorkersError> {
    let polled = spin.poll(|| {
        let (tokens, woken) = poller.wait(Some(Duration::ZERO))?;
        Ok::<_, WorkersError>((woken || !tokens.is_empty()).then_some(tokens))
    })?;
    match polled {
        Some(tokens) => Ok(tokens),
        None if timeout == Some(Duration::ZERO) => Ok(Vec::new()),
        None => Ok(poller.wait(timeout)?.0),
    }
}

/// Waits until the process behind `pidfd` has exited, or `deadline` passes.
pub(super) fn wait_exit(pidfd: BorrowedFd<'_>, deadline: Option<Instant>) -> bool {
    loop {
        let timeout = deadline.map(|d| {
            let left = d.saturating_duration_since(Instant::now());
            Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: left.subsec_nanos() as i64,
            }
        });
        let mut fds = [PollFd::new(&pidfd, PollFlags::IN)];
        match rustix::event::poll(&mut fds, timeout.as_ref()) {
            Ok(0) if deadline.is_some_and(|d| Instant::now() >= d) => return false,
            Ok(0) | Err(Errno::INTR) => {}
            Ok(_) => return true,
            Err(_) => return false,
        }
    }
}
