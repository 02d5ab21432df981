//! A lease: one worker taken by a leased process (a DataLoader's worker loop) until its
//! target returns. The record is shared by the worker set, which ends it, and whoever
//! waits for it: its end is set once, and then its `done` eventfd stays readable, so a
//! wait for data can watch it in the same `poll` as the data.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::event::{eventfd, EventfdFlags};

/// How a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseEnd {
    /// The target's exit code (0, a `SystemExit` code, 1 on an exception), or the dead
    /// worker's status in `multiprocessing`'s convention (minus the signal number).
    pub code: i32,
    /// Whether the worker died (rather than the target returning).
    pub died: bool,
}

/// One lease.
#[derive(Debug)]
pub struct Lease {
    id: u64,
    slot: usize,
    pid: i32,
    sentinel: OwnedFd,
    done: OwnedFd,
    end: Mutex<Option<LeaseEnd>>,
    ended: Condvar,
}

impl Lease {
    pub(crate) fn new(
        id: u64,
        slot: usize,
        pid: i32,
        pidfd: BorrowedFd<'_>,
    ) -> io::Result<Arc<Lease>> {
        Ok(Arc::new(Lease {
            id,
            slot,
            pid,
            sentinel: pidfd.try_clone_to_owned()?,
            done: eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?,
            end: Mutex::new(None),
            ended: Condvar::new(),
        }))
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The worker's slot in its set.
    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// The worker's pidfd (a duplicate owned by the lease): readable once the worker died.
    pub fn sentinel(&self) -> BorrowedFd<'_> {
        self.sentinel.as_fd()
    }

    /// An eventfd readable once the lease ended.
    pub fn done_fd(&self) -> BorrowedFd<'_> {
        self.done.as_fd()
    }

    fn lock(&self) -> MutexGuard<'_, Option<LeaseEnd>> {
        self.end.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// None while the target runs.
    pub fn end(&self) -> Option<LeaseEnd> {
        *self.lock()
    }

    /// Waits up to `timeout` (for ever when None) for the lease to end.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<LeaseEnd> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut end = self.lock();
        loop {
            if end.is_some() {
                return *end;
            }
            let left = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => return None,
                },
            };
            end = self
                .ended
                .wait_timeout(end, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Ends the lease (the first end counts).
    pub(crate) fn finish(&self, end: LeaseEnd) {
        let mut slot = self.lock();
        if slot.is_some() {
            return;
        }
        *slot = Some(end);
        drop(slot);
        let _ = rustix::io::write(&self.done, &1u64.to_ne_bytes());
        self.ended.notify_all();
    }
}
