//! The zygote's wire format: the messages between the parent and the zygote ([`Order`],
//! [`Reply`]) and a blank's job, all
//! written with [`crate::codec`].

use std::io;

use crate::attrs::{Attributes, ThreadAttributes};
use crate::codec::{malformed, Reader, Writer};

/// What the errors of this format call a message.
const WHAT: &str = "zygote message";

const START: u8 = 1;
const BATCH_MSG: u8 = 2;
const STARTED: u8 = 3;
const FAILED: u8 = 4;
const READY: u8 = 5;
const JOB: u8 = 6;
const ROOM: u8 = 9;
const KEPT: u8 = 10;

/// What every child of a request shares: where the shared fds go, and the caller's
/// attributes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Common {
    pub targets: Vec<i32>,
    pub attrs: Attributes,
}

impl Common {
    pub(super) fn encode(&self) -> Vec<u8> {
        let a = &self.attrs;
        Writer::new()
            .list(&self.targets, |w, &t| w.i32(t))
            .u32(a.umask)
            .list(&a.rlimits, |w, &(r, soft, hard)| {
                w.u32(r).u64(soft).u64(hard)
            })
            .bytes(&a.thread.affinity)
            .i32(a.thread.nice)
            .bytes(&a.cwd)
            .list(&a.env, |w, (k, v)| w.bytes(k).bytes(v))
            .finish()
    }

    pub(super) fn decode(data: &[u8]) -> io::Result<Common> {
        let mut r = Reader::new(data, WHAT);
        let targets = r.list(|r| r.i32())?;
        let umask = r.u32()?;
        let rlimits = r.list(|r| Ok((r.u32()?, r.u64()?, r.u64()?)))?;
        let affinity = r.bytes()?.to_vec();
        let nice = r.i32()?;
        let cwd = r.bytes()?.to_vec();
        let env = r.list(|r| Ok((r.bytes()?.to_vec(), r.bytes()?.to_vec())))?;
        Ok(Common {
            targets,
            attrs: Attributes {
                umask,
                rlimits,
                thread: ThreadAttributes { affinity, nice },
                cwd,
                env,
            },
        })
    }
}

/// One child the zygote made for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Made {
    pub rank: u32,
    pub pid: i32,
    /// A blank forked ahead (watched by the parent's reserve until now).
    pub blank: bool,
}

/// A message from the zygote to the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Reply {
    Ready(Vec<u8>),
    Started(Vec<Made>),
    Failed {
        errno: i32,
        message: String,
        made: Vec<Made>,
    },
    /// The blanks it holds once within the room an [`Order::Room`] announced.
    Kept(u32),
}

impl Reply {
    pub(super) fn encode(&self) -> Vec<u8> {
        let made = |w: Writer, m: &Made| w.u32(m.rank).i32(m.pid).u8(m.blank as u8);
        match self {
            Reply::Ready(body) => Writer::new().u8(READY).bytes(body).finish(),
            Reply::Started(list) => Writer::new().u8(STARTED).list(list, made).finish(),
            Reply::Failed {
                errno,
                message,
                made: list,
            } => {
                let w = Writer::new().u8(FAILED).i32(*errno);
                w.bytes(message.as_bytes()).list(list, made).finish()
            }
            Reply::Kept(blanks) => Writer::new().u8(KEPT).u32(*blanks).finish(),
        }
    }

    pub(super) fn decode(data: &[u8]) -> io::Result<Reply> {
        let mut r = Reader::new(data, WHAT);
        let made = |r: &mut Reader<'_>| {
            Ok(Made {
                rank: r.u32()?,
                pid: r.i32()?,
                blank: r.u8()? != 0,
            })
        };
        match r.u8()? {
            READY => Ok(Reply::Ready(r.bytes()?.to_vec())),
            STARTED => Ok(Reply::Started(r.list(made)?)),
            FAILED => Ok(Reply::Failed {
                errno: r.i32()?,
                message: String::from_utf8_lossy(r.bytes()?).into_owned(),
                made: r.list(made)?,
            }),
            KEPT => Ok(Reply::Kept(r.u32()?)),
            _ => Err(malformed(WHAT)),
        }
    }
}

/// A message from the parent to the zygote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Order {
    /// `batch` ranks from the start have report pipes in this message, after the payload
    /// and `shared` shared fds.
    Start {
        ranks: Vec<u32>,
        shared: u32,
        common: Vec<u8>,
        batch: u32,
    },
    /// The next `batch` ranks' report pipes.
    Batch { batch: u32 },
    /// The caller is about to set its soft `RLIMIT_NPROC` to `limit` (`None`: unlimited):
    /// keep the blanks within the room it leaves.
    Room { limit: Option<u64> },
}

impl Order {
    pub(super) fn encode(&self) -> Vec<u8> {
        match self {
            Order::Start {
                ranks,
                shared,
                common,
                batch,
            } => {
                let w = Writer::new().u8(START).list(ranks, |w, &r| w.u32(r));
                w.u32(*shared).bytes(common).u32(*batch).finish()
            }
            Order::Batch { batch } => Writer::new().u8(BATCH_MSG).u32(*batch).finish(),
            Order::Room { limit } => {
                let w = Writer::new().u8(ROOM).u8(limit.is_some() as u8);
                w.u64(limit.unwrap_or(0)).finish()
            }
        }
    }

    pub(super) fn decode(data: &[u8]) -> io::Result<Order> {
        let mut r = Reader::new(data, WHAT);
        match r.u8()? {
            START => Ok(Order::Start {
                ranks: r.list(|r| r.u32())?,
                shared: r.u32()?,
                common: r.bytes()?.to_vec(),
                batch: r.u32()?,
            }),
            BATCH_MSG => Ok(Order::Batch { batch: r.u32()? }),
            ROOM => {
                let bound = r.u8()? != 0;
                let limit = r.u64()?;
                Ok(Order::Room {
                    limit: bound.then_some(limit),
                })
            }
            _ => Err(malformed(WHAT)),
        }
    }
}

/// The message that hands a blank its part of a request: its rank and the raw [`Common`]
/// part (its fds travel with it: payload, shared fds, report pipe).
pub(super) fn job_message(rank: u32, common: &[u8]) -> Vec<u8> {
    Writer::new().u8(JOB).u32(rank).bytes(common).finish()
}

/// Reads back a [`job_message`].
pub(super) fn decode_job(data: &[u8]) -> io::Result<(u32, Common)> {
    let mut r = Reader::new(data, WHAT);
    match (r.u8()?, r.u32()?, r.bytes()?) {
        (JOB, rank, common) => Ok((rank, Common::decode(common)?)),
        _ => Err(malformed(WHAT)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_parts_survive_the_wire() {
        let common = Common {
            targets: vec![0, 1, 2, 17],
            attrs: Attributes {
                umask: 0o077,
                rlimits: vec![(7, 64, 1024), (4, 0, u64::MAX)],
                thread: ThreadAttributes {
                    affinity: vec![1, 0, 0, 0],
                    nice: 5,
                },
                cwd: b"/tmp/x".to_vec(),
                env: vec![(b"A".to_vec(), b"1".to_vec()), (b"B".to_vec(), Vec::new())],
            },
        };
        assert_eq!(Common::decode(&common.encode()).unwrap(), common);
    }

    #[test]
    fn orders_and_replies_survive_the_wire() {
        let start = Order::Start {
            ranks: (0..1000).collect(),
            shared: 5,
            common: vec![9; 300],
            batch: 32,
        };
        assert_eq!(Order::decode(&start.encode()).unwrap(), start);
        let batch = Order::Batch { batch: 7 };
        assert_eq!(Order::decode(&batch.encode()).unwrap(), batch);
        for limit in [None, Some(0), Some(61), Some(u64::MAX)] {
            let room = Order::Room { limit };
            assert_eq!(Order::decode(&room.encode()).unwrap(), room);
        }
        let made = vec![
            Made {
                rank: 3,
                pid: 1234,
                blank: true,
            },
            Made {
                rank: 4,
                pid: 1235,
                blank: false,
            },
        ];
        for reply in [
            Reply::Ready(b"ok".to_vec()),
            Reply::Started(made.clone()),
            Reply::Failed {
                errno: libc::EAGAIN,
                message: "cannot fork rank 5".into(),
                made,
            },
            Reply::Kept(3),
        ] {
            assert_eq!(Reply::decode(&reply.encode()).unwrap(), reply);
        }
    }

    #[test]
    fn truncated_or_unknown_messages_are_errors() {
        let start = Order::Start {
            ranks: vec![1, 2],
            shared: 1,
            common: vec![1, 2, 3],
            batch: 2,
        }
        .encode();
        for cut in 0..start.len() {
            assert!(Order::decode(&start[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Order::decode(&[99]).is_err());
        assert!(Reply::decode(&[]).is_err());
        // A list length beyond the message is refused before anything is allocated.
        let huge = Writer::new().u8(START).u32(u32::MAX).finish();
        assert!(Order::decode(&huge).is_err());
    }
}
