//! Warm ranks in the run: the node's zygote ([`super::zygote`]) is started first of all, so
//! that its imports run while the launcher does everything else; the first round (and the
//! rendezvous helper, which is forked from it too) waits for it with stop signals in view;
//! every rank of every attempt is a fork of it. A zygote that cannot start, or that dies, is
//! one warning, and the ranks start cold from then on: the job never fails for it.
//!
//! Forks start together, so rank 0 gets a head start where it hosts the ranks' store: a rank
//! that connects to `MASTER_PORT` before rank 0 listens there is refused, and torch's store
//! client then waits about half a second before it tries again (a cold rank's start-up is
//! long and uneven enough to hide this; under torchrun the agent hosts the store first).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};
use tether_core::{signal_name, Group, LaunchSpec};

use super::node::Node;
use super::zygote::NodeZygote;
use crate::config::Place;
use crate::output;

/// How long the other ranks of a warm start wait for rank 0 to listen on `MASTER_PORT`: rank
/// 0 of a script that starts with `init_process_group` listens within a few milliseconds; one
/// that does other work first costs the others this much of a head start, no more.
const STORE_HEAD_START: Duration = Duration::from_millis(250);

/// The node's zygote, while the ranks are warm and it serves.
pub struct Warm {
    zygote: Option<NodeZygote>,
}

impl Warm {
    /// Starts the node's zygote when the ranks are warm; returns at once.
    pub fn start(node: &Node) -> Warm {
        let mut warm = Warm { zygote: None };
        if !node.cfg.warm {
            return warm;
        }
        let helper = node.cfg.rendezvous.is_some();
        match NodeZygote::start(&node.cfg, node.omp_unset, helper) {
            Ok(zygote) => warm.zygote = Some(zygote),
            Err(why) => warm.off(&why),
        }
        warm
    }

    /// Waits until the zygote is ready (at once when it is, or when there is none) and prints
    /// what it left to the ranks; `Err` holds the exit status after a stop signal.
    pub fn ready(&mut self, node: &Node) -> Result<(), i32> {
        loop {
            let Some(zygote) = self.zygote.as_ref() else {
                return Ok(());
            };
            if zygote.is_ready() {
                return Ok(());
            }
            let mut fds = [
                PollFd::new(&node.signals, PollFlags::IN),
                PollFd::from_borrowed_fd(zygote.fd(), PollFlags::IN),
            ];
            // A limit of the run (--timeout, --stall-timeout) holds meanwhile.
            let timeout = node
                .deadlines
                .next_check()
                .map(|left| rustix::event::Timespec {
                    tv_sec: left.as_secs() as _,
                    tv_nsec: left.subsec_nanos() as _,
                });
            let _ = rustix::event::poll(&mut fds, timeout.as_ref());
            let answered = !fds[1].revents().is_empty();
            if let (false, Some(limit)) = (answered, node.deadlines.passed()) {
                self.off(&format!("it was not ready when {}", limit.describe()));
                return Ok(());
            }
            if let Some(sig) = node.next_stop(&self.pids().into_iter().collect()) {
                output::message(&format!(
                    "tether: got {} while the zygote of the warm ranks was starting; stopping",
                    signal_name(sig)
                ));
                return Err(128 + sig);
            }
            let ready = match self.zygote.as_mut() {
                Some(zygote) if answered => zygote.wait_ready(),
                _ => continue,
            };
            match ready {
                Ok(notes) => notes.iter().for_each(|note| output::message(note)),
                Err(why) => self.off(&why),
            }
        }
    }

    /// Starts every rank of `specs` (local rank n is member n of `group`) in `place`: forks
    /// of the zygote while it serves (rank 0 first, when it hosts the store of a script that
    /// imports torch), new processes otherwise.
    pub fn start_ranks(
        &mut self,
        group: &Group,
        specs: Vec<LaunchSpec>,
        place: &Place,
    ) -> Result<(), tether_core::Error> {
        let mut forked = 0;
        if let Some(zygote) = self.zygote.as_mut().filter(|z| z.is_ready()) {
            let store = (zygote.preloaded_torch() && hosts_store(place, specs.len()))
                .then_some(place.master_port);
            for (local, spec) in specs.iter().enumerate() {
                if let Err(err) = zygote.fork_rank(group, spec, local as u32) {
                    self.off(&err.to_string());
                    break;
                }
                forked += 1;
                if let (0, Some(port)) = (local, store) {
                    wait_until_listening(port);
                }
            }
        }
        let rest: Vec<LaunchSpec> = specs.into_iter().skip(forked).collect();
        if rest.is_empty() {
            return Ok(());
        }
        group.launch(rest).map(drop)
    }

    /// The zygote, when it serves and has imported what the rendezvous helper needs (the
    /// script imports torch), to fork the helper from.
    pub fn helper_host(&mut self) -> Option<&mut NodeZygote> {
        self.zygote.as_mut().filter(|z| z.hosts_helper())
    }

    /// The zygote cannot serve: says so once, and every rank starts cold from now on.
    pub fn off(&mut self, why: &str) {
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
    pub fn pids(&self) -> HashSet<i32> {
        let Some(zygote) = &self.zygote else {
            return HashSet::new();
        };
        let mut pids: HashSet<i32> = zygote.blanks().into_iter().collect();
        pids.insert(zygote.pid());
        pids
    }

    /// Stops the zygote at the end of the run.
    pub fn close(&mut self) {
        if let Some(mut zygote) = self.zygote.take() {
            zygote.close();
        }
    }
}

/// Whether local rank 0 is to host the ranks' store at `MASTER_PORT` (it is global rank 0,
/// and no agent's store serves there) for other local ranks that would connect to it, and
/// nothing listens there yet.
fn hosts_store(place: &Place, ranks: usize) -> bool {
    place.rank_base == 0
        && !place.agent_store
        && ranks > 1
        && !tether_core::listening::tcp(place.master_port)
}

/// Waits until a socket listens on `port`, [`STORE_HEAD_START`] at most.
fn wait_until_listening(port: u16) {
    let began = Instant::now();
    while !tether_core::listening::tcp(port) {
        if began.elapsed() >= STORE_HEAD_START {
            log::info!(target: "tether::run", "rank 0 did not listen on port {port} within {STORE_HEAD_START:?}; the other ranks start");
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    log::info!(target: "tether::run", "rank 0 listens on port {port} after {:?}; the other ranks start", began.elapsed());
}
