//! What `tether run` does about hangs: every rank's stack on request (SIGUSR1, or the stack
//! signal that `tether stacks PID` sends), and the limits `--timeout` and `--stall-timeout`,
//! past which every rank's stack is shown before the ranks are stopped (exit status 124).
//!
//! The stacks come from tether-core ([`tether_core::stacks`]): a rank running tether's
//! Python registers its dump handler at start-up, and answers without being stopped; one
//! that cannot answer is named, with its pid and state, within the request's timeout. Every
//! block ends with tether-core's summary of where the ranks are (the rank not where the
//! others wait, named), and goes to whoever asked with `tether stacks` as well
//! ([`crate::stacks::reply`]). Under each rank's stack come the stacks of the processes it
//! started (its DataLoader workers: [`crate::stacks::workers`]), and the summary says when a
//! rank waits on them and where they are.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_core::stacks::{self, places::Since, Request};
use tether_core::{signal_name, Group};

use super::{reply, workers};
use crate::clock;
use crate::config::Config;
use crate::output::{self, touch, Activity, Prefix, Stream};

/// Where the launcher saw each rank, over every block of stacks it collected (asked by
/// `tether stacks`, `tether top`, SIGUSR1 or a limit): `tether top`'s seconds in a place.
static SEEN: Since = Since::new();

/// How long a request waits for the ranks' stacks.
pub const STACKS_TIMEOUT: Duration = Duration::from_secs(5);
/// The exit status of a run ended by a limit, as timeout(1) has it.
pub const TIMED_OUT: i32 = 124;

/// The signals that ask for the ranks' stacks: the stack signal always, SIGUSR1 unless
/// `--signals-to-handle` made it a stop signal.
pub fn stack_signals(cfg: &Config) -> Vec<i32> {
    let mut signals = vec![stacks::signal()];
    if !cfg.stop_signals.contains(&libc::SIGUSR1) {
        signals.push(libc::SIGUSR1);
    }
    signals
}

/// Which limit a run went past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Timeout(Duration),
    Stall(Duration),
}

impl Limit {
    pub fn describe(self) -> String {
        match self {
            Limit::Timeout(t) => format!("the run reached its --timeout of {}", secs(t)),
            Limit::Stall(t) => {
                format!("no rank printed anything for {} (--stall-timeout)", secs(t))
            }
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// The run's limits: `--timeout` from the launcher's start, `--stall-timeout` from the
/// last output of any rank (or the attempt's start).
pub struct Deadlines {
    deadline: Option<(Instant, Duration)>,
    stall: Option<Duration>,
    pub activity: Activity,
}

impl Deadlines {
    pub fn new(cfg: &Config) -> Deadlines {
        let activity = Activity::default();
        touch(&activity);
        Deadlines {
            deadline: cfg.timeout.map(|t| (Instant::now() + t, t)),
            stall: cfg.stall_timeout,
            activity,
        }
    }

    /// Starts the stall clock again (a new attempt).
    pub fn restart(&self) {
        touch(&self.activity);
    }

    /// How long until a limit could be reached (`None`: no limit).
    pub fn next_check(&self) -> Option<Duration> {
        let now = Instant::now();
        let timeout = self.deadline.map(|(d, _)| d.saturating_duration_since(now));
        let stall = self.stall.map(|s| s.saturating_sub(self.silent_for()));
        match (timeout, stall) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn silent_for(&self) -> Duration {
        let last = Duration::from_nanos(self.activity.load(Ordering::Relaxed));
        clock::monotonic().saturating_sub(last)
    }

    /// The limit the run has gone past, if any.
    pub fn passed(&self) -> Option<Limit> {
        if let Some((deadline, t)) = self.deadline {
            if Instant::now() >= deadline {
                return Some(Limit::Timeout(t));
            }
        }
        self.stall
            .filter(|&s| self.silent_for() >= s)
            .map(Limit::Stall)
    }
}

/// Whose stacks are printed, and how each rank's lines are prefixed.
#[derive(Clone)]
pub struct Ranks {
    pub group: Group,
    pub prefixes: Arc<Vec<Prefix>>,
}

/// Asks every rank for its stack and prints them all, rank by rank, each line with the
/// rank's prefix, in one block on the launcher's stderr: first `tether: {why}`, how many
/// answered, and `then`; last the summary of where the ranks are. Whoever asked with
/// `tether stacks` gets the block too.
pub fn print_stacks(ranks: &Ranks, why: &str, then: &str, py_spy: Option<PathBuf>) {
    let block = stacks_block(ranks, why, then, py_spy);
    if let Some(block) = &block {
        output::write_console(Stream::Stderr, &block.text);
    }
    reply(block.as_ref());
}

/// A block of stacks, the ranks (rank, pid) that did not answer, and where each rank is.
struct Block {
    text: Vec<u8>,
    silent: Vec<(usize, i32)>,
    places: Vec<reply::Place>,
}

/// Hands `block` (or why there is none) to those who asked with `tether stacks`.
fn reply(block: Option<&Block>) {
    match block {
        Some(block) => reply::answer(&reply::Reply::Stacks {
            block: &block.text,
            silent: &block.silent,
            places: &block.places,
        }),
        None => reply::answer(&reply::Reply::Error(
            "it cannot ask its ranks for their stacks (its stderr says why)",
        )),
    }
}

/// The block [`print_stacks`] prints, once every rank has answered or timed out; `None`
/// (said on stderr) when the ranks cannot be asked.
fn stacks_block(ranks: &Ranks, why: &str, then: &str, py_spy: Option<PathBuf>) -> Option<Block> {
    let request = Request::new(STACKS_TIMEOUT, py_spy);
    let started = Instant::now();
    let answers = match ranks.group.stacks(&request) {
        Ok(answers) => answers,
        Err(err) => {
            output::message(&format!(
                "tether: cannot ask the ranks for their stacks: {err}"
            ));
            return None;
        }
    };
    let (answers, workers) = workers::gather(answers, &request);
    let answered = answers.iter().filter(|a| a.answered()).count();
    let mut block = format!(
        "tether: {why}: the stack of every rank ({answered} of {} answered in {} ms){then}:\n",
        answers.len(),
        started.elapsed().as_millis()
    )
    .into_bytes();
    for ((answer, prefix), started) in answers.iter().zip(ranks.prefixes.iter()).zip(&workers) {
        let text = answer.text(request.timeout);
        let below = workers::lines(started, request.timeout);
        for line in text.lines().chain(below.iter().map(String::as_str)) {
            let prefix = prefix.text();
            match line.is_empty() {
                true => block.extend_from_slice(prefix.trim_ascii_end()),
                false => block.extend_from_slice(prefix),
            }
            block.extend_from_slice(line.as_bytes());
            block.push(b'\n');
        }
    }
    let by_rank: Vec<(usize, &stacks::Answer)> = ranks
        .prefixes
        .iter()
        .map(|prefix| prefix.rank)
        .zip(answers.iter())
        .collect();
    let summary = summary_with_workers(&by_rank, &workers);
    block.extend_from_slice(format!("tether: summary: {summary}\n").as_bytes());
    let silent = by_rank
        .iter()
        .filter(|(_, answer)| !answer.answered())
        .map(|&(rank, answer)| (rank, answer.pid))
        .collect();
    let places: Vec<(usize, i32, String)> = by_rank
        .iter()
        .map(|&(rank, answer)| (rank, answer.pid, stacks::place(answer)))
        .collect();
    Some(Block {
        text: block,
        silent,
        places: SEEN.note(Instant::now(), &places),
    })
}

/// The summary of where the ranks are, and of the ranks that wait on their workers.
fn summary_with_workers(
    by_rank: &[(usize, &stacks::Answer)],
    workers: &[Vec<workers::Worker>],
) -> String {
    let mut summary = stacks::summary(by_rank);
    for ((rank, answer), started) in by_rank.iter().zip(workers) {
        if let Some(waits) = workers::waits_on(*rank, answer, started) {
            summary.push_str(&format!("; {waits}"));
        }
    }
    summary
}

/// Prints the stacks in a thread of its own, so that the launcher keeps watching its ranks;
/// a request while one is being answered is refused with a line. A block that only quiet
/// askers (`tether top`) asked for is theirs alone: not printed on the job's stderr.
pub fn print_stacks_in_background(ranks: &Ranks, sig: i32) {
    static BUSY: AtomicBool = AtomicBool::new(false);
    static LOUD: AtomicBool = AtomicBool::new(false);
    let quiet = sig == stacks::signal() && reply::all_quiet();
    if !quiet {
        LOUD.store(true, Ordering::SeqCst);
    }
    if BUSY.swap(true, Ordering::SeqCst) {
        // Whoever asked with `tether stacks` gets the block being collected.
        if !quiet {
            output::message("tether: the ranks' stacks are being collected already");
        }
        return;
    }
    let ranks = ranks.clone();
    let why = match sig == stacks::signal() {
        true => "`tether stacks` asked".to_string(),
        false => format!("{} asked", signal_name(sig)),
    };
    let spawned = std::thread::Builder::new()
        .name("tether-stacks".into())
        .spawn(move || {
            // Every rank has answered: the next request may begin while this block prints
            // (one refused after its block had been read would seem lost).
            let block = stacks_block(&ranks, &why, "", None);
            let loud = LOUD.swap(false, Ordering::SeqCst) || reply::any_loud();
            BUSY.store(false, Ordering::SeqCst);
            if let Some(block) = block.as_ref().filter(|_| loud) {
                output::write_console(Stream::Stderr, &block.text);
            }
            reply(block.as_ref());
        });
    if spawned.is_err() {
        BUSY.store(false, Ordering::SeqCst);
        output::message("tether: cannot start a thread to collect the ranks' stacks");
    }
}

/// Shows every rank's stack (native frames too when py-spy is installed) because the run
/// went past `limit`. `python` is the ranks' interpreter, if they run Python.
pub fn print_stacks_at_limit(ranks: &Ranks, limit: Limit, python: Option<&OsString>) {
    let py_spy = match std::env::var_os(stacks::PY_SPY_ENV) {
        Some(chosen) => Some(PathBuf::from(chosen)).filter(|p| !p.as_os_str().is_empty()),
        None => {
            let path = std::env::var_os("PATH").unwrap_or_default();
            find_py_spy(&path, python.map(Path::new))
        }
    };
    let then = ", then every rank is stopped";
    print_stacks(ranks, &limit.describe(), then, py_spy);
}

/// `py-spy` on `path`, or beside the ranks' Python (a virtual environment not activated);
/// `TETHER_PY_SPY` names another one, or none when empty.
fn find_py_spy(path: &OsStr, python: Option<&Path>) -> Option<PathBuf> {
    let beside = python.and_then(Path::parent).map(Path::to_path_buf);
    std::env::split_paths(path)
        .chain(beside.filter(|d| !d.as_os_str().is_empty()))
        .map(|dir| dir.join("py-spy"))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_as_sentences() {
        let t = Limit::Timeout(Duration::from_millis(1500)).describe();
        assert_eq!(t, "the run reached its --timeout of 1.5 s");
        let s = Limit::Stall(Duration::from_secs(3)).describe();
        assert_eq!(s, "no rank printed anything for 3 s (--stall-timeout)");
    }

    #[test]
    fn py_spy_is_looked_for_beside_the_python_too() {
        let dir = std::env::temp_dir().join(format!("tether-py-spy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fake = dir.join("py-spy");
        std::fs::write(&fake, "#!/bin/sh\n").unwrap();
        let python = dir.join("python");
        let no_path = OsStr::new("");
        assert_eq!(find_py_spy(no_path, Some(&python)), None);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(find_py_spy(no_path, Some(&python)), Some(fake));
        assert_eq!(find_py_spy(no_path, None), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
