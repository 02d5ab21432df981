//! Stacks on demand: the child's registration of its dump handler, and the parent's
//! requests (see `tether_core::stacks`).

use std::os::fd::RawFd;
use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tether_core::stacks::{self as core_stacks, Request};

use crate::group::Group;
use crate::{core_error, os_error, timeout_of};

/// In a child: registers `faulthandler` to dump every thread's stack to `fd` (the sending
/// end of the parent's stacks channel) on the stack signal, wrapped in the handler that
/// marks where each dump begins and ends. A ValueError when `fd` is no such channel.
#[pyfunction]
fn install_stack_handler(py: Python<'_>, fd: RawFd) -> PyResult<()> {
    if !core_stacks::handler::is_channel(fd) {
        return Err(PyValueError::new_err(format!(
            "fd {fd} is not a tether stacks channel"
        )));
    }
    let kwargs = PyDict::new(py);
    kwargs.set_item("file", fd)?;
    kwargs.set_item("all_threads", true)?;
    kwargs.set_item("chain", false)?;
    py.import("faulthandler")?
        .call_method("register", (core_stacks::signal(),), Some(&kwargs))?;
    core_stacks::handler::wrap(core_stacks::signal(), fd).map_err(os_error)
}

/// The fd number of this process's stacks channel (the end its children write to).
#[pyfunction]
fn stacks_fd() -> PyResult<RawFd> {
    core_stacks::channel_fd().map_err(core_error)
}

/// One answer: `(pid, answered, text)`.
type PyAnswer = (i32, bool, String);

/// Asks each `(group, index)` for its stacks at once and waits (without the GIL) up to
/// `timeout` seconds; with `py_spy`, its native view is added. Returns one
/// `(pid, answered, text)` per target, in order; the text of one that did not answer says
/// why.
#[pyfunction]
#[pyo3(signature = (targets, timeout, py_spy=None))]
fn stacks(
    py: Python<'_>,
    targets: Vec<(PyRef<'_, Group>, usize)>,
    timeout: f64,
    py_spy: Option<PathBuf>,
) -> PyResult<Vec<PyAnswer>> {
    let timeout = timeout_of(Some(timeout))?.unwrap_or(std::time::Duration::from_secs(1 << 30));
    let groups: Vec<(tether_core::Group, usize)> = targets
        .iter()
        .map(|(group, index)| (group.inner.clone(), *index))
        .collect();
    let request = Request { timeout, py_spy };
    let answers = py
        .allow_threads(|| {
            let members: Vec<(&tether_core::Group, usize)> =
                groups.iter().map(|(g, i)| (g, *i)).collect();
            core_stacks::ask(&members, &request)
        })
        .map_err(core_error)?;
    Ok(answers
        .iter()
        .map(|a| (a.pid, a.answered(), a.text(timeout)))
        .collect())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STACKS_SIGNAL", core_stacks::signal())?;
    m.add("STACKS_FD_ENV", core_stacks::FD_ENV)?;
    m.add("PY_SPY_ENV", core_stacks::PY_SPY_ENV)?;
    m.add_function(wrap_pyfunction!(install_stack_handler, m)?)?;
    m.add_function(wrap_pyfunction!(stacks_fd, m)?)?;
    m.add_function(wrap_pyfunction!(stacks, m)?)?;
    Ok(())
}
