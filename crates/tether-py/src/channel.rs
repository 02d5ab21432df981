//! Python classes over `tether_core::channel`: `Endpoint` and `SharedFlag`.
//! Every wait releases the GIL and wakes every [`SIGNAL_CHECK`] to run Python's signal
//! handlers (in the main thread; elsewhere that check does nothing).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyEOFError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::channel::{self, Recv};

/// How often a wait wakes to let Python run its signal handlers (Ctrl-C).
const SIGNAL_CHECK: Duration = Duration::from_millis(50);

pub(crate) fn os_error(err: std::io::Error) -> PyErr {
    PyOSError::new_err((err.raw_os_error().unwrap_or(0), err.to_string()))
}

fn closed() -> PyErr {
    PyValueError::new_err("operation on a closed tether channel")
}

/// A native object that Python can close while other threads still hold it: `close()`
/// drops this handle's reference, and the object goes once the last call using it returns.
struct Closable<T>(Mutex<Option<Arc<T>>>);

impl<T> Closable<T> {
    fn new(value: T) -> Closable<T> {
        Closable(Mutex::new(Some(Arc::new(value))))
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<T>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn get(&self) -> PyResult<Arc<T>> {
        self.slot().clone().ok_or_else(closed)
    }

    fn close(&self) {
        self.slot().take();
    }

    fn is_closed(&self) -> bool {
        self.slot().is_none()
    }
}

/// A timeout in seconds as a deadline; `None` waits for ever.
pub(crate) fn deadline(timeout: Option<f64>) -> PyResult<Option<Instant>> {
    match timeout {
        Some(t) if t.is_nan() => Err(PyValueError::new_err("timeout must be a number")),
        Some(t) if t <= 0.0 => Ok(Some(Instant::now())),
        Some(t) if t > 1e9 => Ok(None),
        Some(t) => Ok(Some(Instant::now() + Duration::from_secs_f64(t))),
        None => Ok(None),
    }
}

/// Runs `step` with the GIL released in slices of at most [`SIGNAL_CHECK`] until it returns
/// `Some` or the deadline passes, checking Python signals between slices.
pub(crate) fn sliced<T, F>(
    py: Python<'_>,
    until: Option<Instant>,
    mut step: F,
) -> PyResult<Option<T>>
where
    F: FnMut(Duration) -> std::io::Result<Option<T>> + Send,
    T: Send,
{
    loop {
        let slice = match until {
            None => SIGNAL_CHECK,
            Some(d) => d
                .saturating_duration_since(Instant::now())
                .min(SIGNAL_CHECK),
        };
        if let Some(found) = py.allow_threads(|| step(slice)).map_err(os_error)? {
            return Ok(Some(found));
        }
        if until.is_some_and(|d| Instant::now() >= d) {
            return Ok(None);
        }
        py.check_signals()?;
    }
}

/// Takes ownership of the raw fds (ints) of a message.
pub(crate) fn into_raw(fds: Vec<OwnedFd>) -> Vec<RawFd> {
    fds.into_iter().map(IntoRawFd::into_raw_fd).collect()
}

/// One end of a message channel (a `SOCK_SEQPACKET` socket pair): messages are sent and
/// received whole, with fds, by any number of processes and threads.
#[pyclass(module = "tether._native", frozen)]
pub struct Endpoint {
    inner: Closable<channel::Endpoint>,
}

impl Endpoint {
    fn wrap(inner: channel::Endpoint) -> Endpoint {
        Endpoint {
            inner: Closable::new(inner),
        }
    }
}

#[pymethods]
impl Endpoint {
    /// A connected pair: what one end sends, the other receives.
    #[staticmethod]
    fn pair() -> PyResult<(Endpoint, Endpoint)> {
        let (a, b) = channel::Endpoint::pair().map_err(os_error)?;
        Ok((Endpoint::wrap(a), Endpoint::wrap(b)))
    }

    /// Takes ownership of `fd`, one end of a pair (received from another process).
    #[staticmethod]
    fn from_fd(fd: RawFd) -> PyResult<Endpoint> {
        if fd < 0 {
            return Err(PyValueError::new_err("invalid fd"));
        }
        // SAFETY: the caller hands over an open fd it no longer uses.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Endpoint::wrap(channel::Endpoint::from_fd(owned)))
    }

    fn fileno(&self) -> PyResult<RawFd> {
        Ok(self.inner.get()?.as_fd().as_raw_fd())
    }

    /// Closes this process's fd (once no call on another thread still uses it).
    fn close(&self) {
        self.inner.close();
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Sends `data` and `fds` (which stay owned by the caller) as one message; waits while
    /// the channel is full, up to `timeout` seconds. Returns False on timeout.
    #[pyo3(signature = (data, fds=Vec::new(), timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        data: &[u8],
        fds: Vec<RawFd>,
        timeout: Option<f64>,
    ) -> PyResult<bool> {
        let ep = self.inner.get()?;
        let until = deadline(timeout)?;
        if fds.iter().any(|&fd| fd < 0) {
            return Err(PyValueError::new_err("invalid fd"));
        }
        // SAFETY: the caller keeps these fds open for the duration of the call.
        let borrowed: Vec<BorrowedFd<'_>> = fds
            .iter()
            .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
            .collect();
        // Fast path: room in the socket buffer, no GIL release needed for a short syscall.
        if ep
            .send(data, &borrowed, Some(Duration::ZERO))
            .map_err(os_error)?
        {
            return Ok(true);
        }
        if until.is_some_and(|d| d <= Instant::now()) {
            return Ok(false);
        }
        let sent = sliced(py, until, |slice| {
            Ok(ep.send(data, &borrowed, Some(slice))?.then_some(()))
        })?;
        Ok(sent.is_some())
    }

    /// Receives one message as `(data, fds)` (the fds are the caller's to close), waiting up
    /// to `timeout` seconds (for ever when None); None on timeout. Raises EOFError once every
    /// peer end is closed.
    ///
    /// With `spin` (seconds), an empty channel is polled without sleeping (and without the
    /// GIL) that long before the thread sleeps: a message that comes soon is taken without
    /// the cost of a wake-up.
    #[pyo3(signature = (timeout=None, spin=0.0))]
    fn recv<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        spin: f64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Vec<RawFd>)>> {
        let ep = self.inner.get()?;
        let until = deadline(timeout)?;
        let mut first = ep.recv(Some(Duration::ZERO)).map_err(os_error)?;
        if matches!(first, Recv::Timeout)
            && spin > 0.0
            && !until.is_some_and(|d| d <= Instant::now())
        {
            let spin = Duration::from_secs_f64(spin.min(0.01));
            first = py
                .allow_threads(|| {
                    let start = Instant::now();
                    loop {
                        let got = ep.recv(Some(Duration::ZERO))?;
                        if !matches!(got, Recv::Timeout) || start.elapsed() >= spin {
                            return Ok(got);
                        }
                        std::hint::spin_loop();
                    }
                })
                .map_err(os_error)?;
        }
        let got = match first {
            Recv::Timeout if until.is_some_and(|d| d <= Instant::now()) => None,
            Recv::Timeout => sliced(py, until, |slice| match ep.recv(Some(slice))? {
                Recv::Timeout => Ok(None),
                other => Ok(Some(other)),
            })?,
            other => Some(other),
        };
        match got {
            None => Ok(None),
            Some(Recv::Message(msg)) => Ok(Some((PyBytes::new(py, &msg.data), into_raw(msg.fds)))),
            Some(Recv::Closed) => Err(PyEOFError::new_err("the channel's peer is closed")),
            Some(Recv::Timeout) => Ok(None),
        }
    }

    /// True when a message (or the end of the channel) is waiting.
    fn readable(&self) -> PyResult<bool> {
        self.inner.get()?.readable().map_err(os_error)
    }

    /// As `recv`, but the same wait also watches `watch` (fds the caller keeps open):
    /// returns `(data, fds)`, or the index in `watch` of an fd that became readable, or None
    /// on timeout. A message already waiting comes before any fd.
    #[pyo3(signature = (timeout, watch))]
    fn recv_watching(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        watch: Vec<RawFd>,
    ) -> PyResult<Option<PyObject>> {
        let ep = self.inner.get()?;
        let until = deadline(timeout)?;
        if watch.iter().any(|&fd| fd < 0) {
            return Err(PyValueError::new_err("invalid fd"));
        }
        let got = sliced(py, until, |slice| {
            match ep.recv(Some(Duration::ZERO))? {
                Recv::Timeout => {}
                other => return Ok(Some(Watched::Got(other))),
            }
            // SAFETY: the caller keeps the watched fds open for the duration of the call.
            let fds: Vec<BorrowedFd<'_>> = watch
                .iter()
                .map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) })
                .collect();
            Ok(ep.wait_watching(&fds, Some(slice))?.map(Watched::Ready))
        })?;
        match got {
            None => Ok(None),
            Some(Watched::Ready(index)) => Ok(Some(index.into_pyobject(py)?.into_any().unbind())),
            Some(Watched::Got(Recv::Message(msg))) => {
                let pair = (PyBytes::new(py, &msg.data), into_raw(msg.fds));
                Ok(Some(pair.into_pyobject(py)?.into_any().unbind()))
            }
            Some(Watched::Got(_)) => Err(PyEOFError::new_err("the channel's peer is closed")),
        }
    }
}

/// What `Endpoint.recv_watching` found.
enum Watched {
    Got(Recv),
    Ready(usize),
}

/// A flag in a shared memory page: set/clear/is_set/wait across processes.
#[pyclass(module = "tether._native", frozen)]
pub struct SharedFlag {
    inner: Closable<channel::SharedFlag>,
}

#[pymethods]
impl SharedFlag {
    #[new]
    fn new() -> PyResult<SharedFlag> {
        let flag = channel::SharedFlag::new().map_err(os_error)?;
        Ok(SharedFlag {
            inner: Closable::new(flag),
        })
    }

    /// Takes ownership of `fd` (a flag's memfd received from another process) and maps it.
    #[staticmethod]
    fn from_fd(fd: RawFd) -> PyResult<SharedFlag> {
        if fd < 0 {
            return Err(PyValueError::new_err("invalid fd"));
        }
        // SAFETY: the caller hands over an open fd it no longer uses.
        let owned = unsafe { OwnedFd::from_raw_fd(fd) };
        let flag = channel::SharedFlag::from_fd(owned).map_err(os_error)?;
        Ok(SharedFlag {
            inner: Closable::new(flag),
        })
    }

    fn fileno(&self) -> PyResult<RawFd> {
        Ok(self.inner.get()?.as_fd().as_raw_fd())
    }

    fn close(&self) {
        self.inner.close();
    }

    fn is_set(&self) -> PyResult<bool> {
        Ok(self.inner.get()?.is_set())
    }

    fn set(&self) -> PyResult<()> {
        self.inner.get()?.set();
        Ok(())
    }

    fn clear(&self) -> PyResult<()> {
        self.inner.get()?.clear();
        Ok(())
    }

    /// Waits until the flag is set or `timeout` seconds pass; returns whether it is set.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let flag = self.inner.get()?;
        if flag.is_set() {
            return Ok(true);
        }
        let until = deadline(timeout)?;
        Ok(sliced(py, until, |slice| Ok(flag.wait(Some(slice)).then_some(())))?.is_some())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Endpoint>()?;
    m.add_class::<SharedFlag>()?;
    Ok(())
}
