//! Python classes over `tether_core::workers`: the pool's `WorkerSet` (with `WorkerLink`
//! and `Lease`, in [`set`]) and a worker's `WorkerEnd` (in [`end`]), and here what crosses
//! between them and Python: events, worker info, results and messages, each a class with
//! named fields. Every wait releases the GIL; waits a main thread may make (a lease's, a
//! worker's receive) also run Python's signal handlers.

mod end;
mod set;

use std::os::fd::RawFd;

use pyo3::exceptions::PyEOFError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::workers::{self, wire::Kind, Event, Incoming};

use crate::convert::{into_raw, owned, Fd};
use crate::group::ExitStatus;
pub use end::WorkerEnd;
pub use set::{Lease, WorkerFds, WorkerLink, WorkerSet};

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

/// A task for `WorkerSet.submit` to queue: its id, its bytes, and fds that go with it
/// (the set owns them once it took the task).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct Task {
    id: u64,
    data: Py<PyBytes>,
    fds: Vec<Fd>,
}

#[pymethods]
impl Task {
    #[new]
    #[pyo3(signature = (id, data, fds=Vec::new()))]
    fn new(id: u64, data: Py<PyBytes>, fds: Vec<Fd>) -> Task {
        Task { id, data, fds }
    }
}

impl Task {
    /// The task as the set takes it, its fds owned from now on.
    pub(crate) fn take(&self, py: Python<'_>) -> workers::Task {
        workers::Task {
            id: self.id,
            data: self.data.as_bytes(py).to_vec(),
            fds: owned(self.fds.clone()),
        }
    }
}

/// A task's result for `WorkerEnd.send_results` to send: the task's id, the kind of
/// result, its bytes, and fds that go with it (they stay the caller's).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct Outcome {
    id: u64,
    kind: ResultKind,
    data: Py<PyBytes>,
    fds: Vec<Fd>,
}

#[pymethods]
impl Outcome {
    #[new]
    #[pyo3(signature = (id, kind, data, fds=Vec::new()))]
    fn new(id: u64, kind: ResultKind, data: Py<PyBytes>, fds: Vec<Fd>) -> Outcome {
        Outcome {
            id,
            kind,
            data,
            fds,
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
    pub(crate) fn new(py: Python<'_>, outcome: workers::Outcome) -> TaskResult {
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

impl From<workers::WorkerInfo> for WorkerInfo {
    fn from(w: workers::WorkerInfo) -> WorkerInfo {
        WorkerInfo {
            slot: w.slot,
            pid: w.pid,
            ready: w.ready,
            lease: w.lease,
            reserved: w.reserved,
        }
    }
}

/// An event of the worker set as its Python class.
pub(crate) fn event(py: Python<'_>, event: Event) -> PyResult<PyObject> {
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
            let lease = Py::new(py, Lease::wrap(lease))?;
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
                    .map(|inner| Py::new(py, Lease::wrap(inner)))
                    .transpose()?,
                report: PyBytes::new(py, &d.report).unbind(),
            };
            Py::new(py, died)?.into_any()
        }
    })
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

/// A note from the pool for a worker to act on (see `WorkerSet.note`): its bytes.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct Note {
    data: Py<PyBytes>,
}

pub(crate) fn incoming(py: Python<'_>, got: Incoming) -> PyResult<Option<PyObject>> {
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
        Incoming::Note(data) => {
            let note = Note {
                data: PyBytes::new(py, &data).unbind(),
            };
            Ok(Some(Py::new(py, note)?.into_any()))
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
    m.add_class::<Task>()?;
    m.add_class::<Outcome>()?;
    m.add_class::<WorkerFds>()?;
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
    m.add_class::<Note>()?;
    Ok(())
}
