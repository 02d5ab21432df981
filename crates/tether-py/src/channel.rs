//! Python classes over `tether_core::channel`: `Endpoint` and `SharedFlag`.
//! Every wait is [`crate::wait`]'s: without the GIL, Ctrl-C-aware.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pyo3::exceptions::{PyEOFError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::channel::{self, Recv};

use crate::convert::{borrowed, into_raw, Fd, Timeout};
use crate::error::os_error;
use crate::wait;

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

/// The longest an empty channel is polled before a wait sleeps.
const MAX_SPIN: Duration = Duration::from_millis(10);

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
    fn from_fd(fd: Fd) -> Endpoint {
        Endpoint::wrap(channel::Endpoint::from_fd(fd.take()))
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
        fds: Vec<Fd>,
        timeout: Option<Timeout>,
    ) -> PyResult<bool> {
        let ep = self.inner.get()?;
        let until = Timeout::of(timeout).deadline();
        let borrowed = borrowed(&fds);
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
        let sent = wait::until_deadline(py, until, |slice| {
            Ok(ep.send(data, &borrowed, Some(slice))?.then_some(()))
        })?;
        Ok(sent.is_some())
    }

    /// Receives one `Message`, waiting up to `timeout` seconds (for ever when None); None on
    /// timeout. Raises EOFError once every peer end is closed.
    ///
    /// With `spin` (seconds), an empty channel is polled without sleeping (and without the
    /// GIL) that long before the thread sleeps: a message that comes soon is taken without
    /// the cost of a wake-up.
    #[pyo3(signature = (timeout=None, spin=0.0))]
    fn recv(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        spin: f64,
    ) -> PyResult<Option<Py<Message>>> {
        let ep = self.inner.get()?;
        let until = Timeout::of(timeout).deadline();
        let mut first = ep.recv(Some(Duration::ZERO)).map_err(os_error)?;
        let spin = Timeout::from_secs(spin)?.or_max().min(MAX_SPIN);
        if matches!(first, Recv::Timeout)
            && !spin.is_zero()
            && !until.is_some_and(|d| d <= Instant::now())
        {
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
            Recv::Timeout => {
                wait::until_deadline(py, until, |slice| match ep.recv(Some(slice))? {
                    Recv::Timeout => Ok(None),
                    other => Ok(Some(other)),
                })?
            }
            other => Some(other),
        };
        match got {
            None => Ok(None),
            Some(Recv::Message(msg)) => Ok(Some(Message::new(py, msg)?)),
            Some(Recv::Closed) => Err(PyEOFError::new_err("the channel's peer is closed")),
            Some(Recv::Timeout) => Ok(None),
        }
    }

    /// True when a message (or the end of the channel) is waiting.
    fn readable(&self) -> PyResult<bool> {
        self.inner.get()?.readable().map_err(os_error)
    }

    /// As `recv`, but the same wait also heeds `sentinels` (fds the caller keeps open):
    /// returns a `Message`, or the index in `sentinels` of an fd that became readable, or None
    /// on timeout. A message already waiting comes before any fd.
    #[pyo3(signature = (timeout, sentinels))]
    fn recv_or_sentinel(
        &self,
        py: Python<'_>,
        timeout: Option<Timeout>,
        sentinels: Vec<Fd>,
    ) -> PyResult<Option<PyObject>> {
        let ep = self.inner.get()?;
        let fds = borrowed(&sentinels);
        let got = wait::until(py, Timeout::of(timeout), |slice| {
            match ep.recv(Some(Duration::ZERO))? {
                Recv::Timeout => {}
                other => return Ok(Some(Woke::Got(other))),
            }
            Ok(ep.wait_or_sentinel(&fds, Some(slice))?.map(Woke::Ready))
        })?;
        match got {
            None => Ok(None),
            Some(Woke::Ready(index)) => Ok(Some(index.into_pyobject(py)?.into_any().unbind())),
            Some(Woke::Got(Recv::Message(msg))) => Ok(Some(Message::new(py, msg)?.into_any())),
            Some(Woke::Got(_)) => Err(PyEOFError::new_err("the channel's peer is closed")),
        }
    }
}

/// A message received: its bytes and the fds that came with it (the caller's to close).
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct Message {
    data: Py<PyBytes>,
    fds: Vec<RawFd>,
}

impl Message {
    fn new(py: Python<'_>, msg: channel::Message) -> PyResult<Py<Message>> {
        let message = Message {
            data: PyBytes::new(py, &msg.data).unbind(),
            fds: into_raw(msg.fds),
        };
        Py::new(py, message)
    }
}

/// What `Endpoint.recv_or_sentinel` found.
enum Woke {
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
    fn from_fd(fd: Fd) -> PyResult<SharedFlag> {
        let flag = channel::SharedFlag::from_fd(fd.take()).map_err(os_error)?;
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
    fn wait(&self, py: Python<'_>, timeout: Option<Timeout>) -> PyResult<bool> {
        let flag = self.inner.get()?;
        if flag.is_set() {
            return Ok(true);
        }
        let set = wait::until(py, Timeout::of(timeout), |slice| {
            Ok(flag.wait(Some(slice)).then_some(()))
        })?;
        Ok(set.is_some())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Endpoint>()?;
    m.add_class::<Message>()?;
    m.add_class::<SharedFlag>()?;
    Ok(())
}
