//! The warden thread's part in a zygote's reserve of blanks: it reads the zygote's
//! notices, follows each blank from its announcement, and reaps one that dies before a
//! request takes it (see [`crate::blanks::Reserve`]).

use std::os::fd::{AsFd, AsRawFd};
use std::time::Duration;

use crate::blanks::notice::Notice;
use crate::blanks::reserve::{Blank, Reserve};
use crate::channel::{Endpoint, Recv};
use crate::error::Error;
use crate::group::{signal_tree, Exit};
use crate::warden::events::{Interest, Loop};
use crate::warden::reap::{kill_and_reap, now_monotonic, open_pidfd, reap_now};

impl Loop {
    /// Follows a zygote's notice channel, for `reserve`.
    pub(super) fn follow_notices(
        &mut self,
        reserve: &Reserve,
        notices: Endpoint,
    ) -> Result<(), Error> {
        let raw = notices.as_fd().as_raw_fd();
        let interest = Interest::Notices {
            reserve: reserve.clone(),
            notices,
        };
        let token = self.add_interest(raw, false, interest)?;
        *reserve.notices() = Some(token);
        Ok(())
    }

    pub(super) fn on_blank_exit(&mut self, token: u64, reserve: &Reserve, pid: i32) {
        let mut blanks = reserve.blanks();
        let Some(Blank::Waiting { pidfd, retired, .. }) = blanks.remove(&pid) else {
            return;
        };
        drop(blanks);
        let _ = self.poller().remove(pidfd.as_fd());
        self.interests.remove(&token);
        let exit = Exit {
            status: reap_now(pidfd.as_fd(), pid),
            at: now_monotonic(),
        };
        log::info!(target: "tether::warden", "blank pid {pid} exited: {}", exit.status);
        if !retired {
            reserve.blanks().insert(pid, Blank::Exited { exit, pidfd });
        }
    }

    /// Takes in every notice waiting on the reserve's channel.
    pub(super) fn drain_notices(&mut self, reserve: &Reserve) {
        let Some(token) = *reserve.notices() else {
            return;
        };
        loop {
            let got = match self.interests.get(&token) {
                Some(Interest::Notices { notices, .. }) => notices.recv(Some(Duration::ZERO)),
                _ => return,
            };
            match got {
                Ok(Recv::Message(message)) => match Notice::decode(&message.data) {
                    Some(Notice::Blank(pid)) => self.follow_blank(reserve, pid),
                    Some(Notice::Retired(pid)) => reserve.retire(pid),
                    None => {}
                },
                Ok(Recv::Timeout) => return,
                Ok(Recv::Closed) | Err(_) => {
                    self.remove_interest(token);
                    *reserve.notices() = None;
                    return;
                }
            }
        }
    }

    /// A start of this process met the process limit: kills every blank that its zygotes
    /// hold (they count against the same limit, see [`crate::blanks`]) and reaps them, so
    /// that the start can try once more; returns how many it gave back. A zygote finds such
    /// a blank's channel closed when it hands it a rank, and forks instead.
    pub(super) fn give_back_blanks(&mut self) -> usize {
        let held: Vec<(u64, Reserve, i32)> = self
            .interests
            .iter()
            .filter_map(|(&token, interest)| match interest {
                Interest::Blank { reserve, pid } => Some((token, reserve.clone(), *pid)),
                _ => None,
            })
            .collect();
        for (_, reserve, pid) in &held {
            if let Some(Blank::Waiting { pidfd, .. }) = reserve.blanks().get(pid) {
                // By pidfd: the blank is our child, unreaped, and cannot be another process.
                let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
            }
        }
        for (token, reserve, pid) in &held {
            self.on_blank_exit(*token, reserve, *pid);
        }
        if !held.is_empty() {
            log::info!(target: "tether::warden", "gave back {} blank(s) to make room for a start", held.len());
        }
        held.len()
    }

    /// Follows a blank child from its announcement; one that cannot be followed is killed.
    fn follow_blank(&mut self, reserve: &Reserve, pid: i32) {
        let pidfd = match open_pidfd(pid) {
            Ok(Some(fd)) => fd,
            Ok(None) => return,
            Err(_) => return kill_and_reap(pid),
        };
        let raw = pidfd.as_raw_fd();
        let interest = Interest::Blank {
            reserve: reserve.clone(),
            pid,
        };
        match self.add_interest(raw, false, interest) {
            Ok(token) => {
                let blank = Blank::Waiting {
                    pidfd,
                    token,
                    retired: false,
                };
                reserve.blanks().insert(pid, blank);
                log::debug!(target: "tether::warden", "following blank pid {pid}");
            }
            Err(_) => {
                signal_tree(pid, libc::SIGKILL);
                reap_now(pidfd.as_fd(), pid);
            }
        }
    }
}
