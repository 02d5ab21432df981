//! The system calls that observe and reap a child, and move the bytes of its pipes: what the
//! warden thread does once an fd is ready.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::io::Errno;
use rustix::process::{
    kill_process, kill_process_group, waitpid, Pid, Signal, WaitId, WaitIdOptions, WaitOptions,
};

use crate::error::Error;
use crate::group::{Exit, GroupInner};
use crate::report::Report;
use crate::status::ExitStatus;

pub(super) fn now_monotonic() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Kills a child of ours that no interest holds, and reaps it.
pub(super) fn kill_and_reap(pid: i32) {
    // Our own child's pid stays reserved until it is reaped here.
    let Some(pid) = Pid::from_raw(pid) else {
        return;
    };
    let _ = kill_process(pid, Signal::KILL);
    let all = WaitOptions::from_bits_retain(libc::__WALL as u32);
    while matches!(waitpid(Some(pid), all), Err(Errno::INTR)) {}
}

/// A pidfd for `pid`, or `None` when no such process exists any more.
pub(super) fn open_pidfd(pid: i32) -> Result<Option<OwnedFd>, Errno> {
    let Some(raw) = rustix::process::Pid::from_raw(pid) else {
        return Ok(None);
    };
    match rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => Ok(Some(fd)),
        Err(Errno::SRCH) => Ok(None),
        Err(err) => Err(err),
    }
}

/// A sentinel that is readable at once: the read end of a pipe whose write end is closed.
pub(super) fn ended_sentinel() -> Result<OwnedFd, Error> {
    let (read, _write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    Ok(read)
}

pub(super) fn unknown_exit() -> Exit {
    Exit {
        status: ExitStatus::Unknown,
        at: now_monotonic(),
    }
}

/// Observes the exit of our child `pid` without reaping it, kills what it left in its
/// process group (the unreaped leader keeps that group id reserved), then reaps it. An
/// exit status that something else took is [`ExitStatus::Unknown`].
pub(super) fn reap_now(pidfd: BorrowedFd<'_>, pid: i32) -> ExitStatus {
    let mut ready = [rustix::event::PollFd::new(
        &pidfd,
        rustix::event::PollFlags::IN,
    )];
    let _ = rustix::event::poll(&mut ready, None);
    let status = match waitid(pidfd, true) {
        Ok(Some(status)) => status,
        Ok(None) | Err(_) => ExitStatus::Unknown,
    };
    // A group id owned by our unreaped child (or nobody's).
    if let Some(group) = Pid::from_raw(pid) {
        let _ = kill_process_group(group, Signal::KILL);
    }
    let _ = waitid(pidfd, false);
    status
}

/// Reads whatever the report pipe holds into member `index`'s report; returns false at end
/// of file or on error.
pub(super) fn drain(fd: BorrowedFd<'_>, group: &GroupInner, index: usize) -> bool {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match rustix::io::read(fd, &mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                let complete = group.lock().members[index]
                    .report
                    .push(&buf[..n], now_monotonic());
                if complete {
                    group.notify();
                }
            }
            Err(Errno::AGAIN) => return true,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
}

/// Reads a pipe whose writer is gone to its end into `report`.
pub(super) fn drain_into(fd: BorrowedFd<'_>, report: &mut Report) {
    let _ = rustix::io::ioctl_fionbio(fd, true);
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n @ 1..) = rustix::io::read(fd, &mut buf) {
        report.push(&buf[..n], now_monotonic());
    }
}

/// Writes what the payload socket takes; returns false once all is written or on error.
pub(super) fn feed(fd: BorrowedFd<'_>, data: &[u8], written: &mut usize) -> bool {
    while *written < data.len() {
        match rustix::net::send(fd, &data[*written..], rustix::net::SendFlags::NOSIGNAL) {
            Ok(n) => *written += n,
            Err(Errno::AGAIN) => return true,
            Err(Errno::INTR) => {}
            Err(_) => return false,
        }
    }
    false
}

/// The status of an exited child (`None` while it runs); with `keep` (`WNOWAIT`) it stays
/// unreaped.
pub(crate) fn waitid(pidfd: BorrowedFd<'_>, keep: bool) -> Result<Option<ExitStatus>, Errno> {
    let mut options = WaitIdOptions::EXITED | WaitIdOptions::NOHANG;
    if keep {
        options |= WaitIdOptions::NOWAIT;
    }
    let found = loop {
        match rustix::process::waitid(WaitId::PidFd(pidfd), options) {
            Err(Errno::INTR) => {}
            found => break found?,
        }
    };
    Ok(found.and_then(|info| {
        let status = info
            .exit_status()
            .or(info.terminating_signal())
            .unwrap_or(0);
        ExitStatus::from_siginfo(info.raw_code(), status)
    }))
}
