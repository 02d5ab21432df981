//! `tether._native`: thin glue between Python and tether-core. It converts types and
//! releases the GIL around every wait; the Python semantics live in `python/tether`.

use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

mod channel;
mod cli;
mod group;
mod stacks;
mod workers;
mod zygote;

create_exception!(
    _native,
    ZygoteError,
    PyRuntimeError,
    "The zygote died, stopped answering, or broke its protocol while starting processes."
);

/// An `OSError` (of the subclass its errno selects, e.g. `FileNotFoundError`) for a system
/// error, with the errno kept.
fn os_error(err: std::io::Error) -> PyErr {
    core_error(tether_core::Error::from(err))
}

/// The Python exception for an error of tether-core: an `OSError` subclass with its errno
/// for system errors, `ZygoteError` for a zygote that failed.
fn core_error(err: tether_core::Error) -> PyErr {
    match (&err, err.raw_os_error()) {
        (tether_core::Error::Zygote(_), _) => ZygoteError::new_err(err.to_string()),
        (tether_core::Error::SupervisorGone, _) => PyRuntimeError::new_err(err.to_string()),
        (_, Some(errno)) => PyOSError::new_err((errno, err.to_string())),
        (_, None) => PyOSError::new_err(err.to_string()),
    }
}

/// A timeout in seconds as Python callers give it: None, inf or beyond what a deadline
/// can hold waits for ever; a negative one is zero (poll once); NaN is an error.
fn timeout_of(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_nan() => Err(PyValueError::new_err("timeout must be a number, not NaN")),
        Some(t) if t <= 0.0 => Ok(Some(Duration::ZERO)),
        // About 30 years: a deadline further out than that is "never".
        Some(t) if t >= 1e9 => Ok(None),
        Some(t) => Ok(Some(Duration::from_secs_f64(t))),
    }
}

/// Run in a child made by `os.fork()` of `parent_pid`: lead a new process group and die with
/// the parent (through the parent-death signal when forked from the main thread, a watcher
/// thread otherwise).
#[pyfunction]
fn setup_forked_child(parent_pid: i32, from_main_thread: bool) -> PyResult<()> {
    tether_core::launch::setup_forked_child(parent_pid, from_main_thread).map_err(os_error)
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

/// Sets this process's title in `ps -o args` and its name in `/proc/self/comm` (15
/// bytes). Call it while the process has a single thread.
#[pyfunction]
fn set_title(title: &str, comm: &str) -> PyResult<()> {
    tether_core::title::set(title, comm).map_err(os_error)
}

/// "; the open-file limit of this process is reached (...)": which system limit an error
/// number most likely means, or "".
#[pyfunction]
fn limit_hint(errno: i32) -> String {
    tether_core::limit_hint(&std::io::Error::from_raw_os_error(errno))
}

/// A failure report frame: the exception's type name, its traceback text, the pickled
/// exception (possibly empty).
#[pyfunction]
fn encode_report<'py>(
    py: Python<'py>,
    type_name: &str,
    text: &[u8],
    pickled: &[u8],
) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &tether_core::report::encode(type_name, text, pickled))
}

/// A report read back: `(type_name, text, pickled or None, missing bytes)`.
type PyReport = (String, Vec<u8>, Option<Vec<u8>>, u64);

/// A report read back, or None when not even the type name arrived.
#[pyfunction]
fn decode_report(data: &[u8]) -> Option<PyReport> {
    tether_core::report::decode(data).map(|d| (d.type_name, d.text, d.pickled, d.missing))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    tether_core::logging::init_from_env();
    m.add_class::<group::Group>()?;
    m.add_class::<group::ExitStatus>()?;
    m.add_class::<zygote::Zygote>()?;
    m.add_class::<zygote::Job>()?;
    channel::register(m)?;
    m.add("ZygoteError", m.py().get_type::<ZygoteError>())?;
    m.add("REPORT_LIMIT", tether_core::report::REPORT_LIMIT)?;
    m.add("MAX_BLANKS", tether_core::zygote::MAX_BLANKS)?;
    m.add("ZYGOTE_FDS_ENV", tether_core::zygote::FDS_ENV)?;
    cli::register(m)?;
    stacks::register(m)?;
    workers::register(m)?;
    m.add_function(wrap_pyfunction!(setup_forked_child, m)?)?;
    m.add_function(wrap_pyfunction!(signal_name, m)?)?;
    m.add_function(wrap_pyfunction!(signal_hint, m)?)?;
    m.add_function(wrap_pyfunction!(encode_report, m)?)?;
    m.add_function(wrap_pyfunction!(limit_hint, m)?)?;
    m.add_function(wrap_pyfunction!(set_title, m)?)?;
    m.add_function(wrap_pyfunction!(decode_report, m)?)?;
    m.add_function(wrap_pyfunction!(zygote::zygote_serve, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
