//! The meeting point of a shared dataset's key (tether-core's `share::meet`) for Python:
//! `share_claim` binds it (a `ShareMeeting`: this process builds) or joins it (a
//! `ShareWaiter`: another one does, or did). Every wait is [`crate::wait`]'s: without the
//! GIL, Ctrl-C-aware.

use std::os::fd::IntoRawFd;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::share::{
    claim, meeting_name, vault_name, Claim, Meeting, Outcome, Vault, Waiter, Who,
};

use crate::convert::{Fd, Timeout};
use crate::error::os_error;
use crate::wait;

fn who(rank: i64) -> Who {
    Who {
        rank,
        pid: std::process::id(),
    }
}

/// A meeting point this process holds: it builds the data (then `publish` or `fail`), or
/// holds the data and answers later askers from a thread of its own.
#[pyclass(module = "tether._native", frozen)]
pub struct ShareMeeting {
    inner: Meeting,
}

#[pymethods]
impl ShareMeeting {
    /// Holds the meeting point `name` received from another holder (`listener` and `memfd`
    /// handed over), as the process of `rank`.
    #[staticmethod]
    fn hold(name: &[u8], listener: Fd, memfd: Fd, rank: i64) -> PyResult<ShareMeeting> {
        let (listener, memfd) = (listener.take(), memfd.take());
        let inner = Meeting::hold(name, listener, memfd, who(rank)).map_err(os_error)?;
        Ok(ShareMeeting { inner })
    }

    /// Hands the built data to the job's vault listening at `vault`; False when there is
    /// none.
    fn hand_over(&self, vault: &[u8]) -> PyResult<bool> {
        self.inner.hand_over(vault).map_err(os_error)
    }

    /// The data is built in `memfd` (lent: a duplicate is kept): waiters get it.
    fn publish(&self, memfd: Fd) -> PyResult<()> {
        let fd = memfd.borrow().try_clone_to_owned().map_err(os_error)?;
        self.inner.publish(fd);
        Ok(())
    }

    /// The build failed with `report`: waiters get it.
    fn fail(&self, report: &[u8]) {
        self.inner.fail(report.to_vec());
    }

    /// This process builds again: later askers wait.
    fn rebuild(&self) {
        self.inner.rebuild();
    }

    /// In a forked child: closes the child's copy of the listening socket.
    fn close_after_fork(&self) {
        self.inner.close_after_fork();
    }
}

/// A process waiting at a meeting point.
#[pyclass(module = "tether._native", frozen)]
pub struct ShareWaiter {
    inner: Mutex<Waiter>,
}

impl ShareWaiter {
    fn waiter(&self) -> std::sync::MutexGuard<'_, Waiter> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl ShareWaiter {
    /// `(rank, pid)` of the builder, once its holder said the data is being built.
    #[getter]
    fn builder(&self) -> Option<(i64, u32)> {
        self.waiter().builder().map(|w| (w.rank, w.pid))
    }

    /// Waits up to `timeout` seconds (for ever when None) for the outcome; None when it has
    /// not come. The outcome is one of [`ShareReady`], [`ShareFailed`], [`ShareBuilderDied`]
    /// and [`ShareLost`].
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<Option<PyObject>> {
        let outcome = wait::until(py, Timeout::of(timeout), |slice| self.waiter().wait(slice))?;
        let Some(outcome) = outcome else {
            return Ok(None);
        };
        let object = match outcome {
            Outcome::Ready {
                memfd,
                listener,
                from,
            } => ShareReady {
                memfd: memfd.into_raw_fd(),
                listener: listener.into_raw_fd(),
                rank: from.rank,
                pid: from.pid,
            }
            .into_pyobject(py)?
            .into_any(),
            Outcome::Failed { report, from } => ShareFailed {
                report: PyBytes::new(py, &report).unbind(),
                rank: from.rank,
                pid: from.pid,
            }
            .into_pyobject(py)?
            .into_any(),
            Outcome::BuilderDied { builder, status } => ShareBuilderDied {
                rank: builder.rank,
                pid: builder.pid,
                exitcode: status.and_then(|s| s.as_exitcode()),
            }
            .into_pyobject(py)?
            .into_any(),
            Outcome::Lost => ShareLost.into_pyobject(py)?.into_any(),
        };
        Ok(Some(object.unbind()))
    }
}

/// The data is built: `memfd` holds it and `listener` answers later askers (both handed
/// over: the receiver owns them), from the builder `rank` (pid `pid`).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct ShareReady {
    memfd: i32,
    listener: i32,
    rank: i64,
    pid: u32,
}

/// The build failed in `rank` (pid `pid`): `report` is its failure report.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct ShareFailed {
    report: Py<PyBytes>,
    rank: i64,
    pid: u32,
}

/// The builder `rank` (pid `pid`) hung up before it was done; `exitcode` in
/// multiprocessing's convention, None when unknown.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct ShareBuilderDied {
    rank: i64,
    pid: u32,
    exitcode: Option<i32>,
}

/// The holder that accepted hung up first: ask again.
#[pyclass(module = "tether._native", frozen)]
pub struct ShareLost;

/// The vault of a job's shared copies (see tether-core's `share::vault`): started for the
/// job `job`, it holds what the job's ranks hand over until it is dropped.
#[pyclass(module = "tether._native", frozen, weakref)]
pub struct ShareVault {
    inner: Vault,
}

#[pymethods]
impl ShareVault {
    #[new]
    fn new(job: &str) -> PyResult<ShareVault> {
        let inner = Vault::start(job).map_err(os_error)?;
        Ok(ShareVault { inner })
    }

    /// How many meeting points it holds.
    #[getter]
    fn held(&self) -> usize {
        self.inner.held()
    }

    /// In a forked child: closes the child's copies of the vault's fds.
    fn close_after_fork(&self) {
        self.inner.close_after_fork();
    }
}

/// The job this process is a rank of under `tether run`, taken out of its environment at
/// start-up (see `share_enter_job`); None elsewhere.
static JOB: Mutex<Option<String>> = Mutex::new(None);

/// Makes this process a rank of the job `job` (`tether run`'s, whose id the start-up hook or
/// the warm rank's fork takes out of the environment, so that a rank's environment is what
/// torchrun's would be).
#[pyfunction]
pub fn share_enter_job(job: String) {
    if let Ok(mut held) = JOB.lock() {
        *held = Some(job);
    }
}

/// The job `share_enter_job` named, if any.
#[pyfunction]
pub fn share_job() -> Option<String> {
    JOB.lock().ok().and_then(|held| held.clone())
}

/// The names of the meeting point of `key` in the job `job` and of the job's vault.
#[pyfunction]
pub fn share_names<'py>(
    py: Python<'py>,
    job: &str,
    key: &str,
) -> (Bound<'py, PyBytes>, Bound<'py, PyBytes>) {
    (
        PyBytes::new(py, &meeting_name(job, key)),
        PyBytes::new(py, &vault_name(job)),
    )
}

/// Binds the meeting point `name` (an abstract socket name, without its leading NUL) as
/// the process of `rank` (negative: none), or joins the process that holds it: a
/// `ShareMeeting` or a `ShareWaiter`.
#[pyfunction]
pub fn share_claim(py: Python<'_>, name: &[u8], rank: i64) -> PyResult<PyObject> {
    let claimed = py
        .allow_threads(|| claim(name, who(rank)))
        .map_err(os_error)?;
    Ok(match claimed {
        Claim::Build(inner) => Py::new(py, ShareMeeting { inner })?.into_any(),
        Claim::Wait(waiter) => Py::new(
            py,
            ShareWaiter {
                inner: Mutex::new(waiter),
            },
        )?
        .into_any(),
    })
}
