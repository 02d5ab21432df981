//! The parent's record of a zygote's blanks: children forked ahead of time, announced on
//! the zygote's notice channel. The warden thread follows each one from its
//! announcement (see [`crate::warden::thread::follow_blanks`]), reaps it at once if it dies, and
//! hands it to a group when a request takes it ([`crate::warden::Adoption::reserve`]);
//! this file holds what it knows of each blank meanwhile.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::group::{signal_tree, Exit};

/// The blanks of one zygote (see the module's documentation).
#[derive(Debug, Clone, Default)]
pub struct Reserve {
    inner: Arc<ReserveInner>,
}

#[derive(Debug, Default)]
struct ReserveInner {
    blanks: Mutex<HashMap<i32, Blank>>,
    /// The warden token of the notice channel, while it is followed.
    notices: Mutex<Option<u64>>,
}

/// What the parent knows of one blank.
#[derive(Debug)]
pub(crate) enum Blank {
    /// Alive and followed under `token`; `retired`: the zygote found it dead and will never
    /// hand it out.
    Waiting {
        pidfd: OwnedFd,
        token: u64,
        retired: bool,
    },
    /// Dead before a request took it; kept in case a request did take it at the last moment.
    Exited { exit: Exit, pidfd: OwnedFd },
}

impl Reserve {
    pub fn new() -> Reserve {
        Reserve::default()
    }

    /// Every blank known, under the reserve's lock.
    pub(crate) fn blanks(&self) -> MutexGuard<'_, HashMap<i32, Blank>> {
        self.inner.blanks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The warden token of the notice channel, while it is followed.
    pub(crate) fn notices(&self) -> MutexGuard<'_, Option<u64>> {
        self.inner.notices.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The pids of the blank children alive and waiting.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .blanks()
            .iter()
            .filter(|(_, b)| matches!(b, Blank::Waiting { .. }))
            .map(|(&pid, _)| pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// The zygote has given up on a dead blank: its status will never be asked for.
    pub(crate) fn retire(&self, pid: i32) {
        let mut blanks = self.blanks();
        match blanks.get_mut(&pid) {
            Some(Blank::Waiting { retired, .. }) => *retired = true,
            Some(Blank::Exited { .. }) => drop(blanks.remove(&pid)),
            None => {}
        }
    }

    /// Kills every blank child still waiting (its zygote is gone, or closing) and waits up
    /// to `limit` for the warden to reap them.
    pub fn stop_all(&self, limit: Duration) {
        {
            let blanks = self.blanks();
            // Not reaped while the lock is held (the warden takes it to reap one): the
            // pids are theirs.
            for (&pid, blank) in blanks.iter() {
                if matches!(blank, Blank::Waiting { .. }) {
                    signal_tree(pid, libc::SIGKILL);
                }
            }
        }
        let deadline = Instant::now() + limit;
        while !self.pids().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
