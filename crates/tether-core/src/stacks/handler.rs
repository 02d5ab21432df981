//! The child's side: the signal handlers that answer a request for stacks, and the
//! markers' wire format.
//!
//! Two ways to answer, each bracketing its dump with a start and an end marker carrying
//! the request's id (the markers tell the parent when a dump is whole, and which request
//! it answers: a dump that arrives after its request gave up is dropped):
//!
//! - The request signal ([`wrap_request`]) is answered by the interpreter itself: the
//!   handler notes the request and passes the signal to the main thread, whose blocking
//!   call it interrupts, and Python's own handler runs the dump there, between two
//!   bytecodes, with the GIL ([`answer`]). Reading the threads there is safe at any moment.
//! - The dump signal ([`wrap`]), which the parent sends only to a process that did not
//!   start answering soon (its main thread busy in C, holding the GIL or not), runs
//!   `faulthandler`'s dump from the signal handler: it answers wherever the program is, but
//!   reads the other threads without a lock, which CPython cannot make safe while a thread
//!   is being created or ending.
//!
//! One dump at a time, and one per request: whichever way starts first answers. Everything
//! the signal handlers do is async-signal-safe: atomics, `send`, `tgkill`, and the calls of
//! the handlers they wrap.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};

/// The fd the markers go to (the sending end of the parent's stacks channel).
static FD: AtomicI32 = AtomicI32::new(-1);
/// The dump signal's wrapped handler (`faulthandler`'s).
static DUMPER: Wrapped = Wrapped::new();
/// The request signal's wrapped handler (Python's own).
static REQUESTER: Wrapped = Wrapped::new();
/// The latest request the interpreter is yet to answer (0: none).
static PENDING: AtomicU64 = AtomicU64::new(0);
/// The latest request answered, either way.
static ANSWERED: AtomicU64 = AtomicU64::new(0);
/// Whether a dump is being written.
static DUMPING: AtomicBool = AtomicBool::new(false);

/// A handler that ours calls, and whether it takes `siginfo` (`SA_SIGINFO`).
struct Wrapped {
    handler: AtomicUsize,
    siginfo: AtomicBool,
}

impl Wrapped {
    const fn new() -> Wrapped {
        Wrapped {
            handler: AtomicUsize::new(0),
            siginfo: AtomicBool::new(false),
        }
    }

    fn call(&self, signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        let handler = self.handler.load(Ordering::SeqCst);
        if handler == 0 {
            return;
        }
        if self.siginfo.load(Ordering::SeqCst) {
            // SAFETY: `handler` is the SA_SIGINFO handler that was installed for `signal`.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(handler) };
            f(signal, info, ctx);
        } else {
            // SAFETY: `handler` is the plain handler that was installed for `signal`.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
            f(signal);
        }
    }
}

/// What our handler for a signal does.
type Ours = extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void);

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
/// that writes the markers around each dump: the dump signal. Calling it again only
/// changes the fd.
pub fn wrap(signal: i32, fd: RawFd) -> io::Result<()> {
    FD.store(fd, Ordering::SeqCst);
    install(signal, &DUMPER, on_dump)
}

/// Wraps the handler Python's `signal.signal` installed for `signal` (one that calls
/// [`answer`]) in one that notes the request and makes the main thread take the signal:
/// the request signal. `fd` is where the dumps go.
pub fn wrap_request(signal: i32, fd: RawFd) -> io::Result<()> {
    FD.store(fd, Ordering::SeqCst);
    install(signal, &REQUESTER, on_request)
}

fn install(signal: i32, wrapped: &Wrapped, ours: Ours) -> io::Result<()> {
    // SAFETY: sigaction is plain data; zeroed is a valid value to fill.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads the current action of `signal` into `current`.
    if unsafe { libc::sigaction(signal, std::ptr::null(), &mut current) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if current.sa_sigaction == ours as usize {
        return Ok(());
    }
    if current.sa_sigaction == libc::SIG_DFL || current.sa_sigaction == libc::SIG_IGN {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "no handler is registered for the signal",
        ));
    }
    wrapped
        .handler
        .store(current.sa_sigaction, Ordering::SeqCst);
    wrapped
        .siginfo
        .store(current.sa_flags & libc::SA_SIGINFO != 0, Ordering::SeqCst);
    let mut action = current;
    action.sa_sigaction = ours as usize;
    action.sa_flags |= libc::SA_SIGINFO;
    // SAFETY: installs a valid SA_SIGINFO handler; the previous one is kept in `wrapped`.
    if unsafe { libc::sigaction(signal, &action, std::ptr::null_mut()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The request id a queued signal carries (0 for one sent without).
fn request_id(info: *mut libc::siginfo_t) -> u64 {
    // SAFETY: the kernel passes a valid siginfo_t, laid out as `QueuedInfo` for SI_QUEUE.
    match unsafe { info.cast::<QueuedInfo>().as_ref() } {
        Some(queued) if queued.code == libc::SI_QUEUE => queued.value,
        _ => 0,
    }
}

/// Runs `dump` between the markers of request `id`, unless a dump is being written or `id`
/// was answered already; returns whether it ran.
fn answer_with(id: u64, dump: impl FnOnce()) -> bool {
    if id != 0 && id <= ANSWERED.load(Ordering::SeqCst) {
        return false;
    }
    if DUMPING.swap(true, Ordering::SeqCst) {
        return false;
    }
    let fd = FD.load(Ordering::SeqCst);
    send(fd, &Marker::Start(id).encode());
    dump();
    send(fd, &Marker::End(id).encode());
    ANSWERED.fetch_max(id, Ordering::SeqCst);
    DUMPING.store(false, Ordering::SeqCst);
    true
}

extern "C" fn on_dump(signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; it is put back before returning to the code the signal
    // interrupted.
    let errno = unsafe { *libc::__errno_location() };
    answer_with(request_id(info), || DUMPER.call(signal, info, ctx));
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

extern "C" fn on_request(signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: as in `on_dump`.
    let errno = unsafe { *libc::__errno_location() };
    let id = request_id(info);
    if id != 0 {
        PENDING.fetch_max(id, Ordering::SeqCst);
    }
    // SAFETY: plain system calls about this process.
    let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
    if tid != pid {
        // Python runs its handlers in the main thread only: interrupt that thread's wait,
        // or its handler would run only once the wait ends.
        // SAFETY: tgkill to this process's own main thread; async-signal-safe.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, signal) };
    } else {
        REQUESTER.call(signal, info, ctx);
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The request the interpreter is to answer now (taken: 0 once taken), from Python's
/// handler of the request signal.
pub fn take_request() -> u64 {
    PENDING.swap(0, Ordering::SeqCst)
}

/// Answers request `id` with `text` (every thread's stack, as `faulthandler` writes it),
/// from the main thread; nothing when it was answered already or a dump is being written.
pub fn answer(id: u64, text: &[u8]) -> bool {
    const PIECE: usize = 32 << 10;
    let fd = FD.load(Ordering::SeqCst);
    answer_with(id, || {
        for piece in text.chunks(PIECE) {
            send(fd, piece);
        }
    })
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
