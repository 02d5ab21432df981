//! The worker's end of the link: it receives batches, leases and notes, claims each task in the
//! gate before running it, and sends results back.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use crate::channel::{Endpoint, Message, Recv};
use crate::workers::error::WorkersError;
use crate::workers::gate::Gate;
use crate::workers::spin::Spin;
use crate::workers::wire::{self, Kind};

/// One task of a received batch.
#[derive(Debug)]
pub struct IncomingTask {
    pub id: u64,
    /// Its claim word in the gate (pass it to [`WorkerEnd::start`]).
    pub seq: u32,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What [`WorkerEnd::recv`] got.
#[derive(Debug)]
pub enum Incoming {
    Batch(Vec<IncomingTask>),
    Lease {
        id: u64,
        data: Vec<u8>,
        fds: Vec<OwnedFd>,
    },
    /// A note from the pool (see [`wire`]): its bytes; nothing answers it.
    Note(Vec<u8>),
    /// Nothing before the timeout.
    Timeout,
    /// The pool closed its end: the worker should exit.
    Closed,
}

/// A worker's end of its link to the pool.
#[derive(Debug)]
pub struct WorkerEnd {
    ctl: Endpoint,
    gate: Gate,
    spin: Spin,
}

/// Splits a message's fds into the consecutive runs its records name.
pub(crate) fn split_fds(fds: Vec<OwnedFd>, runs: impl Iterator<Item = usize>) -> Vec<Vec<OwnedFd>> {
    let mut fds = fds.into_iter();
    runs.map(|n| fds.by_ref().take(n).collect()).collect()
}

impl WorkerEnd {
    /// Takes the control socket and the gate's memfd that the pool passed to this worker;
    /// a receive polls up to `spin` before it sleeps (see [`crate::workers::spin`]).
    pub fn new(ctl: OwnedFd, gate: OwnedFd, spin: Duration) -> io::Result<WorkerEnd> {
        let mut gate = Gate::from_fd(gate)?;
        gate.close_fd();
        Ok(WorkerEnd {
            ctl: Endpoint::from_fd(ctl),
            gate,
            spin: Spin::new(spin),
        })
    }

    /// Tells the pool this worker is ready.
    pub fn hello(&self, pid: i32) -> io::Result<()> {
        self.ctl
            .send(&wire::encode_hello(pid), &[], None)
            .map(|_| ())
    }

    /// Waits up to `timeout` (for ever when None) for the next batch, lease or note.
    pub fn recv(&self, timeout: Option<Duration>) -> Result<Incoming, WorkersError> {
        match self.ctl.recv(timeout)? {
            Recv::Timeout => Ok(Incoming::Timeout),
            Recv::Closed => Ok(Incoming::Closed),
            Recv::Message(message) => decode(message),
        }
    }

    /// Polls for the next message for as long as the spin policy allows (see
    /// [`crate::workers::spin`]); `Incoming::Timeout` when none came meanwhile.
    pub fn recv_polling(&self) -> Result<Incoming, WorkersError> {
        let got = self.spin.poll(|| match self.recv(Some(Duration::ZERO))? {
            Incoming::Timeout => Ok::<_, WorkersError>(None),
            other => Ok(Some(other)),
        })?;
        Ok(got.unwrap_or(Incoming::Timeout))
    }

    /// Claims task `seq` (id `id`) to run it now; false when the pool cancelled it.
    pub fn start(&self, seq: u32, id: u64) -> bool {
        self.gate.start(seq, id)
    }

    /// The running task moved on to item `item`.
    pub fn step(&self, item: u64) {
        self.gate.step(item)
    }

    /// No task runs (a batch is finished).
    pub fn idle(&self) {
        self.gate.idle()
    }

    /// Sends results: `(id, kind, bytes, fds)` each (the fds stay the caller's).
    pub fn send_results(
        &self,
        results: &[(u64, Kind, &[u8], Vec<BorrowedFd<'_>>)],
    ) -> io::Result<()> {
        let head: Vec<(u64, Kind, &[u8], usize)> = results
            .iter()
            .map(|(id, kind, data, fds)| (*id, *kind, *data, fds.len()))
            .collect();
        let fds: Vec<BorrowedFd<'_>> = results.iter().flat_map(|r| r.3.iter().copied()).collect();
        self.ctl
            .send(&wire::encode_results(&head), &fds, None)
            .map(|_| ())
    }

    /// Reports that leased process `id` ended with `code`.
    pub fn send_done(&self, id: u64, code: i32) -> io::Result<()> {
        self.ctl
            .send(&wire::encode_done(id, code), &[], None)
            .map(|_| ())
    }
}

fn decode(message: Message) -> Result<Incoming, WorkersError> {
    let Message { data, fds } = message;
    match data.first() {
        Some(&wire::BATCH) => {
            let records = wire::decode_batch(&data, fds.len())?;
            let mut runs = split_fds(fds, records.iter().map(|r| r.fds.len())).into_iter();
            Ok(Incoming::Batch(
                records
                    .into_iter()
                    .map(|r| IncomingTask {
                        id: r.id,
                        seq: r.tag,
                        data: data[r.bytes].to_vec(),
                        fds: runs.next().unwrap_or_default(),
                    })
                    .collect(),
            ))
        }
        Some(&wire::LEASE) => {
            let (id, at) = wire::decode_lease(&data)?;
            Ok(Incoming::Lease {
                id,
                data: data[at..].to_vec(),
                fds,
            })
        }
        Some(&wire::NOTE) => Ok(Incoming::Note(data[1..].to_vec())),
        _ => Err(WorkersError::Wire("unknown message for a worker")),
    }
}
