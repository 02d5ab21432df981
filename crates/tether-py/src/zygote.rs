//! The zygote's glue: `Zygote` (the parent's handle), `zygote_serve` (the zygote's loop, which
//! returns only in the children it makes) and `Job` (what such a child runs).

use std::ffi::OsString;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStringExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::attrs::Attributes;
use tether_core::zygote::{self, ForkRequest, Served};
use tether_core::LaunchSpec;

use crate::convert::{Fd, Timeout};
use crate::error::{core_error, os_error};
use crate::group::{ExitStatus, Group};

/// Why a zygote stopped serving.
#[pyclass(module = "tether._native", eq, eq_int, frozen, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ZygoteFailureKind {
    /// It died on its own.
    #[pyo3(name = "DIED")]
    Died,
    /// tether stopped it: it stopped answering, or broke its protocol.
    #[pyo3(name = "STOPPED")]
    Stopped,
    /// It was closed.
    #[pyo3(name = "CLOSED")]
    Closed,
}

/// Why a zygote stopped serving, and the error's words for it.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct ZygoteFailure {
    kind: ZygoteFailureKind,
    message: String,
}

#[pymethods]
impl ZygoteFailure {
    fn __repr__(&self) -> String {
        format!("<ZygoteFailure {:?}: {}>", self.kind, self.message)
    }
}

/// An fd of this process that every child of a `Zygote.fork` gets under the number
/// `target`; it stays the caller's.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct SharedFd {
    fd: Fd,
    target: i32,
}

#[pymethods]
impl SharedFd {
    #[new]
    fn new(fd: Fd, target: Fd) -> SharedFd {
        SharedFd {
            fd,
            target: target.raw(),
        }
    }
}

/// The parent's handle on a zygote process (see `tether.zygote.client`).
#[pyclass(module = "tether._native", frozen)]
pub struct Zygote {
    inner: Mutex<zygote::Zygote>,
    pid: i32,
    /// Closed while it still served.
    closed: AtomicBool,
}

impl Zygote {
    fn lock(&self) -> MutexGuard<'_, zygote::Zygote> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl Zygote {
    /// Starts the zygote: `argv` with `env` added, reading `config` from its payload fd.
    /// Returns at once; the zygote gets ready in the background.
    #[new]
    fn start(
        py: Python<'_>,
        argv: Vec<Vec<u8>>,
        env: Vec<(Vec<u8>, Vec<u8>)>,
        config: Vec<u8>,
    ) -> PyResult<Zygote> {
        let spec = LaunchSpec {
            argv: argv.into_iter().map(OsString::from_vec).collect(),
            env: env
                .into_iter()
                .map(|(k, v)| (OsString::from_vec(k), OsString::from_vec(v)))
                .collect(),
            payload: Some(config),
            ..LaunchSpec::default()
        };
        let inner = py
            .allow_threads(|| zygote::Zygote::start(spec))
            .map_err(core_error)?;
        let pid = inner.pid();
        Ok(Zygote {
            inner: Mutex::new(inner),
            pid,
            closed: AtomicBool::new(false),
        })
    }

    #[getter]
    fn pid(&self) -> i32 {
        self.pid
    }

    /// The pids of the blank children waiting for work.
    fn blanks(&self) -> Vec<i32> {
        self.lock().blanks()
    }

    /// None while the zygote runs; then how it ended.
    fn exit(&self) -> Option<ExitStatus> {
        self.lock().exit().map(ExitStatus::new)
    }

    /// Whether it can serve a request made now: running, answering, and started with
    /// resource limits no lower than this process's.
    fn usable(&self) -> PyResult<bool> {
        let attrs = Attributes::of_caller().map_err(os_error)?;
        Ok(self.lock().usable(&attrs))
    }

    /// Why it stopped serving (it died, was stopped, was closed), or None while it serves.
    fn failure(&self) -> Option<ZygoteFailure> {
        let zygote = self.lock();
        let kind = match (zygote.broken(), zygote.exit()) {
            (None, None) => return None,
            (None, Some(_)) => ZygoteFailureKind::Died,
            (Some(_), _) if zygote.vanished() => ZygoteFailureKind::Died,
            (Some(_), _) if self.closed.load(Ordering::Relaxed) => ZygoteFailureKind::Closed,
            (Some(_), _) => ZygoteFailureKind::Stopped,
        };
        let message = match (zygote.broken(), zygote.exit()) {
            (Some(why), _) => why.to_string(),
            (None, exit) => exit
                .map_or(tether_core::ExitStatus::Unknown, |e| e.status)
                .died(&format!("the tether zygote (pid {})", self.pid)),
        };
        Some(ZygoteFailure { kind, message })
    }

    /// Waits until its imports are done; returns what it said then.
    fn wait_ready<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let ready = py
            .allow_threads(|| self.lock().wait_ready().map(<[u8]>::to_vec))
            .map_err(core_error)?;
        Ok(PyBytes::new(py, &ready))
    }

    /// Starts one child per rank in `group`, each running `payload`, each with the fds
    /// `shared`.
    /// The caller's attributes (umask, limits, affinity, nice, working directory,
    /// environment) are read now. Returns the children's indices in `group`.
    fn fork(
        &self,
        py: Python<'_>,
        group: &Group,
        ranks: Vec<u32>,
        shared: Vec<Bound<'_, SharedFd>>,
        payload: &[u8],
    ) -> PyResult<Vec<usize>> {
        let attrs = Attributes::of_caller().map_err(os_error)?;
        let shared: Vec<(BorrowedFd<'_>, i32)> = shared
            .iter()
            .map(|shared| (shared.get().fd.borrow(), shared.get().target))
            .collect();
        let request = ForkRequest {
            ranks: &ranks,
            shared: &shared,
            payload,
            attrs,
        };
        py.allow_threads(|| self.lock().fork(&request, &group.inner))
            .map_err(core_error)
    }

    /// Tells it that this process is about to set its soft RLIMIT_NPROC to `limit` (None:
    /// unlimited); returns once its blank children fit in the room that leaves, with how
    /// many it keeps.
    #[pyo3(signature = (limit))]
    fn make_room(&self, py: Python<'_>, limit: Option<u64>) -> PyResult<usize> {
        py.allow_threads(|| self.lock().make_room(limit))
            .map_err(core_error)
    }

    /// Stops it (its blank children with it), waiting up to `grace` seconds before SIGKILL.
    #[pyo3(signature = (grace=1.0))]
    fn close(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Timeout::from_secs(grace)?.or_max();
        py.allow_threads(|| {
            let mut zygote = self.lock();
            if zygote.broken().is_none() {
                self.closed.store(true, Ordering::Relaxed);
            }
            zygote.close(grace);
        });
        Ok(())
    }
}

/// What a child of the zygote runs, handed over by `zygote_serve` in that child.
#[pyclass(module = "tether._native")]
pub struct Job {
    #[pyo3(get)]
    rank: u32,
    #[pyo3(get)]
    env: Vec<(Vec<u8>, Vec<u8>)>,
    payload: Option<OwnedFd>,
    report: Option<OwnedFd>,
    error: Option<PyErr>,
}

#[pymethods]
impl Job {
    /// The request's payload (read once; its fd is closed).
    fn take_payload<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let fd = self
            .payload
            .take()
            .ok_or_else(|| PyValueError::new_err("the payload was already taken"))?;
        let job = tether_core::zygote::read_payload(&fd).map_err(os_error)?;
        Ok(PyBytes::new(py, &job))
    }

    /// The fd of this child's report pipe, now owned by the caller.
    fn take_report_fd(&mut self) -> PyResult<RawFd> {
        self.report
            .take()
            .map(IntoRawFd::into_raw_fd)
            .ok_or_else(|| PyValueError::new_err("the report fd was already taken"))
    }

    /// The `OSError` to raise when the caller's attributes could not all be applied, else
    /// None.
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        self.error
            .as_ref()
            .map(|err| err.value(py).clone().into_any().unbind())
    }
}

/// The zygote's loop (see `tether.zygote.server.main`): tells the parent `ready`, then serves
/// requests, keeping `blanks` children forked ahead; its idle work waits until no request
/// has come for `quiet` seconds. Returns a `Job` in each child it makes, and an exit code
/// when the zygote (or a blank whose zygote went away) should exit.
#[pyfunction]
#[pyo3(signature = (request_fd, notices_fd, parent, ready, blanks, quiet=0.0))]
pub fn zygote_serve(
    py: Python<'_>,
    request_fd: RawFd,
    notices_fd: RawFd,
    parent: i32,
    ready: &[u8],
    blanks: usize,
    quiet: f64,
) -> PyResult<PyObject> {
    let quiet = Timeout::from_secs(quiet)?.or_max();
    // SAFETY: the zygote hands over the two fds its parent gave it.
    let (request, notices) = unsafe {
        (
            OwnedFd::from_raw_fd(request_fd),
            OwnedFd::from_raw_fd(notices_fd),
        )
    };
    let mut fork = || python_fork(py);
    let served = zygote::serve(request, notices, parent, ready, (blanks, quiet), &mut fork)
        .map_err(os_error)?;
    Ok(match served {
        Served::Exit(code) => code.into_pyobject(py)?.into_any().unbind(),
        Served::Child(job) => {
            let job = Job {
                rank: job.rank,
                env: job.env,
                error: job.error.map(os_error),
                payload: Some(job.payload),
                report: Some(job.report),
            };
            Py::new(py, job)?.into_any()
        }
    })
}

/// Forks the calling (single-threaded) zygote with `clone(CLONE_PARENT)`, so that the new
/// process is a child of the zygote's parent: the process that started the zygote waits for
/// it with a pidfd, sees its real exit status, and its parent-death signal follows that
/// process's warden thread. Wrapped in `PyOS_BeforeFork` / `PyOS_AfterFork_*` like
/// `os.fork()`. Returns 0 in the child and the child's pid in the zygote.
fn python_fork(_py: Python<'_>) -> std::io::Result<i32> {
    // SAFETY: called with the GIL held, as these C-API calls require; the zygote has no
    // other threads whose locks the child could inherit.
    unsafe {
        pyo3::ffi::PyOS_BeforeFork();
        let forked = zygote::clone_parent();
        match forked {
            Ok(0) => pyo3::ffi::PyOS_AfterFork_Child(),
            _ => pyo3::ffi::PyOS_AfterFork_Parent(),
        }
        forked
    }
}
