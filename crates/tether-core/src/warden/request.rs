//! What callers ask of the warden thread, and how they hand it over: a queue and the
//! thread's [`Poller`], whose wake-up makes it look at the queue.

use std::os::fd::OwnedFd;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use crate::blanks::reserve::Reserve;
use crate::channel::{Endpoint, Poller};
use crate::error::Error;
use crate::group::GroupInner;
use crate::launch::LaunchSpec;

/// A child of this process started some other way than [`Group::launch`], for
/// [`Group::adopt_all`].
#[derive(Debug)]
pub struct Adoption {
    pub pid: i32,
    /// The read end of its report pipe (the group takes it over).
    pub report: Option<OwnedFd>,
    /// The reserve that has followed it until now (a zygote's blank child).
    pub reserve: Option<Reserve>,
}

impl Adoption {
    /// A child forked by this process (or for it), unknown to the warden so far.
    pub fn forked(pid: i32, report: Option<OwnedFd>) -> Adoption {
        Adoption {
            pid,
            report,
            reserve: None,
        }
    }
}

pub(super) enum Request {
    Launch {
        group: Arc<GroupInner>,
        specs: Vec<LaunchSpec>,
        reply: mpsc::SyncSender<Result<Added, Error>>,
    },
    Adopt {
        group: Arc<GroupInner>,
        children: Vec<Adoption>,
        reply: mpsc::SyncSender<Result<Added, Error>>,
    },
    Follow {
        reserve: Reserve,
        notices: Endpoint,
        reply: mpsc::SyncSender<Result<(), Error>>,
    },
}

/// The members a request added, and the error that stopped it (those members are then
/// being killed).
pub(super) struct Added {
    pub(super) indices: Vec<usize>,
    pub(super) error: Option<Error>,
}

/// The requests waiting for the warden thread, and its poller: a request is queued,
/// then the poller woken.
pub(super) struct Inbox {
    pub(super) poller: Poller,
    queue: Mutex<Vec<Request>>,
}

impl Inbox {
    pub(super) fn new() -> Result<Inbox, Error> {
        Ok(Inbox {
            poller: Poller::new()?,
            queue: Mutex::new(Vec::new()),
        })
    }

    pub(super) fn queue(&self) -> MutexGuard<'_, Vec<Request>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every request queued so far.
    pub(super) fn take(&self) -> Vec<Request> {
        std::mem::take(&mut *self.queue())
    }
}
