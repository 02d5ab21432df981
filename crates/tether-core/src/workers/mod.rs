//! The worker set of a pool: long-lived worker processes, each linked to the pool by a
//! control socket and a gate page (see [`gate`]), and watched through a duplicate of its
//! pidfd.
//!
//! The set owns the table of workers, the queue of tasks not yet sent, the messages in
//! flight per worker, the batch sizes, which worker runs which task, and the leases (a
//! worker taken by one leased process). It knows nothing of what a task means: a task is an
//! id, bytes and fds; a result is the same. The caller hands tasks in with
//! [`WorkerSet::submit`] from any thread and takes [`Event`]s out of [`WorkerSet::poll`]
//! from one thread: results, a lease that ended, a worker that became ready or died (with
//! its exit status and the tasks it held). Replacing a dead worker is the caller's choice,
//! made outside this lock: [`WorkerSet::add`] puts a new one in its slot.
//!
//! Tasks go to the free, ready workers with the fewest messages in flight, at most `window`
//! messages per worker (one running, the next waiting in its socket), in batches sized to
//! the backlog: one task when the pool is idle, up to `max_batch` under a long queue.
//! A worker's death is seen on its pidfd. The tasks it held are sorted by their claim words:
//! the one it was running crashed, those it ran without sending their results are lost,
//! those it never started go back to the head of the queue, and cancelled ones are dropped.

pub mod end;
pub mod gate;
mod lease;
pub mod spin;
mod wait;
pub mod wire;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::io::Errno;

use crate::channel::{Endpoint, Message, Poller, Recv};
use crate::group::Group;
use crate::status::ExitStatus;
use crate::supervisor::waitid;
use gate::{Claim, Gate};
use spin::Spin;
use wire::Kind;

pub use end::{Incoming, IncomingTask, WorkerEnd};
pub use lease::{Lease, LeaseEnd};
pub use wait::Waited;

/// Errors of the worker set.
#[derive(Debug, thiserror::Error)]
pub enum WorkersError {
    #[error("the worker set is closed")]
    Closed,
    #[error("no worker in slot {0}")]
    NoWorker(usize),
    #[error("the worker in slot {0} is already leased")]
    Leased(usize),
    #[error("slot {0} already has a worker")]
    Occupied(usize),
    #[error("bad message on a worker link: {0}")]
    Wire(&'static str),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<Errno> for WorkersError {
    fn from(errno: Errno) -> WorkersError {
        WorkersError::Io(errno.into())
    }
}

/// How tasks are spread, and how long a wait polls before it sleeps.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Messages of tasks in flight per worker.
    pub window: usize,
    /// The most tasks one message carries.
    pub max_batch: usize,
    /// The most a wait ([`WorkerSet::poll`], [`WorkerSet::wait_for`]) polls before it
    /// sleeps (see [`spin`]).
    pub spin: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            window: 2,
            max_batch: 256,
            spin: Duration::from_micros(100),
        }
    }
}

/// A task or a result: an id, bytes, and the fds that travel with them.
#[derive(Debug)]
pub struct Task {
    pub id: u64,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// A task's result as its worker sent it.
#[derive(Debug)]
pub struct Outcome {
    pub id: u64,
    /// `Kind::Ok` (the bytes are the result) or `Kind::Error` (they describe an exception).
    pub kind: Kind,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// The task a worker died in, and the item within it it had reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    pub id: u64,
    pub item: u64,
}

/// A worker that died.
#[derive(Debug)]
pub struct Death {
    pub slot: usize,
    pub pid: i32,
    pub status: ExitStatus,
    /// Whether it had said it was ready (a worker that dies before cannot start).
    pub ready: bool,
    pub crashed: Option<Crash>,
    /// Tasks it ran without sending their results.
    pub lost: Vec<u64>,
    /// The lease it held (now ended with its status).
    pub lease: Option<Arc<Lease>>,
    /// What it wrote to its report pipe.
    pub report: Vec<u8>,
}

/// What [`WorkerSet::poll`] hands out.
#[derive(Debug)]
pub enum Event {
    Ready {
        slot: usize,
        pid: i32,
    },
    Results {
        slot: usize,
        pid: i32,
        outcomes: Vec<Outcome>,
    },
    LeaseEnded {
        slot: usize,
        lease: Arc<Lease>,
    },
    Died(Death),
}

/// A worker's free state, as [`WorkerSet::workers`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub slot: usize,
    pub pid: i32,
    pub ready: bool,
    pub lease: Option<u64>,
    pub reserved: bool,
}

/// What [`WorkerSet::close`] left: tasks never answered, and the leases it ended.
#[derive(Debug, Default)]
pub struct Closing {
    pub tasks: Vec<u64>,
    pub leases: Vec<Arc<Lease>>,
}

/// The two ends of a new worker's link: its control socket pair and its gate.
#[derive(Debug)]
pub struct Link {
    parent: Endpoint,
    child: Endpoint,
    gate: Gate,
    gate_fd: OwnedFd,
}

impl Link {
    pub fn new() -> io::Result<Link> {
        let (parent, child) = Endpoint::pair()?;
        let mut gate = Gate::new()?;
        let gate_fd = gate
            .fd()
            .ok_or(io::ErrorKind::NotFound)?
            .try_clone_to_owned()?;
        gate.close_fd();
        Ok(Link {
            parent,
            child,
            gate,
            gate_fd,
        })
    }

    /// The fds the worker must inherit: its end of the socket and the gate's memfd.
    pub fn child_fds(&self) -> (BorrowedFd<'_>, BorrowedFd<'_>) {
        (self.child.as_fd(), self.gate_fd.as_fd())
    }

    /// The pool's end of the socket (a forked worker must close its copy).
    pub fn parent_fd(&self) -> BorrowedFd<'_> {
        self.parent.as_fd()
    }
}

/// A message in flight to a worker.
#[derive(Debug)]
enum Sent {
    Batch {
        tasks: Vec<(u32, Task)>,
        answered: usize,
    },
    Lease,
}

#[derive(Debug)]
struct Worker {
    pid: i32,
    generation: u64,
    ctl: Endpoint,
    ctl_open: bool,
    pidfd: OwnedFd,
    gate: Gate,
    group: Group,
    member: usize,
    ready: bool,
    lease: Option<Arc<Lease>>,
    reserved: bool,
    /// A send found its socket full: no more until the worker answers.
    congested: bool,
    /// A waiting thread reads its socket (see [`wait`]).
    lent: bool,
    inflight: VecDeque<Sent>,
    seq: u32,
}

fn ctl_token(generation: u64) -> u64 {
    generation << 1
}

fn pidfd_token(generation: u64) -> u64 {
    (generation << 1) | 1
}

/// The worker set (see the module's documentation).
#[derive(Debug)]
pub struct WorkerSet {
    config: Config,
    state: Mutex<State>,
    /// The epoll set and its wake-up; dropped at close (a `poll` under way keeps its own
    /// reference until it returns).
    poller: Mutex<Option<Arc<Poller>>>,
    /// The polling policies of `poll` and of `wait_for`.
    poll_spin: Spin,
    wait_spin: Spin,
    /// The process that made the set. A copy inherited through a fork is inert: it must
    /// not signal the workers or take their messages.
    owner: u32,
}

#[derive(Debug, Default)]
struct State {
    workers: Vec<Option<Worker>>,
    by_generation: HashMap<u64, usize>,
    next_generation: u64,
    pending: VecDeque<Task>,
    /// Events read by a thread waiting on a lent socket (see [`wait`]), for `poll`.
    deferred: Vec<Event>,
    closed: bool,
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

    pub fn config(&self) -> Config {
        self.config
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data behind: keep going.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this is the process that made the set (see `owner`).
    fn ours(&self) -> bool {
        std::process::id() == self.owner
    }

    /// The epoll set; `Closed` once the set is closed, or in a process that is not ours.
    fn poller(&self) -> Result<Arc<Poller>, WorkersError> {
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

    pub fn is_closed(&self) -> bool {
        self.lock().closed
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
fn wait_exit(pidfd: BorrowedFd<'_>, deadline: Option<Instant>) -> bool {
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

/// The exit code a leased process gets when its worker died: the worker's, in
/// `multiprocessing`'s convention; 255 when something else took the worker's status (it
/// did end, but how is lost).
fn lease_code(status: ExitStatus) -> i32 {
    status.as_exitcode().unwrap_or(255)
}

/// The status of an exited worker: its group's record, else a look without reaping it
/// (the supervisor reaps it), else the record again (it reaped it meanwhile, under the
/// group's lock, so the record is there).
fn exit_status(pidfd: &OwnedFd, group: &Group, member: usize) -> ExitStatus {
    if let Some(exit) = group.exit(member) {
        return exit.status;
    }
    match waitid(pidfd.as_fd(), true) {
        Ok(Some(status)) => status,
        _ => group.exit(member).map_or(ExitStatus::Unknown, |e| e.status),
    }
}

/// A worker's process, as its launch left it.
struct Process {
    pid: i32,
    pidfd: OwnedFd,
    group: Group,
    member: usize,
}

impl Worker {
    fn new(process: Process, generation: u64, ctl: Endpoint, gate: Gate) -> Worker {
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
        }
    }

    fn is_free(&self) -> bool {
        self.lease.is_none() && !self.reserved
    }

    /// Whether tasks may go to it now: free, ready (a worker still starting would hold
    /// them while the others idle), with room in its window.
    fn schedulable(&self, window: usize) -> bool {
        self.is_free() && self.ready && !self.congested && self.inflight.len() < window
    }

    /// The tasks sent and not answered, with their sequence numbers.
    fn unanswered(&self) -> impl Iterator<Item = (u32, &Task)> {
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
    fn send(&mut self, data: &[u8], fds: &[BorrowedFd<'_>]) -> bool {
        !matches!(self.ctl.send(data, fds, Some(Duration::ZERO)), Ok(false))
    }

    /// Sends a batch; gives the tasks back when the socket is full.
    fn send_batch(&mut self, tasks: Vec<Task>) -> Result<(), Vec<Task>> {
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

    /// Reads every message waiting on the socket; false once the worker closed it.
    fn read(&mut self, slot: usize, events: &mut Vec<Event>) -> bool {
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

    fn on_message(&mut self, slot: usize, message: Message, events: &mut Vec<Event>) {
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
    fn on_results(&mut self, message: Message) -> Vec<Outcome> {
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

    fn on_done(&mut self, data: &[u8]) -> Option<Arc<Lease>> {
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
    fn bury(self, slot: usize) -> (Death, Vec<Task>) {
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
    /// The slot of the worker that holds task `id` unanswered.
    fn holder_of(&self, id: u64) -> Option<usize> {
        self.workers.iter().position(|w| {
            w.as_ref()
                .is_some_and(|w| w.unanswered().any(|(_, task)| task.id == id))
        })
    }

    fn on_ready(&mut self, token: u64, poller: &Poller, events: &mut Vec<Event>) {
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
        let (death, requeue) = w.bury(slot);
        for task in requeue.into_iter().rev() {
            self.pending.push_front(task);
        }
        events.push(Event::Died(death));
    }

    /// Sends queued tasks to the free workers with room, the least busy first.
    fn dispatch(&mut self, config: &Config) {
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

    /// Withdraws the unstarted tasks whose ids `wanted` accepts.
    fn cancel(&mut self, wanted: impl Fn(u64) -> bool) -> Vec<u64> {
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

#[cfg(test)]
mod tests;
