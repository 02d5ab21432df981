//! How the warden thread takes children into a group: it launches them (the parent-death
//! signal is tied to the thread that forks), or adopts those started some other way, and
//! follows each from then on. A child that cannot be followed is killed and reaped at once:
//! unfollowed, nobody would reap it.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use rustix::io::Errno;

use crate::blanks::reserve::{Blank, Reserve};
use crate::error::Error;
use crate::group::{signal_tree, Exit, GroupInner, Member};
use crate::launch::{self, LaunchSpec, PAYLOAD_FD_ENV, REPORT_FD_ENV};
use crate::report::Report;
use crate::stacks;
use crate::warden::events::Loop;
use crate::warden::reap::{
    drain_into, ended_sentinel, kill_and_reap, now_monotonic, open_pidfd, reap_now, unknown_exit,
};
use crate::warden::request::{Added, Adoption};

impl Loop {
    /// Starts each spec; at the first error, kills those started (the caller waits for
    /// their exits) and stops.
    pub(super) fn launch_all(&mut self, group: &Arc<GroupInner>, specs: Vec<LaunchSpec>) -> Added {
        let mut indices = Vec::with_capacity(specs.len());
        for spec in specs {
            match self.launch(group, spec) {
                Ok(index) => indices.push(index),
                Err(err) => return kill_added(group, indices, err),
            }
        }
        Added {
            indices,
            error: None,
        }
    }

    fn launch(&mut self, group: &Arc<GroupInner>, mut spec: LaunchSpec) -> Result<usize, Error> {
        let mut extra_keep = Vec::new();
        let report = if spec.report {
            let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
            spec.env
                .push((REPORT_FD_ENV.into(), write.as_raw_fd().to_string().into()));
            extra_keep.push(write.as_raw_fd());
            Some((read, write))
        } else {
            None
        };
        if spec.stacks {
            let sender = self.stacks.sender().as_raw_fd();
            let value = stacks::handler::env_value(sender, self.stacks.inode());
            spec.env.push((stacks::FD_ENV.into(), value.into()));
            extra_keep.push(sender);
        }
        let payload = match spec.payload.take() {
            Some(data) => {
                let (ours, theirs) = rustix::net::socketpair(
                    rustix::net::AddressFamily::UNIX,
                    rustix::net::SocketType::STREAM,
                    rustix::net::SocketFlags::CLOEXEC,
                    None,
                )?;
                spec.env
                    .push((PAYLOAD_FD_ENV.into(), theirs.as_raw_fd().to_string().into()));
                extra_keep.push(theirs.as_raw_fd());
                Some((ours, theirs, data))
            }
            None => None,
        };
        let spawned = match launch::command(&spec, &extra_keep)?.spawn() {
            // The process limit: the zygotes' idle blanks give way, then once more.
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && self.give_back_blanks() > 0 => {
                launch::command(&spec, &extra_keep)?.spawn()
            }
            spawned => spawned,
        };
        let child = spawned.map_err(|e| Error::Launch {
            program: spec
                .argv
                .first()
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default(),
            source: e,
        })?;
        let pid = child.id() as i32;
        drop(child);
        log::info!(target: "tether::warden", "started pid {pid}: {:?}", spec.argv);
        let report = report.map(|(read, _write)| read);
        let payload = payload.map(|(ours, _theirs, data)| (ours, data));
        let found = self.find(pid, None)?;
        self.take(group, pid, found, report, payload)
    }

    /// Takes each child into the group; at the first error, kills the rest of the call's
    /// children (reaping those it never registered) and stops.
    pub(super) fn adopt_all(&mut self, group: &Arc<GroupInner>, children: Vec<Adoption>) -> Added {
        let mut indices = Vec::with_capacity(children.len());
        for reserve in children.iter().filter_map(|c| c.reserve.as_ref()) {
            // The zygote announced each blank before it handed it out: take in those notices.
            self.drain_notices(reserve);
        }
        let mut children = children.into_iter();
        while let Some(child) = children.next() {
            match self.adopt(group, child) {
                Ok(index) => indices.push(index),
                Err(err) => {
                    for rest in children {
                        match rest.reserve {
                            // Still the reserve's: its interest reaps it.
                            Some(_) => drop(signal_tree(rest.pid, libc::SIGKILL)),
                            None => kill_and_reap(rest.pid),
                        }
                    }
                    return kill_added(group, indices, err);
                }
            }
        }
        Added {
            indices,
            error: None,
        }
    }

    fn adopt(&mut self, group: &Arc<GroupInner>, child: Adoption) -> Result<usize, Error> {
        let found = self.find(child.pid, child.reserve.as_ref())?;
        let how = if child.reserve.is_some() {
            "a blank"
        } else {
            "a fork"
        };
        log::info!(target: "tether::warden", "adopted pid {} ({how})", child.pid);
        self.take(group, child.pid, found, child.report, None)
    }

    /// The pidfd of our child `pid` (from the reserve that followed it, or a new one) and its
    /// exit if it has already been reaped; a child that cannot be followed is killed and
    /// reaped.
    fn find(
        &mut self,
        pid: i32,
        reserve: Option<&Reserve>,
    ) -> Result<(OwnedFd, Option<Exit>), Error> {
        match reserve.and_then(|r| r.blanks().remove(&pid)) {
            Some(Blank::Waiting { pidfd, token, .. }) => {
                self.interests.remove(&token);
                let _ = self.poller().remove(pidfd.as_fd());
                Ok((pidfd, None))
            }
            Some(Blank::Exited { exit, pidfd }) => Ok((pidfd, Some(exit))),
            None => match open_pidfd(pid) {
                Ok(Some(fd)) => Ok((fd, None)),
                // Gone already: something else reaped it (SIGCHLD ignored).
                Ok(None) => Ok((ended_sentinel()?, Some(unknown_exit()))),
                Err(err) => Err(unfollowed(pid, err)),
            },
        }
    }

    /// Makes our child a member of the group: followed from now on, or, when it has already
    /// been reaped, with its exit and what its report pipe holds.
    fn take(
        &mut self,
        group: &Arc<GroupInner>,
        pid: i32,
        (pidfd, exit): (OwnedFd, Option<Exit>),
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<usize, Error> {
        let mut member = Member::new(pid, pidfd, report_state(&report));
        let Some(exit) = exit else {
            return self.register(group, member, report, payload);
        };
        if let Some(fd) = &report {
            drain_into(fd.as_fd(), &mut member.report);
        }
        member.report.close();
        member.exit = Some(exit);
        Ok(push_member(group, member))
    }

    /// Adds the member to the group and interests its pidfd and pipes. A member that cannot be
    /// followed is killed and reaped here: unfollowed, nobody would reap it.
    fn register(
        &mut self,
        group: &Arc<GroupInner>,
        member: Member,
        report: Option<OwnedFd>,
        payload: Option<(OwnedFd, Vec<u8>)>,
    ) -> Result<usize, Error> {
        let (pid, pidfd) = (member.pid, member.sentinel.as_raw_fd());
        let index = push_member(group, member);
        match self.follow_member(group, index, pidfd, report, payload) {
            Ok(()) => Ok(index),
            Err(err) => {
                let mut state = group.lock();
                let member = &mut state.members[index];
                // SAFETY: the member's pidfd stays open while the group lives.
                let pidfd = unsafe { BorrowedFd::borrow_raw(pidfd) };
                signal_tree(pid, libc::SIGKILL);
                let status = reap_now(pidfd, pid);
                member.exit = Some(Exit {
                    status,
                    at: now_monotonic(),
                });
                member.report.close();
                drop(state);
                group.notify();
                Err(err)
            }
        }
    }
}

fn push_member(group: &Arc<GroupInner>, member: Member) -> usize {
    let mut state = group.lock();
    state.members.push(member);
    state.members.len() - 1
}

fn report_state(report: &Option<OwnedFd>) -> Report {
    match report {
        Some(_) => Report::default(),
        None => Report::none(),
    }
}

/// Kills the members a failed request had added (the caller waits for their exits).
fn kill_added(group: &Arc<GroupInner>, indices: Vec<usize>, error: Error) -> Added {
    let state = group.lock();
    for &i in &indices {
        if state.members[i].exit.is_none() {
            signal_tree(state.members[i].pid, libc::SIGKILL);
        }
    }
    Added {
        indices,
        error: Some(error),
    }
}

/// The error for a child that could not be followed (it has been killed and reaped).
fn unfollowed(pid: i32, err: Errno) -> Error {
    kill_and_reap(pid);
    Error::Resource {
        what: format!("cannot follow child process {pid}"),
        source: io::Error::from(err),
    }
}
