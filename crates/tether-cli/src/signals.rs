//! The launcher's signals: SIGINT, SIGTERM, SIGHUP (forwarded to the ranks) and SIGCHLD
//! (re-parented orphans to reap) are blocked in every thread and read from a signalfd.
//!
//! [`block`] must run first thing in `main`, before any thread exists, so that every
//! thread (tether-core's supervisor, the output pumps) inherits the mask. The ranks get an
//! empty mask from tether-core whatever the launcher's is.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

/// The signals the launcher handles itself.
pub const HANDLED: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD];

fn handled_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the zeroed set; sigaddset only writes into it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in HANDLED {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// Blocks the handled signals in the calling thread (and so in every thread it starts).
pub fn block() -> io::Result<()> {
    let set = handled_set();
    // SAFETY: `set` is an initialised signal set; the old mask is not asked for.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// A non-blocking signalfd for the handled signals.
pub struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    pub fn new() -> io::Result<SignalFd> {
        let set = handled_set();
        // SAFETY: a new signalfd (-1) for an initialised set; the flags are valid.
        let raw = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(SignalFd { fd })
    }

    /// The next pending signal, or `None` when none is pending.
    pub fn next(&self) -> Option<i32> {
        // SAFETY: signalfd_siginfo is plain data, valid when zeroed.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        loop {
            // SAFETY: reads at most `size` bytes into `info`, which is that large.
            let n = unsafe {
                libc::read(
                    std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                    (&mut info as *mut libc::signalfd_siginfo).cast(),
                    size,
                )
            };
            if n == size as isize {
                return Some(info.ssi_signo as i32);
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
    }
}

impl AsFd for SignalFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
