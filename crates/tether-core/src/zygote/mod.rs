//! The zygote: a warm process that forks children on request, so that a new process costs a
//! fork instead of an interpreter start and the heavy imports. Both sides live here: the
//! [`Zygote`] client in the parent, and [`serve`], the zygote's loop.
//!
//! The zygote forks with `clone(CLONE_PARENT)` (the embedding supplies the fork, see
//! [`serve`]): every child is a child of the *parent*, which watches it through a pidfd like
//! any other. Between requests the zygote keeps "blank" children forked ahead, each waiting
//! on a private channel for its part of a request, so that a start costs no fork at all.
//!
//! Protocol, on [`crate::channel`] endpoints (`SOCK_SEQPACKET`, messages of any size and
//! any number of fds). The parent and the zygote alternate strictly: each parent message
//! gets one reply.
//! - `Start` (parent): ranks, the [`Common`] part (fd targets, the caller's
//!   [`crate::attrs::Attributes`]) as raw bytes, and the first batch of ranks; fds: the
//!   payload (a sealed memfd, the prepared and pickled work, opaque here), the shared fds,
//!   one report pipe per rank of the batch.
//! - `Batch` (parent): the next batch of ranks; fds: their report pipes.
//! - `Started` / `Failed` (zygote): per batch, the children made (rank, pid, whether it was a
//!   blank), or an errno and a message with those made before the error.
//! - `Ready` (zygote, once): the embedding's bytes (what the preload did).
//! - On the notice channel (zygote to parent's warden): the blanks' notices (see
//!   [`crate::blanks`]).
//! - To a blank: `Job` with its rank and the raw [`Common`] part; fds: payload, shared fds,
//!   its report pipe. A blank receives only its own part.
//!
//! One file per concern: `wire` (the messages above), `child` (what a new child does
//! between its fork and its job), `server` (the zygote's loop), `collapse` (its memory in
//! huge pages) and `client` (the parent's handle). The blanks, which both the zygote and
//! the parent's warden handle, are [`crate::blanks`].

mod child;
mod client;
mod collapse;
mod server;
pub(crate) mod wire;

pub use crate::blanks::{Notice, Reserve, MAX_BLANKS};
pub use child::{read_payload, Job, Served, SETUP_FAILED};
pub use client::{ForkRequest, Zygote, FDS_ENV};
pub use server::{clone_parent, serve, Fork};
pub use wire::{Common, Made};

/// A zygote's name in `/proc/PID/comm` (it names itself when it starts serving).
pub const ZYGOTE_COMM: &str = "tether-zygote";
/// A blank's name in `/proc/PID/comm`; a blank just forked bears its zygote's until it
/// names itself.
pub const BLANK_COMM: &str = "tether-blank";
/// The names of tether's processes that run no code of the program: a zygote and the
/// blanks it keeps.
pub const IDLE_COMMS: [&str; 2] = [ZYGOTE_COMM, BLANK_COMM];

/// Whether process `pid` bears one of [`IDLE_COMMS`] (false once it is gone).
pub fn idle_named(pid: i32) -> bool {
    crate::proc::stat(crate::proc::Of::Pid(pid))
        .and_then(|s| s.command().map(|c| IDLE_COMMS.contains(&c)))
        .unwrap_or(false)
}
