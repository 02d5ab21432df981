//! The warden: one long-lived thread per process that launches children, waits for
//! them with pidfds and epoll, drains their report pipes and feeds their payloads, records
//! when each one exited, and reaps every one of them, the zygote's blank children included.
//!
//! It installs no SIGCHLD handler and never calls `waitpid(-1)`: tether lives inside other
//! people's processes and touches only the children it started.
//!
//! Children are launched from this thread because the kernel ties the parent-death signal to
//! the thread that forked: a child started from a short-lived thread would be killed when
//! that thread ended.
//!
//! One file per part: `thread` (the per-process warden, its thread, and the calls that
//! hand it requests: [`crate::Group::launch`], [`crate::Group::adopt_all`]), `request`
//! (what a request carries), `events` (the thread's loop over its poller), `take` (launching
//! and adopting members), `blanks` (a zygote's blanks) and `reap` (observing and reaping a
//! child).

mod blanks;
mod events;
mod reap;
pub(crate) mod request;
mod take;
pub(crate) mod thread;

pub(crate) use reap::waitid;
pub use request::Adoption;
