//! The values the worker set takes and hands out.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use super::gate::Gate;
use super::lease::Lease;
use super::wire::Kind;
use crate::channel::Endpoint;
use crate::status::ExitStatus;

/// How tasks are spread, and how long a wait polls before it sleeps.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// Messages of tasks in flight per worker.
    pub window: usize,
    /// The most tasks one message carries.
    pub max_batch: usize,
    /// The most a wait ([`WorkerSet::poll`], [`WorkerSet::wait_for`]) polls before it
    /// sleeps (see [`spin`]).
    pub spin: Duration,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            window: 2,
            max_batch: 256,
            spin: Duration::from_micros(100),
        }
    }
}

/// A task or a result: an id, bytes, and the fds that travel with them.
#[derive(Debug)]
pub struct Task {
    pub id: u64,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// A task's result as its worker sent it.
#[derive(Debug)]
pub struct Outcome {
    pub id: u64,
    /// `Kind::Ok` (the bytes are the result) or `Kind::Error` (they describe an exception).
    pub kind: Kind,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// The task a worker died in, and the item within it it had reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    pub id: u64,
    pub item: u64,
}

/// A worker that died.
#[derive(Debug)]
pub struct Death {
    pub slot: usize,
    pub pid: i32,
    pub status: ExitStatus,
    /// Whether it had said it was ready (a worker that dies before cannot start).
    pub ready: bool,
    pub crashed: Option<Crash>,
    /// Tasks it ran without sending their results.
    pub lost: Vec<u64>,
    /// The lease it held (now ended with its status).
    pub lease: Option<Arc<Lease>>,
    /// What it wrote to its report pipe.
    pub report: Vec<u8>,
}

/// What [`WorkerSet::poll`] hands out.
#[derive(Debug)]
pub enum Event {
    Ready {
        slot: usize,
        pid: i32,
    },
    Results {
        slot: usize,
        pid: i32,
        outcomes: Vec<Outcome>,
    },
    LeaseEnded {
        slot: usize,
        lease: Arc<Lease>,
    },
    Died(Death),
}

/// A worker's free state, as [`WorkerSet::workers`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerInfo {
    pub slot: usize,
    pub pid: i32,
    pub ready: bool,
    pub lease: Option<u64>,
    pub reserved: bool,
}

/// What [`WorkerSet::close`] left: tasks never answered, and the leases it ended.
#[derive(Debug, Default)]
pub struct Closing {
    pub tasks: Vec<u64>,
    pub leases: Vec<Arc<Lease>>,
}

/// The two ends of a new worker's link: its control socket pair and its gate.
#[derive(Debug)]
pub struct Link {
    pub(super) parent: Endpoint,
    pub(super) child: Endpoint,
    pub(super) gate: Gate,
    pub(super) gate_fd: OwnedFd,
}

impl Link {
    pub fn new() -> io::Result<Link> {
        let (parent, child) = Endpoint::pair()?;
        let mut gate = Gate::new()?;
        let gate_fd = gate
            .fd()
            .ok_or(io::ErrorKind::NotFound)?
            .try_clone_to_owned()?;
        gate.close_fd();
        Ok(Link {
            parent,
            child,
            gate,
            gate_fd,
        })
    }

    /// The fds the worker must inherit: its end of the socket and the gate's memfd.
    pub fn child_fds(&self) -> (BorrowedFd<'_>, BorrowedFd<'_>) {
        (self.child.as_fd(), self.gate_fd.as_fd())
    }

    /// The pool's end of the socket (a forked worker must close its copy).
    pub fn parent_fd(&self) -> BorrowedFd<'_> {
        self.parent.as_fd()
    }
}
