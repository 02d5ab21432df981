//! The messages between the pool and a worker, over the worker's control socket (one
//! [`Endpoint`](crate::channel::Endpoint) pair). The first byte names the kind:
//!
//! - `B` (pool to worker): a batch of tasks. A count, then per task its id, its sequence
//!   number (its claim word in the gate), the length of its bytes and how many fds it
//!   carries; then the bytes of every task. The fds travel with the message, in order.
//! - `P` (pool to worker): a leased process: its lease id, then its bytes.
//! - `N` (pool to worker): a note, bytes the worker acts on between its other messages
//!   and answers nothing (the pool tells it so to drop the objects it no longer needs).
//! - `H` (worker to pool): the worker is ready (its pid).
//! - `R` (worker to pool): results, laid out as a batch: id, kind (ok, error, skipped),
//!   length, fd count per result; then the bytes.
//! - `D` (worker to pool): a leased process ended: its lease id and exit code.
//!
//! Integers are little-endian, written and read with the crate's codec (`codec.rs`).

use std::ops::Range;

use crate::codec::{Reader, Writer};
use crate::workers::error::WorkersError;

pub const BATCH: u8 = b'B';
pub const LEASE: u8 = b'P';
pub const NOTE: u8 = b'N';
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

/// What the codec's errors call a message of this format.
const WHAT: &str = "worker message";

/// A field ran past the end of the message.
fn short(_: std::io::Error) -> WorkersError {
    WorkersError::Wire("short message")
}

fn encode_records<T: Copy>(
    kind: u8,
    record: usize,
    items: &[(u64, T, &[u8], usize)],
    tag: impl Fn(Writer, T) -> Writer,
) -> Vec<u8> {
    let body: usize = items.iter().map(|item| item.2.len()).sum();
    let capacity = COUNT + items.len() * record + body;
    let mut w = Writer::with_capacity(capacity)
        .u8(kind)
        .u32(items.len() as u32);
    for &(id, t, bytes, nfds) in items {
        w = tag(w.u64(id), t).u32(bytes.len() as u32).u32(nfds as u32);
    }
    for item in items {
        w = w.raw(item.2);
    }
    w.finish()
}

fn decode_records<T>(
    data: &[u8],
    record: usize,
    tag: impl Fn(&mut Reader<'_>) -> Result<T, WorkersError>,
    nfds_total: usize,
) -> Result<Vec<Record<T>>, WorkersError> {
    let mut r = Reader::new(data, WHAT);
    r.u8().map_err(short)?;
    let count = r.u32().map_err(short)? as usize;
    let mut offset = COUNT
        .checked_add(
            count
                .checked_mul(record)
                .ok_or(WorkersError::Wire("bad count"))?,
        )
        .ok_or(WorkersError::Wire("bad count"))?;
    let mut fd_at = 0usize;
    let mut out = Vec::with_capacity(count.min(4096));
    for _ in 0..count {
        let id = r.u64().map_err(short)?;
        let tag = tag(&mut r)?;
        let len = r.u32().map_err(short)? as usize;
        let nfds = r.u32().map_err(short)? as usize;
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
    encode_records(BATCH, TASK, tasks, |w, seq| w.u32(seq))
}

pub fn decode_batch(data: &[u8], nfds: usize) -> Result<Vec<Record<u32>>, WorkersError> {
    decode_records(data, TASK, |r| r.u32().map_err(short), nfds)
}

/// An `R` message: `(id, kind, bytes, fd count)` per result.
pub fn encode_results(results: &[(u64, Kind, &[u8], usize)]) -> Vec<u8> {
    encode_records(RESULTS, RESULT, results, |w, kind| w.u8(kind.byte()))
}

pub fn decode_results(data: &[u8], nfds: usize) -> Result<Vec<Record<Kind>>, WorkersError> {
    let kind = |r: &mut Reader<'_>| Kind::from_byte(r.u8().map_err(short)?);
    decode_records(data, RESULT, kind, nfds)
}

pub fn encode_lease(id: u64, bytes: &[u8]) -> Vec<u8> {
    let w = Writer::with_capacity(9 + bytes.len()).u8(LEASE);
    w.u64(id).raw(bytes).finish()
}

/// The lease id and where its bytes start.
pub fn decode_lease(data: &[u8]) -> Result<(u64, usize), WorkersError> {
    let mut r = Reader::new(data, WHAT);
    r.u8().map_err(short)?;
    Ok((r.u64().map_err(short)?, 9))
}

pub fn encode_note(bytes: &[u8]) -> Vec<u8> {
    Writer::with_capacity(1 + bytes.len())
        .u8(NOTE)
        .raw(bytes)
        .finish()
}

pub fn encode_done(id: u64, code: i32) -> Vec<u8> {
    Writer::with_capacity(13)
        .u8(DONE)
        .u64(id)
        .i32(code)
        .finish()
}

pub fn decode_done(data: &[u8]) -> Result<(u64, i32), WorkersError> {
    let mut r = Reader::new(data, WHAT);
    r.u8().map_err(short)?;
    Ok((r.u64().map_err(short)?, r.i32().map_err(short)?))
}

pub fn encode_hello(pid: i32) -> Vec<u8> {
    Writer::with_capacity(5).u8(HELLO).i32(pid).finish()
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

    /// The layout, byte for byte: little-endian fields in the order the module names them.
    #[test]
    fn the_bytes_on_the_link() {
        let mut batch = vec![b'B', 1, 0, 0, 0];
        batch.extend_from_slice(&[7, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0]);
        batch.extend_from_slice(b"ab");
        assert_eq!(encode_batch(&[(7, 5, b"ab", 1)]), batch);
        assert_eq!(batch.len(), COUNT + TASK + 2);

        let mut results = vec![b'R', 1, 0, 0, 0];
        results.extend_from_slice(&[9, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]);
        results.push(b'e');
        assert_eq!(encode_results(&[(9, Kind::Error, b"e", 0)]), results);
        assert_eq!(results.len(), COUNT + RESULT + 1);

        let lease = [b'P', 42, 0, 0, 0, 0, 0, 0, 0, b'x'];
        assert_eq!(encode_lease(42, b"x"), lease);
        assert_eq!(encode_note(b"xy"), [b'N', b'x', b'y']);
        let done = [b'D', 42, 0, 0, 0, 0, 0, 0, 0, 0xf7, 0xff, 0xff, 0xff];
        assert_eq!(encode_done(42, -9), done);
        assert_eq!(encode_hello(258), [b'H', 2, 1, 0, 0]);
    }
}
