//! The child's side: a signal handler around `faulthandler`'s that brackets each dump with
//! a start and an end marker carrying the request's id, and the markers' wire format.
//!
//! `faulthandler` writes a dump with many `write` calls and no terminator; the markers tell
//! the parent when a dump is whole (no settle time, no dump cut short by a slow scheduler)
//! and which request it answers (a dump that arrives after its request gave up is
//! dropped). Everything in the handler is async-signal-safe: atomics, `send`, and the call
//! of the handler it wraps.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

/// The fd the markers go to (the sending end of the parent's stacks channel).
static FD: AtomicI32 = AtomicI32::new(-1);
/// `faulthandler`'s handler, and whether it takes `siginfo` (`SA_SIGINFO`).
static WRAPPED: AtomicUsize = AtomicUsize::new(0);
static WRAPPED_SIGINFO: AtomicBool = AtomicBool::new(false);

/// A marker datagram: a NUL byte (a dump is ASCII text and never holds one), the kind, and
/// the request id (little-endian).
const MARKER_LEN: usize = 10;
const START: u8 = b's';
const END: u8 = b'e';

/// A marker read back by the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    Start(u64),
    End(u64),
}

impl Marker {
    pub(crate) fn encode(self) -> [u8; MARKER_LEN] {
        let (kind, id) = match self {
            Marker::Start(id) => (START, id),
            Marker::End(id) => (END, id),
        };
        let mut out = [0u8; MARKER_LEN];
        out[1] = kind;
        out[2..].copy_from_slice(&id.to_le_bytes());
        out
    }

    /// The marker in `datagram`, or `None` for a piece of a dump.
    pub(crate) fn decode(datagram: &[u8]) -> Option<Marker> {
        if datagram.len() != MARKER_LEN || datagram[0] != 0 {
            return None;
        }
        let id = u64::from_le_bytes(datagram[2..].try_into().ok()?);
        match datagram[1] {
            START => Some(Marker::Start(id)),
            END => Some(Marker::End(id)),
            _ => None,
        }
    }
}

/// `siginfo_t` as the kernel lays out a queued signal (`SI_QUEUE`): pid, uid, then the
/// value, after the three leading ints (padded to eight bytes).
#[repr(C)]
pub(crate) struct QueuedInfo {
    pub signo: i32,
    pub errno: i32,
    pub code: i32,
    _pad: i32,
    pub pid: i32,
    pub uid: u32,
    pub value: u64,
    _rest: [u8; 96],
}

const _: () = assert!(std::mem::size_of::<QueuedInfo>() == std::mem::size_of::<libc::siginfo_t>());

impl QueuedInfo {
    /// A queued `signal` carrying `value`, from this process.
    pub(crate) fn new(signal: i32, value: u64) -> QueuedInfo {
        QueuedInfo {
            signo: signal,
            errno: 0,
            code: libc::SI_QUEUE,
            _pad: 0,
            pid: std::process::id() as i32,
            // SAFETY: getuid cannot fail.
            uid: unsafe { libc::getuid() },
            value,
            _rest: [0; 96],
        }
    }
}

/// Whether `fd` is a stacks channel: a Unix datagram socket (so that a stray
/// `TETHER_STACKS_FD` never makes a process write its stacks into some other file).
pub fn is_channel(fd: RawFd) -> bool {
    use rustix::net::{sockopt, AddressFamily, SocketType};
    if fd < 0 {
        return false;
    }
    // SAFETY: the fd is only inspected for the duration of this call; an fd that is not open
    // makes the calls fail.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    sockopt::socket_type(fd) == Ok(SocketType::DGRAM)
        && sockopt::socket_domain(fd) == Ok(AddressFamily::UNIX)
}

/// Wraps the handler `faulthandler.register` installed for `signal` (writing to `fd`) in one
/// that writes the markers around each dump. Calling it again only changes the fd.
pub fn wrap(signal: i32, fd: RawFd) -> io::Result<()> {
    // SAFETY: sigaction is plain data; zeroed is a valid value to fill.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads the current action of `signal` into `current`.
    if unsafe { libc::sigaction(signal, std::ptr::null(), &mut current) } != 0 {
        return Err(io::Error::last_os_error());
    }
    FD.store(fd, Ordering::SeqCst);
    let ours = on_signal as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);
    if current.sa_sigaction == ours as usize {
        return Ok(());
    }
    if current.sa_sigaction == libc::SIG_DFL || current.sa_sigaction == libc::SIG_IGN {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "no stack dump handler is registered for the signal",
        ));
    }
    WRAPPED.store(current.sa_sigaction, Ordering::SeqCst);
    WRAPPED_SIGINFO.store(current.sa_flags & libc::SA_SIGINFO != 0, Ordering::SeqCst);
    let mut action = current;
    action.sa_sigaction = ours as usize;
    action.sa_flags |= libc::SA_SIGINFO;
    // SAFETY: installs a valid SA_SIGINFO handler; the previous one is kept in WRAPPED.
    if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

extern "C" fn on_signal(signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; it is put back before returning to the code the signal
    // interrupted.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes a valid siginfo_t, laid out as `QueuedInfo` for SI_QUEUE.
    let id = match unsafe { info.cast::<QueuedInfo>().as_ref() } {
        Some(queued) if queued.code == libc::SI_QUEUE => queued.value,
        _ => 0,
    };
    let fd = FD.load(Ordering::SeqCst);
    send(fd, &Marker::Start(id).encode());
    let wrapped = WRAPPED.load(Ordering::SeqCst);
    if wrapped != 0 {
        if WRAPPED_SIGINFO.load(Ordering::SeqCst) {
            // SAFETY: WRAPPED holds the SA_SIGINFO handler that was installed for `signal`.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(wrapped) };
            f(signal, info, ctx);
        } else {
            // SAFETY: WRAPPED holds the plain handler that was installed for `signal`.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(wrapped) };
            f(signal);
        }
    }
    send(fd, &Marker::End(id).encode());
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// One datagram, retried on EINTR; errors are dropped (the parent may be gone).
fn send(fd: RawFd, data: &[u8]) {
    loop {
        // SAFETY: send on an fd number with a valid buffer; async-signal-safe.
        let n = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL) };
        if n >= 0 || io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_survive_the_wire_and_text_is_no_marker() {
        for marker in [Marker::Start(0), Marker::End(u64::MAX), Marker::Start(77)] {
            assert_eq!(Marker::decode(&marker.encode()), Some(marker));
        }
        assert_eq!(Marker::decode(b"  File \"x.py\""), None);
        assert_eq!(Marker::decode(b"0123456789"), None);
        let mut unknown = Marker::End(1).encode();
        unknown[1] = b'x';
        assert_eq!(Marker::decode(&unknown), None);
    }
}
