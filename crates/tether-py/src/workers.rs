//! Python classes over `tether_core::workers`: the pool's `WorkerSet` (with `WorkerLink`
//! and `Lease`) and a worker's `WorkerEnd`. Every wait releases the GIL; waits a main
//! thread may make (a lease's, a worker's receive) also run Python's signal handlers.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyEOFError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use tether_core::workers::{self, wire::Kind, Event, Incoming, Waited, WorkersError};

use crate::channel::{deadline, into_raw, os_error, sliced};
use crate::group::{ExitStatus, Group};

fn workers_error(err: WorkersError) -> PyErr {
    match err {
        WorkersError::Io(io) => os_error(io),
        WorkersError::Closed => PyRuntimeError::new_err("the worker set is closed"),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// Takes ownership of fds handed over by Python.
fn owned(fds: Vec<RawFd>) -> PyResult<Vec<OwnedFd>> {
    if fds.iter().any(|&fd| fd < 0) {
        return Err(PyValueError::new_err("invalid fd"));
    }
    // SAFETY: the caller hands these fds over; nothing else closes them afterwards.
    Ok(fds
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect())
}

/// Borrows fds Python keeps open for the duration of a call.
fn borrowed(fds: &[RawFd]) -> PyResult<Vec<BorrowedFd<'_>>> {
    if fds.iter().any(|&fd| fd < 0) {
        return Err(PyValueError::new_err("invalid fd"));
    }
    // SAFETY: the caller keeps these fds open for the duration of the call.
    Ok(fds
        .iter()
        .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
        .collect())
}

fn seconds(value: Option<f64>) -> PyResult<Option<Duration>> {
    match value {
        Some(t) if t.is_nan() => Err(PyValueError::new_err("timeout must be a number")),
        Some(t) => Ok(Some(Duration::from_secs_f64(t.clamp(0.0, 1e9)))),
        None => Ok(None),
    }
}

/// A task's result as Python gets it: `(ok, data, fds)`.
type PyOutcome = (bool, Py<PyBytes>, Vec<RawFd>);

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

    /// None while the target runs; then `(exitcode, died)`.
    fn end(&self) -> Option<(i32, bool)> {
        self.inner.end().map(|e| (e.code, e.died))
    }

    /// Waits up to `timeout` seconds (for ever when None) for the lease to end.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<(i32, bool)>> {
        if let Some(end) = self.end() {
            return Ok(Some(end));
        }
        let until = deadline(timeout)?;
        let lease = self.inner.clone();
        sliced(py, until, move |slice| {
            Ok(lease.wait(Some(slice)).map(|e| (e.code, e.died)))
        })
    }
}

/// A pool's worker set (see tether-core's `workers`).
#[pyclass(module = "tether._native", frozen)]
pub struct WorkerSet {
    inner: Arc<workers::WorkerSet>,
}

fn event<'py>(py: Python<'py>, event: Event) -> PyResult<Bound<'py, PyTuple>> {
    match event {
        Event::Ready { slot, pid } => ("ready", slot, pid).into_pyobject(py),
        Event::Results {
            slot,
            pid,
            outcomes,
        } => {
            let items = PyList::empty(py);
            for o in outcomes {
                let data = PyBytes::new(py, &o.data);
                items.append((o.id, o.kind == Kind::Ok, data, into_raw(o.fds)))?;
            }
            ("results", slot, pid, items).into_pyobject(py)
        }
        Event::LeaseEnded { slot, lease } => {
            ("lease", slot, Lease { inner: lease }).into_pyobject(py)
        }
        Event::Died(d) => {
            let status = ExitStatus::now(d.status);
            let crashed = d.crashed.map(|c| (c.id, c.item));
            let lease = d.lease.map(|inner| Lease { inner });
            let report = PyBytes::new(py, &d.report);
            let died = (
                "died", d.slot, d.pid, status, d.ready, crashed, d.lost, lease, report,
            );
            died.into_pyobject(py)
        }
    }
}

#[pymethods]
impl WorkerSet {
    #[new]
    #[pyo3(signature = (window=2, max_batch=256, spin=0.0001))]
    fn new(window: usize, max_batch: usize, spin: f64) -> PyResult<WorkerSet> {
        let spin = seconds(Some(spin))?.unwrap_or_default();
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
    fn submit(&self, tasks: Vec<(u64, Vec<u8>, Vec<RawFd>)>) -> PyResult<()> {
        let tasks = tasks
            .into_iter()
            .map(|(id, data, fds)| {
                Ok(workers::Task {
                    id,
                    data,
                    fds: owned(fds)?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
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

    /// `(slot, pid, ready, lease id or None, reserved)` per worker.
    fn workers(&self) -> Vec<(usize, i32, bool, Option<u64>, bool)> {
        self.inner
            .workers()
            .into_iter()
            .map(|w| (w.slot, w.pid, w.ready, w.lease, w.reserved))
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
    fn lease(&self, slot: usize, id: u64, data: &[u8], fds: Vec<RawFd>) -> PyResult<Lease> {
        let fds = borrowed(&fds)?;
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
    fn poll<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Vec<Bound<'py, PyTuple>>>> {
        let timeout = seconds(timeout)?;
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

    /// Waits up to `timeout` seconds for task `id`'s result `(ok, data, fds)`, taken from
    /// its worker by this thread; None when the timeout passed or the result comes through
    /// `poll` instead. Ctrl-C raises here in the main thread.
    #[pyo3(signature = (id, timeout=None))]
    fn wait_for(
        &self,
        py: Python<'_>,
        id: u64,
        timeout: Option<f64>,
    ) -> PyResult<Option<PyOutcome>> {
        let until = deadline(timeout)?;
        let set = self.inner.clone();
        let got = sliced(py, until, |slice| match set.wait_for(id, Some(slice)) {
            Ok(Waited::Outcome(outcome)) => Ok(Some(Some(outcome))),
            Ok(Waited::Timeout) => Ok(None),
            Ok(Waited::Elsewhere) | Err(WorkersError::Closed) => Ok(Some(None)),
            Err(WorkersError::Io(io)) => Err(io),
            Err(other) => Err(std::io::Error::other(other.to_string())),
        })?;
        Ok(got.flatten().map(|o| {
            let data = PyBytes::new(py, &o.data).unbind();
            (o.kind == Kind::Ok, data, into_raw(o.fds))
        }))
    }

    /// Makes the current or next `poll` return at once.
    fn wake(&self) {
        self.inner.wake()
    }

    /// Closes the set (see tether-core's `WorkerSet::close`); returns the ids of the tasks
    /// never answered. Leases end with their workers' status.
    fn close(&self, py: Python<'_>, kill: bool, grace: f64) -> Vec<u64> {
        let grace = Duration::from_secs_f64(grace.clamp(0.0, 3600.0));
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
    fn new(ctl_fd: RawFd, gate_fd: RawFd, spin: f64) -> PyResult<WorkerEnd> {
        let spin = seconds(Some(spin))?.unwrap_or_default();
        let mut fds = owned(vec![ctl_fd, gate_fd])?.into_iter();
        let (Some(ctl), Some(gate)) = (fds.next(), fds.next()) else {
            return Err(PyValueError::new_err("invalid fds"));
        };
        let inner = workers::WorkerEnd::new(ctl, gate, spin).map_err(os_error)?;
        Ok(WorkerEnd {
            inner: Arc::new(inner),
        })
    }

    fn hello(&self, pid: i32) -> PyResult<()> {
        self.inner.hello(pid).map_err(os_error)
    }

    /// The next message: `("batch", [(id, seq, data, fds)])` or `("lease", id, data, fds)`,
    /// or None after `timeout` seconds (for ever when None). Raises EOFError once the pool
    /// closed the link.
    #[pyo3(signature = (timeout=None))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let until = deadline(timeout)?;
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
            let waited = sliced(py, until, |slice| match end.recv(Some(slice)) {
                Ok(Incoming::Timeout) => Ok(None),
                Ok(other) => Ok(Some(other)),
                Err(WorkersError::Io(io)) => Err(io),
                Err(other) => Err(std::io::Error::other(other.to_string())),
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

    /// Sends `(id, kind, data, fds)` results, kind 0 (ok), 1 (error) or 2 (skipped); the
    /// fds stay the caller's.
    fn send_results(
        &self,
        py: Python<'_>,
        results: Vec<(u64, u8, Vec<u8>, Vec<RawFd>)>,
    ) -> PyResult<()> {
        let mut records = Vec::with_capacity(results.len());
        for (id, kind, data, fds) in &results {
            let kind = match kind {
                0 => Kind::Ok,
                1 => Kind::Error,
                2 => Kind::Skipped,
                _ => return Err(PyValueError::new_err("kind must be 0, 1 or 2")),
            };
            records.push((*id, kind, data.as_slice(), borrowed(fds)?));
        }
        let end = self.inner.clone();
        py.allow_threads(move || end.send_results(&records))
            .map_err(os_error)
    }

    fn send_done(&self, id: u64, code: i32) -> PyResult<()> {
        self.inner.send_done(id, code).map_err(os_error)
    }
}

fn incoming<'py>(py: Python<'py>, got: Incoming) -> PyResult<Option<Bound<'py, PyTuple>>> {
    match got {
        Incoming::Timeout => Ok(None),
        Incoming::Closed => Err(PyEOFError::new_err("the pool closed the link")),
        Incoming::Batch(tasks) => {
            let items = PyList::empty(py);
            for t in tasks {
                let fds: Vec<RawFd> = t
                    .fds
                    .into_iter()
                    .map(std::os::fd::IntoRawFd::into_raw_fd)
                    .collect();
                items.append((t.id, t.seq, PyBytes::new(py, &t.data), fds))?;
            }
            Ok(Some(("batch", items).into_pyobject(py)?))
        }
        Incoming::Lease { id, data, fds } => {
            let fds = into_raw(fds);
            Ok(Some(
                ("lease", id, PyBytes::new(py, &data), fds).into_pyobject(py)?,
            ))
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<WorkerSet>()?;
    m.add_class::<WorkerLink>()?;
    m.add_class::<Lease>()?;
    m.add_class::<WorkerEnd>()?;
    Ok(())
}
