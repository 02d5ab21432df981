//! How many more processes this process may start before a limit stops it: the user's
//! `RLIMIT_NPROC` (every process and thread of the real user counts, the kernel's own
//! exemptions aside) and the `pids.max` of its cgroup and of every cgroup above it. The
//! zygote keeps its reserve of blanks within what they leave, so that the processes it
//! holds idle never take the user's last ones.

use std::path::{Path, PathBuf};

use rustix::process::{getrlimit, Resource};

use crate::proc::{self, Of};

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
    let soft = getrlimit(Resource::Nproc).current?;
    let status = proc::status(Of::This)?;
    let uid = status.number("Uid")?;
    let caps = status.radix("CapEff", 16)?;
    const CAP_SYS_ADMIN: u64 = 21;
    const CAP_SYS_RESOURCE: u64 = 24;
    if uid == 0 || caps & (1 << CAP_SYS_ADMIN | 1 << CAP_SYS_RESOURCE) != 0 {
        return None;
    }
    let used = user_tasks(uid);
    Some((soft as usize).saturating_sub(used))
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
fn cgroup_room() -> Option<usize> {
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
    fn this_process_counts_among_its_users_tasks() {
        let uid = proc::status(Of::This)
            .and_then(|s| s.number("Uid"))
            .unwrap();
        assert!(user_tasks(uid) >= 1);
    }
}
