//! tether-core: start, watch and stop groups of processes on Linux without ever hanging
//! or leaving an orphan.
//!
//! - [`launch`]: what each child does to itself before it runs (own process group,
//!   parent-death signal, clean signal state, only the fds asked for).
//! - [`supervisor`]: the long-lived thread that launches children and waits on their pidfds
//!   with epoll, drains their reports, records their exits and reaps them; [`Group`] is the
//!   handle to a set of children.
//! - [`status`]: exit statuses and signal names.
//! - [`workers`]: a pool's worker set: its table of workers, task scheduling, deaths.

pub mod channel;
pub mod launch;
pub mod status;
pub mod supervisor;
pub mod workers;

pub use launch::LaunchSpec;
pub use status::{signal_name, ExitStatus};
pub use supervisor::{Exit, Group, WaitFor};

use std::io;

/// Errors of tether-core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start {program:?}: {source}")]
    Launch {
        program: String,
        #[source]
        source: io::Error,
    },
    #[error("the tether supervisor thread is gone")]
    SupervisorGone,
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<rustix::io::Errno> for Error {
    fn from(errno: rustix::io::Errno) -> Error {
        Error::Io(errno.into())
    }
}
