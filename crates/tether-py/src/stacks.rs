//! Stacks on demand: the child's registration of its dump handler, and the parent's
//! requests (see `tether_core::stacks`).

use std::os::fd::RawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple, PyType};
use tether_core::stacks::{self as core_stacks, Request};

use crate::convert::{Fd, Timeout};
use crate::error::{core_error, os_error};
use crate::group::{Group, Member};

/// In a child: makes this process answer its parent's requests for its stacks through `fd`
/// (the sending end of the parent's stacks channel; when `inode` is given, that very
/// socket), moved to a private high fd number first; returns the fd it now has. Python's
/// own handler of the request signal dumps every thread from the main thread
/// ([`answer_request`]), and `faulthandler` dumps the main thread on the dump signal (see
/// `tether_core::stacks::handler`). A ValueError, with nothing changed, when `fd` is no
/// such channel.
///
/// It also guards the program's own calls (`signal.signal`, `faulthandler.register`) for
/// a handler of its own on tether's signals, which withdraws this process from requests,
/// and `signal.set_wakeup_fd`, whose fd Python's handler would write to.
#[pyfunction]
#[pyo3(signature = (fd, inode=None))]
fn install_stack_handler(py: Python<'_>, fd: RawFd, inode: Option<u64>) -> PyResult<RawFd> {
    let fd = core_stacks::handler::adopt(fd, inode)
        .map_err(|err| PyValueError::new_err(err.to_string()))?;
    let faulthandler = py.import("faulthandler")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("file", fd)?;
    kwargs.set_item("all_threads", false)?;
    kwargs.set_item("chain", false)?;
    original(&faulthandler.getattr("register")?)?
        .call((core_stacks::dump_signal(),), Some(&kwargs))?;
    core_stacks::handler::wrap(core_stacks::dump_signal()).map_err(os_error)?;
    let answer = wrap_pyfunction!(answer_request, py)?;
    // `_signal`, the C module: `signal` would import `enum`, milliseconds in a `tether
    // run` rank that registers at interpreter start.
    let signal_module = py.import("_signal")?;
    original(&signal_module.getattr("signal")?)?.call1((core_stacks::signal(), answer))?;
    core_stacks::handler::wrap_request(core_stacks::signal()).map_err(os_error)?;
    note_wakeup_fd(py, &signal_module);
    guard(py, &faulthandler, "register", Guarded::Handler)?;
    keep_on_import(py, &faulthandler)?;
    guard(py, &signal_module, "signal", Guarded::Handler)?;
    guard(py, &signal_module, "set_wakeup_fd", Guarded::Wakeup)?;
    if let Ok(module) = py.import("sys")?.getattr("modules")?.get_item("signal") {
        // `signal` copied `set_wakeup_fd` from `_signal` when it was imported.
        guard(py, &module, "set_wakeup_fd", Guarded::Wakeup)?;
    }
    Ok(fd)
}

/// What a [`SignalGuard`] stands guard over.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Guarded {
    /// A handler of the program's own for one of tether's signals.
    Handler,
    /// The interpreter's wakeup fd.
    Wakeup,
}

/// A function of `signal` or `faulthandler` as the program calls it, watched: it does what
/// the function does, having noted what tether must know (see [`install_stack_handler`]).
#[pyclass(module = "tether._native", frozen)]
struct SignalGuard {
    original: PyObject,
    guarded: Guarded,
}

#[pymethods]
impl SignalGuard {
    #[pyo3(signature = (*args, **kwargs))]
    fn __call__(
        &self,
        py: Python<'_>,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyObject> {
        let first: Option<i64> = args.get_item(0).ok().and_then(|a| a.extract().ok());
        let ours = [core_stacks::signal(), core_stacks::dump_signal()];
        if self.guarded == Guarded::Handler
            && first.is_some_and(|n| ours.iter().any(|&s| n == s as i64))
        {
            core_stacks::handler::withdraw();
        }
        let result = self.original.bind(py).call(args, kwargs)?;
        if let (Guarded::Wakeup, Some(fd)) = (self.guarded, first) {
            core_stacks::handler::set_wakeup_fd(fd.try_into().unwrap_or(-1));
        }
        Ok(result.unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.original.bind(py).repr()?.to_string())
    }

    #[getter]
    fn __wrapped__(&self, py: Python<'_>) -> PyObject {
        self.original.clone_ref(py)
    }

    #[getter]
    fn __doc__(&self, py: Python<'_>) -> PyResult<PyObject> {
        Ok(self.original.bind(py).getattr("__doc__")?.unbind())
    }
}

/// The function a guard stands over, or `function` itself.
fn original<'py>(function: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match function.downcast::<SignalGuard>() {
        Ok(guard) => Ok(guard.get().original.bind(function.py()).clone()),
        Err(_) => Ok(function.clone()),
    }
}

/// Puts a guard of `guarded` on `module.name` (once).
fn guard(py: Python<'_>, module: &Bound<'_, PyAny>, name: &str, guarded: Guarded) -> PyResult<()> {
    let function = module.getattr(name)?;
    if function.downcast::<SignalGuard>().is_ok() {
        return Ok(());
    }
    let guard = SignalGuard {
        original: function.unbind(),
        guarded,
    };
    module.setattr(name, Py::new(py, guard)?)
}

/// Whether [`keep_on_import`] added its audit hook in this process (or the one it was
/// forked from): the hook is never removed.
static KEEPING: AtomicBool = AtomicBool::new(false);

/// Makes a later `import` of `module` give this very module (whose functions are guarded),
/// even when it was taken out of `sys.modules`: a program's modules are python's own until it
/// imports them (see `_tether_stacks`), and a fresh `faulthandler` would bypass the guard.
fn keep_on_import(py: Python<'_>, module: &Bound<'_, PyModule>) -> PyResult<()> {
    if KEEPING.swap(true, Ordering::Relaxed) {
        return Ok(());
    }
    let keeper = ModuleKeeper {
        name: module.name()?.unbind(),
        module: module.clone().into_any().unbind(),
    };
    py.import("sys")?
        .call_method1("addaudithook", (Py::new(py, keeper)?,))?;
    Ok(())
}

/// An audit hook: on the `import` event of its module's name, which the interpreter raises
/// before the import system looks in `sys.modules`, it puts the module back there.
#[pyclass(module = "tether._native", frozen)]
struct ModuleKeeper {
    name: Py<PyString>,
    module: PyObject,
}

#[pymethods]
impl ModuleKeeper {
    fn __call__(
        &self,
        py: Python<'_>,
        event: &Bound<'_, PyString>,
        args: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // SAFETY: `event` is a live str (its type was checked), read under the GIL.
        let compared = unsafe {
            pyo3::ffi::PyUnicode_CompareWithASCIIString(event.as_ptr(), c"import".as_ptr())
        };
        if compared != 0 || !args.get_item(0)?.eq(self.name.bind(py))? {
            return Ok(());
        }
        let modules = py.import("sys")?.getattr("modules")?;
        modules.call_method1("setdefault", (self.name.bind(py), self.module.bind(py)))?;
        Ok(())
    }
}

/// Notes the wakeup fd the interpreter has now (a fork child keeps its parent's); only the
/// main thread can read it.
fn note_wakeup_fd(py: Python<'_>, signal_module: &Bound<'_, PyModule>) {
    let read = || -> PyResult<i32> {
        let set = original(&signal_module.getattr("set_wakeup_fd")?)?;
        let fd: i32 = set.call1((-1,))?.extract()?;
        if fd >= 0 {
            set.call1((fd,))?;
        }
        Ok(fd)
    };
    match read() {
        Ok(fd) => core_stacks::handler::set_wakeup_fd(fd),
        Err(err) => drop(err.value(py)),
    }
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
    core_stacks::handler::answer(id, || {
        let mut text = every_thread(py)
            .unwrap_or_else(|err| format!("(tether could not read the Python stacks: {err})\n"));
        text.push_str(&pool_workers(py));
        text.into_bytes()
    });
}

/// How long a process waits for the workers of its pools, answering a request.
const POOL_WORKERS_TIMEOUT: f64 = 1.0;

/// The stacks of the workers of this process's `tether.Pool`s, each under its header (see
/// [`core_stacks::relay`]): they answer to this process, not to whoever asked it. Nothing
/// when this process never used a pool (the module is never imported for it).
fn pool_workers(py: Python<'_>) -> String {
    let asked = || -> PyResult<Vec<(i32, String)>> {
        let modules = py.import("sys")?.getattr("modules")?;
        match modules.get_item("tether.pool.core") {
            Ok(core) => core
                .call_method1("worker_stacks", (POOL_WORKERS_TIMEOUT,))?
                .extract(),
            Err(_) => Ok(Vec::new()),
        }
    };
    match asked() {
        Ok(workers) => workers
            .iter()
            .map(|(pid, text)| core_stacks::relay::section(*pid, text))
            .collect(),
        Err(err) => format!("(tether could not ask this process's pool workers: {err})\n"),
    }
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

/// A stacks channel as a child finds it: the fd number of the end it writes to, and that
/// socket's inode (so that the child can tell the channel from another file under that
/// number). It pickles, to travel to a child.
#[pyclass(module = "tether._native", frozen, get_all)]
struct StacksChannel {
    fd: RawFd,
    inode: u64,
}

#[pymethods]
impl StacksChannel {
    #[new]
    fn new(fd: Fd, inode: u64) -> StacksChannel {
        StacksChannel {
            fd: fd.raw(),
            inode,
        }
    }

    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, PyType>, (RawFd, u64))> {
        let me = slf.get();
        Ok((slf.get_type(), (me.fd, me.inode)))
    }

    fn __repr__(&self) -> String {
        format!("StacksChannel(fd={}, inode={})", self.fd, self.inode)
    }
}

/// This process's stacks channel (the end its children write to).
#[pyfunction]
fn stacks_fd() -> PyResult<StacksChannel> {
    let (fd, inode) = core_stacks::channel_fd().map_err(core_error)?;
    Ok(StacksChannel { fd, inode })
}

/// A process's answer to a request for its stacks.
#[pyclass(module = "tether._native", frozen)]
struct StackAnswer {
    #[pyo3(get)]
    pid: i32,
    /// Whether it answered; when not, `text` says why.
    #[pyo3(get)]
    answered: bool,
    #[pyo3(get)]
    text: String,
    /// The answer itself, which the summary reads.
    answer: core_stacks::Answer,
}

/// Asks each of `targets` for its stacks at once and waits (without the GIL) up to
/// `timeout` seconds; with `py_spy`, its native view is added. Returns one answer per
/// target, in order; the text of one that did not answer says why.
#[pyfunction]
#[pyo3(signature = (targets, timeout, py_spy=None, dump_after=None))]
fn stacks(
    py: Python<'_>,
    targets: Vec<Bound<'_, Member>>,
    timeout: Timeout,
    py_spy: Option<PathBuf>,
    dump_after: Option<Timeout>,
) -> PyResult<Vec<StackAnswer>> {
    let timeout = timeout
        .duration()
        .unwrap_or(std::time::Duration::from_secs(1 << 30));
    let groups: Vec<(tether_core::Group, usize)> =
        targets.iter().map(|member| member.get().target()).collect();
    let mut request = Request::new(timeout, py_spy);
    if let Some(after) = dump_after.and_then(Timeout::duration) {
        request.dump_after = after;
    }
    let answers = py
        .allow_threads(|| {
            let members: Vec<(&tether_core::Group, usize)> =
                groups.iter().map(|(g, i)| (g, *i)).collect();
            core_stacks::ask(&members, &request)
        })
        .map_err(core_error)?;
    Ok(answers
        .iter()
        .map(|a| StackAnswer {
            pid: a.pid,
            answered: a.answered(),
            text: a.text(timeout),
            answer: a.clone(),
        })
        .collect())
}

/// The summary that ends a block of stacks (see `tether_core::stacks::summary`): the ranks
/// grouped by where their main thread is, and those not where most others are, named.
/// `ranks` gives each answer's rank, in order.
#[pyfunction]
fn stacks_summary(ranks: Vec<usize>, answers: Vec<PyRef<'_, StackAnswer>>) -> PyResult<String> {
    if ranks.len() != answers.len() {
        return Err(PyValueError::new_err(format!(
            "{} ranks for {} answers",
            ranks.len(),
            answers.len()
        )));
    }
    let pairs: Vec<(usize, &core_stacks::Answer)> = ranks
        .into_iter()
        .zip(answers.iter().map(|a| &a.answer))
        .collect();
    Ok(core_stacks::summary(&pairs))
}

/// Makes the members of `group` answer `tether top PID` (PID: this process) as ranks of
/// this process, listening for it from a thread of tether's own (see
/// `tether_core::stacks::served`).
#[pyfunction]
fn serve_top(group: &Bound<'_, Group>) -> PyResult<()> {
    core_stacks::served::serve(&group.get().inner).map_err(os_error)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STACKS_FD_ENV", core_stacks::FD_ENV)?;
    m.add("PY_SPY_ENV", core_stacks::PY_SPY_ENV)?;
    m.add_class::<SignalGuard>()?;
    m.add_class::<ModuleKeeper>()?;
    m.add_class::<StackAnswer>()?;
    m.add_class::<StacksChannel>()?;
    m.add_function(wrap_pyfunction!(install_stack_handler, m)?)?;
    m.add_function(wrap_pyfunction!(stacks_fd, m)?)?;
    m.add_function(wrap_pyfunction!(stacks, m)?)?;
    m.add_function(wrap_pyfunction!(stacks_summary, m)?)?;
    m.add_function(wrap_pyfunction!(serve_top, m)?)?;
    Ok(())
}
