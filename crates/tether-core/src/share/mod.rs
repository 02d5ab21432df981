//! One copy of a dataset per machine: the layout of a shared list or dict in one sealed
//! memfd ([`table`]), the meeting point where the ranks of one job find the copy of a key,
//! built once ([`meet`]), and the job's vault, which holds the copies as long as the job
//! runs ([`vault`]). What the items' bytes mean (pickles) is the caller's.

pub mod meet;
pub mod table;
pub mod vault;

pub use meet::{claim, meeting_name, vault_name, Claim, Meeting, Outcome, Waiter, Who, JOB_ENV};
pub use table::{key_hash, kind_of, Kind, Table, TableBuilder};
pub use vault::Vault;
