//! The zygote's side of its blanks: the children it has forked ahead and keeps waiting,
//! each on a private channel, until a request hands one its rank. It forks them (up to a
//! target that the largest request raised), hands them out oldest first, and gives them
//! back: one found dead, all of them when a fork of a request meets the process limit, and
//! as many as it takes to stay within the caller's room.
//!
//! The caller's room: idle blanks are processes of the caller's user, and count against the
//! caller's `RLIMIT_NPROC` as its own threads and children do. So the zygote keeps at most
//! half of what the caller's limits would leave without them (read from the caller, see
//! [`crate::limits`]): the caller always has at least as many processes to spare as the
//! blanks hold. It checks again before it forks blanks, every [`ROOM_CHECK`] while it holds
//! any, and at once when the caller announces a new limit (the parent's
//! [`crate::zygote::Zygote::make_room`], before the caller sets it), giving back the newest
//! blanks first.
//!
//! Every blank is announced on the notice channel before it can be handed out, and every
//! one given back is announced too, so that the parent's warden (which reaps them)
//! knows what it holds.

use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

use crate::blanks::notice::Notice;
use crate::channel::Endpoint;
use crate::group::signal_tree;
use crate::limits;

/// Most blank children a zygote keeps ready.
pub const MAX_BLANKS: usize = 64;
/// How often a zygote that holds blanks checks that the caller's room still allows them.
pub const ROOM_CHECK: Duration = Duration::from_millis(500);

/// The blanks a zygote keeps (see the module's documentation).
pub(crate) struct Kept {
    notices: Endpoint,
    blanks: VecDeque<(i32, Endpoint)>,
    target: usize,
    /// The process whose limits the blanks count against (the zygote's parent).
    caller: i32,
    /// A soft `RLIMIT_NPROC` the caller announced and `/proc` does not show yet.
    announced: Option<Option<u64>>,
}

impl Kept {
    /// None kept yet; `target` to fork once idle, `notices` the channel to the parent,
    /// `caller` the parent (whose limits count).
    pub(crate) fn new(notices: Endpoint, target: usize, caller: i32) -> Kept {
        Kept {
            notices,
            blanks: VecDeque::new(),
            target: target.min(MAX_BLANKS),
            caller,
            announced: None,
        }
    }

    /// Whether it holds any blank.
    pub(crate) fn holds_any(&self) -> bool {
        !self.blanks.is_empty()
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

    /// Gives back a blank: it exits at the end of its channel, and the parent's warden
    /// reaps it. No signal goes by pid: the blank may be dead and reaped already (given back
    /// by the parent itself), its pid free for another process.
    pub(crate) fn give_back(&self, pid: i32, channel: Endpoint) -> io::Result<()> {
        drop(channel);
        self.notify(Notice::Retired(pid))
    }

    /// A blank taken that does not take its job (stopped, stuck): killed, never handed out;
    /// the parent's warden reaps it.
    pub(crate) fn kill(&self, pid: i32, channel: Endpoint) -> io::Result<()> {
        signal_tree(pid, libc::SIGKILL);
        self.give_back(pid, channel)
    }

    /// Gives back every blank kept and keeps none until the next request; returns once they
    /// are gone, or after a second. Returns how many processes it held idle with the zygote
    /// itself.
    pub(crate) fn give_back_all(&mut self) -> io::Result<usize> {
        let held = 1 + self.blanks.len();
        self.target = 0;
        let mut given = Vec::with_capacity(self.blanks.len());
        while let Some((pid, channel)) = self.blanks.pop_front() {
            self.give_back(pid, channel)?;
            given.push(pid);
        }
        wait_gone(&given);
        Ok(held)
    }

    /// Forks blanks up to the target, within the caller's room (see the module's
    /// documentation), and stops when `interrupted` says a request is waiting.
    /// Running out of processes or fds here only stops it: the target drops to what exists.
    /// `fork` is the zygote's (0 in the child). Returns, in a new blank, its channel.
    pub(crate) fn replenish(
        &mut self,
        fork: &mut dyn FnMut() -> io::Result<i32>,
        interrupted: &mut dyn FnMut() -> io::Result<bool>,
    ) -> io::Result<Option<Endpoint>> {
        // Each blank forked takes one process of the room it counts in: the bound holds.
        let allowed = self.allowed();
        while self.blanks.len() < allowed && !interrupted()? {
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

    /// The caller is about to set its soft `RLIMIT_NPROC` to `limit` (`None`: unlimited):
    /// counts with it from now on, and gives back what it no longer allows. Returns how
    /// many blanks it holds then.
    pub(crate) fn announce(&mut self, limit: Option<u64>) -> io::Result<usize> {
        self.announced = Some(limit);
        self.fit()?;
        Ok(self.blanks.len())
    }

    /// Gives back the blanks beyond what the caller's room allows now (the newest first),
    /// and returns once they are gone.
    pub(crate) fn fit(&mut self) -> io::Result<()> {
        let allowed = self.allowed();
        if self.blanks.len() <= allowed {
            return Ok(());
        }
        let mut given = Vec::new();
        while self.blanks.len() > allowed {
            if let Some((pid, channel)) = self.blanks.pop_back() {
                self.give_back(pid, channel)?;
                given.push(pid);
            }
        }
        log::info!(
            target: "tether::zygote",
            "gave back {} blank(s): the caller's process limits leave room for {allowed}",
            given.len()
        );
        wait_gone(&given);
        Ok(())
    }

    /// How many blanks it may hold now: the target, and at most half of what the caller's
    /// limits would leave it without them.
    fn allowed(&mut self) -> usize {
        if let (Some(announced), Some(read)) = (self.announced, limits::caller_nproc(self.caller)) {
            if announced == read {
                self.announced = None; // in force: /proc shows it from now on
            }
        }
        match limits::process_room(self.caller, self.announced) {
            Some(room) => {
                let without_blanks = room.saturating_add(self.blanks.len() as i64);
                self.target
                    .min(usize::try_from(without_blanks / 2).unwrap_or(0))
            }
            None => self.target,
        }
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
