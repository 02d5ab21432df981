//! The Python values converted at the edge, each in one place: a timeout or a number of
//! seconds ([`Timeout`]), a wait condition ([`WaitFor`]) and an fd ([`Fd`]). A `#[pymethods]`
//! parameter of one of these types is checked before the method's body runs.

use std::convert::Infallible;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyInt;

/// A number of seconds as Python callers give it: inf, or one beyond what a deadline can
/// hold (about 30 years), is "for ever"; a negative one is zero (poll once); NaN is a
/// ValueError. A `None` where the parameter is optional (`Option<Timeout>`) is "for ever"
/// too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeout(Option<Duration>);

impl Timeout {
    /// For ever.
    pub const NEVER: Timeout = Timeout(None);

    /// The seconds `t` stand for.
    pub fn from_secs(t: f64) -> PyResult<Timeout> {
        if t.is_nan() {
            return Err(PyValueError::new_err("timeout must be a number, not NaN"));
        }
        Ok(Timeout(match t {
            t if t <= 0.0 => Some(Duration::ZERO),
            t if t >= 1e9 => None,
            t => Some(Duration::from_secs_f64(t)),
        }))
    }

    /// The duration; None for ever.
    pub fn duration(self) -> Option<Duration> {
        self.0
    }

    /// The duration; `Duration::MAX` for ever.
    pub fn or_max(self) -> Duration {
        self.0.unwrap_or(Duration::MAX)
    }

    /// When it ends, counted from now; None for ever.
    pub fn deadline(self) -> Option<Instant> {
        self.0.and_then(|t| Instant::now().checked_add(t))
    }

    /// An optional timeout: None is for ever.
    pub fn of(timeout: Option<Timeout>) -> Timeout {
        timeout.unwrap_or(Timeout::NEVER)
    }
}

impl<'py> FromPyObject<'py> for Timeout {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Timeout> {
        Timeout::from_secs(ob.extract::<f64>()?)
    }
}

/// The condition a wait on a group's members waits for.
#[pyclass(module = "tether._native", eq, eq_int, frozen, hash)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitFor {
    /// Every member has exited.
    #[pyo3(name = "ALL")]
    All,
    /// Every member has exited, or one failed.
    #[pyo3(name = "ALL_OR_FAILURE")]
    AllOrFailure,
    /// One member has exited.
    #[pyo3(name = "ANY")]
    Any,
}

impl From<WaitFor> for tether_core::WaitFor {
    fn from(until: WaitFor) -> tether_core::WaitFor {
        match until {
            WaitFor::All => tether_core::WaitFor::AllExited,
            WaitFor::AllOrFailure => tether_core::WaitFor::AllExitedOrFailure,
            WaitFor::Any => tether_core::WaitFor::AnyExited,
        }
    }
}

/// An fd number from Python: never negative. Whether it is handed over ([`Fd::take`],
/// [`owned`]) or lent for the call ([`borrowed`]) is the method's documented contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fd(RawFd);

impl Fd {
    /// Takes ownership of the fd.
    pub fn take(self) -> OwnedFd {
        // SAFETY: a method taking an `Fd` to own documents that the caller hands the open fd
        // over and closes it no more.
        unsafe { OwnedFd::from_raw_fd(self.0) }
    }

    /// The fd number, still the caller's.
    pub fn raw(self) -> RawFd {
        self.0
    }

    /// Borrows the fd for the duration of the call.
    pub fn borrow(&self) -> BorrowedFd<'_> {
        // SAFETY: a method taking an `Fd` to borrow documents that the caller keeps it open
        // for the duration of the call, which `self` (an argument of that call) outlives.
        unsafe { BorrowedFd::borrow_raw(self.0) }
    }
}

impl<'py> FromPyObject<'py> for Fd {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Fd> {
        match ob.extract::<RawFd>()? {
            fd if fd < 0 => Err(PyValueError::new_err(format!("invalid fd {fd}"))),
            fd => Ok(Fd(fd)),
        }
    }
}

/// The fd number again, as a field of a class shows it.
impl<'py> IntoPyObject<'py> for Fd {
    type Target = PyInt;
    type Output = Bound<'py, PyInt>;
    type Error = Infallible;

    fn into_pyobject(self, py: Python<'py>) -> Result<Self::Output, Self::Error> {
        self.0.into_pyobject(py)
    }
}

/// Takes ownership of fds handed over by Python.
pub fn owned(fds: Vec<Fd>) -> Vec<OwnedFd> {
    fds.into_iter().map(Fd::take).collect()
}

/// Borrows fds Python keeps open for the duration of a call.
pub fn borrowed(fds: &[Fd]) -> Vec<BorrowedFd<'_>> {
    fds.iter().map(Fd::borrow).collect()
}

/// Hands fds over to Python, as the ints it takes (the caller's to close).
pub fn into_raw(fds: Vec<OwnedFd>) -> Vec<RawFd> {
    fds.into_iter().map(IntoRawFd::into_raw_fd).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_read_as_python_callers_mean_them() {
        assert_eq!(
            Timeout::from_secs(-1.0).unwrap().duration(),
            Some(Duration::ZERO)
        );
        assert_eq!(
            Timeout::from_secs(0.5).unwrap().duration(),
            Some(Duration::from_millis(500))
        );
        assert_eq!(Timeout::from_secs(f64::INFINITY).unwrap(), Timeout::NEVER);
        assert_eq!(Timeout::from_secs(1e12).unwrap(), Timeout::NEVER);
        assert_eq!(Timeout::NEVER.or_max(), Duration::MAX);
        assert_eq!(Timeout::NEVER.deadline(), None);
    }
}
