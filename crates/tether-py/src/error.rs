//! Every error of tether-core as the Python exception it raises, in one place.

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError};
use pyo3::prelude::*;
use tether_core::workers::WorkersError;

create_exception!(
    _native,
    ZygoteError,
    PyRuntimeError,
    "The zygote died, stopped answering, or broke its protocol while starting processes."
);

/// An `OSError` (of the subclass its errno selects, e.g. `FileNotFoundError`) for a system
/// error, with the errno kept.
pub fn os_error(err: std::io::Error) -> PyErr {
    core_error(tether_core::Error::from(err))
}

/// The Python exception for an error of tether-core: an `OSError` subclass with its errno
/// for system errors, `ZygoteError` for a zygote that failed, `RuntimeError` for a
/// warden that is gone.
pub fn core_error(err: tether_core::Error) -> PyErr {
    match (&err, err.raw_os_error()) {
        (tether_core::Error::Zygote(_), _) => ZygoteError::new_err(err.to_string()),
        (tether_core::Error::WardenGone, _) => PyRuntimeError::new_err(err.to_string()),
        (_, Some(errno)) => PyOSError::new_err((errno, err.to_string())),
        (_, None) => PyOSError::new_err(err.to_string()),
    }
}

/// The Python exception for an error of the worker set: an `OSError` for a system error,
/// `RuntimeError` for the rest (a closed set, a slot taken or empty, a bad message).
pub fn workers_error(err: WorkersError) -> PyErr {
    match err {
        WorkersError::Io(io) => os_error(io),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// A worker-set error as the I/O error a [`crate::wait`] step returns.
pub fn workers_io(err: WorkersError) -> std::io::Error {
    match err {
        WorkersError::Io(io) => io,
        other => std::io::Error::other(other.to_string()),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ZygoteError", m.py().get_type::<ZygoteError>())
}
