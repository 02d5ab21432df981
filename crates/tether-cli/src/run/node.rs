//! What every round and attempt of this node's run works with: the configuration (whose
//! place the membership sets each round), the signalfd, the private and log directories,
//! the deadlines of the run's limits, and what the ranks' prefixes and environment read.

use std::cell::Cell;
use std::collections::HashSet;
use std::path::PathBuf;

use crate::config::{Config, DEFAULT_PREFIX};
use crate::output::{self, Prefix, RankNames};
use crate::reaper;
use crate::signalfd::SignalFd;
use crate::signals;
use crate::stacks::hangs::{self, Deadlines};

pub struct Node {
    pub cfg: Config,
    pub signals: SignalFd,
    /// The signals that ask for the ranks' stacks.
    pub stack_signals: Vec<i32>,
    /// A stop signal read while waiting for an attempt's leftovers to die.
    pub stop_pending: Cell<Option<i32>>,
    /// The ranks' error files, by attempt.
    pub tmp: PathBuf,
    /// The run's log directory.
    pub logs: Option<PathBuf>,
    /// Whether the launcher's environment has no OMP_NUM_THREADS (the ranks get 1).
    pub omp_unset: bool,
    /// Whether the console's stdout and stderr are one file.
    pub one_console: bool,
    pub hostname: String,
    pub deadlines: Deadlines,
}

impl Node {
    /// `tmp` holds the ranks' error files; `logs` is the run's log directory.
    pub fn new(cfg: Config, signals: SignalFd, tmp: PathBuf, logs: Option<PathBuf>) -> Node {
        Node {
            omp_unset: std::env::var_os("OMP_NUM_THREADS").is_none(),
            one_console: output::console_is_one_file(),
            hostname: hostname(),
            deadlines: Deadlines::new(&cfg),
            stack_signals: hangs::stack_signals(&cfg),
            stop_pending: Cell::new(None),
            cfg,
            signals,
            tmp,
            logs,
        }
    }

    /// The next stop signal that arrived, if one did; SIGCHLDs on the way reap orphans (all
    /// but `own`, the launcher's own processes), and stack signals are passed over.
    pub fn next_stop(&self, own: &HashSet<i32>) -> Option<i32> {
        while let Some(sig) = signals::next(&self.signals) {
            if sig == libc::SIGCHLD {
                reaper::reap_orphans(own);
            } else if !self.stack_signals.contains(&sig) {
                return Some(sig);
            }
        }
        None
    }

    /// A stop signal that arrived while no rank ran (between attempts).
    pub fn pending_stop(&self, own: &HashSet<i32>) -> Option<i32> {
        self.stop_pending.take().or_else(|| self.next_stop(own))
    }

    /// Reads every pending signal, keeping a stop signal for [`Self::pending_stop`]; whether
    /// one came (then no attempt starts).
    pub fn stop_noted(&self) -> bool {
        while let Some(sig) = signals::next(&self.signals) {
            if sig != libc::SIGCHLD && !self.stack_signals.contains(&sig) {
                self.stop_pending.set(Some(sig));
            }
        }
        self.stop_pending.get().is_some()
    }

    /// Local rank `local`'s console prefix (`None` for `--no-prefix`).
    pub fn prefix(&self, local: usize) -> Option<Prefix> {
        let template = self.cfg.output.prefix.as_ref()?;
        Some(self.render_prefix(template, local))
    }

    /// Local rank `local`'s prefix, the default one under `--no-prefix` (for its stacks).
    pub fn prefix_or_default(&self, local: usize) -> Prefix {
        self.prefix(local)
            .unwrap_or_else(|| self.render_prefix(DEFAULT_PREFIX, local))
    }

    fn render_prefix(&self, template: &str, local: usize) -> Prefix {
        let names = RankNames {
            rank: self.cfg.global_rank(local),
            local_rank: local,
            role: &self.cfg.role,
            hostname: &self.hostname,
        };
        Prefix::render(template, &names)
    }
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
