//! `WorkerEnd`: a worker's end of its link to the pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tether_core::workers::{self, wire::Kind, Incoming};

use super::{incoming, Outcome};
use crate::convert::{borrowed, Fd, Timeout};
use crate::error::{os_error, workers_error, workers_io};
use crate::wait;

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

    /// The next message (a `TaskBatch`, a `LeaseCall` or a `Note`), or None after `timeout` seconds
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

    /// Sends results; their fds stay the caller's.
    fn send_results(&self, py: Python<'_>, results: Vec<Bound<'_, Outcome>>) -> PyResult<()> {
        let records: Vec<_> = results
            .iter()
            .map(|result| result.get())
            .map(|r| {
                (
                    r.id,
                    Kind::from(r.kind),
                    r.data.as_bytes(py),
                    borrowed(&r.fds),
                )
            })
            .collect();
        let end = self.inner.clone();
        py.allow_threads(move || end.send_results(&records))
            .map_err(os_error)
    }

    fn send_done(&self, id: u64, code: i32) -> PyResult<()> {
        self.inner.send_done(id, code).map_err(os_error)
    }
}
