//! The supervisor process, forked by the keeper ([`crate::keeper`]): its title, its own
//! process group, a child subreaper, its signalfd, the vigil over the keeper, its private
//! and log directories; then it launches the run ([`super::launch`]) and ends with its exit
//! status.

use std::path::{Path, PathBuf};

use super::abandon::{self, stop_launching};
use super::error::{io_err, RunError};
use super::temp::make_temp_dir;
use crate::config::Config;
use crate::output;
use crate::signals;

/// The supervisor's name in `/proc/PID/comm` (the kernel keeps its first 15 bytes,
/// `tether-supervis`, as it keeps `systemd-journal` of `systemd-journald`).
pub const SUPERVISOR_COMM: &str = "tether-supervisor";

/// The supervisor process, forked by the keeper (`keeper`'s pid): runs every round and
/// ends the process with the launcher's exit status. It never returns into the code it was
/// forked from, not even on a panic.
pub fn supervisor_main(cfg: Config, tmp: PathBuf, keeper: i32) -> ! {
    let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        supervisor(cfg, tmp, keeper)
    }))
    .unwrap_or(1);
    // The keeper died: the thread that kills what is left ends the process when it is done.
    while abandon::abandoned() {
        std::thread::park();
    }
    // SAFETY: ends this process without running the keeper's exit handlers or destructors,
    // which belong to the process it was forked from.
    unsafe { libc::_exit(code) }
}

fn supervisor(cfg: Config, tmp: PathBuf, keeper: i32) -> i32 {
    // Before any thread starts: the title may move the environment strings. Without it, the
    // supervisor would show the keeper's command line and name, as a copy of it.
    let title = format!(
        "tether supervisor of run {} (keeper {keeper}, {} rank(s))",
        cfg.run_id, cfg.nproc
    );
    if let Err(err) = tether_core::title::set(&title, SUPERVISOR_COMM) {
        log::info!(target: "tether::run", "cannot set the supervisor's title: {err}");
    }
    // SAFETY: setpgid on this process (a signal to the keeper's group must not reach it),
    // and SIGTTOU ignored: out of the terminal's foreground group, it still writes to the
    // terminal when `stty tostop` is set, instead of being stopped.
    unsafe {
        libc::setpgid(0, 0);
        libc::signal(libc::SIGTTOU, libc::SIG_IGN);
    }
    let Some(signals) = signals::set_up(&signals::handled(&cfg), "them") else {
        return 1;
    };
    if let Err(err) = abandon::keep_vigil(keeper, tmp.clone()) {
        output::message(&format!(
            "tether: warning: cannot follow the launcher ({}{}); if it is killed with SIGKILL, \
             what the ranks started may outlive it",
            tether_core::strerror(&err),
            tether_core::limit_hint(&err)
        ));
    }
    for note in &cfg.notes {
        output::message(note);
    }
    let logs = match create_private_dir(&tmp).and_then(|()| run_log_dir(&cfg)) {
        Ok(dir) => dir,
        Err(err) => {
            output::message(&format!("tether: {err}"));
            return 1;
        }
    };
    // tether.share's key form: the job's copies live as long as the job, not only as long
    // as the ranks that hold them (a thread, started with the handled signals blocked).
    let _copies = tether_core::share::Vault::start(super::env::job_id());
    super::launch(cfg, signals, tmp, logs)
}

/// Creates the supervisor's private directory `tmp` (mode 0700; it must not exist yet).
fn create_private_dir(tmp: &Path) -> Result<(), RunError> {
    use std::os::unix::fs::DirBuilderExt;
    let _launching = stop_launching();
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(tmp)
        .map_err(io_err(format!("cannot create {}", tmp.display())))
}

/// The run's log directory (`<log dir>/<run id>`), created and announced; `None` when the
/// output goes to the console only.
fn run_log_dir(cfg: &Config) -> Result<Option<PathBuf>, RunError> {
    let base = match (&cfg.output.log_dir, cfg.output.auto_log_dir) {
        (Some(dir), _) => dir.clone(),
        (None, true) => {
            make_temp_dir("tether-logs-").map_err(io_err("cannot create a log directory"))?
        }
        (None, false) => return Ok(None),
    };
    let dir = base.join(&cfg.log_name);
    std::fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    output::message(&format!(
        "tether: logs of run {} in {}",
        cfg.run_id,
        dir.display()
    ));
    Ok(Some(dir))
}
