//! One copy of a dataset per machine: the layout of a shared list or dict in one sealed
//! memfd ([`table`]), and the meeting point where the ranks of one job find the copy of a
//! key, built once ([`meet`]). What the items' bytes mean (pickles) is the caller's.

pub mod meet;
pub mod table;

pub use meet::{claim, Claim, Meeting, Outcome, Waiter, Who, JOB_ENV};
pub use table::{key_hash, Kind, Table, TableBuilder};
