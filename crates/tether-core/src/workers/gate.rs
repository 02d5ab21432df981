//! The gate: a page of shared memory between the pool and one worker that says which task
//! the worker runs and settles, task by task, whether it starts or is cancelled.
//!
//! Every task sent to a worker gets a sequence number and a claim word in the page. The
//! word starts `QUEUED`; the worker moves it to `STARTED` just before it runs the task, the
//! pool moves it to `CANCELLED` to withdraw a task the worker has not started. Both moves
//! are compare-and-swap, so exactly one side wins: a task is never both cancelled and run.
//! Beside the claim words, the worker keeps the id of the task it is running and the index
//! of the item within it (a `map` chunk holds several), which tell the pool, when the worker
//! dies, which task it died in.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::memfd::SharedPages;

/// The page's size: two words, then the claim words.
const SIZE: usize = 8192;
const CLAIMS_AT: usize = 64;
/// How many claim words: more than the tasks a worker can hold at once (see
/// [`max_in_flight`]), so that a word is reused only once its previous task is answered.
pub const CLAIMS: usize = 1024;

/// The most tasks a worker may hold unanswered, for any configuration.
pub const fn max_in_flight() -> usize {
    CLAIMS / 2
}

const QUEUED: u32 = 0;
const STARTED: u32 = 1;
const CANCELLED: u32 = 2;

/// Where a task sent to a worker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Sent, not started: the pool may still cancel it.
    Queued,
    /// The worker started it (and may have finished it).
    Started,
    /// The pool withdrew it; the worker skips it.
    Cancelled,
}

/// One worker's gate page, mapped in this process.
#[derive(Debug)]
pub struct Gate {
    fd: Option<OwnedFd>,
    page: SharedPages,
}

impl Gate {
    /// A fresh page (a memfd), all tasks `QUEUED`, no task running.
    pub fn new() -> io::Result<Gate> {
        let (fd, page) = SharedPages::create("tether-gate", SIZE)?;
        Ok(Gate { fd: Some(fd), page })
    }

    /// Maps the page held by `fd` (made by [`Gate::new`] in some process).
    pub fn from_fd(fd: OwnedFd) -> io::Result<Gate> {
        let page = SharedPages::map(&fd, SIZE, "tether gate")?;
        Ok(Gate { fd: Some(fd), page })
    }

    /// The memfd (until [`Gate::close_fd`]), to pass to the worker.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|fd| fd.as_fd())
    }

    /// Closes the memfd; the mapping stays.
    pub fn close_fd(&mut self) {
        self.fd = None;
    }

    fn word(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: `offset` is 0 or 8: aligned, inside the page.
        unsafe { self.page.at(offset) }
    }

    fn claim_word(&self, seq: u32) -> &AtomicU32 {
        let at = CLAIMS_AT + (seq as usize % CLAIMS) * 4;
        // SAFETY: `at` is 4-aligned and below CLAIMS_AT + CLAIMS * 4 <= SIZE.
        unsafe { self.page.at(at) }
    }

    // -- the pool's side ------------------------------------------------------------------

    /// Readies the claim word of a task about to be sent as `seq`.
    pub fn arm(&self, seq: u32) {
        self.claim_word(seq).store(QUEUED, Ordering::Release);
    }

    /// Withdraws task `seq` unless the worker started it; true when it is now cancelled.
    pub fn cancel(&self, seq: u32) -> bool {
        match self.claim_word(seq).compare_exchange(
            QUEUED,
            CANCELLED,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(state) => state == CANCELLED,
        }
    }

    pub fn claim(&self, seq: u32) -> Claim {
        match self.claim_word(seq).load(Ordering::Acquire) {
            QUEUED => Claim::Queued,
            CANCELLED => Claim::Cancelled,
            _ => Claim::Started,
        }
    }

    /// The id of the task the worker runs (0 between tasks) and the item within it.
    pub fn running(&self) -> (u64, u64) {
        (
            self.word(0).load(Ordering::Acquire),
            self.word(8).load(Ordering::Acquire),
        )
    }

    // -- the worker's side ----------------------------------------------------------------

    /// Claims task `seq` (id `id`) to run it; false when the pool cancelled it (skip it).
    pub fn start(&self, seq: u32, id: u64) -> bool {
        self.word(8).store(0, Ordering::Release);
        self.word(0).store(id, Ordering::Release);
        let won = self
            .claim_word(seq)
            .compare_exchange(QUEUED, STARTED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if !won {
            self.word(0).store(0, Ordering::Release);
        }
        won
    }

    /// Records that the running task moved on to item `item`.
    pub fn step(&self, item: u64) {
        self.word(8).store(item, Ordering::Release);
    }

    /// Records that no task runs.
    pub fn idle(&self) {
        self.word(0).store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exactly_one_side_wins_a_claim() -> io::Result<()> {
        let pool = Gate::new()?;
        let fd = pool
            .fd()
            .ok_or(io::ErrorKind::NotFound)?
            .try_clone_to_owned()?;
        let worker = Gate::from_fd(fd)?;
        pool.arm(5);
        pool.arm(6);
        assert!(worker.start(5, 50));
        assert_eq!(pool.running(), (50, 0));
        assert!(!pool.cancel(5));
        assert_eq!(pool.claim(5), Claim::Started);
        assert!(pool.cancel(6));
        assert!(!worker.start(6, 60));
        assert_eq!(pool.running(), (0, 0));
        assert_eq!(pool.claim(6), Claim::Cancelled);
        // A word is reused CLAIMS tasks later.
        pool.arm(6 + CLAIMS as u32);
        assert_eq!(pool.claim(6), Claim::Queued);
        worker.step(3);
        worker.idle();
        assert_eq!(pool.running(), (0, 3));
        Ok(())
    }
}
