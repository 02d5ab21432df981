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

/// In a child: makes this process answer its parent's requests for its stacks on `fd` (the
/// sending end of the parent's stacks channel): Python's own handler of the request signal
/// dumps every thread from the main thread ([`answer_request`]), and `faulthandler` does on
/// the dump signal (see `tether_core::stacks::handler`). A ValueError when `fd` is no such
/// channel.
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
    py.import("faulthandler")?.call_method(
        "register",
        (core_stacks::dump_signal(),),
        Some(&kwargs),
    )?;
    core_stacks::handler::wrap(core_stacks::dump_signal(), fd).map_err(os_error)?;
    let answer = wrap_pyfunction!(answer_request, py)?;
    // `_signal`, the C module: `signal` would import `enum`, milliseconds in a `tether
    // run` rank that registers at interpreter start.
    py.import("_signal")?
        .call_method1("signal", (core_stacks::signal(), answer))?;
    core_stacks::handler::wrap_request(core_stacks::signal(), fd).map_err(os_error)
}

/// Python's handler of the request signal (in the main thread, with the GIL): writes every
/// thread's stack, as `faulthandler` writes them, for the request waiting. It never raises:
/// an exception would surface in the program at the line the signal interrupted.
#[pyfunction]
#[pyo3(signature = (_signal, _frame))]
fn answer_request(py: Python<'_>, _signal: i32, _frame: PyObject) {
    let id = core_stacks::handler::take_request();
    if id == 0 {
        return;
    }
    let text = every_thread(py)
        .unwrap_or_else(|err| format!("(tether could not read the Python stacks: {err})\n"));
    core_stacks::handler::answer(id, text.as_bytes());
}

/// Most threads, and most frames of one thread, written (as `faulthandler` does).
const MAX_THREADS: usize = 100;
const MAX_FRAMES: usize = 100;

/// Every thread's Python stack, most recent call first, in `faulthandler`'s format.
fn every_thread(py: Python<'_>) -> PyResult<String> {
    use std::fmt::Write;
    let frames = py.import("sys")?.call_method0("_current_frames")?;
    let frames = frames.downcast::<PyDict>()?;
    let current: u64 = py.import("_thread")?.call_method0("get_ident")?.extract()?;
    let mut out = String::new();
    for (n, (ident, frame)) in frames.iter().enumerate() {
        if n == MAX_THREADS {
            out.push_str("...\n");
            break;
        }
        if n > 0 {
            out.push('\n');
        }
        let ident: u64 = ident.extract()?;
        let label = if ident == current {
            "Current thread"
        } else {
            "Thread"
        };
        let _ = writeln!(out, "{label} 0x{ident:016x} (most recent call first):");
        let mut frame = frame;
        let mut depth = 0;
        while !frame.is_none() {
            if depth == MAX_FRAMES {
                out.push_str("  ...\n");
                break;
            }
            let code = frame.getattr("f_code")?;
            let file = code.getattr("co_filename")?;
            let name = code.getattr("co_name")?;
            let line = frame.getattr("f_lineno")?;
            let line = if line.is_none() {
                "???".into()
            } else {
                line.to_string()
            };
            let _ = writeln!(out, "  File \"{file}\", line {line} in {name}");
            frame = frame.getattr("f_back")?;
            depth += 1;
        }
    }
    Ok(out)
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
    m.add("STACKS_DUMP_SIGNAL", core_stacks::dump_signal())?;
    m.add("STACKS_FD_ENV", core_stacks::FD_ENV)?;
    m.add("PY_SPY_ENV", core_stacks::PY_SPY_ENV)?;
    m.add_function(wrap_pyfunction!(install_stack_handler, m)?)?;
    m.add_function(wrap_pyfunction!(stacks_fd, m)?)?;
    m.add_function(wrap_pyfunction!(stacks, m)?)?;
    Ok(())
}
