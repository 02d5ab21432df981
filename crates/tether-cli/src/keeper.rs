//! The keeper: the process users see as `tether run` (the one they started, whose pid they
//! hold). It stays small: it forks the supervisor ([`crate::run`]), forwards stop signals
//! (and the terminal's resizes) to it, and once the supervisor has ended, however it ended,
//! kills and reaps whatever is left, then exits with the supervisor's status.
//!
//! The pact between the two processes, which leaves no orphan whichever of them dies:
//! - both are child subreapers. The supervisor is the ranks' parent, so whatever a rank
//!   leaves behind (in any session or process group) is re-parented to it, and it kills that
//!   at the end of each attempt;
//! - the supervisor sits in its own process group: a signal to the keeper's group
//!   (`kill -9 %1`, a Ctrl-C) reaches the keeper alone, which forwards stop signals;
//! - if the supervisor dies, even by SIGKILL, the ranks die with it (their parent-death
//!   signal) and everything they started is re-parented to the keeper, which kills it all;
//! - if the keeper dies, even by SIGKILL, a thread of the supervisor sees it through a pidfd
//!   and kills every rank and everything re-parented to the supervisor, then exits.

use std::collections::HashSet;
use std::io;

use tether_core::ExitStatus;

use crate::config::Config;
use crate::output::message;
use crate::reaper;
use crate::run::{supervisor_main, TempDir};
use crate::signalfd::{self, SignalFd};
use crate::signals;

/// Runs `cfg` in a supervisor process and returns the exit status. Must be called while
/// the process has a single thread.
pub fn run(cfg: Config) -> i32 {
    let mut handled = signals::handled(&cfg);
    // Forwarded to the supervisor, which gives the terminal's new size to the ranks' ptys.
    if cfg.output.tty {
        handled.push(libc::SIGWINCH);
    }
    let saved = match signalfd::block(&handled) {
        Ok(saved) => saved,
        Err(err) => {
            message(&format!("tether: cannot block signals: {err}"));
            return 1;
        }
    };
    let code = keep(cfg, &handled);
    signalfd::restore(saved);
    code
}

fn keep(cfg: Config, handled: &[i32]) -> i32 {
    let Some(signals) = signals::set_up(handled, "tether") else {
        return 1;
    };
    let tmp = match TempDir::name("tether-run-") {
        Ok(tmp) => tmp,
        Err(err) => {
            message(&format!("tether: {err}"));
            return 1;
        }
    };
    let keeper = std::process::id() as i32;
    // The children the host process had already are its own: never killed nor reaped.
    let hosts: HashSet<i32> = tether_core::proc::children().into_iter().collect();
    // SAFETY: the process has a single thread (checked by `main`), so the child may run any
    // code; it never returns here (see `supervisor_main`).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let err = io::Error::last_os_error();
        message(&format!(
            "tether: cannot start the supervisor: {}{}",
            tether_core::strerror(&err),
            tether_core::limit_hint(&err)
        ));
        return 1;
    }
    if pid == 0 {
        drop(signals);
        let path = tmp.path().to_path_buf();
        std::mem::forget(tmp);
        supervisor_main(cfg, path, keeper);
    }
    let status = wait_for(pid, &signals);
    reaper::kill_and_reap_all_but(&hosts);
    drop(tmp);
    // SAFETY: prctl clears a flag of this process (the host process may live on).
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0 as libc::c_ulong) };
    exit_code(pid, status)
}

/// Forwards stop signals to the supervisor `pid` until it exits; returns its wait status.
/// (Anything else re-parented here meanwhile, which only a supervisor that could not be a
/// subreaper lets through, is killed and reaped once it has ended.)
fn wait_for(pid: i32, signals: &SignalFd) -> i32 {
    loop {
        signals.wait(None);
        while let Some((sig, queued)) = signals.next_queued() {
            if sig != libc::SIGCHLD {
                forward(pid, sig, queued);
            }
        }
        let mut status = 0;
        // SAFETY: reaping the supervisor, our own child, once it has exited.
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            return status;
        }
    }
}

/// Sends `sig` on to the supervisor `pid`, with the value it was queued with (which names
/// who asked for the stacks: see [`crate::stacks::reply`]).
fn forward(pid: i32, sig: i32, queued: Option<u64>) {
    match queued {
        Some(value) => {
            let value = libc::sigval {
                sival_ptr: value as usize as *mut libc::c_void,
            };
            // SAFETY: queueing a signal with a plain value to our own unreaped child.
            unsafe { libc::sigqueue(pid, sig, value) };
        }
        // SAFETY: signalling our own unreaped child.
        None => unsafe {
            libc::kill(pid, sig);
        },
    }
}

fn exit_code(pid: i32, status: i32) -> i32 {
    if libc::WIFEXITED(status) {
        return libc::WEXITSTATUS(status);
    }
    let sig = libc::WTERMSIG(status);
    let ended = ExitStatus::Signaled {
        signal: sig,
        core_dumped: libc::WCOREDUMP(status),
    };
    let died = ended.died(&format!("tether: the supervisor (pid {pid})"));
    message(&format!(
        "{died}; every rank and what they started are stopped"
    ));
    128 + sig
}
