//! `tether._native`: thin glue between Python and tether-core. It converts types and
//! releases the GIL around every wait; the Python semantics live in `python/tether`.

use std::ffi::OsString;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::{ExitStatus, LaunchSpec, WaitFor};

mod channel;
mod workers;

/// How often a wait wakes to let Python run its signal handlers (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

fn os_error(err: impl std::fmt::Display) -> PyErr {
    PyOSError::new_err(err.to_string())
}

/// A launch as Python gives it: `(argv, env, keep_fds, payload)`, strings as bytes.
type PySpec = (
    Vec<Vec<u8>>,
    Vec<(Vec<u8>, Vec<u8>)>,
    Vec<i32>,
    Option<Vec<u8>>,
);

/// A member's exit as Python sees it: `(exitcode, signal_name, core_dumped, exited_at)`.
type PyExit = (i32, Option<String>, bool, f64);

/// A set of children started and watched together.
#[pyclass(module = "tether._native", frozen)]
struct Group {
    inner: tether_core::Group,
}

#[pymethods]
impl Group {
    #[new]
    fn new() -> Group {
        Group {
            inner: tether_core::Group::new(),
        }
    }

    /// Starts one child per `(argv, env, keep_fds, payload)`; returns their indices.
    /// `argv` and `env` items are bytes (`os.fsencode`); each child gets a report pipe.
    fn launch(&self, py: Python<'_>, specs: Vec<PySpec>) -> PyResult<Vec<usize>> {
        let specs: Vec<LaunchSpec> = specs
            .into_iter()
            .map(|(argv, env, keep_fds, payload)| LaunchSpec {
                argv: argv.into_iter().map(OsString::from_vec).collect(),
                env: env
                    .into_iter()
                    .map(|(k, v)| (OsString::from_vec(k), OsString::from_vec(v)))
                    .collect(),
                keep_fds,
                payload,
                report: true,
                ..LaunchSpec::default()
            })
            .collect();
        py.allow_threads(|| self.inner.launch(specs))
            .map_err(os_error)
    }

    /// Takes on a child this process forked (`pid`), and a duplicate of the read end of its
    /// report pipe (the caller keeps and closes its own fd).
    #[pyo3(signature = (pid, report_fd=None))]
    fn adopt(&self, py: Python<'_>, pid: i32, report_fd: Option<i32>) -> PyResult<usize> {
        let report: Option<OwnedFd> = match report_fd {
            Some(fd) => {
                // SAFETY: the caller passes an fd it holds open for the duration of this call.
                let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
                Some(borrowed.try_clone_to_owned().map_err(os_error)?)
            }
            None => None,
        };
        py.allow_threads(|| self.inner.adopt(pid, report))
            .map_err(os_error)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn pid(&self, index: usize) -> PyResult<i32> {
        self.inner.pid(index).ok_or_else(|| no_member(index))
    }

    /// The pidfd of a member: readable once it has exited, open while the group lives.
    fn sentinel(&self, index: usize) -> PyResult<i32> {
        self.inner
            .with_member(index, |m| m.sentinel())
            .ok_or_else(|| no_member(index))
    }

    /// `None` while the member runs; else `(exitcode, signal_name, core_dumped, exited_at)`
    /// with `exitcode` negative for a signal (as in multiprocessing) and `exited_at` on the
    /// `time.monotonic()` clock.
    fn exit(&self, index: usize) -> PyResult<Option<PyExit>> {
        if index >= self.inner.len() {
            return Err(no_member(index));
        }
        Ok(self.inner.exit(index).map(|e| {
            let core = matches!(
                e.status,
                ExitStatus::Signaled {
                    core_dumped: true,
                    ..
                }
            );
            (
                e.status.as_exitcode(),
                e.status.signal().map(tether_core::signal_name),
                core,
                e.at.as_secs_f64(),
            )
        }))
    }

    /// When the member failed (`time.monotonic()` clock): the arrival of its whole failure
    /// report, or its non-zero exit; None while it has not failed.
    fn failed_at(&self, index: usize) -> PyResult<Option<f64>> {
        self.inner
            .with_member(index, |m| m.failed_at().map(|t| t.as_secs_f64()))
            .ok_or_else(|| no_member(index))
    }

    /// Everything the member wrote to its report pipe so far.
    fn report<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        self.inner
            .with_member(index, |m| PyBytes::new(py, m.report()))
            .ok_or_else(|| no_member(index))
    }

    /// Sends `signal` to the member's process group; false if it had already exited.
    fn signal(&self, index: usize, signal: i32) -> PyResult<bool> {
        self.inner.signal(index, signal).map_err(os_error)
    }

    /// Sends `signal` to every running member's process group; returns how many.
    fn signal_all(&self, signal: i32) -> usize {
        self.inner.signal_all(signal)
    }

    /// Waits (without the GIL) until `until` holds for the members in `which` (all when
    /// None): "all", "all_or_failure" or "any". Returns False on timeout. Python signal
    /// handlers run meanwhile, so Ctrl-C raises KeyboardInterrupt here.
    #[pyo3(signature = (which=None, until="all", timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        which: Option<Vec<usize>>,
        until: &str,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let until = match until {
            "all" => WaitFor::AllExited,
            "all_or_failure" => WaitFor::AllExitedOrFailure,
            "any" => WaitFor::AnyExited,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown wait condition {other:?}"
                )))
            }
        };
        let deadline = match timeout {
            Some(t) if !t.is_finite() || t < 0.0 => {
                return Err(PyValueError::new_err(
                    "timeout must be a non-negative number",
                ))
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
            None => None,
        };
        loop {
            let slice = match deadline {
                None => SIGNAL_CHECK,
                Some(d) => d
                    .saturating_duration_since(Instant::now())
                    .min(SIGNAL_CHECK),
            };
            if py.allow_threads(|| self.inner.wait(which.as_deref(), until, Some(slice))) {
                return Ok(true);
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
        }
    }
}

fn no_member(index: usize) -> PyErr {
    pyo3::exceptions::PyIndexError::new_err(format!("no process with index {index}"))
}

/// Run in a child made by `os.fork()` of `parent_pid`: lead a new process group and die with
/// the parent (through the parent-death signal when forked from the main thread, a watcher
/// thread otherwise).
#[pyfunction]
fn setup_forked_child(parent_pid: i32, from_main_thread: bool) -> PyResult<()> {
    tether_core::launch::setup_forked_child(parent_pid, from_main_thread).map_err(os_error)
}

/// Forks the calling (single-threaded) zygote with `clone(CLONE_PARENT)`, so that the new
/// process is a child of the zygote's parent: the process that started the zygote waits
/// for it with a pidfd, sees its real exit status, and its parent-death signal follows that
/// process's supervisor thread. Wrapped in `PyOS_BeforeFork` / `PyOS_AfterFork_*` like
/// `os.fork()`. Returns 0 in the child and the child's pid in the zygote.
#[pyfunction]
fn zygote_fork(_py: Python<'_>) -> PyResult<i32> {
    // SAFETY: called with the GIL held, as these C-API calls require. The raw clone with a
    // null stack pointer behaves like fork (the child continues on a copy of this stack);
    // the zygote has no other threads whose locks the child could inherit.
    let pid = unsafe {
        pyo3::ffi::PyOS_BeforeFork();
        let pid = libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        );
        if pid == 0 {
            pyo3::ffi::PyOS_AfterFork_Child();
        } else {
            pyo3::ffi::PyOS_AfterFork_Parent();
        }
        pid
    };
    if pid < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok(pid as i32)
}

/// The name of a signal number (`SIGKILL`), as torch and `signal.Signals` spell it.
#[pyfunction]
fn signal_name(signal: i32) -> String {
    tether_core::signal_name(signal)
}

/// A hint for an error about a process killed by `signal` (OOM killer, /dev/shm).
#[pyfunction]
fn signal_hint(signal: i32) -> Option<&'static str> {
    tether_core::status::signal_hint(signal)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Group>()?;
    channel::register(m)?;
    workers::register(m)?;
    m.add_function(wrap_pyfunction!(setup_forked_child, m)?)?;
    m.add_function(wrap_pyfunction!(signal_name, m)?)?;
    m.add_function(wrap_pyfunction!(zygote_fork, m)?)?;
    m.add_function(wrap_pyfunction!(signal_hint, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
