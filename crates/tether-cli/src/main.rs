//! `tether`: the command-line face of tether. `tether run` starts N ranks of any command
//! with torchrun's environment, prints their output line by line with a `[rank N]: `
//! prefix, stops them all on the first failure and reports it, and leaves no orphan.

mod args;
mod env;
mod output;
mod reaper;
mod report;
mod run;
mod signals;
mod slurm;

use crate::reaper::Watchdog;
use crate::run::{Launcher, TempDir};
use crate::signals::SignalFd;
use crate::slurm::SlurmJob;

fn main() {
    // First of all, while this is the only thread: every thread started later (tether-core's
    // supervisor, the output pumps) inherits this mask, so the signals reach only the
    // signalfd.
    if let Err(err) = signals::block() {
        output::message(&format!("tether: cannot block signals: {err}"));
        std::process::exit(1);
    }
    let cli = args::parse();
    let args::Command::Run(run_args) = cli.command;
    let slurm = SlurmJob::from_env(|key| std::env::var(key).ok());
    let cfg = match args::resolve(run_args, slurm) {
        Ok(cfg) => cfg,
        Err(err) => err.exit(),
    };
    std::process::exit(run(cfg));
}

fn run(cfg: args::Config) -> i32 {
    let signals = match SignalFd::new() {
        Ok(fd) => fd,
        Err(err) => {
            output::message(&format!("tether: cannot create a signalfd: {err}"));
            return 1;
        }
    };
    if let Err(err) = reaper::become_subreaper() {
        output::message(&format!(
            "tether: warning: cannot become a child subreaper ({err}); processes that ranks \
             leave behind may outlive them"
        ));
    }
    let tmp = match TempDir::new("tether-run-") {
        Ok(dir) => dir,
        Err(err) => {
            output::message(&format!(
                "tether: cannot create a temporary directory: {err}"
            ));
            return 1;
        }
    };
    // Still single-threaded: the watchdog is forked here.
    let watchdog = match Watchdog::start(tmp.path()) {
        Ok(w) => Some(w),
        Err(err) => {
            output::message(&format!(
                "tether: warning: no watchdog ({err}); if tether is killed with SIGKILL, \
                 processes the ranks started may outlive it"
            ));
            None
        }
    };
    let mut launcher = Launcher::new(cfg, signals, watchdog, tmp);
    let code = launcher.run();
    launcher.finish();
    code
}
