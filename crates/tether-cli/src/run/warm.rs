//! Warm ranks in the attempt loop: the node's zygote ([`crate::zygote`]) is started first of
//! all, so that its imports run while the launcher does everything else; the first attempt
//! (and the rendezvous helper, which is forked from it too) waits for it with stop signals in
//! view; every rank of every attempt is a fork of it. A zygote that cannot start, or that
//! dies, is one warning, and the ranks start cold from then on: the job never fails for it.

use std::os::fd::AsFd;

use rustix::event::{PollFd, PollFlags};
use tether_core::{signal_name, Group, LaunchSpec};

use super::Launcher;
use crate::output;
use crate::reaper;
use crate::rendezvous::{Helper, Rendezvous};
use crate::zygote::NodeZygote;

impl Launcher {
    /// Starts the node's zygote when the ranks are warm; returns at once.
    pub(super) fn start_zygote(&mut self) {
        if !self.cfg.warm {
            return;
        }
        let helper = self.cfg.rendezvous.is_some();
        match NodeZygote::start(&self.cfg, self.omp_unset, helper) {
            Ok(zygote) => self.zygote = Some(zygote),
            Err(why) => self.zygote_off(&why),
        }
    }

    /// Waits until the zygote is ready (at once when it is, or when there is none) and prints
    /// what it left to the ranks; `Err` holds the stop signal that came first.
    pub(super) fn await_zygote(&mut self) -> Result<(), i32> {
        loop {
            let Some(zygote) = self.zygote.as_ref() else {
                return Ok(());
            };
            if zygote.is_ready() {
                return Ok(());
            }
            let mut fds = [
                PollFd::new(&self.signals, PollFlags::IN),
                PollFd::from_borrowed_fd(zygote.fd(), PollFlags::IN),
            ];
            // A limit of the run (--timeout, --stall-timeout) holds meanwhile.
            let timeout = self
                .watchdog
                .next_check()
                .map(|left| rustix::event::Timespec {
                    tv_sec: left.as_secs() as _,
                    tv_nsec: left.subsec_nanos() as _,
                });
            let _ = rustix::event::poll(&mut fds, timeout.as_ref());
            let answered = !fds[1].revents().is_empty();
            if let (false, Some(limit)) = (answered, self.watchdog.passed()) {
                self.zygote_off(&format!("it was not ready when {}", limit.describe()));
                return Ok(());
            }
            while let Some(sig) = self.signals.next() {
                if sig == libc::SIGCHLD {
                    reaper::reap_orphans(&self.own_pids());
                } else if !self.stack_signals.contains(&sig) {
                    output::message(&format!(
                        "tether: got {} while the zygote of the warm ranks was starting; \
                         stopping",
                        signal_name(sig)
                    ));
                    return Err(sig);
                }
            }
            let ready = match self.zygote.as_mut() {
                Some(zygote) if answered => zygote.wait_ready(),
                _ => continue,
            };
            match ready {
                Ok(notes) => notes.iter().for_each(|note| output::message(note)),
                Err(why) => self.zygote_off(&why),
            }
        }
    }

    /// Starts every rank of `specs` (local rank n is member n of `group`): forks of the
    /// zygote while it serves, new processes otherwise.
    pub(super) fn start_ranks(
        &mut self,
        group: &Group,
        specs: Vec<LaunchSpec>,
    ) -> Result<(), tether_core::Error> {
        let mut forked = 0;
        if let Some(zygote) = self.zygote.as_mut().filter(|z| z.is_ready()) {
            for (local, spec) in specs.iter().enumerate() {
                if let Err(err) = zygote.fork_rank(group, spec, local as u32) {
                    self.zygote_off(&err.to_string());
                    break;
                }
                forked += 1;
            }
        }
        let rest: Vec<LaunchSpec> = specs.into_iter().skip(forked).collect();
        if rest.is_empty() {
            return Ok(());
        }
        group.launch(rest).map(drop)
    }

    /// The node's rendezvous helper: a fork of the zygote while it serves and has imported
    /// what the helper needs (the script imports torch), else a new interpreter (`python -m
    /// tether._rendezvous`).
    pub(super) fn start_helper(&mut self, rdzv: &Rendezvous) -> std::io::Result<Helper> {
        if let Some(zygote) = self.zygote.as_mut().filter(|z| z.hosts_helper()) {
            match fork_helper(zygote, rdzv) {
                Ok(helper) => return Ok(helper),
                Err(err) => self.zygote_off(&err.to_string()),
            }
        }
        Helper::spawn(&self.cfg.rendezvous_python, rdzv)
    }

    /// The zygote cannot serve: says so once, and every rank starts cold from now on.
    pub(super) fn zygote_off(&mut self, why: &str) {
        if let Some(mut zygote) = self.zygote.take() {
            zygote.close();
        }
        output::message(&format!(
            "tether: warning: warm ranks are off for this run: {why}; every rank starts as a \
             new interpreter (as with --no-warm)"
        ));
    }

    /// The zygote's pid and those of the children it keeps forked ahead, which only
    /// tether-core may reap.
    pub(super) fn zygote_pids(&self) -> Vec<i32> {
        let Some(zygote) = &self.zygote else {
            return Vec::new();
        };
        let mut pids = zygote.blanks();
        pids.push(zygote.pid());
        pids
    }

    /// Stops the zygote at the end of the run.
    pub(super) fn close_zygote(&mut self) {
        if let Some(mut zygote) = self.zygote.take() {
            zygote.close();
        }
    }
}

/// The helper, forked from `zygote`, with a pipe for its stdin and one for its stdout.
fn fork_helper(zygote: &mut NodeZygote, rdzv: &Rendezvous) -> Result<Helper, tether_core::Error> {
    let pipe = || {
        rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| tether_core::Error::resource("cannot create a pipe", e))
    };
    let ((their_in, our_in), (our_out, their_out)) = (pipe()?, pipe()?);
    let group = Group::new();
    let options = rdzv.options().to_string();
    zygote.fork_helper(&group, their_in.as_fd(), their_out.as_fd(), &options)?;
    Ok(Helper::forked(group, our_in, our_out))
}
