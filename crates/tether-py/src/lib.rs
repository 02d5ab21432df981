//! `tether._native`: thin glue between Python and tether-core. It converts types and
//! releases the GIL around every wait; the Python semantics live in `python/tether`.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::os_error;

mod channel;
mod cli;
mod convert;
mod error;
mod group;
mod plain;
mod share;
mod signatures;
mod stacks;
mod wait;
mod workers;
mod zygote;

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

/// The bytes of this process's command line as it was started (`/proc/self/cmdline`: each
/// argument followed by a NUL), while no title was set.
#[pyfunction]
fn command_line(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let bytes = tether_core::title::arguments().map_err(os_error)?;
    Ok(PyBytes::new(py, &bytes))
}

/// Makes this process show `arguments` as its command line (as `command_line` returned
/// them), `environment` as its environment (`/proc/self/environ`, as far as its area
/// holds) and `comm` as its name. Call it while the process has a single thread.
#[pyfunction]
fn show_command_line(
    arguments: &[u8],
    environment: Vec<(Vec<u8>, Vec<u8>)>,
    comm: &str,
) -> PyResult<()> {
    tether_core::title::show(arguments, &environment, comm).map_err(os_error)
}

/// Makes `signal` this process's parent-death signal; exits at once (status 111) when its
/// parent is no longer `parent_pid` (it died before the signal was armed).
#[pyfunction]
fn die_with_parent(signal: i32, parent_pid: i32) -> PyResult<()> {
    tether_core::launch::die_with_parent(signal, parent_pid).map_err(os_error)
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

/// A failure report read back.
#[pyclass(module = "tether._native", frozen, get_all)]
struct Report {
    /// The exception's type name.
    type_name: String,
    /// Its traceback text.
    text: Py<PyBytes>,
    /// The pickled exception, or None.
    pickled: Option<Py<PyBytes>>,
    /// How many bytes of the report never arrived (cut at the limit, or never written).
    missing: u64,
}

/// A report read back, or None when not even the type name arrived.
#[pyfunction]
fn decode_report(py: Python<'_>, data: &[u8]) -> Option<Report> {
    tether_core::report::decode(data).map(|d| Report {
        type_name: d.type_name,
        text: PyBytes::new(py, &d.text).unbind(),
        pickled: d.pickled.map(|p| PyBytes::new(py, &p).unbind()),
        missing: d.missing,
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    tether_core::logging::init_from_env();
    m.add_class::<group::Group>()?;
    m.add_class::<group::ExitStatus>()?;
    m.add_class::<group::Spec>()?;
    m.add_class::<group::ForkedChild>()?;
    m.add_class::<group::Escalation>()?;
    m.add_class::<group::Member>()?;
    m.add_class::<zygote::SharedFd>()?;
    m.add_class::<zygote::Zygote>()?;
    m.add_class::<zygote::Job>()?;
    m.add_class::<zygote::ZygoteFailure>()?;
    m.add_class::<zygote::ZygoteFailureKind>()?;
    m.add_class::<convert::WaitFor>()?;
    m.add_class::<Report>()?;
    channel::register(m)?;
    error::register(m)?;
    m.add("REPORT_LIMIT", tether_core::report::REPORT_LIMIT)?;
    m.add("MAX_BLANKS", tether_core::zygote::MAX_BLANKS)?;
    m.add("ZYGOTE_FDS_ENV", tether_core::zygote::FDS_ENV)?;
    m.add("ZYGOTE_COMM", tether_core::zygote::ZYGOTE_COMM)?;
    cli::register(m)?;
    share::register(m)?;
    stacks::register(m)?;
    workers::register(m)?;
    plain::register(m)?;
    signatures::register(m)?;
    m.add_function(wrap_pyfunction!(setup_forked_child, m)?)?;
    m.add_function(wrap_pyfunction!(signal_name, m)?)?;
    m.add_function(wrap_pyfunction!(signal_hint, m)?)?;
    m.add_function(wrap_pyfunction!(encode_report, m)?)?;
    m.add_function(wrap_pyfunction!(limit_hint, m)?)?;
    m.add_function(wrap_pyfunction!(set_title, m)?)?;
    m.add_function(wrap_pyfunction!(command_line, m)?)?;
    m.add_function(wrap_pyfunction!(show_command_line, m)?)?;
    m.add_function(wrap_pyfunction!(die_with_parent, m)?)?;
    m.add_function(wrap_pyfunction!(decode_report, m)?)?;
    m.add_function(wrap_pyfunction!(zygote::zygote_serve, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
