//! How many more processes a caller may start before a limit stops it: the caller's
//! `RLIMIT_NPROC` (every process and thread of its real user counts, the kernel's own
//! exemptions aside) and the `pids.max` of this process's cgroup and of every cgroup above
//! it. The limit is read from the caller (`/proc/PID/limits`), never assumed from the
//! process that asks: a zygote keeps the limits its caller had when it started it, and the
//! caller may lower its own since. The zygote keeps its blanks within what these leave (see
//! [`crate::blanks`]), so that the processes it holds idle never take the caller's last
//! ones.

use std::path::{Path, PathBuf};

use rustix::process::{getrlimit, Resource};

use crate::proc::{self, Of};

/// The name of `RLIMIT_NPROC` in `/proc/PID/limits`.
const NPROC: &str = "Max processes";
/// Past this much room, an exact count of the user's tasks would change no decision: the
/// system's task count (one read) bounds it instead of a walk of `/proc`.
const PLENTY: i64 = 1024;

/// The soft `RLIMIT_NPROC` of `caller` as it stands (`Some(None)`: unlimited), or `None`
/// when it cannot be read.
pub fn caller_nproc(caller: i32) -> Option<Option<u64>> {
    proc::soft_limit(caller, NPROC)
}

/// How many more tasks (processes or threads) `caller` can make, by the tightest limit that
/// binds it (negative: how far past it they are already); `None` when none binds.
/// `announced`: a soft `RLIMIT_NPROC` the caller is about to set (`Some(None)`: unlimited);
/// until it shows, the lower of the two counts.
pub fn process_room(caller: i32, announced: Option<Option<u64>>) -> Option<i64> {
    match (nproc_room(caller, announced), cgroup_room()) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The room `RLIMIT_NPROC` leaves the caller: its soft value less the tasks of its real
/// user, unless the limit is infinite or does not bind (the kernel exempts root and holders
/// of CAP_SYS_RESOURCE or CAP_SYS_ADMIN).
fn nproc_room(caller: i32, announced: Option<Option<u64>>) -> Option<i64> {
    let read = caller_nproc(caller).unwrap_or_else(|| getrlimit(Resource::Nproc).current);
    let soft = match announced {
        Some(Some(a)) => Some(read.map_or(a, |r| r.min(a))),
        _ => read,
    }?;
    let status = proc::status(Of::Pid(caller)).or_else(|| proc::status(Of::This))?;
    let uid = status.number("Uid")?;
    let caps = status.radix("CapEff", 16)?;
    const CAP_SYS_ADMIN: u64 = 21;
    const CAP_SYS_RESOURCE: u64 = 24;
    if uid == 0 || caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_RESOURCE) != 0 {
        return None;
    }
    let soft = i64::try_from(soft).unwrap_or(i64::MAX);
    if let Some(all) = proc::system_tasks() {
        if soft.saturating_sub(all as i64) >= PLENTY {
            return Some(soft - all as i64);
        }
    }
    Some(soft.saturating_sub(user_tasks(uid) as i64))
}

/// The tasks (threads included) of the processes whose real user is `uid`.
fn user_tasks(uid: u64) -> usize {
    proc::pids()
        .into_iter()
        .filter_map(|pid| proc::status(Of::Pid(pid)))
        .filter(|s| s.number("Uid") == Some(uid))
        .map(|s| s.number("Threads").unwrap_or(1) as usize)
        .sum()
}

/// The room the pids controller leaves this process: the least `pids.max - pids.current`
/// of its cgroup and every cgroup above it (cgroup v2, or v1's pids hierarchy).
fn cgroup_room() -> Option<i64> {
    let mut rooms = Vec::new();
    for cgroup in proc::cgroups() {
        let base = if cgroup.id == "0" && cgroup.controllers.is_empty() {
            ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
                .into_iter()
                .map(PathBuf::from)
                .find(|b| b.join("cgroup.controllers").exists())
        } else if cgroup.controllers.split(',').any(|c| c == "pids") {
            Some(PathBuf::from("/sys/fs/cgroup/pids"))
        } else {
            None
        };
        if let Some(base) = base {
            rooms.extend(hierarchy_room(&base, &cgroup.path));
        }
    }
    rooms.into_iter().min()
}

/// The least room of the cgroup `path` under `base` and of its ancestors.
fn hierarchy_room(base: &Path, path: &str) -> Option<i64> {
    let mut dir = base.join(path.trim_start_matches('/'));
    let mut least: Option<i64> = None;
    loop {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        if let (Some(max), Some(current)) = (read("pids.max"), read("pids.current")) {
            if let (Ok(max), Ok(current)) = (max.trim().parse::<i64>(), current.trim().parse()) {
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
    fn this_process_counts_among_its_users_tasks() {
        let uid = proc::status(Of::This)
            .and_then(|s| s.number("Uid"))
            .unwrap();
        assert!(user_tasks(uid) >= 1);
    }
}
