//! The messages between the pool and a worker, over the worker's control socket (one
//! [`Endpoint`](crate::channel::Endpoint) pair). The first byte names the kind:
//!
//! - `B` (pool to worker): a batch of tasks. A count, then per task its id, its sequence
//!   number (its claim word in the gate), the length of its bytes and how many fds it
//!   carries; then the bytes of every task. The fds travel with the message, in order.
//! - `P` (pool to worker): a leased process: its lease id, then its bytes.
//! - `H` (worker to pool): the worker is ready (its pid).
//! - `R` (worker to pool): results, laid out as a batch: id, kind (ok, error, skipped),
//!   length, fd count per result; then the bytes.
//! - `D` (worker to pool): a leased process ended: its lease id and exit code.
//!
//! Integers are little-endian.

use std::ops::Range;

use crate::workers::WorkersError;

pub const BATCH: u8 = b'B';
pub const LEASE: u8 = b'P';
pub const HELLO: u8 = b'H';
pub const RESULTS: u8 = b'R';
pub const DONE: u8 = b'D';

const COUNT: usize = 5; // kind, u32 count
const TASK: usize = 20; // u64 id, u32 seq, u32 len, u32 fds
const RESULT: usize = 17; // u64 id, u8 kind, u32 len, u32 fds

/// How a task ended, as the worker reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The bytes are the result.
    Ok,
    /// The bytes describe an exception.
    Error,
    /// The pool cancelled the task before it started: nothing ran.
    Skipped,
}

impl Kind {
    fn byte(self) -> u8 {
        match self {
            Kind::Ok => 0,
            Kind::Error => 1,
            Kind::Skipped => 2,
        }
    }

    fn from_byte(byte: u8) -> Result<Kind, WorkersError> {
        match byte {
            0 => Ok(Kind::Ok),
            1 => Ok(Kind::Error),
            2 => Ok(Kind::Skipped),
            _ => Err(WorkersError::Wire("unknown result kind")),
        }
    }
}

/// One record of a decoded `B` or `R` message: where its bytes are in the message, and
/// which of the message's fds are its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record<T> {
    pub id: u64,
    /// The sequence number (`B`) or the kind (`R`).
    pub tag: T,
    pub bytes: Range<usize>,
    pub fds: Range<usize>,
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, WorkersError> {
    data.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(WorkersError::Wire("short message"))
}

fn u64_at(data: &[u8], at: usize) -> Result<u64, WorkersError> {
    data.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or(WorkersError::Wire("short message"))
}

fn encode_records<'a>(
    kind: u8,
    record: usize,
    items: impl ExactSizeIterator<Item = (u64, [u8; 4], usize, &'a [u8], usize)> + Clone,
) -> Vec<u8> {
    let count = items.len();
    let body: usize = items.clone().map(|item| item.3.len()).sum();
    let mut out = Vec::with_capacity(COUNT + count * record + body);
    out.push(kind);
    out.extend_from_slice(&(count as u32).to_le_bytes());
    for (id, tag, tag_len, bytes, nfds) in items.clone() {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(&tag[..tag_len]);
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(&(nfds as u32).to_le_bytes());
    }
    for item in items {
        out.extend_from_slice(item.3);
    }
    out
}

fn decode_records<T>(
    data: &[u8],
    record: usize,
    tag: impl Fn(&[u8]) -> Result<T, WorkersError>,
    nfds_total: usize,
) -> Result<Vec<Record<T>>, WorkersError> {
    let count = u32_at(data, 1)? as usize;
    let mut offset = COUNT
        .checked_add(
            count
                .checked_mul(record)
                .ok_or(WorkersError::Wire("bad count"))?,
        )
        .ok_or(WorkersError::Wire("bad count"))?;
    let mut fd_at = 0usize;
    let mut out = Vec::with_capacity(count.min(4096));
    for n in 0..count {
        let at = COUNT + n * record;
        let id = u64_at(data, at)?;
        let tag_len = record - 16;
        let tag = tag(data
            .get(at + 8..at + 8 + tag_len)
            .ok_or(WorkersError::Wire("short"))?)?;
        let len = u32_at(data, at + 8 + tag_len)? as usize;
        let nfds = u32_at(data, at + 12 + tag_len)? as usize;
        if offset + len > data.len() || fd_at + nfds > nfds_total {
            return Err(WorkersError::Wire("record out of bounds"));
        }
        out.push(Record {
            id,
            tag,
            bytes: offset..offset + len,
            fds: fd_at..fd_at + nfds,
        });
        offset += len;
        fd_at += nfds;
    }
    Ok(out)
}

/// A `B` message: `(id, seq, bytes, fd count)` per task.
pub fn encode_batch(tasks: &[(u64, u32, &[u8], usize)]) -> Vec<u8> {
    encode_records(
        BATCH,
        TASK,
        tasks
            .iter()
            .map(|&(id, seq, bytes, nfds)| (id, seq.to_le_bytes(), 4, bytes, nfds)),
    )
}

pub fn decode_batch(data: &[u8], nfds: usize) -> Result<Vec<Record<u32>>, WorkersError> {
    decode_records(data, TASK, |b| u32_at(b, 0), nfds)
}

/// An `R` message: `(id, kind, bytes, fd count)` per result.
pub fn encode_results(results: &[(u64, Kind, &[u8], usize)]) -> Vec<u8> {
    encode_records(
        RESULTS,
        RESULT,
        results
            .iter()
            .map(|&(id, kind, bytes, nfds)| (id, [kind.byte(), 0, 0, 0], 1, bytes, nfds)),
    )
}

pub fn decode_results(data: &[u8], nfds: usize) -> Result<Vec<Record<Kind>>, WorkersError> {
    decode_records(
        data,
        RESULT,
        |b| Kind::from_byte(*b.first().unwrap_or(&255)),
        nfds,
    )
}

pub fn encode_lease(id: u64, bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + bytes.len());
    out.push(LEASE);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(bytes);
    out
}

/// The lease id and where its bytes start.
pub fn decode_lease(data: &[u8]) -> Result<(u64, usize), WorkersError> {
    Ok((u64_at(data, 1)?, 9))
}

pub fn encode_done(id: u64, code: i32) -> Vec<u8> {
    let mut out = Vec::with_capacity(13);
    out.push(DONE);
    out.extend_from_slice(&id.to_le_bytes());
    out.extend_from_slice(&code.to_le_bytes());
    out
}

pub fn decode_done(data: &[u8]) -> Result<(u64, i32), WorkersError> {
    Ok((u64_at(data, 1)?, u32_at(data, 9)? as i32))
}

pub fn encode_hello(pid: i32) -> Vec<u8> {
    let mut out = vec![HELLO];
    out.extend_from_slice(&pid.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_and_results_round_trip() -> Result<(), WorkersError> {
        let data = encode_batch(&[(7, 1, b"abc", 2), (8, 2, b"", 0), (9, 3, b"xy", 1)]);
        let records = decode_batch(&data, 3)?;
        assert_eq!(records.len(), 3);
        assert_eq!((records[0].id, records[0].tag), (7, 1));
        assert_eq!(&data[records[0].bytes.clone()], b"abc");
        assert_eq!(records[0].fds, 0..2);
        assert_eq!(records[1].bytes.len(), 0);
        assert_eq!(&data[records[2].bytes.clone()], b"xy");
        assert_eq!(records[2].fds, 2..3);
        assert!(decode_batch(&data, 2).is_err());
        assert!(decode_batch(&data[..data.len() - 1], 3).is_err());

        let data = encode_results(&[(7, Kind::Ok, b"r", 0), (8, Kind::Skipped, b"", 0)]);
        let records = decode_results(&data, 0)?;
        assert_eq!(records[0].tag, Kind::Ok);
        assert_eq!(records[1].tag, Kind::Skipped);
        assert_eq!(&data[records[0].bytes.clone()], b"r");

        let lease = encode_lease(42, b"call");
        assert_eq!(decode_lease(&lease)?, (42, 9));
        assert_eq!(decode_done(&encode_done(42, -9))?, (42, -9));
        Ok(())
    }
}
