//! Starting one child: what the child does to itself between `fork` and `exec`.
//!
//! Every child tether starts:
//! - leads its own process group, so that it and whatever it starts can be signalled as one;
//! - carries a parent-death signal (SIGKILL, which no child can ignore or block), checked
//!   against the race where the parent died before the signal was armed;
//! - starts with default signal dispositions and an empty signal mask, whatever the parent
//!   had (a background job of a non-interactive shell inherits SIGINT as ignored);
//! - inherits no file descriptor but stdin, stdout, stderr and those asked for.

use std::ffi::OsString;
use std::io;
use std::os::fd::RawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use rustix::process::{
    getpid, getppid, kill_process, set_parent_process_death_signal, setpgid, Pid, Signal,
};

use crate::attrs::ThreadAttributes;

/// What to run in a new child.
#[derive(Debug, Clone, Default)]
pub struct LaunchSpec {
    /// The program and its arguments; `argv[0]` is looked up in `PATH` when it has no slash.
    pub argv: Vec<OsString>,
    /// Variables set (or overriding) in the child's environment, on top of the parent's.
    pub env: Vec<(OsString, OsString)>,
    /// Variables removed from the child's environment.
    pub env_remove: Vec<OsString>,
    /// The working directory; the parent's when `None`.
    pub cwd: Option<PathBuf>,
    /// File descriptors of the parent that the child inherits under the same numbers.
    pub keep_fds: Vec<RawFd>,
    /// Bytes written to the child through a socket whose fd number is passed in the
    /// environment variable `TETHER_PAYLOAD_FD`; the socket is closed once all is written.
    pub payload: Option<Vec<u8>>,
    /// Open a report pipe: the child writes to the fd named by `TETHER_REPORT_FD`, and the
    /// warden collects everything written while the child runs. A failure report is one
    /// frame (a little-endian u64 length, then the body); once it is whole, the child counts
    /// as failed (see `Member::failed_at`).
    pub report: bool,
    /// Give the child this process's stacks channel (see [`crate::stacks`]): the fd named by
    /// `TETHER_STACKS_FD`, on which a Python child registers its stack dump handler.
    pub stacks: bool,
    /// Replaces stdout and stderr with these fds (for a launcher that captures output).
    pub stdout: Option<RawFd>,
    pub stderr: Option<RawFd>,
    /// Replaces stdin with /dev/null.
    pub null_stdin: bool,
    /// The CPU affinity and nice value the child takes (those of the thread that asked for
    /// it); the warden thread's when `None`.
    pub thread: Option<ThreadAttributes>,
}

impl LaunchSpec {
    pub fn new<I, S>(argv: I) -> LaunchSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        LaunchSpec {
            argv: argv.into_iter().map(Into::into).collect(),
            ..LaunchSpec::default()
        }
    }
}

/// The environment variable that names the payload socket's fd in the child.
pub const PAYLOAD_FD_ENV: &str = "TETHER_PAYLOAD_FD";
/// The environment variable that names the report pipe's fd in the child.
pub const REPORT_FD_ENV: &str = "TETHER_REPORT_FD";

/// Builds the `Command` for `spec`. `extra_keep` are fds (payload, report) that the child
/// keeps beside `spec.keep_fds`.
pub(crate) fn command(spec: &LaunchSpec, extra_keep: &[RawFd]) -> io::Result<Command> {
    let (program, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty argv"))?;
    let mut cmd = Command::new(program);
    cmd.args(args);
    for key in &spec.env_remove {
        cmd.env_remove(key);
    }
    for (key, value) in &spec.env {
        cmd.env(key, value);
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    if let Some(fd) = spec.stdout {
        cmd.stdout(dup_stdio(fd)?);
    }
    if let Some(fd) = spec.stderr {
        cmd.stderr(dup_stdio(fd)?);
    }
    if spec.null_stdin {
        cmd.stdin(std::process::Stdio::null());
    }
    let mut keep: Vec<RawFd> = spec.keep_fds.clone();
    keep.extend_from_slice(extra_keep);
    let parent = std::process::id() as libc::pid_t;
    let thread = spec.thread.clone();
    // SAFETY: the closure runs in the child between fork and exec and calls only
    // async-signal-safe system calls (see `setup_child`); it allocates nothing, since
    // `keep` and `thread` were built before the fork.
    unsafe {
        cmd.pre_exec(move || {
            setup_child(parent, &keep)?;
            match &thread {
                Some(attrs) => attrs.apply(),
                None => Ok(()),
            }
        });
    }
    Ok(cmd)
}

fn dup_stdio(fd: RawFd) -> io::Result<std::process::Stdio> {
    // SAFETY: `fd` is open for the duration of this call (the caller owns it); the
    // duplicate is a new descriptor owned by the returned `OwnedFd`.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    Ok(std::process::Stdio::from(borrowed.try_clone_to_owned()?))
}

/// Runs in the child between `fork` and `exec`. Only async-signal-safe calls.
fn setup_child(parent: libc::pid_t, keep: &[RawFd]) -> io::Result<()> {
    setpgid(None, None)?;
    arm_parent_death(parent)?;
    reset_signals()?;
    // Every fd above stderr becomes close-on-exec, then the kept ones are opened back up.
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only changes fd flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    for &fd in keep {
        // SAFETY: F_SETFD on an fd the parent asked to pass; no memory is touched.
        if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Arms SIGKILL as the parent-death signal, then closes the race in which the parent died
/// before it was armed (the child would then have been re-parented already).
fn arm_parent_death(parent: libc::pid_t) -> io::Result<()> {
    set_parent_process_death_signal(Some(Signal::KILL))?;
    if parent_pid() != parent {
        // SAFETY: _exit is async-signal-safe; the parent is gone, nobody waits for us.
        unsafe { libc::_exit(111) };
    }
    Ok(())
}

/// Makes `signal` this process's parent-death signal, then exits at once (status 111) when
/// its parent is no longer `parent` (it died before the signal was armed). For a child that
/// must hear of its parent's death otherwise than by SIGKILL (a helper that says goodbye).
pub fn die_with_parent(signal: i32, parent: libc::pid_t) -> io::Result<()> {
    let signal =
        Signal::from_named_raw(signal).ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
    set_parent_process_death_signal(Some(signal))?;
    if parent_pid() != parent {
        std::process::exit(111);
    }
    Ok(())
}

/// The pid of this process's parent (0 when it has none, which never matches a parent).
fn parent_pid() -> libc::pid_t {
    Pid::as_raw(getppid())
}

/// The kernel's `struct sigaction` (not glibc's, whose signal set is larger).
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

/// Default dispositions for every catchable signal, and an empty signal mask. The raw
/// system call also resets the signals glibc keeps for itself (32 and 33), which `signal()`
/// refuses to touch but a parent may still have ignored.
fn reset_signals() -> io::Result<()> {
    let default = KernelSigaction {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: rt_sigaction with a valid kernel sigaction; it reads `default` only.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                &default as *const KernelSigaction,
                std::ptr::null_mut::<KernelSigaction>(),
                8usize,
            )
        };
    }
    let empty: u64 = 0;
    // SAFETY: rt_sigprocmask with an 8-byte kernel signal set.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            libc::SIG_SETMASK,
            &empty as *const u64,
            std::ptr::null_mut::<u64>(),
            8usize,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Called in a child made by a plain `fork()` (no exec) of `parent`: leads its own process
/// group and dies with its parent. The parent-death signal is tied to the thread that
/// forked, so when that thread is not the parent's main thread (`forked_from_main` false),
/// a watcher thread in the child waits on the parent's pidfd instead.
pub fn setup_forked_child(parent: libc::pid_t, forked_from_main: bool) -> io::Result<()> {
    setpgid(None, None)?;
    // SAFETY: an empty, initialised set passed to sigprocmask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
    if forked_from_main {
        return arm_parent_death(parent);
    }
    let pidfd = match rustix::process::Pid::from_raw(parent)
        .map(|pid| rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()))
    {
        Some(Ok(fd)) => fd,
        // The parent is already gone.
        _ => std::process::exit(111),
    };
    if parent_pid() != parent {
        std::process::exit(111);
    }
    std::thread::Builder::new()
        .name("tether-parent-watch".into())
        .spawn(move || {
            let mut fds = [rustix::event::PollFd::new(
                &pidfd,
                rustix::event::PollFlags::IN,
            )];
            while rustix::event::poll(&mut fds, None).is_err() {}
            // The parent is gone: so are we.
            let _ = kill_process(getpid(), Signal::KILL);
        })?;
    Ok(())
}
