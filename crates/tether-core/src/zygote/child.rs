//! A child of the zygote, from its fork to the moment it runs its job: it closes every fd
//! of the zygote but its own, moves the request's fds to their numbers, takes the caller's
//! attributes, and (a blank) waits for its part of a request first. What runs here runs in
//! a fresh fork of the single-threaded zygote.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use crate::channel::{Endpoint, Recv};
use crate::codec::malformed;
use crate::launch;
use crate::memfd::read_memfd;
use crate::zygote::wire::{decode_job, Common};

/// What a child of the zygote runs: handed to the embedding, in the child, by [`super::serve`].
#[derive(Debug)]
pub struct Job {
    pub rank: u32,
    /// The caller's environment, for the embedding to install.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    /// The request's payload (a sealed memfd).
    pub payload: OwnedFd,
    /// The write end of this child's report pipe (close-on-exec).
    pub report: OwnedFd,
    /// Why the caller's attributes could not all be applied (the child reports it).
    pub error: Option<io::Error>,
}

impl Job {
    /// The whole payload.
    pub fn read_payload(&self) -> io::Result<Vec<u8>> {
        read_payload(&self.payload)
    }
}

/// The whole of a payload memfd.
pub fn read_payload(fd: &OwnedFd) -> io::Result<Vec<u8>> {
    let size = rustix::fs::fstat(fd)?.st_size as usize;
    read_memfd(fd, size)
}

/// The fds a new child takes: the shared ones go to their target numbers, the payload and
/// report to free numbers; every other fd of the zygote is closed. Works on raw numbers: the
/// zygote's own fd owners have been forgotten in the child.
pub(super) struct Parts {
    pub(super) rank: u32,
    pub(super) common: Common,
    pub(super) payload: RawFd,
    pub(super) shared: Vec<RawFd>,
    pub(super) report: RawFd,
}

impl Parts {
    /// Takes the fds and attributes of the request. Every fd of the zygote but these is
    /// closed; the report pipe moves first, so that a later failure can be reported on it.
    pub(super) fn become_child(self) -> Served {
        let mut all = vec![self.report, self.payload];
        all.extend(&self.shared);
        if close_all_but(&all).is_err() {
            return Served::Exit(SETUP_FAILED);
        }
        let Ok(report) = move_avoiding(self.report, &self.common.targets) else {
            return Served::Exit(SETUP_FAILED);
        };
        // SAFETY: `move_avoiding` made this fd for us alone.
        let report = unsafe { OwnedFd::from_raw_fd(report) };
        match self.into_job(report.as_raw_fd()) {
            Ok(job) => {
                std::mem::forget(report); // now owned by the job
                Served::Child(job)
            }
            Err(err) => {
                let text = format!("tether could not set up this process: {err}\n");
                let frame = crate::report::encode("OSError", text.as_bytes(), &[]);
                let _ = rustix::io::write(&report, &frame);
                Served::Exit(SETUP_FAILED)
            }
        }
    }

    /// Moves the payload to a free number and the shared fds to their targets, and applies
    /// the caller's attributes (a failure there is the job's to report).
    fn into_job(self, report: RawFd) -> io::Result<Job> {
        let Parts {
            rank,
            common,
            payload,
            shared,
            ..
        } = self;
        if shared.len() != common.targets.len() {
            return Err(malformed("zygote message"));
        }
        let payload = move_avoiding(payload, &common.targets)?;
        // SAFETY: `move_avoiding` made this fd for us alone.
        let payload = unsafe { OwnedFd::from_raw_fd(payload) };
        let moved = shared
            .iter()
            .map(|&fd| move_avoiding(fd, &common.targets))
            .collect::<io::Result<Vec<RawFd>>>()?;
        for (&fd, &target) in moved.iter().zip(&common.targets) {
            // SAFETY: dup2 onto a number this child chose; clears close-on-exec on the target.
            if unsafe { libc::dup2(fd, target) } < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is our temporary copy.
            unsafe { libc::close(fd) };
        }
        let error = common.attrs.apply().err();
        Ok(Job {
            rank,
            env: common.attrs.env,
            payload,
            // SAFETY: the caller hands over `report`, a fd of ours alone.
            report: unsafe { OwnedFd::from_raw_fd(report) },
            error,
        })
    }
}

/// Moves `fd` to the lowest free number outside `avoid` (close-on-exec), closing `fd`.
fn move_avoiding(fd: RawFd, avoid: &[i32]) -> io::Result<RawFd> {
    let new = dup_avoiding(fd, avoid)?;
    // SAFETY: the original is ours alone and has just been copied.
    unsafe { libc::close(fd) };
    Ok(new)
}

/// A close-on-exec copy of `fd` at the lowest free number that is not in `avoid`.
fn dup_avoiding(fd: RawFd, avoid: &[i32]) -> io::Result<RawFd> {
    let mut rejected = Vec::new();
    let found = loop {
        // SAFETY: F_DUPFD_CLOEXEC on an fd this process holds.
        let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if new < 0 {
            break Err(io::Error::last_os_error());
        }
        if !avoid.contains(&new) {
            break Ok(new);
        }
        rejected.push(new);
    };
    for fd in rejected {
        // SAFETY: copies made above, ours alone.
        unsafe { libc::close(fd) };
    }
    found
}

/// Closes every fd above 2 except `keep`.
fn close_all_but(keep: &[RawFd]) -> io::Result<()> {
    let mut keep = keep.to_vec();
    keep.sort_unstable();
    let mut low = 3u32;
    for fd in keep.into_iter().map(|fd| fd as u32).chain([u32::MAX]) {
        if fd > low {
            // SAFETY: close_range closes fds this process holds; nothing refers to them now.
            let rc = unsafe { libc::syscall(libc::SYS_close_range, low, fd - 1, 0u32) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        low = low.max(fd.saturating_add(1));
    }
    Ok(())
}

/// A blank child: watched until a request takes it, it waits for its job on `channel`, and
/// exits quietly when the zygote goes away first.
pub(super) fn blank_main(channel: Endpoint, parent: i32, zygote: u32) -> Served {
    if launch::setup_forked_child(parent, true).is_err() {
        return Served::Exit(SETUP_FAILED);
    }
    let raw = channel.as_fd().as_raw_fd();
    if close_all_but(&[raw]).is_err() {
        return Served::Exit(SETUP_FAILED);
    }
    let title = format!("tether blank of zygote {zygote} (ready to run a rank of pid {parent})");
    let _ = crate::title::set(&title, super::BLANK_COMM);
    let message = match channel.recv(None) {
        Ok(Recv::Message(m)) => m,
        _ => return Served::Exit(0),
    };
    let _ = channel.into_fd().into_raw_fd(); // closed by the fd placement
    let mut fds: Vec<RawFd> = message
        .fds
        .into_iter()
        .map(IntoRawFd::into_raw_fd)
        .collect();
    let (Ok((rank, common)), true) = (decode_job(&message.data), fds.len() >= 2) else {
        return Served::Exit(SETUP_FAILED);
    };
    let report = fds.pop().unwrap_or(-1);
    let payload = fds.remove(0);
    let parts = Parts {
        rank,
        common,
        payload,
        shared: fds,
        report,
    };
    parts.become_child()
}

/// What [`super::serve`] returns: only ever in a child, or when the zygote should exit.
#[derive(Debug)]
pub enum Served {
    /// In a new child: run this.
    Child(Job),
    /// Exit with this code: 0 when the parent closed the request channel (or a blank's
    /// zygote went away), non-zero in a child that could not be set up (its report says
    /// why when it could be written).
    Exit(i32),
}

/// The exit code of a child that could not be set up.
pub const SETUP_FAILED: i32 = 111;
