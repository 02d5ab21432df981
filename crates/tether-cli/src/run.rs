//! The supervisor process and its attempt loop. Each attempt launches every local rank,
//! pumps their output, waits for exits and signals, stops the rest on the first failure,
//! and kills whatever the ranks left behind; a failure with restarts left starts the next
//! attempt.

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use tether_core::{limit_hint, signal_name, strerror, Group, LaunchSpec, WaitFor};

use crate::clock;
use crate::config::Config;
use crate::hangs::{self, Limit, Watchdog};
use crate::output::{self, FilterSink, SharedTail};
use crate::reaper;
use crate::rendezvous::Helper;
use crate::report::{oom_kills, Failure};
use crate::signals::SignalFd;
use crate::zygote::NodeZygote;

mod abandon;
mod conclude;
mod rounds;
mod supervise;
mod warm;
mod wire;

use abandon::stop_launching;

/// How long the supervisor waits for output pipes to drain once every rank has exited, and
/// after which it says which leftovers are slow to die (it waits for them all the same).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start {program:?}: {}{}", strerror(source), limit_hint(source))]
    Start { program: String, source: io::Error },
    #[error("{what}: {}{}", strerror(source), limit_hint(source))]
    Io { what: String, source: io::Error },
    #[error(transparent)]
    Core(#[from] tether_core::Error),
}

impl RunError {
    /// The launcher's exit status for this error: 127 for a command that does not exist,
    /// 126 for one that cannot be run, 1 otherwise (a shell's convention).
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Start { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => 127,
                _ => 126,
            },
            _ => 1,
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}

/// The temporary directory, chosen once as Python's `tempfile` chooses it (torchrun's
/// choice): the first of `$TMPDIR`, `$TEMP`, `$TMP`, `/tmp`, `/var/tmp`, `/usr/tmp` and the
/// working directory in which a file can be created, so that a `TMPDIR` that is missing, a
/// file or unwritable falls back instead of stopping the run.
pub fn temp_dir() -> io::Result<PathBuf> {
    static CHOSEN: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    CHOSEN
        .get_or_init(choose_temp_dir)
        .clone()
        .map_err(|tried| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no usable temporary directory found in {tried}"),
            )
        })
}

fn choose_temp_dir() -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = ["TMPDIR", "TEMP", "TMP"]
        .into_iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .collect();
    candidates.extend(["/tmp", "/var/tmp", "/usr/tmp"].map(PathBuf::from));
    candidates.extend(std::env::current_dir().ok());
    for dir in &candidates {
        if can_create_in(dir) {
            return Ok(dir.clone());
        }
    }
    Err(format!("{candidates:?}"))
}

/// Whether a file can be created (and written) in `dir`: an unnamed file (O_TMPFILE), which
/// leaves nothing behind even if the launcher is killed at that moment; where the file
/// system has no unnamed files, a named one, removed again.
fn can_create_in(dir: &Path) -> bool {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let unnamed = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir);
    match unnamed {
        Ok(mut file) => return file.write_all(b"tether").is_ok(),
        Err(err) if !matches!(err.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
            return false
        }
        Err(_) => {}
    }
    let probe = dir.join(format!(".tether-probe-{}", crate::config::random_id()));
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&probe);
    match made {
        Ok(mut file) => {
            let written = file.write_all(b"tether").is_ok();
            let _ = std::fs::remove_file(&probe);
            written
        }
        Err(_) => false,
    }
}

/// A new directory (mode 0700) under the temporary directory, `prefix` then six random
/// characters.
fn make_temp_dir(prefix: &str) -> io::Result<PathBuf> {
    let template = temp_dir()?.join(format!("{prefix}XXXXXX"));
    let template = CString::new(template.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut bytes = template.into_bytes_with_nul();
    // SAFETY: `bytes` is a NUL-terminated template that mkdtemp rewrites in place.
    if unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) }.is_null() {
        return Err(io::Error::last_os_error());
    }
    bytes.pop();
    Ok(PathBuf::from(
        <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes),
    ))
}

/// The supervisor's private directory (error files): named by the keeper, created by the
/// supervisor, and removed with everything in it on drop (by the keeper once the supervisor
/// has ended, or by a supervisor whose keeper died). Naming it before the fork and making it
/// after leaves no moment at which a SIGKILL of either process would leave it behind.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new name under the temporary directory ([`temp_dir`]); nothing is created yet.
    pub fn name(prefix: &str) -> io::Result<TempDir> {
        let name = format!("{prefix}{}", crate::config::random_id());
        Ok(TempDir {
            path: temp_dir()?.join(name),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
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

/// The supervisor process, forked by the keeper (`keeper`'s pid): runs every attempt and
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

/// The supervisor's name in `/proc/PID/comm` (the kernel keeps its first 15 bytes,
/// `tether-supervis`, as it keeps `systemd-journal` of `systemd-journald`).
pub const SUPERVISOR_COMM: &str = "tether-supervisor";

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
    if let Err(err) = reaper::become_subreaper() {
        output::message(&format!(
            "tether: warning: cannot become a child subreaper ({err}); processes that ranks \
             leave behind may outlive them"
        ));
    }
    let mut handled = cfg.stop_signals.clone();
    handled.push(libc::SIGCHLD);
    handled.extend(hangs::stack_signals(&cfg));
    let signals = match SignalFd::new(&handled) {
        Ok(fd) => fd,
        Err(err) => {
            output::message(&format!(
                "tether: cannot create a signalfd: {}{}",
                tether_core::strerror(&err),
                tether_core::limit_hint(&err)
            ));
            return 1;
        }
    };
    if let Err(err) = abandon::watch(keeper, tmp.clone()) {
        output::message(&format!(
            "tether: warning: cannot watch the launcher ({}{}); if it is killed with SIGKILL, \
             what the ranks started may outlive it",
            strerror(&err),
            limit_hint(&err)
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
    let _copies = tether_core::share::Vault::start(crate::env::job_id());
    Launcher::new(cfg, signals, tmp, logs).run()
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

/// How an attempt ended.
enum AttemptEnd {
    Success,
    Failed(Box<Failure>),
    /// The launcher got this signal and stopped the ranks.
    Interrupted(i32),
    /// The run went past `--timeout` or `--stall-timeout`; the ranks were stopped.
    TimedOut(Limit),
    /// The rendezvous moved on (nodes waiting to join, a node gone); the ranks were stopped.
    Membership(String),
    /// Another node ended the job; its root cause.
    Ended(serde_json::Value),
    /// The job moved on while this node was away: what happened, and the root cause if the
    /// job ended.
    Away(String, serde_json::Value),
}

/// Why the launcher stopped the ranks of an attempt itself.
enum Stop {
    Signal(i32),
    Limit(Limit),
    Membership(String),
    Ended(serde_json::Value),
    Away(String, serde_json::Value),
}

/// The pipes and files of one rank, ready for its launch.
struct Wired {
    spec: LaunchSpec,
    write_ends: Vec<OwnedFd>,
    pumps: usize,
    tail: SharedTail,
    /// Whether the tail holds both streams (one pipe).
    merged: bool,
    error_file: PathBuf,
}

/// The duplicate-filter files of an attempt.
#[derive(Default)]
struct Sinks {
    stdout: Option<FilterSink>,
    stderr: Option<FilterSink>,
}

pub struct Launcher {
    cfg: Config,
    signals: SignalFd,
    tmp: PathBuf,
    logs: Option<PathBuf>,
    omp_unset: bool,
    one_console: bool,
    hostname: String,
    watchdog: Watchdog,
    /// The signals that ask for the ranks' stacks.
    stack_signals: Vec<i32>,
    /// A stop signal read while waiting for an attempt's leftovers to die.
    stop_pending: std::cell::Cell<Option<i32>>,
    /// The rendezvous helper of a dynamic run, and the round the ranks run in.
    helper: Option<Helper>,
    round: u64,
    /// The node's zygote, while the ranks are warm and it serves.
    zygote: Option<NodeZygote>,
}

impl Launcher {
    /// `tmp` holds the ranks' error files; `logs` is the run's log directory.
    fn new(cfg: Config, signals: SignalFd, tmp: PathBuf, logs: Option<PathBuf>) -> Launcher {
        Launcher {
            omp_unset: std::env::var_os("OMP_NUM_THREADS").is_none(),
            one_console: output::console_is_one_file(),
            hostname: hostname(),
            watchdog: Watchdog::new(&cfg),
            stack_signals: hangs::stack_signals(&cfg),
            stop_pending: std::cell::Cell::new(None),
            helper: None,
            round: 0,
            zygote: None,
            cfg,
            signals,
            tmp,
            logs,
        }
    }

    /// Runs every attempt; returns the launcher's exit status.
    fn run(&mut self) -> i32 {
        self.start_zygote();
        let code = if self.cfg.rendezvous.is_some() {
            self.run_rounds()
        } else {
            self.run_attempts()
        };
        self.close_zygote();
        code
    }

    /// Every attempt of a fixed membership; returns the launcher's exit status.
    fn run_attempts(&mut self) -> i32 {
        if let Err(sig) = self.await_zygote() {
            return 128 + sig;
        }
        let max = self.cfg.max_restarts;
        for attempt in 0..=max {
            if let Some(sig) = self.pending_stop_signal() {
                output::message(&format!("tether: got {}; not restarting", signal_name(sig)));
                return 128 + sig;
            }
            match self.attempt(attempt) {
                // Only a rendezvous (`run_rounds`) moves on or ends the job from elsewhere.
                Ok(
                    AttemptEnd::Success
                    | AttemptEnd::Membership(_)
                    | AttemptEnd::Ended(_)
                    | AttemptEnd::Away(..),
                ) => return 0,
                Ok(AttemptEnd::Interrupted(sig)) => return 128 + sig,
                Ok(AttemptEnd::TimedOut(limit)) => {
                    output::message(&format!(
                        "tether: every rank was stopped: {}; exit status {}",
                        limit.describe(),
                        hangs::TIMED_OUT
                    ));
                    return hangs::TIMED_OUT;
                }
                Ok(AttemptEnd::Failed(failure)) if attempt < max => {
                    output::message(&format!(
                        "tether: attempt {attempt} failed at {}: rank {} (pid {}) ended with \
                         {}; restarting all {} ranks (restart {} of {max})",
                        clock::local_iso(failure.ended_at),
                        failure.root.rank,
                        failure.root.pid,
                        failure.root.status,
                        self.cfg.nproc,
                        attempt + 1,
                    ));
                }
                Ok(AttemptEnd::Failed(failure)) => {
                    output::message(&failure.render());
                    return failure.root.status.as_shell_code();
                }
                Err(err) => {
                    output::message(&format!("tether: {err}"));
                    return err.exit_code();
                }
            }
        }
        1
    }

    /// A stop signal that arrived while no rank ran (between attempts); SIGCHLDs on the way
    /// reap orphans.
    fn pending_stop_signal(&self) -> Option<i32> {
        if let Some(sig) = self.stop_pending.take() {
            return Some(sig);
        }
        while let Some(sig) = self.signals.next() {
            if sig == libc::SIGCHLD {
                reaper::reap_orphans(&self.own_pids());
            } else if !self.stack_signals.contains(&sig) {
                return Some(sig);
            }
        }
        None
    }

    /// The pids of running ranks, which only tether-core may reap, and [`Self::own_pids`].
    fn live_pids(&self, group: &Group) -> HashSet<i32> {
        (0..group.len())
            .filter(|&i| group.exit(i).is_none())
            .filter_map(|i| group.pid(i))
            .chain(self.own_pids())
            .collect()
    }

    /// The launcher's own processes beside the ranks (the rendezvous helper, the zygote and
    /// the children it keeps forked ahead), which are neither leftovers nor for anyone else
    /// to reap.
    fn own_pids(&self) -> HashSet<i32> {
        self.helper_pid()
            .into_iter()
            .chain(self.zygote_pids())
            .collect()
    }

    fn helper_pid(&self) -> Option<i32> {
        self.helper.as_ref().map(Helper::pid)
    }

    fn attempt(&mut self, attempt: u32) -> Result<AttemptEnd, RunError> {
        let launching = stop_launching();
        let n = self.cfg.nproc;
        let logs = self
            .logs
            .as_ref()
            .map(|d| d.join(format!("attempt_{attempt}")));
        let sinks = self.sinks(logs.as_deref())?;
        let (done_tx, done_rx) = mpsc::channel();
        let mut wired = Vec::with_capacity(n);
        for local in 0..n {
            wired.push(self.wire(local, attempt, logs.as_deref(), &sinks, &done_tx)?);
        }
        drop(done_tx);
        let pumps = wired.iter().map(|w| w.pumps).sum();
        let specs = wired
            .iter_mut()
            .map(|w| std::mem::take(&mut w.spec))
            .collect();
        let oom_before = oom_kills();
        self.watchdog.restart();
        let group = Group::new();
        output::pty::attach(&group);
        let launched = self.start_ranks(&group, specs);
        // The ranks hold their own copies now; the pumps see EOF once the ranks (and what
        // they started) are gone.
        wired.iter_mut().for_each(|w| w.write_ends.clear());
        drop(launching);
        if let Err(err) = launched {
            kill_all(&group);
            self.cleanup(&group, &done_rx, pumps);
            return Err(start_error(err));
        }
        log::info!(
            target: "tether::run",
            "attempt {attempt}: started {n} rank(s), pids {:?}",
            (0..group.len()).filter_map(|i| group.pid(i)).collect::<Vec<_>>()
        );
        let record = |me: &Launcher, g: &Group| me.record(g, attempt, &wired, oom_before, &logs);
        let supervised = self.supervise(&group, &record);
        if supervised.is_err() {
            kill_all(&group);
        }
        let oom = oom_before.zip(oom_kills());
        self.cleanup(&group, &done_rx, pumps);
        let (stop_mono, stopped) = supervised?;
        match stopped {
            Some(Stop::Signal(sig)) => return Ok(AttemptEnd::Interrupted(sig)),
            Some(Stop::Limit(limit)) => return Ok(AttemptEnd::TimedOut(limit)),
            Some(Stop::Membership(why)) => return Ok(AttemptEnd::Membership(why)),
            Some(Stop::Ended(cause)) => return Ok(AttemptEnd::Ended(cause)),
            Some(Stop::Away(why, cause)) => return Ok(AttemptEnd::Away(why, cause)),
            None => {}
        }
        Ok(self.conclude(&group, attempt, stop_mono, &wired, oom, logs))
    }
}

/// What a failed start of the ranks reports: the program that could not start, or the
/// core's error.
fn start_error(err: tether_core::Error) -> RunError {
    match err {
        tether_core::Error::Launch { program, source } => RunError::Start { program, source },
        other => RunError::Core(other),
    }
}

/// SIGKILL to every rank, and a bounded wait for their exits.
fn kill_all(group: &Group) {
    group.signal_all(libc::SIGKILL);
    group.wait(None, WaitFor::AllExited, Some(DRAIN_LIMIT));
}

/// This machine's name, for the `${hostname}` of prefix templates.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into `buf`.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "localhost".to_string();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}
