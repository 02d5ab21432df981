//! Stacks of processes that are no member of a group: the processes a rank started (its
//! DataLoader workers, a forkserver and its children, a pool's workers). A child forked from
//! a rank (a `fork` DataLoader worker) keeps the rank's handlers and its end of the stacks
//! channel, and answers as the rank does; a new interpreter (`spawn`, `forkserver`) has no
//! handler of tether's and is said to have none, with its state. Each is signalled through
//! a pidfd of its own, opened once its parent is checked, so that a pid reused meanwhile is
//! never signalled.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Instant;

use super::{catches, collect, leave_alone, reply_of_other, send, signal, Answer, Reply, Request};
use crate::error::Error;
use crate::proc::{self, Of};

/// The parent of `pid`, from /proc.
fn parent(pid: i32) -> Option<i32> {
    proc::stat(Of::Pid(pid))?.number(4).map(|p| p as i32)
}

/// Asks every process `(pid, its parent)` of `targets` for its stacks at once (each only
/// while `pid` is still the child of that parent), and waits up to `request.timeout`;
/// returns the answers in order. The dump signal is not sent: a worker busy in C code is
/// described by its state.
pub fn ask_others(targets: &[(i32, i32)], request: &Request) -> Result<Vec<Answer>, Error> {
    let channel = collect::this_process()?;
    let id = super::NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = Instant::now();
    let deadline = start.checked_add(request.timeout).unwrap_or(start);
    let mut pidfds: HashMap<i32, OwnedFd> = HashMap::new();
    let mut known: Vec<Option<Reply>> = Vec::with_capacity(targets.len());
    for &(pid, ppid) in targets {
        let pidfd = rustix::process::Pid::from_raw(pid).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        let reply = match pidfd {
            Some(fd) if parent(pid) == Some(ppid) => {
                if !catches(pid, signal()) {
                    Some(Reply::NoHandler)
                } else if let Some(why) = leave_alone(channel, pid) {
                    Some(Reply::LeftAlone(why))
                } else {
                    channel.expect(pid, id);
                    match send(fd.as_fd(), signal(), id) {
                        Ok(()) => {
                            pidfds.insert(pid, fd);
                            None
                        }
                        Err(_) => {
                            channel.forget(pid, id);
                            Some(Reply::Exited(None))
                        }
                    }
                }
            }
            _ => Some(Reply::Exited(None)),
        };
        known.push(reply);
    }
    let waiting: Vec<i32> = pidfds.keys().copied().collect();
    let mut gone = |pid: i32| !proc::exists(pid);
    let mut dumps = channel.collect(id, &waiting, deadline, &mut gone);
    Ok(targets
        .iter()
        .zip(known)
        .map(|(&(pid, _), known)| Answer {
            pid,
            reply: known.unwrap_or_else(|| reply_of_other(channel, pid, dumps.remove(&pid))),
            native: None,
        })
        .collect())
}
