//! Python classes over `tether_core::workers`: the pool's `WorkerSet` (with `WorkerLink`
//! and `Lease`) and a worker's `WorkerEnd`. Every wait releases the GIL; waits a main
//! thread may make (a lease's, a worker's receive) also run Python's signal handlers.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyEOFError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::workers::{self, wire::Kind, Event, Incoming, Waited, WorkersError};

use crate::convert::{borrowed, into_raw, owned, Fd, Timeout};
use crate::error::{os_error, workers_error, workers_io};
use crate::group::{ExitStatus, Group};
use crate::wait;

/// The kind of a task's result a worker sends.
#[pyclass(module = "tether._native", eq, eq_int, frozen, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResultKind {
    /// The bytes are the result.
    #[pyo3(name = "OK")]
    Ok,
    /// The bytes describe an exception.
    #[pyo3(name = "ERROR")]
    Error,
    /// The task was cancelled before it started: nothing to deliver.
    #[pyo3(name = "SKIPPED")]
    Skipped,
}

impl From<ResultKind> for Kind {
    fn from(kind: ResultKind) -> Kind {
        match kind {
            ResultKind::Ok => Kind::Ok,
            ResultKind::Error => Kind::Error,
            ResultKind::Skipped => Kind::Skipped,
        }
    }
}

/// A task's result as its worker sent it.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct TaskResult {
    id: u64,
    /// False when `data` describes an exception.
    ok: bool,
    data: Py<PyBytes>,
    /// Fds that came with it, the caller's to close.
    fds: Vec<RawFd>,
}

impl TaskResult {
    fn new(py: Python<'_>, outcome: workers::Outcome) -> TaskResult {
        TaskResult {
            id: outcome.id,
            ok: outcome.kind == Kind::Ok,
            data: PyBytes::new(py, &outcome.data).unbind(),
            fds: into_raw(outcome.fds),
        }
    }
}

/// How a leased process ended: its exit code (minus the signal number when its worker was
/// killed), and whether its worker died.
#[pyclass(module = "tether._native", frozen, get_all)]
#[derive(Debug, Clone, Copy)]
pub struct LeaseEnd {
    code: i32,
    died: bool,
}

impl From<workers::LeaseEnd> for LeaseEnd {
    fn from(end: workers::LeaseEnd) -> LeaseEnd {
        LeaseEnd {
            code: end.code,
            died: end.died,
        }
    }
}

/// A worker as `WorkerSet.workers` shows it.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct WorkerInfo {
    slot: usize,
    pid: i32,
    /// It said it is ready.
    ready: bool,
    /// The id of the process it is leased to, or None.
    lease: Option<u64>,
    reserved: bool,
}

/// A worker said it is ready.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct WorkerReady {
    slot: usize,
    pid: i32,
}

/// Results a worker sent.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct WorkerResults {
    slot: usize,
    pid: i32,
    results: Vec<Py<TaskResult>>,
}

/// A leased process ended (its worker lives on).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct LeaseEnded {
    slot: usize,
    lease: Py<Lease>,
}

/// The task a worker died in, and the item within it it had reached.
#[pyclass(module = "tether._native", frozen, get_all)]
#[derive(Debug, Clone, Copy)]
pub struct Crash {
    id: u64,
    item: u64,
}

/// A worker died.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct WorkerDied {
    slot: usize,
    pid: i32,
    status: Py<ExitStatus>,
    /// Whether it had said it was ready (one that dies before cannot start).
    ready: bool,
    /// The task it was running, or None.
    crashed: Option<Crash>,
    /// Tasks it ran without sending their results.
    lost: Vec<u64>,
    /// The lease it held (now ended with its status), or None.
    lease: Option<Py<Lease>>,
    /// What it wrote to its report pipe.
    report: Py<PyBytes>,
}

/// The link of a worker about to start: pass `child_fds()` to it, then `WorkerSet.add`.
#[pyclass(module = "tether._native", frozen)]
pub struct WorkerLink {
    inner: Mutex<Option<workers::Link>>,
}

#[pymethods]
impl WorkerLink {
    /// The fds the worker inherits: `(control socket, gate)`.
    fn child_fds(&self) -> PyResult<(RawFd, RawFd)> {
        let link = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let link = link.as_ref().ok_or_else(used)?;
        let (ctl, gate) = link.child_fds();
        Ok((ctl.as_raw_fd(), gate.as_raw_fd()))
    }

    /// The pool's end of the control socket (a forked worker closes its copy).
    fn parent_fd(&self) -> PyResult<RawFd> {
        let link = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        Ok(link.as_ref().ok_or_else(used)?.parent_fd().as_raw_fd())
    }
}

fn used() -> PyErr {
    PyValueError::new_err("this worker link was already added")
}

/// A worker leased to one process until its target returns.
#[pyclass(module = "tether._native", frozen)]
pub struct Lease {
    inner: Arc<workers::Lease>,
}

#[pymethods]
impl Lease {
    #[getter]
    fn id(&self) -> u64 {
        self.inner.id()
    }

    #[getter]
    fn pid(&self) -> i32 {
        self.inner.pid()
    }

    /// The worker's pidfd (readable once the worker died), open while the lease lives.
    fn sentinel(&self) -> RawFd {
        self.inner.sentinel().as_raw_fd()
    }

    /// An fd readable once the lease ended.
    fn fileno(&self) -> RawFd {
        self.inner.done_fd().as_raw_fd()
    }

    /// None while the target runs; then how it ended.
    fn end(&self) -> Option<LeaseEnd> {
        self.inner.end().map(LeaseEnd::from)
    }

    /// Waits up to `timeout` seconds (for ever when None) for the lease to end.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<Option<LeaseEnd>> {
        if let Some(end) = self.end() {
            return Ok(Some(end));
        }
        let lease = self.inner.clone();
        wait::until(py, Timeout::of(timeout), move |slice| {
            Ok(lease.wait(Some(slice)).map(LeaseEnd::from))
        })
    }
}

/// A pool's worker set (see tether-core's `workers`).
#[pyclass(module = "tether._native", frozen)]
pub struct WorkerSet {
    inner: Arc<workers::WorkerSet>,
}

/// An event of the worker set as its Python class.
fn event(py: Python<'_>, event: Event) -> PyResult<PyObject> {
    Ok(match event {
        Event::Ready { slot, pid } => Py::new(py, WorkerReady { slot, pid })?.into_any(),
        Event::Results {
            slot,
            pid,
            outcomes,
        } => {
            let results = outcomes
                .into_iter()
                .map(|o| Py::new(py, TaskResult::new(py, o)))
                .collect::<PyResult<_>>()?;
            Py::new(py, WorkerResults { slot, pid, results })?.into_any()
        }
        Event::LeaseEnded { slot, lease } => {
            let lease = Py::new(py, Lease { inner: lease })?;
            Py::new(py, LeaseEnded { slot, lease })?.into_any()
        }
        Event::Died(d) => {
            let died = WorkerDied {
                slot: d.slot,
                pid: d.pid,
                status: Py::new(py, ExitStatus::now(d.status))?,
                ready: d.ready,
                crashed: d.crashed.map(|c| Crash {
                    id: c.id,
                    item: c.item,
                }),
                lost: d.lost,
                lease: d
                    .lease
                    .map(|inner| Py::new(py, Lease { inner }))
                    .transpose()?,
                report: PyBytes::new(py, &d.report).unbind(),
            };
            Py::new(py, died)?.into_any()
        }
    })
}

#[pymethods]
impl WorkerSet {
    #[new]
    #[pyo3(signature = (window=2, max_batch=256, spin=0.0001))]
    fn new(window: usize, max_batch: usize, spin: f64) -> PyResult<WorkerSet> {
        let spin = Timeout::from_secs(spin)?.or_max();
        let config = workers::Config {
            window,
            max_batch,
            spin,
        };
        let inner = workers::WorkerSet::new(config).map_err(workers_error)?;
        Ok(WorkerSet {
            inner: Arc::new(inner),
        })
    }

    /// A new link (control socket pair and gate) for a worker about to start.
    #[staticmethod]
    fn link() -> PyResult<WorkerLink> {
        let link = workers::Link::new().map_err(os_error)?;
        Ok(WorkerLink {
            inner: Mutex::new(Some(link)),
        })
    }

    /// Puts the worker started over `link` (member `member` of `group`) in `slot`; its pid.
    fn add(&self, slot: usize, link: &WorkerLink, group: &Group, member: usize) -> PyResult<i32> {
        let taken = link.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        let link = taken.ok_or_else(used)?;
        self.inner
            .add(slot, link, group.inner.clone(), member)
            .map_err(workers_error)
    }

    /// Queues `(id, data, fds)` tasks; the set owns the fds from now on.
    fn submit(&self, tasks: Vec<(u64, Vec<u8>, Vec<Fd>)>) -> PyResult<()> {
        let tasks = tasks
            .into_iter()
            .map(|(id, data, fds)| workers::Task {
                id,
                data,
                fds: owned(fds),
            })
            .collect();
        self.inner.submit(tasks).map_err(workers_error)
    }

    /// Withdraws those of `ids` not started yet; returns them.
    fn cancel(&self, ids: Vec<u64>) -> Vec<u64> {
        self.inner.cancel(&ids)
    }

    /// Withdraws every task not started yet; returns their ids.
    fn cancel_all(&self) -> Vec<u64> {
        self.inner.cancel_all()
    }

    /// Whether a worker is running task `id`.
    fn started(&self, id: u64) -> bool {
        self.inner.started(id)
    }

    /// Whether tasks are queued or in flight.
    fn busy(&self) -> bool {
        self.inner.busy()
    }

    fn pids(&self) -> Vec<i32> {
        self.inner.pids()
    }

    /// Each worker as `(group, member index)` (to ask it for its stack).
    fn members(&self) -> Vec<(Group, usize)> {
        self.inner
            .members()
            .into_iter()
            .map(|(inner, member)| (Group { inner }, member))
            .collect()
    }

    /// Every worker in the table.
    fn workers(&self) -> Vec<WorkerInfo> {
        self.inner
            .workers()
            .into_iter()
            .map(|w| WorkerInfo {
                slot: w.slot,
                pid: w.pid,
                ready: w.ready,
                lease: w.lease,
                reserved: w.reserved,
            })
            .collect()
    }

    /// The pool's ends of the workers' sockets.
    fn parent_fds(&self) -> Vec<RawFd> {
        self.inner.parent_fds()
    }

    /// Reserves `n` free workers; their slots, or an empty list when fewer are free.
    fn reserve(&self, n: usize) -> Vec<usize> {
        self.inner.reserve(n).unwrap_or_default()
    }

    fn unreserve(&self, slots: Vec<usize>) {
        self.inner.unreserve(&slots)
    }

    /// Leases the worker in `slot` to process `id` whose call is `data` (with `fds`, which
    /// stay the caller's).
    fn lease(&self, slot: usize, id: u64, data: &[u8], fds: Vec<Fd>) -> PyResult<Lease> {
        let fds = borrowed(&fds);
        let inner = self
            .inner
            .lease(slot, id, data, &fds)
            .map_err(workers_error)?;
        Ok(Lease { inner })
    }

    /// Sends `signal` to the worker while it runs `lease`; false once it does not.
    fn signal_lease(&self, lease: &Lease, signal: i32) -> PyResult<bool> {
        self.inner
            .signal_lease(&lease.inner, signal)
            .map_err(os_error)
    }

    /// Waits (without the GIL) up to `timeout` seconds and returns the events; None once
    /// the set is closed.
    #[pyo3(signature = (timeout=None))]
    fn poll(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<Option<Vec<PyObject>>> {
        let timeout = Timeout::of(timeout).duration();
        let set = self.inner.clone();
        match py.allow_threads(move || set.poll(timeout)) {
            Ok(events) => Ok(Some(
                events
                    .into_iter()
                    .map(|e| event(py, e))
                    .collect::<PyResult<_>>()?,
            )),
            Err(WorkersError::Closed) => Ok(None),
            Err(err) => Err(workers_error(err)),
        }
    }

    /// Waits up to `timeout` seconds for task `id`'s result, taken from
    /// its worker by this thread; None when the timeout passed or the result comes through
    /// `poll` instead. Ctrl-C raises here in the main thread.
    #[pyo3(signature = (id, timeout=None))]
    fn wait_for(
        &self,
        py: Python<'_>,
        id: u64,
        timeout: Option<Timeout>,
    ) -> PyResult<Option<TaskResult>> {
        let set = self.inner.clone();
        let got = wait::until(py, Timeout::of(timeout), |slice| {
            match set.wait_for(id, Some(slice)) {
                Ok(Waited::Outcome(outcome)) => Ok(Some(Some(outcome))),
                Ok(Waited::Timeout) => Ok(None),
                Ok(Waited::Elsewhere) | Err(WorkersError::Closed) => Ok(Some(None)),
                Err(err) => Err(workers_io(err)),
            }
        })?;
        Ok(got.flatten().map(|o| TaskResult::new(py, o)))
    }

    /// Makes the current or next `poll` return at once.
    fn wake(&self) {
        self.inner.wake()
    }

    /// Closes the set (see tether-core's `WorkerSet::close`); returns the ids of the tasks
    /// never answered. Leases end with their workers' status.
    fn close(&self, py: Python<'_>, kill: bool, grace: Timeout) -> Vec<u64> {
        let grace = grace.or_max().min(Duration::from_secs(3600));
        let set = self.inner.clone();
        py.allow_threads(move || set.close(kill, grace)).tasks
    }
}

/// A worker's end of its link to the pool.
#[pyclass(module = "tether._native", frozen)]
pub struct WorkerEnd {
    inner: Arc<workers::WorkerEnd>,
}

#[pymethods]
impl WorkerEnd {
    /// Takes the control socket and gate fds the pool passed; a receive polls up to `spin`
    /// seconds before it sleeps (less when polling does not pay).
    #[new]
    #[pyo3(signature = (ctl_fd, gate_fd, spin=0.0001))]
    fn new(ctl_fd: Fd, gate_fd: Fd, spin: f64) -> PyResult<WorkerEnd> {
        let spin = Timeout::from_secs(spin)?.or_max();
        let inner =
            workers::WorkerEnd::new(ctl_fd.take(), gate_fd.take(), spin).map_err(os_error)?;
        Ok(WorkerEnd {
            inner: Arc::new(inner),
        })
    }

    fn hello(&self, pid: i32) -> PyResult<()> {
        self.inner.hello(pid).map_err(os_error)
    }

    /// The next message (a `TaskBatch` or a `LeaseCall`), or None after `timeout` seconds
    /// (for ever when None). Raises EOFError once the pool closed the link.
    #[pyo3(signature = (timeout=None))]
    fn recv(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<Option<PyObject>> {
        let until = Timeout::of(timeout).deadline();
        let end = self.inner.clone();
        let mut got = end.recv(Some(Duration::ZERO)).map_err(workers_error)?;
        let waiting = |got: &Incoming| {
            matches!(got, Incoming::Timeout) && !until.is_some_and(|d| d <= Instant::now())
        };
        if waiting(&got) {
            let polling = end.clone();
            got = py
                .allow_threads(move || polling.recv_polling())
                .map_err(workers_error)?;
        }
        if waiting(&got) {
            let waited = wait::until_deadline(py, until, |slice| match end.recv(Some(slice)) {
                Ok(Incoming::Timeout) => Ok(None),
                Ok(other) => Ok(Some(other)),
                Err(err) => Err(workers_io(err)),
            })?;
            got = waited.unwrap_or(Incoming::Timeout);
        }
        incoming(py, got)
    }

    /// Claims task `seq` (id `id`) to run it; False when the pool cancelled it.
    fn start(&self, seq: u32, id: u64) -> bool {
        self.inner.start(seq, id)
    }

    /// The running task reached item `item`.
    fn step(&self, item: u64) {
        self.inner.step(item)
    }

    /// No task runs.
    fn idle(&self) {
        self.inner.idle()
    }

    /// Sends `(id, kind, data, fds)` results; the fds stay the caller's.
    fn send_results(
        &self,
        py: Python<'_>,
        results: Vec<(u64, ResultKind, Vec<u8>, Vec<Fd>)>,
    ) -> PyResult<()> {
        let records: Vec<_> = results
            .iter()
            .map(|(id, kind, data, fds)| (*id, Kind::from(*kind), data.as_slice(), borrowed(fds)))
            .collect();
        let end = self.inner.clone();
        py.allow_threads(move || end.send_results(&records))
            .map_err(os_error)
    }

    fn send_done(&self, id: u64, code: i32) -> PyResult<()> {
        self.inner.send_done(id, code).map_err(os_error)
    }
}

/// A task as a worker receives it.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct IncomingTask {
    id: u64,
    /// Its sequence number on the link (to claim it, see `WorkerEnd.start`).
    seq: u32,
    data: Py<PyBytes>,
    /// Fds that came with it, the worker's to close.
    fds: Vec<RawFd>,
}

/// Tasks for a worker to run in order.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct TaskBatch {
    tasks: Vec<Py<IncomingTask>>,
}

/// A leased process for a worker to run: its id, its call, and fds (the worker's to close).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct LeaseCall {
    id: u64,
    data: Py<PyBytes>,
    fds: Vec<RawFd>,
}

fn incoming(py: Python<'_>, got: Incoming) -> PyResult<Option<PyObject>> {
    match got {
        Incoming::Timeout => Ok(None),
        Incoming::Closed => Err(PyEOFError::new_err("the pool closed the link")),
        Incoming::Batch(tasks) => {
            let tasks = tasks
                .into_iter()
                .map(|t| {
                    let task = IncomingTask {
                        id: t.id,
                        seq: t.seq,
                        data: PyBytes::new(py, &t.data).unbind(),
                        fds: into_raw(t.fds),
                    };
                    Py::new(py, task)
                })
                .collect::<PyResult<_>>()?;
            Ok(Some(Py::new(py, TaskBatch { tasks })?.into_any()))
        }
        Incoming::Lease { id, data, fds } => {
            let call = LeaseCall {
                id,
                data: PyBytes::new(py, &data).unbind(),
                fds: into_raw(fds),
            };
            Ok(Some(Py::new(py, call)?.into_any()))
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<WorkerSet>()?;
    m.add_class::<WorkerLink>()?;
    m.add_class::<Lease>()?;
    m.add_class::<WorkerEnd>()?;
    m.add_class::<ResultKind>()?;
    m.add_class::<TaskResult>()?;
    m.add_class::<LeaseEnd>()?;
    m.add_class::<WorkerInfo>()?;
    m.add_class::<WorkerReady>()?;
    m.add_class::<WorkerResults>()?;
    m.add_class::<LeaseEnded>()?;
    m.add_class::<Crash>()?;
    m.add_class::<WorkerDied>()?;
    m.add_class::<IncomingTask>()?;
    m.add_class::<TaskBatch>()?;
    m.add_class::<LeaseCall>()?;
    Ok(())
}
