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
//!   bytecodes, with the GIL ([`answer`]): every thread, read safely.
//! - The dump signal ([`wrap`]), which the parent sends only to a process that did not
//!   start answering soon (its main thread busy in C, holding the GIL or not), runs
//!   `faulthandler`'s dump of the thread it interrupts, passed on to the main thread: the
//!   one thread a signal handler can read without a lock (another thread's state may be
//!   half made or half freed at that moment).
//!
//! Only the channel registered is ever written to ([`adopt`]): it is moved to a private
//! high fd, and before every write both handlers check that the number still names that
//! socket (`st_dev`, `st_ino`); a program that closed it and reused the number gets
//! nothing. A program that installs its own handler for either signal [`withdraw`]s the
//! process: the parent is told, and sends neither signal again.
//!
//! One dump at a time, and one per request: whichever way starts first answers. Everything
//! the signal handlers do is async-signal-safe: atomics, `fstat`, `send`, `tgkill`,
//! `rt_tgsigqueueinfo`, and the calls of the handlers they wrap.

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};

use crate::codec::{Reader, Writer};

/// The fd the answers go to (the sending end of the parent's stacks channel, moved to a
/// private high number at registration), and its identity then: before every write the
/// handlers check that the number still names that socket, so that a program that closed
/// it and opened something else under the same number never gets a byte of ours.
static FD: AtomicI32 = AtomicI32::new(-1);
static DEV: AtomicU64 = AtomicU64::new(0);
static INO: AtomicU64 = AtomicU64::new(0);
/// Set once the program installs its own handler for one of tether's signals: from then on
/// this process writes nothing more (the parent, told so, sends nothing more).
static WITHDRAWN: AtomicBool = AtomicBool::new(false);
/// The interpreter's wakeup fd (`signal.set_wakeup_fd`), -1 when none: Python's own
/// handler writes the signal's number there, so while the program has one the request
/// signal is not passed to Python's handler.
static WAKEUP: AtomicI32 = AtomicI32::new(-1);
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
const WITHDRAW: u8 = b'w';

/// A marker read back by the parent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    Start(u64),
    End(u64),
    /// The program installed its own handler for one of tether's signals: never send them
    /// to this process again.
    Withdraw,
}

impl Marker {
    /// The datagram, written without allocating (a signal handler sends it).
    pub(crate) fn encode(self) -> [u8; MARKER_LEN] {
        let (kind, id) = match self {
            Marker::Start(id) => (START, id),
            Marker::End(id) => (END, id),
            Marker::Withdraw => (WITHDRAW, 0),
        };
        Writer::fixed().u8(0).u8(kind).u64(id).array()
    }

    /// The marker in `datagram`, or `None` for a piece of a dump.
    pub(crate) fn decode(datagram: &[u8]) -> Option<Marker> {
        if datagram.len() != MARKER_LEN {
            return None;
        }
        let mut r = Reader::new(datagram, "stacks marker");
        let (nul, kind, id) = (r.u8().ok()?, r.u8().ok()?, r.u64().ok()?);
        match (nul, kind) {
            (0, START) => Some(Marker::Start(id)),
            (0, END) => Some(Marker::End(id)),
            (0, WITHDRAW) => Some(Marker::Withdraw),
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
            uid: rustix::process::getuid().as_raw(),
            value,
            _rest: [0; 96],
        }
    }
}

/// What `TETHER_STACKS_FD` holds: `FD:INODE`, the channel's fd number and its socket's
/// inode (so that a stray value never names some other socket of the program).
pub fn env_value(fd: RawFd, inode: u64) -> String {
    format!("{fd}:{inode}")
}

/// The fd and inode in a `TETHER_STACKS_FD` value; `None` for anything else.
pub fn parse_env_value(value: &str) -> Option<(RawFd, u64)> {
    let (fd, inode) = value.split_once(':')?;
    Some((fd.parse().ok()?, inode.parse().ok()?))
}

/// `(st_dev, st_ino)` of `fd`; async-signal-safe (one `fstat`).
fn identity(fd: RawFd) -> Option<(u64, u64)> {
    if fd < 0 {
        return None;
    }
    // SAFETY: stat is plain data; zeroed is a valid value to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat on an fd number with a valid buffer; async-signal-safe.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_dev, st.st_ino))
}

/// Whether `fd` is a stacks channel: a Unix datagram socket, and when `inode` is given, that
/// very socket.
pub fn is_channel(fd: RawFd, inode: Option<u64>) -> bool {
    use rustix::net::{sockopt, AddressFamily, SocketType};
    if fd < 0 {
        return false;
    }
    // SAFETY: the fd is only inspected for the duration of this call; an fd that is not open
    // makes the calls fail.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    sockopt::socket_type(borrowed) == Ok(SocketType::DGRAM)
        && sockopt::socket_domain(borrowed) == Ok(AddressFamily::UNIX)
        && inode.map_or(true, |ino| identity(fd).is_some_and(|(_, i)| i == ino))
}

/// The lowest fd number the channel is moved to, when the fd limit allows: far above the
/// numbers a program's own files get, so that it is not closed or replaced by accident.
const PRIVATE_FD: RawFd = 1000;

/// Makes `fd` (checked with [`is_channel`]) this process's answering channel: moved to a
/// private high number (close-on-exec; `fd` itself is closed) when the fd limit allows,
/// its identity recorded for the checks before every write. Returns the fd it now has.
/// On an error nothing was changed.
pub fn adopt(fd: RawFd, inode: Option<u64>) -> io::Result<RawFd> {
    if !is_channel(fd, inode) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fd {fd} is not a tether stacks channel"),
        ));
    }
    let (dev, ino) = identity(fd).ok_or_else(io::Error::last_os_error)?;
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    let mut kept = fd;
    if fd < PRIVATE_FD && soft > PRIVATE_FD as u64 + 16 {
        // SAFETY: F_DUPFD_CLOEXEC makes a new fd of ours; the old one is then closed.
        let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, PRIVATE_FD) };
        if moved >= 0 {
            // SAFETY: `fd` is the channel's old number, no longer used.
            unsafe { libc::close(fd) };
            kept = moved;
        }
    }
    if kept == fd {
        // SAFETY: sets close-on-exec on the channel's fd.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    DEV.store(dev, Ordering::SeqCst);
    INO.store(ino, Ordering::SeqCst);
    FD.store(kept, Ordering::SeqCst);
    WITHDRAWN.store(false, Ordering::SeqCst);
    Ok(kept)
}

/// The channel's fd when it still names the socket registered and this process has not
/// withdrawn; async-signal-safe.
fn owned() -> Option<RawFd> {
    if WITHDRAWN.load(Ordering::SeqCst) {
        return None;
    }
    let fd = FD.load(Ordering::SeqCst);
    let want = (DEV.load(Ordering::SeqCst), INO.load(Ordering::SeqCst));
    (identity(fd) == Some(want)).then_some(fd)
}

/// The channel's fd, for a child of this process's own that answers through it
/// (`faulthandler`'s registration).
pub fn channel() -> Option<RawFd> {
    owned()
}

/// The program installed its own handler for one of tether's signals: tells the parent
/// (which then never sends them again) and answers nothing more.
pub fn withdraw() {
    if let Some(fd) = owned() {
        send(fd, &Marker::Withdraw.encode());
    }
    WITHDRAWN.store(true, Ordering::SeqCst);
}

/// Notes the interpreter's wakeup fd (-1: none), as `signal.set_wakeup_fd` sets it.
pub fn set_wakeup_fd(fd: RawFd) {
    WAKEUP.store(fd, Ordering::SeqCst);
}

/// Wraps the handler `faulthandler.register` installed for `signal` (writing to the
/// adopted channel, for the interrupted thread only) in one that writes the markers around
/// each dump: the dump signal. Calling it again changes nothing.
pub fn wrap(signal: i32) -> io::Result<()> {
    install(signal, &DUMPER, on_dump, libc::SA_RESTART)
}

/// Wraps the handler Python's `signal.signal` installed for `signal` (one that calls
/// [`answer`]) in one that notes the request and makes the main thread take the signal:
/// the request signal.
pub fn wrap_request(signal: i32) -> io::Result<()> {
    install(signal, &REQUESTER, on_request, 0)
}

fn install(signal: i32, wrapped: &Wrapped, ours: Ours, flags: libc::c_int) -> io::Result<()> {
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
    action.sa_flags |= libc::SA_SIGINFO | flags;
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

/// Runs `dump` (which writes to the channel's fd, given) between the markers of request
/// `id`, unless a dump is being written, `id` was answered already, or the channel's fd no
/// longer names the socket registered; returns whether it ran.
fn answer_with(id: u64, dump: impl FnOnce(RawFd)) -> bool {
    if id != 0 && id <= ANSWERED.load(Ordering::SeqCst) {
        return false;
    }
    if DUMPING.swap(true, Ordering::SeqCst) {
        return false;
    }
    let ran = match owned() {
        Some(fd) => {
            send(fd, &Marker::Start(id).encode());
            dump(fd);
            send(fd, &Marker::End(id).encode());
            ANSWERED.fetch_max(id, Ordering::SeqCst);
            true
        }
        None => false,
    };
    DUMPING.store(false, Ordering::SeqCst);
    ran
}

/// The line that follows a dump written from the signal handler.
pub const ONE_THREAD: &str = "(only the thread the request interrupted is shown: its \
interpreter could not answer between two bytecodes, and from a signal handler the other \
threads cannot be read safely)\n";

/// This process's pid and the calling thread's id: two system calls, async-signal-safe.
fn this_thread() -> (i32, i32) {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    (pid, rustix::thread::gettid().as_raw_nonzero().get())
}

extern "C" fn on_dump(signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: errno is thread-local; it is put back before returning to the code the signal
    // interrupted.
    let errno = unsafe { *libc::__errno_location() };
    let (pid, tid) = this_thread();
    if tid != pid && !info.is_null() {
        // The thread that matters is the main one (the one that could not answer): pass
        // the request on to it, id and all. rt_tgsigqueueinfo to this process's own main
        // thread is async-signal-safe.
        // SAFETY: `info` is the kernel's valid siginfo_t for this signal.
        unsafe { libc::syscall(libc::SYS_rt_tgsigqueueinfo, pid, pid, signal, info) };
    } else {
        answer_with(request_id(info), |fd| {
            DUMPER.call(signal, info, ctx);
            send(fd, ONE_THREAD.as_bytes());
        });
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

extern "C" fn on_request(signal: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: as in `on_dump`.
    let errno = unsafe { *libc::__errno_location() };
    let id = request_id(info);
    // With a wakeup fd, Python's handler would write into it: the dump signal answers.
    if owned().is_some() && WAKEUP.load(Ordering::SeqCst) < 0 {
        if id != 0 {
            PENDING.fetch_max(id, Ordering::SeqCst);
        }
        let (pid, tid) = this_thread();
        if tid != pid {
            // Python runs its handlers in the main thread only: interrupt that thread's
            // wait, or its handler would run only once the wait ends.
            // SAFETY: tgkill to this process's own main thread; async-signal-safe.
            unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, signal) };
        } else {
            REQUESTER.call(signal, info, ctx);
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// The request the interpreter is to answer now (taken: 0 once taken), from Python's
/// handler of the request signal.
pub fn take_request() -> u64 {
    PENDING.swap(0, Ordering::SeqCst)
}

/// Answers request `id` with the text `make` gives (every thread's stack, as `faulthandler`
/// writes it, and what this process answers for its own children), from the main thread;
/// nothing when it was answered already, a dump is being written or the channel is gone.
/// The answer is claimed (its start marker sent) before `make` runs: a dump signal that
/// comes meanwhile finds it under way and writes nothing.
pub fn answer(id: u64, make: impl FnOnce() -> Vec<u8>) -> bool {
    const PIECE: usize = 32 << 10;
    answer_with(id, |fd| {
        for piece in make().chunks(PIECE) {
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
        for marker in [
            Marker::Start(0),
            Marker::End(u64::MAX),
            Marker::Start(77),
            Marker::Withdraw,
        ] {
            assert_eq!(Marker::decode(&marker.encode()), Some(marker));
        }
        assert_eq!(Marker::decode(b"  File \"x.py\""), None);
        assert_eq!(Marker::decode(b"0123456789"), None);
        let mut unknown = Marker::End(1).encode();
        unknown[1] = b'x';
        assert_eq!(Marker::decode(&unknown), None);
    }

    #[test]
    fn nothing_is_written_once_the_channel_fd_names_another_socket() {
        use rustix::net::{socketpair, AddressFamily, SocketFlags, SocketType};
        use std::os::fd::AsRawFd;
        let pair = || {
            socketpair(
                AddressFamily::UNIX,
                SocketType::DGRAM,
                SocketFlags::CLOEXEC,
                None,
            )
            .unwrap()
        };
        let (parent, child) = pair();
        let (theirs, their_other_end) = pair();
        rustix::io::ioctl_fionbio(&parent, true).unwrap();
        rustix::io::ioctl_fionbio(&theirs, true).unwrap();
        let inode = identity(child.as_raw_fd()).unwrap().1;
        assert!(adopt(child.as_raw_fd(), Some(inode + 1)).is_err());
        let fd = adopt(child.as_raw_fd(), Some(inode)).unwrap();
        std::mem::forget(child); // adopt closed or kept it: the fd is the channel's now
        assert!(answer(1, || b"a stack".to_vec()));
        let mut buf = [0u8; 64];
        let mut got = Vec::new();
        while let Ok(n) = rustix::io::read(&parent, &mut buf) {
            got.push(buf[..n].to_vec());
        }
        assert_eq!(got.len(), 3, "{got:?}");
        // The program puts a socket of its own under the channel's number.
        // SAFETY: dup2 onto the fd adopted above, which this test owns.
        assert_eq!(unsafe { libc::dup2(their_other_end.as_raw_fd(), fd) }, fd);
        assert!(!answer(2, || b"a stack".to_vec()));
        assert!(rustix::io::read(&theirs, &mut buf).is_err());
        // SAFETY: closes the fd dup2 made.
        unsafe { libc::close(fd) };
    }

    #[test]
    fn the_environment_names_the_fd_and_its_socket() {
        assert_eq!(parse_env_value(&env_value(5, 1234)), Some((5, 1234)));
        assert_eq!(parse_env_value("5"), None);
        assert_eq!(parse_env_value("x:1"), None);
    }
}
