//! The `tether` command line inside the extension module, so that a wheel needs no
//! separate executable: the console script and `python -m tether` call [`cli_main`].

use std::ffi::OsString;

use pyo3::prelude::*;

/// Runs the `tether` command line `argv` (program name first) in this process and returns
/// its exit status. `python` runs the ranks' scripts (`sys.executable`); `commands` are the
/// subcommands the Python package implements, `(name, summary)`, listed in the help.
/// `tether run` forks its supervisor from this process, which must have a single thread.
#[pyfunction]
#[pyo3(signature = (argv, python=None, commands=Vec::new()))]
fn cli_main(
    py: Python<'_>,
    argv: Vec<OsString>,
    python: Option<OsString>,
    commands: Vec<(String, String)>,
) -> i32 {
    let host = tether_cli::Host { python, commands };
    py.allow_threads(move || tether_cli::main(argv, host))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli_main, m)?)
}
