//! No orphans: the launcher is a child subreaper, so whatever a rank leaves behind is
//! re-parented to it and can be killed and reaped; and a watchdog process kills the ranks'
//! process groups should the launcher itself be killed with SIGKILL.
//!
//! Ranks are reaped by tether-core through their pidfds. Everything here peeks before it
//! reaps and never reaps a rank's pid, so a rank's exit status is never stolen.

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

/// Makes this process the reaper of its orphaned descendants.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The pids of this process's children (every thread's), from /proc.
fn children() -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for task in tasks.filter_map(Result::ok) {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            pids.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    }
    pids
}

/// Reaps the exited children that are not ranks (`ranks`: pids tether-core still has to
/// reap) nor `spare` (the watchdog). Returns the pids reaped.
pub fn reap_orphans(ranks: &HashSet<i32>, spare: Option<i32>) -> Vec<i32> {
    let mut reaped = Vec::new();
    loop {
        // SAFETY: siginfo_t is plain data; zeroed is valid for waitid to fill.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid with WNOWAIT only looks at an exited child, leaving it unreaped.
        let rc = unsafe {
            libc::waitid(
                libc::P_ALL,
                0,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        if rc != 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return reaped;
        }
        // SAFETY: waitid succeeded, so the child fields of `info` are initialised.
        let pid = unsafe { info.si_pid() };
        if pid == 0 {
            return reaped;
        }
        if ranks.contains(&pid) || Some(pid) == spare {
            // A rank's status belongs to tether-core; it sits first in line, so look at the
            // other children one by one instead.
            break;
        }
        if reap(pid) {
            reaped.push(pid);
        }
    }
    for pid in children() {
        if !ranks.contains(&pid) && Some(pid) != spare && exited(pid) && reap(pid) {
            reaped.push(pid);
        }
    }
    reaped
}

/// Whether child `pid` has exited (without reaping it).
fn exited(pid: i32) -> bool {
    // SAFETY: siginfo_t is plain data; zeroed is valid for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid with WNOWAIT on one child of ours, leaving it unreaped.
    let rc = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // SAFETY: waitid succeeded, so the child fields of `info` are initialised.
    rc == 0 && unsafe { info.si_pid() } == pid
}

/// Reaps child `pid`, which has exited.
fn reap(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: waitpid on one exited child of ours that is not a rank.
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) == pid }
}

/// Kills and reaps every child that is not a rank nor `spare`, again and again as their own
/// orphans are re-parented here, for up to `limit`. Returns how many were killed.
pub fn kill_orphans(ranks: &HashSet<i32>, spare: Option<i32>, limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    let mut killed = HashSet::new();
    loop {
        let orphans: Vec<i32> = children()
            .into_iter()
            .filter(|p| !ranks.contains(p) && Some(*p) != spare)
            .collect();
        if orphans.is_empty() || Instant::now() >= deadline {
            return killed.len();
        }
        for &pid in &orphans {
            // SAFETY: `pid` is our own unreaped child, so the id cannot belong to anyone
            // else; its process group is signalled only while it leads it (checked by the
            // kernel: killpg fails for a group that does not exist).
            unsafe {
                if libc::getpgid(pid) == pid {
                    libc::killpg(pid, libc::SIGKILL);
                }
                libc::kill(pid, libc::SIGKILL);
            }
            killed.insert(pid);
        }
        std::thread::sleep(Duration::from_millis(2));
        reap_orphans(ranks, spare);
    }
}

/// The launcher's side of the watchdog: the write end of a pipe whose EOF (the launcher's
/// death, however it dies) tells the watchdog to SIGKILL the process groups it was told of.
pub struct Watchdog {
    pid: i32,
    pipe: Option<OwnedFd>,
}

const ADD: i32 = 1;
const REMOVE: i32 = 2;

impl Watchdog {
    /// Forks the watchdog, which also removes `tmp` (the launcher's private directory) when
    /// the launcher is gone. Must be called while the process has a single thread.
    pub fn start(tmp: &Path) -> io::Result<Watchdog> {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        // SAFETY: the process is single-threaded here (called before any thread starts), so
        // the child may run ordinary code; it only uses raw system calls and exits with
        // _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            drop(write);
            watchdog_main(read, tmp);
        }
        drop(read);
        Ok(Watchdog {
            pid,
            pipe: Some(write),
        })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    fn send(&self, op: i32, pgid: i32) {
        let Some(pipe) = &self.pipe else { return };
        let mut msg = [0u8; 8];
        msg[..4].copy_from_slice(&op.to_ne_bytes());
        msg[4..].copy_from_slice(&pgid.to_ne_bytes());
        // 8 bytes to a pipe: written whole or not at all.
        let _ = rustix::io::write(pipe, &msg);
    }

    /// The watchdog will kill process group `pgid` if the launcher dies.
    pub fn add(&self, pgid: i32) {
        self.send(ADD, pgid);
    }

    /// Process group `pgid` is gone.
    pub fn remove(&self, pgid: i32) {
        self.send(REMOVE, pgid);
    }

    /// Ends the watchdog (with nothing left to kill) and reaps it.
    pub fn finish(mut self) {
        self.pipe = None;
        let mut status = 0;
        // SAFETY: waitpid on our own child, the watchdog, which exits at EOF.
        while unsafe { libc::waitpid(self.pid, &mut status, 0) } < 0
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
    }
}

/// The watchdog process: reads add/remove messages until EOF, then SIGKILLs every process
/// group still listed and removes `tmp`. It sits in its own process group (a signal to the launcher's group
/// does not reach it) with the launcher's signals still blocked, and holds no other fd.
fn watchdog_main(pipe: OwnedFd, tmp: &Path) -> ! {
    let fd = pipe.as_raw_fd();
    // SAFETY: plain system calls on this process's own state and descriptors; the name is
    // a NUL-terminated static string.
    unsafe {
        libc::setpgid(0, 0);
        libc::prctl(
            libc::PR_SET_NAME,
            c"tether-watchdog".as_ptr() as libc::c_ulong,
        );
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for target in 0..3 {
                libc::dup2(null, target);
            }
        }
        libc::dup2(fd, 3);
        libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
    }
    std::mem::forget(pipe);
    let mut groups: Vec<i32> = Vec::with_capacity(256);
    let mut msg = [0u8; 8];
    loop {
        // SAFETY: reads at most 8 bytes into `msg`.
        let n = unsafe { libc::read(3, msg.as_mut_ptr().cast(), msg.len()) };
        if n == 8 {
            let op = i32::from_ne_bytes([msg[0], msg[1], msg[2], msg[3]]);
            let pgid = i32::from_ne_bytes([msg[4], msg[5], msg[6], msg[7]]);
            match op {
                ADD => groups.push(pgid),
                REMOVE => groups.retain(|&g| g != pgid),
                _ => {}
            }
            continue;
        }
        if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        break;
    }
    for &pgid in &groups {
        if pgid > 1 {
            // SAFETY: killpg on a process group of the launcher's ranks.
            unsafe { libc::killpg(pgid, libc::SIGKILL) };
        }
    }
    if !groups.is_empty() {
        // Let the killed ranks finish dying before their error files go.
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_dir_all(tmp);
    // SAFETY: _exit ends this forked process without running the parent's destructors.
    unsafe { libc::_exit(0) }
}
