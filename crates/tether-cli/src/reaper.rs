//! Finding and killing what the ranks leave behind. Both of tether's processes are child
//! subreapers: whatever a rank starts, in any session or process group, is re-parented to
//! the nearest of them that is alive once its own parent dies, so killing every child again
//! and again, as their children come up, reaches every descendant.
//!
//! Ranks are reaped by tether-core through their pidfds. The supervisor's functions here
//! peek before they reap and never reap a rank's pid, so a rank's exit status is never
//! stolen.

use std::collections::{HashMap, HashSet};
use std::io;
use std::time::{Duration, Instant};

use tether_core::proc;

/// Makes this process the reaper of its orphaned descendants.
pub fn become_subreaper() -> io::Result<()> {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// SIGKILL to child `pid`, and to the process group it leads.
fn kill_child(pid: i32) {
    // SAFETY: `pid` is our own unreaped child, so the id cannot belong to anyone else; its
    // process group is signalled only while it leads it (a group id stays reserved while
    // its leader exists, zombie included).
    unsafe {
        if libc::getpgid(pid) == pid {
            libc::killpg(pid, libc::SIGKILL);
        }
        libc::kill(pid, libc::SIGKILL);
    }
}

/// Reaps the exited children that are not ranks (`ranks`: pids tether-core still has to
/// reap). Returns the pids reaped.
pub fn reap_orphans(ranks: &HashSet<i32>) -> Vec<i32> {
    let mut reaped = Vec::new();
    loop {
        match peek_any() {
            Some(pid) if !ranks.contains(&pid) => {
                if reap(pid) {
                    reaped.push(pid);
                }
            }
            // A rank's status belongs to tether-core; it sits first in line, so look at the
            // other children one by one instead.
            Some(_) => break,
            None => return reaped,
        }
    }
    for pid in proc::children() {
        if !ranks.contains(&pid) && exited(pid) && reap(pid) {
            reaped.push(pid);
        }
    }
    reaped
}

/// An exited child, left unreaped.
fn peek_any() -> Option<i32> {
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
            return None;
        }
        // SAFETY: waitid succeeded, so the child fields of `info` are initialised.
        let pid = unsafe { info.si_pid() };
        return (pid != 0).then_some(pid);
    }
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

/// Whether this process has no child left at all, zombies included, in the kernel's own
/// words (`ECHILD`): unlike `/proc`'s lists, which the kernel does not promise to be exact
/// while children come and go, this answer is exact.
fn childless() -> bool {
    // SAFETY: siginfo_t is plain data; zeroed is valid for waitid to fill.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid with WNOHANG | WNOWAIT only looks, reaping nothing.
    let rc = unsafe {
        libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL,
        )
    };
    rc != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD)
}

/// Kills and reaps every child that is not one of `live` (read again at each pass: the pids
/// tether-core still has to reap, and the launcher's own processes), again and again as
/// their own orphans are re-parented here, until none is left, dead or alive: then nothing
/// that the ranks left, in any session, lives on, and no pid of theirs is still taken. With
/// nothing live the end is the kernel's word that this process has no child at all. It
/// takes no deadline, since what comes next (another attempt) must not meet a leftover;
/// `slow` is told once which pids are still there after `patience`, and from then on the
/// wait ends early when `stop` says so (the user gave up on the run). A child named as a
/// zygote's blank is given [`BLANK_NOTICE`] to become one of `live` before it is killed: the
/// zygote announces each blank it forks just after the fork. Returns how many were killed.
pub fn kill_orphans(
    live: impl Fn() -> HashSet<i32>,
    patience: Duration,
    mut slow: impl FnMut(&[i32]),
    mut stop: impl FnMut() -> bool,
) -> usize {
    let tell_at = Instant::now() + patience;
    let mut told = false;
    let mut killed = HashSet::new();
    let mut blanks_seen: HashMap<i32, Instant> = HashMap::new();
    loop {
        let known = live();
        let mut orphans: Vec<i32> = proc::children()
            .into_iter()
            .filter(|p| !known.contains(p))
            .collect();
        if orphans.is_empty() && known.is_empty() {
            if childless() {
                return killed.len();
            }
            // A child /proc/self/task/*/children missed: every process names its parent.
            orphans = proc::children_by_parent();
        } else if orphans.is_empty() {
            return killed.len();
        }
        if !told && Instant::now() >= tell_at && !orphans.is_empty() {
            told = true;
            slow(&orphans);
        }
        if told && stop() {
            return killed.len();
        }
        for &pid in &orphans {
            if !announced_soon(pid, &mut blanks_seen) {
                kill_child(pid);
                killed.insert(pid);
            }
        }
        std::thread::sleep(Duration::from_millis(1));
        reap_orphans(&known);
    }
}

/// How long a child named as a zygote's blank may go unannounced before it counts as a
/// leftover.
pub const BLANK_NOTICE: Duration = Duration::from_millis(100);

/// Whether `pid` is named as a zygote or its blank (a blank bears its zygote's name until it
/// names itself) and was first seen less than [`BLANK_NOTICE`] ago.
fn announced_soon(pid: i32, seen: &mut HashMap<i32, Instant>) -> bool {
    tether_core::zygote::idle_named(pid)
        && seen.entry(pid).or_insert_with(Instant::now).elapsed() < BLANK_NOTICE
}

/// Kills every child, and every process re-parented here as they die, until no child is
/// alive (or `limit` passes); exited children stay unreaped. For a process that is about
/// to end, whose children's statuses no longer matter.
pub fn kill_every_child(limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let live: Vec<i32> = proc::children()
            .into_iter()
            .filter(|&p| !exited(p))
            .collect();
        if live.is_empty() || Instant::now() >= deadline {
            return;
        }
        live.into_iter().for_each(kill_child);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Kills and reaps every child but those in `keep`, and every process re-parented here as
/// they die, until no other child is left: then no descendant of theirs is left either.
/// `keep` are the host process's own children, which are not tether's to touch.
pub fn kill_and_reap_all_but(keep: &HashSet<i32>) {
    loop {
        let ours: Vec<i32> = proc::children()
            .into_iter()
            .filter(|p| !keep.contains(p))
            .collect();
        if ours.is_empty() {
            return;
        }
        for &pid in &ours {
            kill_child(pid);
        }
        std::thread::sleep(Duration::from_millis(1));
        for pid in ours {
            let mut status = 0;
            // SAFETY: reaping one exited child that tether started or that was re-parented
            // to it.
            unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};

    /// A child running `sleep` under the name `name` (its executable's, as `comm` shows it).
    fn named_child(dir: &std::path::Path, name: &str) -> Child {
        let exe = dir.join(name);
        std::fs::copy("/bin/sleep", &exe).unwrap();
        Command::new(&exe).arg("30").spawn().unwrap()
    }

    #[test]
    fn a_child_named_as_a_blank_is_spared_until_its_notice_is_overdue() {
        let dir = std::env::temp_dir().join(format!("tether-reaper-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut blank = named_child(&dir, tether_core::zygote::BLANK_COMM);
        let mut other = named_child(&dir, "sleeper");
        // The kernel names the child once it runs its executable.
        let deadline = Instant::now() + Duration::from_secs(10);
        while proc::stat(proc::Of::Pid(blank.id() as i32))
            .and_then(|s| s.command().map(String::from))
            != Some(tether_core::zygote::BLANK_COMM.to_string())
        {
            assert!(Instant::now() < deadline, "the child never took its name");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut seen = HashMap::new();
        assert!(announced_soon(blank.id() as i32, &mut seen));
        assert!(!announced_soon(other.id() as i32, &mut seen));
        std::thread::sleep(BLANK_NOTICE);
        assert!(!announced_soon(blank.id() as i32, &mut seen));
        for child in [&mut blank, &mut other] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
