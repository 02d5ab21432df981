//! The zygote's side of its blanks: the children it has forked ahead and keeps waiting,
//! each on a private channel, until a request hands one its rank. It forks them (up to a
//! target that the largest request raised), hands them out oldest first, and gives them
//! back: one found dead, or all of them when a fork of a request meets the process limit.
//! Every blank is announced on the notice channel before it can be handed out, and every
//! one given back is announced too, so that the parent's supervisor (which reaps them)
//! knows what it holds.

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use crate::blanks::notice::Notice;
use crate::channel::Endpoint;
use crate::group::signal_tree;

/// Most blank children a zygote keeps ready.
pub const MAX_BLANKS: usize = 64;

/// The blanks a zygote keeps (see the module's documentation).
pub(crate) struct Kept {
    notices: Endpoint,
    blanks: VecDeque<(i32, Endpoint)>,
    target: usize,
}

impl Kept {
    /// None kept yet; `target` to fork once idle, `notices` the channel to the parent.
    pub(crate) fn new(notices: Endpoint, target: usize) -> Kept {
        Kept {
            notices,
            blanks: VecDeque::new(),
            target: target.min(MAX_BLANKS),
        }
    }

    /// Whether fewer are kept than the target.
    pub(crate) fn wants_more(&self) -> bool {
        self.blanks.len() < self.target
    }

    /// A request of `ranks` ranks came: keep as many ready for the next one.
    pub(crate) fn expect(&mut self, ranks: usize) {
        self.target = self.target.max(ranks).min(MAX_BLANKS);
    }

    /// The oldest blank kept, to hand a rank.
    pub(crate) fn take(&mut self) -> Option<(i32, Endpoint)> {
        self.blanks.pop_front()
    }

    /// A blank taken but dead (or stuck): never handed out; the parent's supervisor reaps it.
    pub(crate) fn retire(&self, pid: i32) -> io::Result<()> {
        signal_tree(pid, libc::SIGKILL);
        self.notify(Notice::Retired(pid))
    }

    /// Gives back every blank kept (the parent's supervisor reaps them) and keeps none until
    /// the next request; returns once they are gone, or after a second. Returns how many
    /// processes it held idle with the zygote itself.
    pub(crate) fn give_back_all(&mut self) -> io::Result<usize> {
        let held = 1 + self.blanks.len();
        self.target = 0;
        let given: Vec<i32> = self.blanks.drain(..).map(|(pid, _)| pid).collect();
        for &pid in &given {
            self.retire(pid)?;
        }
        wait_gone(&given);
        Ok(held)
    }

    /// Forks blanks up to the target, never more than half of what the process limits leave
    /// (see [`crate::limits`]), and stops when `interrupted` says a request is waiting.
    /// Running out of processes or fds here only stops it: the target drops to what exists.
    /// `fork` is the zygote's (0 in the child). Returns, in a new blank, its channel.
    pub(crate) fn replenish(
        &mut self,
        fork: &mut dyn FnMut() -> io::Result<i32>,
        interrupted: &mut dyn FnMut() -> io::Result<bool>,
    ) -> io::Result<Option<Endpoint>> {
        if let Some(room) = crate::limits::process_room() {
            self.target = self.target.min(self.blanks.len() + room / 2);
        }
        while self.blanks.len() < self.target && !interrupted()? {
            let made = Endpoint::pair().and_then(|pair| Ok((fork()?, pair)));
            let Ok((pid, (ours, theirs))) = made else {
                self.target = self.blanks.len();
                return Ok(None);
            };
            if pid == 0 {
                drop(ours);
                return Ok(Some(theirs));
            }
            drop(theirs);
            log::debug!(target: "tether::zygote", "forked blank pid {pid}");
            self.notify(Notice::Blank(pid))?;
            self.blanks.push_back((pid, ours));
        }
        Ok(None)
    }

    fn notify(&self, notice: Notice) -> io::Result<()> {
        self.notices.send(&notice.encode(), &[], None).map(drop)
    }
}

/// Waits until every one of `pids` is gone (reaped by the parent), or a second has passed.
fn wait_gone(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(1);
    while Instant::now() < deadline && pids.iter().any(|&pid| crate::proc::exists(pid)) {
        std::thread::sleep(Duration::from_millis(1));
    }
}
