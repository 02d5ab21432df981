//! The worker set of a pool: long-lived worker processes, each linked to the pool by a
//! control socket and a gate page (see [`gate`]), and watched through a duplicate of its
//! pidfd.
//!
//! The set owns the table of workers, the queue of tasks not yet sent, the messages in
//! flight per worker, the batch sizes, which worker runs which task, and the leases (a
//! worker taken by one leased process). It knows nothing of what a task means: a task is an
//! id, bytes and fds; a result is the same. The caller hands tasks in with
//! [`WorkerSet::submit`] from any thread and takes [`Event`]s out of [`WorkerSet::poll`]
//! from one thread: results, a lease that ended, a worker that became ready or died (with
//! its exit status and the tasks it held). Replacing a dead worker is the caller's choice,
//! made outside this lock: [`WorkerSet::add`] puts a new one in its slot.
//!
//! Tasks go to the free, ready workers with the fewest messages in flight, at most `window`
//! messages per worker (one running, the next waiting in its socket), in batches sized to
//! the backlog: one task when the pool is idle, up to `max_batch` under a long queue.
//! A worker's death is seen on its pidfd. The tasks it held are sorted by their claim words:
//! the one it was running crashed, those it ran without sending their results are lost,
//! those it never started go back to the head of the queue, and cancelled ones are dropped.
//!
//! The files: `types.rs` (what the set takes and hands out), `set.rs` (the set behind its
//! lock, its [`Poller`](crate::channel::Poller) and its calls), `table.rs` (the workers,
//! what is in flight to each, and the dispatch of queued tasks), `read.rs` (messages and
//! deaths sorted into events), `wait.rs` (a thread that takes its task's result itself),
//! `lease.rs`, `error.rs`, [`gate`], [`spin`], [`wire`] (the link's messages), and
//! [`end`] (the worker's side).

pub mod end;
mod error;
pub mod gate;
mod lease;
mod read;
mod set;
pub mod spin;
mod table;
mod types;
mod wait;
pub mod wire;

pub use end::{Incoming, IncomingTask, WorkerEnd};
pub use error::WorkersError;
pub use lease::{Lease, LeaseEnd};
pub use set::WorkerSet;
pub use types::{Closing, Config, Crash, Death, Event, Link, Outcome, Task, WorkerInfo};
pub use wait::Waited;

#[cfg(test)]
mod tests;
