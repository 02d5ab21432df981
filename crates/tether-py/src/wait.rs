//! The one wait of every blocking call: the GIL released, in slices of at most
//! [`SIGNAL_CHECK`], Python's signal handlers run between slices (in the main thread; a
//! handler that raises, as Ctrl-C's does, ends the wait with its exception).

use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::convert::Timeout;
use crate::error::os_error;

/// How often a wait wakes to let Python run its signal handlers (Ctrl-C).
pub const SIGNAL_CHECK: Duration = Duration::from_millis(50);

/// Runs `step(slice)` without the GIL until it returns `Some` or `timeout` passes (None
/// then), checking Python's signals between slices. A step waits at most `slice`.
pub fn until<T, F>(py: Python<'_>, timeout: Timeout, step: F) -> PyResult<Option<T>>
where
    F: FnMut(Duration) -> std::io::Result<Option<T>> + Send,
    T: Send,
{
    until_deadline(py, timeout.deadline(), step)
}

/// [`until`], up to a deadline fixed earlier.
pub fn until_deadline<T, F>(
    py: Python<'_>,
    deadline: Option<Instant>,
    mut step: F,
) -> PyResult<Option<T>>
where
    F: FnMut(Duration) -> std::io::Result<Option<T>> + Send,
    T: Send,
{
    loop {
        let slice = match deadline {
            None => SIGNAL_CHECK,
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_CHECK),
        };
        if let Some(found) = py.allow_threads(|| step(slice)).map_err(os_error)? {
            return Ok(Some(found));
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// For a loop of tether-core's that asks whether to stop between its own slices (called
/// without the GIL): runs Python's signal handlers; true, with the error kept, when one
/// raised.
pub fn interrupted(error: &mut Option<PyErr>) -> bool {
    Python::with_gil(|py| match py.check_signals() {
        Ok(()) => false,
        Err(err) => {
            *error = Some(err);
            true
        }
    })
}
