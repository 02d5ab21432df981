//! The blanks: children a zygote forks ahead of time, each waiting on a private channel for
//! its part of a request, so that a start costs no fork. This module is their one owner;
//! the zygote and the parent's warden both use it, and neither imports the other for
//! them.
//!
//! - `kept`: the zygote's side: forking blanks up to a target, keeping them within what the
//!   process limits leave, handing them out, giving them back.
//! - `notice`: what the zygote tells the parent's warden on their own channel: a blank
//!   was forked ([`Notice::Blank`]), or given back ([`Notice::Retired`]).
//! - `reserve`: the parent's record of them ([`Reserve`]), which its warden thread
//!   fills from the notices, reaps from, and hands to a group when a request takes a blank.
//!
//! A blank is a child of the zygote's parent (`clone(CLONE_PARENT)`): the parent's
//! warden follows it by pidfd from its announcement and reaps it, whether it dies idle,
//! is given back, or runs a rank.

pub(crate) mod kept;
pub(crate) mod notice;
pub(crate) mod reserve;

pub use kept::MAX_BLANKS;
pub use notice::Notice;
pub use reserve::Reserve;
