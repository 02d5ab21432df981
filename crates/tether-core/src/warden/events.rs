//! The warden thread's loop: it waits on every fd it interests (pidfds, report pipes,
//! payload sockets, zygotes' notice channels, the stacks channel) with one [`Poller`],
//! serves the requests queued for it, and acts on each fd that is ready.
//!
//! Launching and adopting members are in `take`, the zygotes' blanks in `blanks`, the
//! system calls that reap in `reap`: each adds methods to [`Loop`].

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::blanks::reserve::{Blank, Reserve};
use crate::channel::{Endpoint, Poller};
use crate::error::Error;
use crate::group::{Exit, GroupInner};
use crate::stacks::Channel;
use crate::warden::reap::{drain, feed, now_monotonic, reap_now};
use crate::warden::request::{Inbox, Request};

/// The token of the stacks channel.
pub(super) const STACKS: u64 = 0;

/// What an fd in the poller stands for.
pub(super) enum Interest {
    /// The pidfd of member `index`; `report` and `payload` are the tokens of its pipes.
    Exit {
        group: Arc<GroupInner>,
        index: usize,
        report: Option<u64>,
        payload: Option<u64>,
    },
    Report {
        group: Arc<GroupInner>,
        index: usize,
        fd: OwnedFd,
    },
    Payload {
        fd: OwnedFd,
        data: Vec<u8>,
        written: usize,
    },
    /// The pidfd of a blank child (held by the reserve).
    Blank { reserve: Reserve, pid: i32 },
    /// A zygote's notice channel.
    Notices { reserve: Reserve, notices: Endpoint },
}

/// The warden thread's state.
pub(super) struct Loop {
    inbox: &'static Inbox,
    /// This process's stacks channel: its children's dumps arrive here.
    pub(super) stacks: &'static Channel,
    pub(super) interests: HashMap<u64, Interest>,
    next_token: u64,
}

impl Loop {
    pub(super) fn new(inbox: &'static Inbox, stacks: &'static Channel) -> Loop {
        Loop {
            inbox,
            stacks,
            interests: HashMap::new(),
            next_token: STACKS,
        }
    }

    pub(super) fn poller(&self) -> &'static Poller {
        &self.inbox.poller
    }

    /// Runs for the life of the process.
    pub(super) fn run(mut self) {
        loop {
            let (ready, woken) = match self.poller().wait(None) {
                Ok(got) => got,
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            if woken {
                self.serve_requests();
            }
            for token in ready {
                if token == STACKS {
                    self.stacks.drain();
                } else {
                    self.on_ready(token);
                }
            }
        }
    }

    fn serve_requests(&mut self) {
        let requests = self.inbox.take();
        for request in requests {
            // Each reply goes out only once the request's hold on its group is dropped: the
            // caller may drop the group (and expect its fds closed) as soon as it has it.
            match request {
                Request::Launch {
                    group,
                    specs,
                    reply,
                } => {
                    let added = self.launch_all(&group, specs);
                    drop(group);
                    let _ = reply.send(Ok(added));
                }
                Request::Adopt {
                    group,
                    children,
                    reply,
                } => {
                    let added = self.adopt_all(&group, children);
                    drop(group);
                    let _ = reply.send(Ok(added));
                }
                Request::Follow {
                    reserve,
                    notices,
                    reply,
                } => {
                    let _ = reply.send(self.follow_notices(&reserve, notices));
                }
            }
        }
    }

    /// Follows the member's pipes and its pidfd.
    pub(super) fn follow_member(
        &mut self,
        group: &Arc<GroupInner>,
        index: usize,
        pidfd: RawFd,
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<(), Error> {
        let report = match report {
            Some(fd) => {
                let raw = fd.as_raw_fd();
                let interest = Interest::Report {
                    group: group.clone(),
                    index,
                    fd,
                };
                Some(self.add_interest(raw, false, interest)?)
            }
            None => None,
        };
        let payload = match payload {
            Some((fd, data)) => {
                let raw = fd.as_raw_fd();
                let interest = Interest::Payload {
                    fd,
                    data,
                    written: 0,
                };
                Some(self.add_interest(raw, true, interest)?)
            }
            None => None,
        };
        let interest = Interest::Exit {
            group: group.clone(),
            index,
            report,
            payload,
        };
        self.add_interest(pidfd, false, interest)?;
        Ok(())
    }

    /// Adds `fd` (non-blocking) to the poller under a new token for `interest`, which owns
    /// the fd or keeps alive what owns it; `writable`: followed for room to write, else for
    /// something to read.
    pub(super) fn add_interest(
        &mut self,
        fd: RawFd,
        writable: bool,
        interest: Interest,
    ) -> Result<u64, Error> {
        // SAFETY: `interest` keeps `fd` open (see above) for as long as it is in the set.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        rustix::io::ioctl_fionbio(fd, true)?;
        self.next_token += 1;
        let token = self.next_token;
        match writable {
            true => self.poller().add_writable(token, fd)?,
            false => self.poller().add(token, fd)?,
        }
        self.interests.insert(token, interest);
        Ok(token)
    }

    fn on_ready(&mut self, token: u64) {
        let open = match self.interests.get_mut(&token) {
            Some(Interest::Report { group, index, fd }) => drain(fd.as_fd(), group, *index),
            Some(Interest::Payload { fd, data, written }) => feed(fd.as_fd(), data, written),
            Some(Interest::Exit { .. }) => return self.on_exit(token),
            Some(Interest::Blank { reserve, pid }) => {
                let (reserve, pid) = (reserve.clone(), *pid);
                return self.on_blank_exit(token, &reserve, pid);
            }
            Some(Interest::Notices { reserve, .. }) => {
                let reserve = reserve.clone();
                return self.drain_notices(&reserve);
            }
            None => return,
        };
        if !open {
            self.remove_interest(token);
        }
    }

    /// Removes an interest and its fd from the poller.
    pub(super) fn remove_interest(&mut self, token: u64) -> Option<Interest> {
        let interest = self.interests.remove(&token)?;
        let fd: RawFd = match &interest {
            Interest::Report { fd, .. } | Interest::Payload { fd, .. } => fd.as_raw_fd(),
            Interest::Notices { notices, .. } => notices.as_fd().as_raw_fd(),
            Interest::Exit { group, index, .. } => group.lock().members[*index].sentinel(),
            Interest::Blank { reserve, pid } => match reserve.blanks().get(pid) {
                Some(Blank::Waiting { pidfd, .. }) => pidfd.as_raw_fd(),
                _ => -1,
            },
        };
        if fd < 0 {
            return Some(interest);
        }
        // SAFETY: the fd is open: its owner is `interest` or is kept alive by it.
        let _ = self.poller().remove(unsafe { BorrowedFd::borrow_raw(fd) });
        Some(interest)
    }

    /// The child behind `token` is ready to be waited for: drain its report, kill what it
    /// left in its process group, reap it, and record its exit.
    fn on_exit(&mut self, token: u64) {
        let Some(Interest::Exit {
            group,
            index,
            report,
            payload,
        }) = self.remove_interest(token)
        else {
            return;
        };
        if let Some(Interest::Report { fd, .. }) = report.and_then(|t| self.remove_interest(t)) {
            drain(fd.as_fd(), &group, index);
        }
        if let Some(t) = payload {
            self.remove_interest(t);
        }
        let mut state = group.lock();
        let member = &mut state.members[index];
        let status = reap_now(member.sentinel.as_fd(), member.pid);
        member.exit = Some(Exit {
            status,
            at: now_monotonic(),
        });
        member.report.close();
        log::info!(target: "tether::warden", "pid {} exited: {status}", member.pid);
        drop(state);
        group.notify();
    }
}
