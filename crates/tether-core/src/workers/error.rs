//! [`WorkersError`]: what the worker set's calls, and a worker's end, fail with.

use std::io;

use rustix::io::Errno;

/// Errors of the worker set.
#[derive(Debug, thiserror::Error)]
pub enum WorkersError {
    #[error("the worker set is closed")]
    Closed,
    #[error("no worker in slot {0}")]
    NoWorker(usize),
    #[error("the worker in slot {0} is already leased")]
    Leased(usize),
    #[error("slot {0} already has a worker")]
    Occupied(usize),
    #[error("bad message on a worker link: {0}")]
    Wire(&'static str),
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<Errno> for WorkersError {
    fn from(errno: Errno) -> WorkersError {
        WorkersError::Io(errno.into())
    }
}
