//! `Group` and `ExitStatus`: a set of supervised children, and how each one ended; with
//! what Python hands a group (`LaunchSpec`, `ForkedChild`, `Escalation`) and `Member`, one
//! child of a group.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tether_core::attrs::ThreadAttributes;
use tether_core::{Adoption, LaunchSpec};

use crate::convert::{Fd, Timeout, WaitFor};
use crate::error::{core_error, os_error};
use crate::wait;

/// A child for `Group.launch` to start: its command line and environment (bytes, as
/// `os.fsencode` gives them), the fds it inherits under their own numbers, and the payload
/// it reads from the pipe `TETHER_PAYLOAD_FD` names (none: no such pipe).
#[pyclass(module = "tether._native", name = "LaunchSpec", frozen, get_all)]
pub struct Spec {
    argv: Vec<Vec<u8>>,
    /// `(name, value)` pairs added to the child's environment.
    env: Vec<(Vec<u8>, Vec<u8>)>,
    keep_fds: Vec<i32>,
    payload: Option<Vec<u8>>,
}

#[pymethods]
impl Spec {
    #[new]
    #[pyo3(signature = (argv, env=Vec::new(), keep_fds=Vec::new(), payload=None))]
    fn new(
        argv: Vec<Vec<u8>>,
        env: Vec<(Vec<u8>, Vec<u8>)>,
        keep_fds: Vec<Fd>,
        payload: Option<Vec<u8>>,
    ) -> Spec {
        Spec {
            argv,
            env,
            keep_fds: keep_fds.into_iter().map(Fd::raw).collect(),
            payload,
        }
    }
}

/// A child this process forked, for `Group.adopt_all`: its pid and the read end of its
/// report pipe (the group takes that fd over), or None.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct ForkedChild {
    pid: i32,
    report_fd: Option<Fd>,
}

#[pymethods]
impl ForkedChild {
    #[new]
    #[pyo3(signature = (pid, report_fd=None))]
    fn new(pid: i32, report_fd: Option<Fd>) -> ForkedChild {
        ForkedChild { pid, report_fd }
    }
}

/// A further signal for `Group.terminate`: `signal`, to the members still running `after`
/// seconds after the first one.
#[pyclass(module = "tether._native", frozen)]
pub struct Escalation {
    #[pyo3(get)]
    signal: i32,
    /// The seconds as given.
    #[pyo3(get)]
    after: f64,
    wait: Timeout,
}

#[pymethods]
impl Escalation {
    #[new]
    fn new(signal: i32, after: f64) -> PyResult<Escalation> {
        Ok(Escalation {
            signal,
            after,
            wait: Timeout::from_secs(after)?,
        })
    }
}

/// One child of a group: the group and the child's index in it.
#[pyclass(module = "tether._native", frozen, get_all)]
pub struct Member {
    group: Py<Group>,
    index: usize,
}

#[pymethods]
impl Member {
    #[new]
    pub fn new(group: Py<Group>, index: usize) -> Member {
        Member { group, index }
    }
}

impl Member {
    /// The core group and the index.
    pub fn target(&self) -> (tether_core::Group, usize) {
        (self.group.get().inner.clone(), self.index)
    }
}

/// How a child ended: the one typed exit status, from the warden.
#[pyclass(module = "tether._native", frozen, eq)]
#[derive(Debug, Clone, PartialEq)]
pub struct ExitStatus {
    status: tether_core::ExitStatus,
    /// When the warden saw the exit, on the `time.monotonic()` clock.
    #[pyo3(get)]
    at: f64,
}

impl ExitStatus {
    /// `status`, seen now.
    pub fn now(status: tether_core::ExitStatus) -> ExitStatus {
        let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        ExitStatus {
            status,
            at: ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9,
        }
    }

    pub fn new(exit: tether_core::Exit) -> ExitStatus {
        ExitStatus {
            status: exit.status,
            at: exit.at.as_secs_f64(),
        }
    }
}

#[pymethods]
impl ExitStatus {
    /// The exit code the process passed to `exit`, or None (killed, or unavailable).
    #[getter]
    fn code(&self) -> Option<i32> {
        match self.status {
            tether_core::ExitStatus::Exited(code) => Some(code),
            _ => None,
        }
    }

    /// The number of the signal that killed it, or None.
    #[getter]
    fn signal(&self) -> Option<i32> {
        self.status.signal()
    }

    /// The name of the signal that killed it (`"SIGKILL"`), or None.
    #[getter]
    fn signal_name(&self) -> Option<String> {
        self.status.signal().map(tether_core::signal_name)
    }

    #[getter]
    fn core_dumped(&self) -> bool {
        self.status.core_dumped()
    }

    /// In `multiprocessing`'s convention: the code, or minus the signal number; None when
    /// the status is unavailable.
    #[getter]
    fn exitcode(&self) -> Option<i32> {
        self.status.as_exitcode()
    }

    /// Exited with code 0.
    #[getter]
    fn success(&self) -> bool {
        self.status.success()
    }

    /// Exited non-zero or was killed by a signal.
    #[getter]
    fn failure(&self) -> bool {
        self.status.failure()
    }

    /// Something else reaped the process (SIGCHLD ignored, a `waitpid(-1)`): the status is
    /// lost; neither a success nor a failure.
    #[getter]
    fn unavailable(&self) -> bool {
        self.status == tether_core::ExitStatus::Unknown
    }

    /// "exit code 3", "signal SIGKILL; SIGKILL often means ...", "exit status unavailable
    /// (reaped outside tether)".
    fn describe(&self) -> String {
        self.status.describe()
    }

    fn __str__(&self) -> String {
        self.status.to_string()
    }

    fn __repr__(&self) -> String {
        format!("<ExitStatus {}>", self.status)
    }
}

/// A set of children started and watched together.
#[pyclass(module = "tether._native", frozen)]
pub struct Group {
    pub inner: tether_core::Group,
}

#[pymethods]
impl Group {
    #[new]
    fn new() -> Group {
        Group {
            inner: tether_core::Group::new(),
        }
    }

    /// Starts one child per `LaunchSpec`; returns their indices. Each child gets a report
    /// pipe, the stacks channel (`TETHER_STACKS_FD`), and the CPU affinity and nice value
    /// of the calling thread.
    fn launch(&self, py: Python<'_>, specs: Vec<Bound<'_, Spec>>) -> PyResult<Vec<usize>> {
        let thread = ThreadAttributes::of_calling_thread().map_err(os_error)?;
        let specs: Vec<LaunchSpec> = specs
            .iter()
            .map(|spec| spec.get())
            .map(|spec| LaunchSpec {
                argv: spec.argv.iter().cloned().map(OsString::from_vec).collect(),
                env: spec
                    .env
                    .iter()
                    .map(|(k, v)| (OsString::from_vec(k.clone()), OsString::from_vec(v.clone())))
                    .collect(),
                keep_fds: spec.keep_fds.clone(),
                payload: spec.payload.clone(),
                report: true,
                stacks: true,
                thread: Some(thread.clone()),
                ..LaunchSpec::default()
            })
            .collect();
        py.allow_threads(|| self.inner.launch(specs))
            .map_err(core_error)
    }

    /// Takes on children this process forked, in one call; the group takes ownership of
    /// each report fd (the read end of the child's report pipe). On an error every one of
    /// them is killed and reaped.
    fn adopt_all(
        &self,
        py: Python<'_>,
        children: Vec<Bound<'_, ForkedChild>>,
    ) -> PyResult<Vec<usize>> {
        let children = children
            .iter()
            .map(|child| child.get())
            .map(|child| Adoption::forked(child.pid, child.report_fd.map(Fd::take)))
            .collect();
        py.allow_threads(|| self.inner.adopt_all(children))
            .map_err(core_error)
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn pid(&self, index: usize) -> PyResult<i32> {
        self.inner.pid(index).ok_or_else(|| no_member(index))
    }

    fn pids(&self) -> Vec<i32> {
        (0..self.inner.len())
            .filter_map(|i| self.inner.pid(i))
            .collect()
    }

    /// The pidfd of a member: readable once it has exited, open while the group lives.
    fn sentinel(&self, index: usize) -> PyResult<i32> {
        self.inner
            .with_member(index, |m| m.sentinel())
            .ok_or_else(|| no_member(index))
    }

    /// None while the member runs; then how it ended.
    fn exit(&self, index: usize) -> PyResult<Option<ExitStatus>> {
        if index >= self.inner.len() {
            return Err(no_member(index));
        }
        Ok(self.inner.exit(index).map(ExitStatus::new))
    }

    /// The member that failed first in time, if any.
    fn first_failure(&self) -> Option<usize> {
        self.inner.first_failure()
    }

    /// Everything the member wrote to its report pipe so far (up to the report limit).
    fn report<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        self.inner
            .with_member(index, |m| PyBytes::new(py, m.report()))
            .ok_or_else(|| no_member(index))
    }

    /// Sends `signal` to the member's process group; false if it had already exited.
    fn signal(&self, index: usize, signal: i32) -> PyResult<bool> {
        self.inner.signal(index, signal).map_err(os_error)
    }

    /// Waits (without the GIL) until `until` holds for the members in `which` (all when
    /// None). A negative `timeout` polls once; None, inf or a huge one waits for ever; NaN
    /// is a ValueError. Returns False on timeout. Python signal handlers run meanwhile, so
    /// Ctrl-C raises KeyboardInterrupt here.
    #[pyo3(signature = (which=None, until=WaitFor::All, timeout=None))]
    fn wait(
        &self,
        py: Python<'_>,
        which: Option<Vec<usize>>,
        until: WaitFor,
        timeout: Option<Timeout>,
    ) -> PyResult<bool> {
        let until = until.into();
        let group = &self.inner;
        let held = wait::until(py, Timeout::of(timeout), |slice| {
            Ok(group
                .wait(which.as_deref(), until, Some(slice))
                .then_some(()))
        })?;
        Ok(held.is_some())
    }

    /// Stops every running member: `signal` (SIGTERM) to its process group after any report
    /// in progress is written, `grace` seconds, then SIGKILL; returns once all are reaped.
    /// With `then`, the members still running its `after` seconds after `signal` get its
    /// signal too. `on_signal(signal, count)` is called for each
    /// signal sent after the first (SIGKILL included), with the number of members it went
    /// to. Ctrl-C meanwhile sends SIGKILL at once, then raises KeyboardInterrupt.
    #[pyo3(signature = (grace, signal=libc::SIGTERM, then=None, on_signal=None))]
    fn terminate(
        &self,
        py: Python<'_>,
        grace: Timeout,
        signal: i32,
        then: Option<Bound<'_, Escalation>>,
        on_signal: Option<PyObject>,
    ) -> PyResult<()> {
        let grace = grace.or_max();
        let then = then.map(|then| tether_core::Escalation {
            signal: then.get().signal,
            after: then.get().wait.or_max(),
        });
        let mut error = None;
        let mut told = None;
        py.allow_threads(|| {
            let mut check = || wait::interrupted(&mut error);
            let mut sent = |signal: i32, count: usize| {
                if let Some(callback) = &on_signal {
                    Python::with_gil(|py| {
                        if let Err(err) = callback.call1(py, (signal, count)) {
                            told.get_or_insert(err);
                        }
                    });
                }
            };
            self.inner
                .terminate_escalating(signal, then, grace, &mut check, &mut sent)
        });
        error.or(told).map_or(Ok(()), Err)
    }
}

fn no_member(index: usize) -> PyErr {
    PyIndexError::new_err(format!("no process with index {index}"))
}
