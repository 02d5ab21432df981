//! `WorkerSet`, the pool's end, with `WorkerLink` (a worker about to start) and `Lease`.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyType;
use tether_core::workers::{self, Waited, WorkersError};

use super::{event, LeaseEnd, Task, TaskResult, WorkerInfo};
use crate::convert::{borrowed, Fd, Timeout};
use crate::error::{os_error, workers_error, workers_io};
use crate::group::{Group, Member};
use crate::wait;

/// The fds a worker inherits: its end of its control socket, and its gate. It pickles, to
/// travel to the worker.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct WorkerFds {
    ctl: RawFd,
    gate: RawFd,
}

#[pymethods]
impl WorkerFds {
    #[new]
    fn new(ctl: Fd, gate: Fd) -> WorkerFds {
        WorkerFds {
            ctl: ctl.raw(),
            gate: gate.raw(),
        }
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> (Bound<'py, PyType>, (RawFd, RawFd)) {
        let me = slf.get();
        (slf.get_type(), (me.ctl, me.gate))
    }

    fn __repr__(&self) -> String {
        format!("WorkerFds(ctl={}, gate={})", self.ctl, self.gate)
    }
}

/// The link of a worker about to start: pass `child_fds()` to it, then `WorkerSet.add`.
#[pyclass(module = "tether._native", frozen)]
pub struct WorkerLink {
    inner: Mutex<Option<workers::Link>>,
}

#[pymethods]
impl WorkerLink {
    /// The fds the worker inherits.
    fn child_fds(&self) -> PyResult<WorkerFds> {
        let link = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let link = link.as_ref().ok_or_else(used)?;
        let (ctl, gate) = link.child_fds();
        Ok(WorkerFds {
            ctl: ctl.as_raw_fd(),
            gate: gate.as_raw_fd(),
        })
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

impl Lease {
    pub(super) fn wrap(inner: Arc<workers::Lease>) -> Lease {
        Lease { inner }
    }
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

    /// Queues tasks; the set owns their fds from now on.
    fn submit(&self, py: Python<'_>, tasks: Vec<Bound<'_, Task>>) -> PyResult<()> {
        let tasks = tasks.iter().map(|task| task.get().take(py)).collect();
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

    /// Withdraws every task submitted after the last one a worker started (the latest
    /// first), so that the tasks that run are the first ones submitted; returns their ids.
    fn cancel_after_started(&self) -> Vec<u64> {
        self.inner.cancel_after_started()
    }

    /// Whether a worker is running task `id`.
    fn started(&self, id: u64) -> bool {
        self.inner.started(id)
    }

    /// Whether tasks are queued or in flight.
    fn busy(&self) -> bool {
        self.inner.busy()
    }

    /// How many tasks wait for a worker (queued, not sent to any).
    fn queued(&self) -> usize {
        self.inner.queued()
    }

    fn pids(&self) -> Vec<i32> {
        self.inner.pids()
    }

    /// Each worker as a member of its group (to ask it for its stack).
    fn members(&self, py: Python<'_>) -> PyResult<Vec<Member>> {
        self.inner
            .members()
            .into_iter()
            .map(|(inner, index)| Ok(Member::new(Py::new(py, Group { inner })?, index)))
            .collect()
    }

    /// Every worker in the table.
    fn workers(&self) -> Vec<WorkerInfo> {
        self.inner
            .workers()
            .into_iter()
            .map(WorkerInfo::from)
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

    /// Sends the worker in `slot` a note (bytes it acts on after what it was sent before,
    /// answering nothing); false when no worker is there, its link is full or the set is
    /// closed.
    fn note(&self, slot: usize, data: &[u8]) -> bool {
        self.inner.note(slot, data)
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
