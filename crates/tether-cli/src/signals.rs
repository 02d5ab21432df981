//! The launcher's signals: the stop signals (SIGINT, SIGTERM, SIGHUP and those of
//! `--signals-to-handle`, forwarded to the ranks) and SIGCHLD (exits to reap) are blocked in
//! every thread and read from a signalfd.
//!
//! [`block`] runs while the process has one thread, before the supervisor is forked, so that
//! every thread inherits the mask. The ranks get an empty mask from tether-core whatever
//! the launcher's is. The keeper and the supervisor set up the same way ([`handled`],
//! [`set_up`]).

use crate::config::Config;
use crate::output::message;
use crate::reaper;
use crate::signalfd::SignalFd;

/// The signals the launcher handles: the stop signals, SIGCHLD, and those that ask for the
/// ranks' stacks (the keeper forwards them to the supervisor, which prints the stacks).
pub fn handled(cfg: &Config) -> Vec<i32> {
    let mut handled = cfg.stop_signals.clone();
    handled.push(libc::SIGCHLD);
    handled.extend(crate::stacks::hangs::stack_signals(cfg));
    handled
}

/// The set-up the keeper and the supervisor share, with `handled` (theirs: [`handled`], and
/// the keeper's SIGWINCH) blocked already: their signalfd, and the process made a child
/// subreaper (what the ranks leave behind comes back to it; should it fail, they "may
/// outlive `whom`"). `None` after saying why there is no signalfd.
pub fn set_up(handled: &[i32], whom: &str) -> Option<SignalFd> {
    let signals = match SignalFd::new(handled) {
        Ok(fd) => fd,
        Err(err) => {
            message(&format!(
                "tether: cannot create a signalfd: {}{}",
                tether_core::strerror(&err),
                tether_core::limit_hint(&err)
            ));
            return None;
        }
    };
    if let Err(err) = reaper::become_subreaper() {
        message(&format!(
            "tether: warning: cannot become a child subreaper ({err}); processes that ranks \
             leave behind may outlive {whom}"
        ));
    }
    Some(signals)
}

/// The next signal pending on `signals`, or `None` when none is. The asker of a stack
/// signal that `tether stacks` queued is noted for the reply ([`crate::stacks::reply`]).
pub fn next(signals: &SignalFd) -> Option<i32> {
    let info = signals.next_info()?;
    crate::stacks::reply::note(&info);
    Some(info.ssi_signo as i32)
}
