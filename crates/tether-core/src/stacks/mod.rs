//! Stacks on demand: every Python process tether starts can be asked for the Python stack
//! of each of its threads, without being stopped and without ptrace.
//!
//! - The request is a real-time signal, [`signal`] (`SIGRTMIN+4`), so that SIGUSR1 and
//!   SIGUSR2 stay the program's own. It goes out queued through the process's pidfd and
//!   carries the request's id.
//! - A child answers on the sending end of its parent's stacks channel (the fd and socket
//!   named by [`FD_ENV`], or passed another way), in one of two ways ([`handler`]): its
//!   interpreter dumps every thread from Python's own handler of the request signal, in
//!   the main thread, between two bytecodes, which is safe at any moment; or, when that has
//!   not begun within [`DUMP_AFTER`] (the main thread runs C code, holding the GIL or not),
//!   the parent sends the dump signal, [`dump_signal`], on which `faulthandler` dumps the
//!   main thread from a C signal handler without taking the GIL (the one thread it can read
//!   safely there). Each dump is bracketed with markers carrying the request's id.
//! - A request changes nothing in what the program does. A child is not signalled when it
//!   no longer holds the channel (it closed or replaced the fd: it would have nowhere of
//!   its own to answer), when it installed its own handler for either signal, when its main
//!   thread blocks the request signal (a `sigwait` or a signalfd of the program's would
//!   take it) or waits in `pause()`/`sigsuspend()` (which any handler ends); the answer
//!   says which.
//! - The channel is one `SOCK_DGRAM` socket pair per parent process (one fd there, one in
//!   each child, whatever the number of children). The warden thread drains the
//!   receiving end; the kernel tags each datagram with its sender's pid (`SO_PASSCRED`),
//!   so the dumps of many processes at once are told apart. Nothing goes through the
//!   child's stdout or stderr, nor through a file.
//! - [`ask`] asks every target at once and waits for all of them in parallel, up to a
//!   timeout; a process that cannot answer (no handler, stopped, too slow) is reported as
//!   such with its state, and never holds up the others. With py-spy, the native frames
//!   are added ([`Request::py_spy`]).
//! - [`summary`] ends every block of stacks: the ranks grouped by where their main thread
//!   waits, and the ranks that are not where most others are, named.
//! - A request for the main thread alone ([`Request::main_thread`], what the run's watch
//!   samples) sends only the dump signal, whose handler restarts the calls it interrupts:
//!   `faulthandler` dumps the main thread from its signal handler, and Python's own
//!   handlers never run. Requests are asked one at a time in a process (one that comes
//!   while another is being answered waits for it), so that no request takes another's
//!   answer.
//! - `tether top PID` reads each rank's place ([`places`]) from a `tether run`, or from a
//!   process that started ranks itself, which listens for it ([`served`]).

mod answer;
mod collect;
pub mod handler;
mod native;
pub mod others;
pub mod places;
pub mod relay;
pub mod served;
mod summary;

use std::collections::HashMap;
use std::os::fd::{BorrowedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use answer::{Answer, Reply, Untouched};
pub(crate) use collect::{this_process as channel, Channel};
pub use summary::{place, ranks_words, summary, whereabouts, Whereabouts};

use crate::error::Error;
use crate::group::{Exit, Group};
use crate::proc::{self, process_state, Of};

/// The environment variable that names, in a child, the fd of its parent's stacks channel.
pub const FD_ENV: &str = "TETHER_STACKS_FD";

/// The environment variable that chooses the py-spy program for native frames (empty: none),
/// instead of the one found on `PATH`.
pub const PY_SPY_ENV: &str = "TETHER_PY_SPY";

/// The signal that asks for a dump: `SIGRTMIN+4`.
pub fn signal() -> i32 {
    libc::SIGRTMIN() + 4
}

/// The signal on which `faulthandler` dumps every thread at once: `SIGRTMIN+5`.
pub fn dump_signal() -> i32 {
    libc::SIGRTMIN() + 5
}

/// How long a process may take to begin its answer from its interpreter before the parent
/// sends the dump signal.
pub const DUMP_AFTER: Duration = Duration::from_millis(100);

/// The fd number of this process's stacks channel (its sending end, close-on-exec), for a
/// child this process forks or hands to the zygote, and its socket's inode (which the
/// child checks).
pub fn channel_fd() -> Result<(RawFd, u64), Error> {
    use std::os::fd::AsRawFd;
    let channel = collect::this_process()?;
    Ok((channel.sender().as_raw_fd(), channel.inode()))
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// What to ask for.
#[derive(Debug, Clone)]
pub struct Request {
    /// How long to wait for the Python stacks (and then for py-spy).
    pub timeout: Duration,
    /// py-spy's path, for the native frames too.
    pub py_spy: Option<PathBuf>,
    /// How long a process may take to begin answering from its interpreter before the dump
    /// signal is sent ([`DUMP_AFTER`] unless a test wants the signal path at once).
    pub dump_after: Duration,
    /// Only the main thread's stack, from the dump signal alone (see the module's
    /// documentation).
    pub main_thread: bool,
}

impl Request {
    /// A request for the Python stacks within `timeout`, with py-spy's view when given.
    pub fn new(timeout: Duration, py_spy: Option<PathBuf>) -> Request {
        Request {
            timeout,
            py_spy,
            dump_after: DUMP_AFTER,
            main_thread: false,
        }
    }

    /// A request for the main thread's stack alone within `timeout` (see the module's
    /// documentation).
    pub fn main_thread(timeout: Duration) -> Request {
        Request {
            timeout,
            py_spy: None,
            dump_after: Duration::ZERO,
            main_thread: true,
        }
    }

    /// The signal that asks.
    fn signal(&self) -> i32 {
        match self.main_thread {
            true => dump_signal(),
            false => signal(),
        }
    }
}

/// Held while a request is asked and answered: one at a time in a process.
static ASKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether `pid` catches `signal` (`SigCgt` in /proc/PID/status): only then may it be
/// sent, since the signal's default action ends a process.
fn catches(pid: i32, signal: i32) -> bool {
    proc::status(Of::Pid(pid)).is_some_and(|s| s.has_signal("SigCgt", signal))
}

/// Why `pid` must not be sent a request now, if it must not: a signal would reach no
/// channel of ours, or change what the program does.
fn leave_alone(channel: &Channel, pid: i32) -> Option<Untouched> {
    if channel.withdrawn(pid) {
        return Some(Untouched::OwnHandler);
    }
    if !holds_socket(pid, channel.inode()) {
        return Some(Untouched::ChannelGone);
    }
    main_thread_takes(channel, pid, signal())
}

/// Whether `pid` holds the socket `inode` on some fd (true when /proc does not tell).
fn holds_socket(pid: i32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    proc::fd_targets(pid).map_or(true, |fds| fds.iter().any(|fd| *fd == *want))
}

/// Whether the main thread of `pid` would take `signal` for itself, or wait where a
/// request would change what it does. A program that waits for the signal blocks it
/// while it is not in its wait, and the kernel unblocks it while it is: so each look reads
/// the thread's call before and after its `SigBlk`, a wait seen in either is the answer,
/// and a process once seen waiting for the signal is never sent it again (its wait may
/// have just ended, with the signal still unblocked while it waits for a CPU). The signal
/// kept blocked for some milliseconds is taken too (glibc blocks every signal for a moment
/// while it creates a thread, a program that waits for a signal in another way blocks it
/// for good).
fn main_thread_takes(channel: &Channel, pid: i32, signal: i32) -> Option<Untouched> {
    if channel.sigwaiting(pid) {
        return Some(Untouched::Blocked);
    }
    for _ in 0..10 {
        let before = main_thread_call(pid);
        let blocked = blocks(pid, signal);
        let after = main_thread_call(pid);
        if let Some(why) = [before, after]
            .iter()
            .find_map(|call| takes(pid, signal, call))
        {
            if why == Untouched::Blocked {
                channel.saw_sigwait(pid);
            }
            return Some(why);
        }
        if !blocked {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Some(Untouched::Blocked)
}

/// Whether the main thread of `pid` blocks `signal` (`SigBlk` in /proc/PID/status).
fn blocks(pid: i32, signal: i32) -> bool {
    proc::status(Of::Pid(pid)).is_some_and(|s| s.has_signal("SigBlk", signal))
}

/// The call the main thread of `pid` sleeps in (its number and first arguments, from
/// /proc/PID/syscall); nothing when it runs, or when /proc does not tell.
fn main_thread_call(pid: i32) -> Option<(i64, [u64; 3])> {
    let (number, args) = proc::syscall(pid)?;
    let mut first = [0u64; 3];
    for (slot, arg) in first.iter_mut().zip(args) {
        *slot = arg;
    }
    Some((number, first))
}

/// Whether `call` (see [`main_thread_call`]) is a wait a request would change: a call
/// that any signal handler ends for good (`pause`, `rt_sigsuspend`, `ppoll` on no fd
/// without a timeout), or a `sigwait` whose set holds `signal` (the kernel unblocks the
/// set while it waits).
fn takes(pid: i32, signal: i32, call: &Option<(i64, [u64; 3])>) -> Option<Untouched> {
    let (number, args) = (*call)?;
    #[cfg(target_arch = "x86_64")]
    if number == libc::SYS_pause {
        return Some(Untouched::Paused);
    }
    if number == libc::SYS_rt_sigsuspend
        || (number == libc::SYS_ppoll && args.iter().all(|&a| a == 0))
    {
        return Some(Untouched::Paused);
    }
    if number == libc::SYS_rt_sigtimedwait {
        // The set it waits for, read from its memory (taken as holding the signal when it
        // cannot be read).
        let set = proc::read_u64(pid, args[0]);
        if set.map_or(true, |set| {
            (1..=64).contains(&signal) && set & (1 << (signal - 1)) != 0
        }) {
            return Some(Untouched::Blocked);
        }
    }
    None
}

/// Sends `signal` queued with `id` through `pidfd`.
fn send(pidfd: BorrowedFd<'_>, signal: i32, id: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let info = handler::QueuedInfo::new(signal, id);
    // SAFETY: pidfd_send_signal with a pidfd of ours and a siginfo of the right size.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            &info as *const handler::QueuedInfo,
            0u32,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Member `index` of `group`: its pid, exit and sentinel (its pidfd).
fn live(group: &Group, index: usize) -> Option<(i32, Option<Exit>, RawFd)> {
    group.with_member(index, |m| (m.pid, m.exit, m.sentinel()))
}

/// Asks member `index` of `group` with `signal`; `None` once asked (the answer will come),
/// else the reply already known.
fn ask_one(
    channel: &Channel,
    (group, index): (&Group, usize),
    id: u64,
    signal: i32,
) -> (i32, Option<Reply>) {
    let found = live(group, index);
    let Some((pid, exit, sentinel)) = found else {
        return (0, Some(Reply::Unreachable(format!("no member {index}"))));
    };
    if let Some(exit) = exit {
        return (pid, Some(Reply::Exited(Some(exit.status))));
    }
    if !catches(pid, signal) {
        return (pid, Some(Reply::NoHandler));
    }
    if let Some(why) = leave_alone(channel, pid) {
        return (pid, Some(Reply::LeftAlone(why)));
    }
    channel.expect(pid, id);
    // SAFETY: a live member's sentinel is its pidfd, open as long as the group.
    let pidfd = unsafe { BorrowedFd::borrow_raw(sentinel) };
    match send(pidfd, signal, id) {
        Ok(()) => (pid, None),
        Err(err) => {
            channel.forget(pid, id);
            match err.raw_os_error() {
                Some(libc::ESRCH) => (pid, Some(Reply::Exited(None))),
                _ => (pid, Some(Reply::Unreachable(crate::error::strerror(&err)))),
            }
        }
    }
}

impl Group {
    /// Every member's stacks, asked at once (see [`ask`]), in member order.
    pub fn stacks(&self, request: &Request) -> Result<Vec<Answer>, Error> {
        let members: Vec<(&Group, usize)> = (0..self.len()).map(|i| (self, i)).collect();
        ask(&members, request)
    }
}

/// Asks every member in `members` (`(group, index)`) for its stacks at once, and waits for
/// the answers up to `request.timeout`; returns them in order.
pub fn ask(members: &[(&Group, usize)], request: &Request) -> Result<Vec<Answer>, Error> {
    let channel = collect::this_process()?;
    let _one_at_a_time = ASKING.lock().unwrap_or_else(|e| e.into_inner());
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let start = Instant::now();
    let deadline = start.checked_add(request.timeout).unwrap_or(start);
    let asked: Vec<(i32, Option<Reply>)> = members
        .iter()
        .map(|&member| ask_one(channel, member, id, request.signal()))
        .collect();
    let waiting: Vec<i32> = asked
        .iter()
        .filter(|(_, reply)| reply.is_none())
        .map(|&(pid, _)| pid)
        .collect();
    let by_pid: HashMap<i32, (&Group, usize)> = asked
        .iter()
        .zip(members)
        .map(|(&(pid, _), &member)| (pid, member))
        .collect();
    let silent = match request.main_thread {
        true => Vec::new(),
        false => channel.wait_started(id, &waiting, deadline.min(start + request.dump_after)),
    };
    for pid in silent {
        if let Some(&(group, index)) = by_pid.get(&pid) {
            send_dump_signal(channel, group, index, id);
        }
    }
    let mut gone = |pid: i32| by_pid.get(&pid).is_some_and(|(g, i)| g.exit(*i).is_some());
    let mut dumps = channel.collect(id, &waiting, deadline, &mut gone);
    log::info!(
        target: "tether::stacks",
        "asked {} process(es) for their stacks: {} answered in {:?}",
        waiting.len(),
        dumps.values().filter(|d| d.done).count(),
        start.elapsed()
    );
    let mut answers: Vec<Answer> = asked
        .into_iter()
        .map(|(pid, known)| {
            let reply = known.unwrap_or_else(|| {
                let member = by_pid.get(&pid).copied();
                reply_of(channel, pid, dumps.remove(&pid), member)
            });
            Answer {
                pid,
                reply,
                native: None,
            }
        })
        .collect();
    if let Some(py_spy) = &request.py_spy {
        add_native(&mut answers, py_spy, request.timeout);
    }
    Ok(answers)
}

/// Sends the dump signal for request `id` to member `index` of `group`, which has not begun
/// to answer from its interpreter, when it catches that signal and may be sent it.
fn send_dump_signal(channel: &Channel, group: &Group, index: usize, id: u64) {
    let Some((pid, None, sentinel)) = live(group, index) else {
        return;
    };
    if catches(pid, dump_signal()) && leave_alone(channel, pid).is_none() {
        // SAFETY: a live member's sentinel is its pidfd, open as long as the group.
        let _ = send(
            unsafe { BorrowedFd::borrow_raw(sentinel) },
            dump_signal(),
            id,
        );
    }
}

/// The reply of a process that was asked, from what arrived.
fn reply_of(
    channel: &Channel,
    pid: i32,
    dump: Option<collect::Dump>,
    member: Option<(&Group, usize)>,
) -> Reply {
    let dump = dump.unwrap_or_default();
    let text = || String::from_utf8_lossy(&dump.text).into_owned();
    if dump.done {
        return Reply::Stack(text());
    }
    if let Some(exit) = member.and_then(|(g, i)| g.exit(i)) {
        return Reply::Exited(Some(exit.status));
    }
    if !dump.started {
        if let Some(why) = leave_alone(channel, pid) {
            return Reply::LeftAlone(why);
        }
    }
    let state = process_state(pid);
    match dump.started {
        true => Reply::Cut {
            text: text(),
            state,
        },
        false => Reply::Silent { state },
    }
}

/// The reply of a process that is no member of a group (see [`others`]), from what arrived.
fn reply_of_other(channel: &Channel, pid: i32, dump: Option<collect::Dump>) -> Reply {
    match proc::exists(pid) {
        true => reply_of(channel, pid, dump, None),
        false => match dump {
            Some(d) if d.done => Reply::Stack(String::from_utf8_lossy(&d.text).into_owned()),
            _ => Reply::Exited(None),
        },
    }
}

/// Adds py-spy's view of every process still running.
fn add_native(answers: &mut [Answer], py_spy: &std::path::Path, timeout: Duration) {
    let live: Vec<usize> = (0..answers.len())
        .filter(|&i| !matches!(answers[i].reply, Reply::Exited(_) | Reply::Unreachable(_)))
        .collect();
    let pids: Vec<i32> = live.iter().map(|&i| answers[i].pid).collect();
    let views = native::dump(py_spy, &pids, timeout);
    for (i, view) in live.into_iter().zip(views) {
        answers[i].native = Some(view);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_in_pause_is_seen_and_a_running_one_is_not() {
        // SAFETY: fork in a test binary; the child only calls pause and _exit (via a signal).
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: async-signal-safe calls in the child.
            unsafe {
                libc::pause();
                libc::_exit(0);
            }
        }
        let end = Instant::now() + Duration::from_secs(10);
        let paused = |pid| takes(pid, signal(), &main_thread_call(pid)) == Some(Untouched::Paused);
        while !paused(child) && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(paused(child));
        assert!(!paused(std::process::id() as i32));
        assert!(!blocks(child, signal()));
        // SAFETY: kills and reaps the child forked above.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
    }

    #[test]
    fn this_process_does_not_catch_the_stack_signal_by_default() {
        assert!(!catches(std::process::id() as i32, signal()));
        assert!(!catches(-1, signal()));
    }

    #[test]
    fn silent_and_stopped_processes_are_described() {
        let answer = Answer {
            pid: 42,
            reply: Reply::Silent { state: Some('T') },
            native: None,
        };
        let text = answer.text(Duration::from_secs(2));
        assert!(text.contains("pid 42 did not answer within 2 s"), "{text}");
        assert!(text.contains("stopped (state T)"), "{text}");
        assert!(!answer.answered());
    }
}
