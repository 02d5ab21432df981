//! The supervisor's side of the pact with the keeper ([`crate::keeper`]): should the keeper
//! die, a thread kills every rank and everything re-parented to the supervisor, then ends
//! it.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::output::message;
use crate::reaper;

/// Held while an attempt creates its files and starts its ranks. A supervisor whose keeper
/// died takes it for good ([`stop_launching`]) before it kills what runs, so that no rank
/// starts behind its back and nothing recreates the directories it removes.
static LAUNCHING: Mutex<()> = Mutex::new(());

/// Waits for a launch in progress to end and forbids any other.
pub fn stop_launching() -> MutexGuard<'static, ()> {
    LAUNCHING.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long a supervisor whose keeper died keeps killing before it gives up on what will
/// not die (a process stuck in the kernel).
const ABANDON_LIMIT: Duration = Duration::from_secs(5);

/// Set in a supervisor whose keeper died: its own end belongs to the thread that cleans up.
static ABANDONED: AtomicBool = AtomicBool::new(false);

/// Whether this supervisor's keeper died (and another thread is ending the process).
pub fn abandoned() -> bool {
    ABANDONED.load(Ordering::SeqCst)
}

/// In the supervisor: starts the thread that, should the keeper die, kills every rank and
/// everything re-parented here, removes `tmp` and ends the process.
pub fn keep_vigil(keeper: i32, tmp: PathBuf) -> io::Result<()> {
    let pidfd = rustix::process::Pid::from_raw(keeper)
        .map(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()));
    // SAFETY: getppid cannot fail.
    if unsafe { libc::getppid() } != keeper {
        abandon(keeper, &tmp);
    }
    std::thread::Builder::new()
        .name("tether-vigil".into())
        .spawn(move || {
            match pidfd {
                Some(Ok(fd)) => {
                    let mut fds = [rustix::event::PollFd::new(
                        &fd,
                        rustix::event::PollFlags::IN,
                    )];
                    while !matches!(rustix::event::poll(&mut fds, None), Ok(n) if n > 0) {}
                }
                // No pidfds (a kernel before 5.3): the parent changes when the keeper dies.
                _ => {
                    // SAFETY: getppid reads a process attribute and cannot fail.
                    while unsafe { libc::getppid() } == keeper {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            abandon(keeper, &tmp);
        })?;
    Ok(())
}

/// The keeper is gone: kill everything below the supervisor and end it.
fn abandon(keeper: i32, tmp: &Path) -> ! {
    ABANDONED.store(true, Ordering::SeqCst);
    message(&format!(
        "tether: the launcher (pid {keeper}) is gone; killing every rank and what they started"
    ));
    crate::output::silence();
    let _no_more_ranks = stop_launching();
    super::membership::let_the_helper_leave(Duration::from_secs(1));
    reaper::kill_every_child(ABANDON_LIMIT);
    let _ = std::fs::remove_dir_all(tmp);
    // SAFETY: ends the supervisor at once; nothing is left for it to do.
    unsafe { libc::_exit(128 + libc::SIGKILL) }
}
