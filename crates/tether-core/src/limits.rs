//! How many more processes this process may start before a limit stops it: the user's
//! `RLIMIT_NPROC` (every process and thread of the real user counts, the kernel's own
//! exemptions aside) and the `pids.max` of its cgroup and of every cgroup above it. The
//! zygote keeps its reserve of blanks within what they leave, so that the processes it
//! holds idle never take the user's last ones.

use std::path::{Path, PathBuf};

/// How many more tasks (processes or threads) this process can make, by the tightest limit
/// that binds it; `None` when none does.
pub fn process_room() -> Option<usize> {
    match (nproc_room(), cgroup_room()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The room `RLIMIT_NPROC` leaves: its soft value less the tasks of the real user, unless
/// the limit is infinite or does not bind (the kernel exempts root and holders of
/// CAP_SYS_RESOURCE or CAP_SYS_ADMIN).
fn nproc_room() -> Option<usize> {
    // SAFETY: getrlimit writes into a plain-data struct.
    let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid = status_field(&status, "Uid:")?;
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())?;
    const CAP_SYS_ADMIN: u64 = 21;
    const CAP_SYS_RESOURCE: u64 = 24;
    if uid == 0 || caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_RESOURCE) != 0 {
        return None;
    }
    let used = user_tasks(uid);
    Some((lim.rlim_cur as usize).saturating_sub(used))
}

/// The first number of the `/proc/PID/status` line that starts with `name`.
fn status_field(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The tasks (threads included) of the processes whose real user is `uid`.
fn user_tasks(uid: u64) -> usize {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return 0;
    };
    procs
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .filter(|s| status_field(s, "Uid:") == Some(uid))
        .map(|s| status_field(&s, "Threads:").unwrap_or(1) as usize)
        .sum()
}

/// The room the pids controller leaves this process: the least `pids.max - pids.current`
/// of its cgroup and every cgroup above it (cgroup v2, or v1's pids hierarchy).
fn cgroup_room() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut rooms = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let base = if id == "0" && controllers.is_empty() {
            ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
                .into_iter()
                .map(PathBuf::from)
                .find(|b| b.join("cgroup.controllers").exists())
        } else if controllers.split(',').any(|c| c == "pids") {
            Some(PathBuf::from("/sys/fs/cgroup/pids"))
        } else {
            None
        };
        if let Some(base) = base {
            rooms.extend(hierarchy_room(&base, path));
        }
    }
    rooms.into_iter().min()
}

/// The least room of the cgroup `path` under `base` and of its ancestors.
fn hierarchy_room(base: &Path, path: &str) -> Option<usize> {
    let mut dir = base.join(path.trim_start_matches('/'));
    let mut least: Option<usize> = None;
    loop {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        if let (Some(max), Some(current)) = (read("pids.max"), read("pids.current")) {
            if let (Ok(max), Ok(current)) = (max.trim().parse::<usize>(), current.trim().parse()) {
                let room = max.saturating_sub(current);
                least = Some(least.map_or(room, |l| l.min(room)));
            }
        }
        if dir == base || !dir.pop() || !dir.starts_with(base) {
            return least;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read() {
        let status = "Name:\tx\nUid:\t1000\t1000\t1000\t1000\nThreads:\t7\n";
        assert_eq!(status_field(status, "Uid:"), Some(1000));
        assert_eq!(status_field(status, "Threads:"), Some(7));
        assert_eq!(status_field(status, "Gid:"), None);
    }

    #[test]
    fn this_process_counts_among_its_users_tasks() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let uid = status_field(&status, "Uid:").unwrap();
        assert!(user_tasks(uid) >= 1);
    }
}
