//! Signals read from a signalfd: [`block`] (and [`restore`]) a set in the calling thread, and
//! [`SignalFd`], which reads the blocked signals that are pending.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

fn set_of(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the zeroed set; sigaddset only writes into it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &sig in signals {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// The signal mask in force before [`block`], to put back with [`restore`].
pub struct SavedMask(libc::sigset_t);

/// Blocks `signals` in the calling thread (and so in every thread it starts).
pub fn block(signals: &[i32]) -> io::Result<SavedMask> {
    let set = set_of(signals);
    // SAFETY: sigset_t is plain data; pthread_sigmask fills `old`.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is an initialised signal set and `old` a place for the previous mask.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(SavedMask(old))
}

/// Puts back the mask that [`block`] replaced.
pub fn restore(saved: SavedMask) {
    // SAFETY: `saved.0` is the mask pthread_sigmask returned.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &saved.0, std::ptr::null_mut()) };
}

/// A non-blocking signalfd for a set of signals.
pub struct SignalFd {
    fd: OwnedFd,
}

impl SignalFd {
    pub fn new(signals: &[i32]) -> io::Result<SignalFd> {
        let set = set_of(signals);
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
        self.next_info().map(|info| info.ssi_signo as i32)
    }

    /// The next pending signal and the value queued with it (`sigqueue`), if any.
    pub fn next_queued(&self) -> Option<(i32, Option<u64>)> {
        let info = self.next_info()?;
        let queued = (info.ssi_code == libc::SI_QUEUE).then_some(info.ssi_ptr);
        Some((info.ssi_signo as i32, queued))
    }

    /// The next pending signal as the kernel describes it.
    pub fn next_info(&self) -> Option<libc::signalfd_siginfo> {
        // SAFETY: signalfd_siginfo is plain data, valid when zeroed.
        let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::signalfd_siginfo>();
        loop {
            // SAFETY: reads at most `size` bytes into `info`, which is that large.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&mut info as *mut libc::signalfd_siginfo).cast(),
                    size,
                )
            };
            if n == size as isize {
                return Some(info);
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return None;
        }
    }

    /// Waits until a signal is pending (or `timeout` passes).
    pub fn wait(&self, timeout: Option<std::time::Duration>) {
        let timeout = timeout.map(|t| rustix::event::Timespec {
            tv_sec: t.as_secs() as _,
            tv_nsec: t.subsec_nanos() as _,
        });
        let mut fds = [rustix::event::PollFd::new(
            self,
            rustix::event::PollFlags::IN,
        )];
        let _ = rustix::event::poll(&mut fds, timeout.as_ref());
    }
}

impl AsFd for SignalFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
