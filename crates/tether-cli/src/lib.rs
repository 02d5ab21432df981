//! `tether`'s command line as a library: the `tether` binary and the Python package (the
//! `tether` console script and `python -m tether`, through `tether._native.cli_main`) run
//! the same [`main`], so a wheel needs no separate executable.
//!
//! `tether run` starts N ranks of a Python script, a module or any command with torchrun's
//! command line and environment, prints their output line by line with a rank prefix, stops
//! them all on the first failure and reports it, and leaves no orphan. Two processes do
//! it: the keeper ([`keeper`], the process that called [`main`]) and the supervisor it
//! forks ([`run`]), which starts and watches the ranks. `tether ps` ([`ps`]) lists what
//! tether runs for this user, `tether stacks PID` ([`stacks`]) asks a `tether run`
//! for every rank's stack, and `tether top PID` ([`top`]) shows its ranks live.

mod args;
mod clock;
mod config;
mod keeper;
mod output;
mod procs;
mod ps;
mod reaper;
mod run;
mod signalfd;
mod signals;
mod slurm;
mod stacks;
mod top;
mod watch;

use std::ffi::OsString;
use std::path::PathBuf;

use crate::args::Parsed;
use crate::config::Context;
use crate::slurm::SlurmJob;

/// What the program that embeds the command line brings to it.
#[derive(Debug, Clone, Default)]
pub struct Host {
    /// The Python interpreter that runs scripts (`sys.executable` of the Python package);
    /// `$PYTHON_EXEC` overrides it, and `python3` stands in when there is none.
    pub python: Option<OsString>,
    /// Subcommands the host implements itself, `(name, one-line summary)`, for the help.
    pub commands: Vec<(String, String)>,
}

/// The environment of this process, as the resolution of options reads it.
fn context(host_python: Option<OsString>) -> Context {
    let var = |key: &str| std::env::var(key).ok();
    let python = var("PYTHON_EXEC")
        .filter(|p| !p.is_empty())
        .map(OsString::from)
        .or(host_python)
        .unwrap_or_else(|| "python3".into());
    Context {
        slurm: SlurmJob::from_env(var),
        python,
        var: Box::new(var),
        dev: PathBuf::from("/dev"),
    }
}

/// Runs the command line `argv` (program name first) and returns the exit status. The
/// calling process must have a single thread: `tether run` forks its supervisor from it.
pub fn main(argv: Vec<OsString>, host: Host) -> i32 {
    let parsed = match args::parse(argv, &host.commands) {
        Ok(parsed) => parsed,
        Err(err) => {
            let _ = err.print();
            return err.exit_code();
        }
    };
    let run_args = match parsed {
        Parsed::Run(run_args) => run_args,
        Parsed::Ps(args) => return ps::main(&args),
        Parsed::Stacks(args) => return stacks::main(&args),
        Parsed::Top(args) => return top::main(&args),
        Parsed::Hosted(name) => {
            output::message(&format!("tether: `{name}` is run by the Python package"));
            return 2;
        }
    };
    let threads = tether_core::proc::threads();
    if threads > 1 {
        output::message(&format!(
            "tether: `tether run` must start in a process with one thread (this one has \
             {threads}); run it as its own command"
        ));
        return 1;
    }
    clock::init();
    match config::resolve(*run_args, &context(host.python)) {
        Ok(cfg) => keeper::run(cfg),
        Err(err) => {
            let _ = err.print();
            err.exit_code()
        }
    }
}
