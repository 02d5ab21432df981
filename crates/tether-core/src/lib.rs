//! tether-core: start, watch and stop groups of processes on Linux without ever hanging
//! or leaving an orphan.
//!
//! - [`launch`]: what each child does to itself before it runs (own process group,
//!   parent-death signal, clean signal state, only the fds asked for).
//! - [`attrs`]: the caller's process attributes (umask, limits, affinity, ...) a child takes.
//! - [`warden`]: the long-lived thread that launches children and waits on their pidfds
//!   with epoll, drains their reports, records their exits and reaps them.
//! - [`group`]: [`Group`], the handle to a set of children (wait, signal, first failure,
//!   terminate).
//! - [`zygote`]: the fork server's protocol, both sides: the warm process that forks
//!   children on request, and its client in the parent.
//! - [`blanks`]: the children a zygote forks ahead: the zygote's set, the notices about
//!   them, the parent's record; the one owner the zygote and the warden share.
//! - [`limits`]: how many more processes the user's and the cgroup's limits leave.
//! - [`report`]: a child's failure report as it arrives.
//! - [`stacks`]: every Python child's stacks on demand, through one channel per process.
//! - [`status`]: exit statuses and signal names.
//! - [`proc`]: the one reader of `/proc`.
//! - [`listening`]: whether a TCP socket listens on a port (the kernel's socket
//!   diagnostics; `/proc` where they are not available).
//! - [`channel`]: message channels with fds between running processes.
//! - `codec`: the one byte-level codec of every message and frame above.
//! - [`title`]: a process's title in `ps` and its name in `/proc/PID/comm`.
//! - [`error`]: [`Error`], and the words that explain an errno.
//! - `memfd`: sealed memfds and shared mappings, the memory shared between processes.
//! - [`logging`]: `TETHER_LOG=info|debug` sends the runtime's events to stderr.
//! - [`share`]: one copy of a dataset per machine: shared items in a sealed memfd, and the
//!   meeting point where the ranks of a job find the copy of a key.
//! - [`workers`]: a pool's worker set: its table of workers, task scheduling, deaths.

pub mod attrs;
pub mod blanks;
pub mod channel;
mod codec;
pub mod error;
pub mod group;
pub mod launch;
pub mod limits;
pub mod listening;
pub mod logging;
mod memfd;
pub mod proc;
pub mod report;
pub mod share;
pub mod stacks;
pub mod status;
pub mod title;
pub mod warden;
pub mod workers;
pub mod zygote;

pub use blanks::Reserve;
pub use error::{limit_hint, strerror, Error};
pub use group::{Escalation, Exit, Group, Member, WaitFor};
pub use launch::LaunchSpec;
pub use status::{signal_name, ExitStatus};
pub use warden::Adoption;
