//! What /proc says of a rank and of the processes it started (its DataLoader workers, a
//! forkserver and its children): state, CPU time, resident memory, and the process tree.

use std::collections::BTreeMap;

use tether_core::proc::{self, Of};

/// One process, sampled once.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub pid: i32,
    /// Its state letter, as ps shows it (`R`, `S`, `D`, `T`, `Z`, ...).
    pub state: char,
    /// User and system CPU time, in clock ticks.
    pub ticks: u64,
    /// Resident memory, in bytes.
    pub rss: u64,
}

/// Samples `pid` (`None` once it is gone).
pub fn sample(pid: i32) -> Option<Sample> {
    let stat = proc::stat(Of::Pid(pid))?;
    let state = stat.field(3)?.chars().next()?;
    let ticks = stat.number(14)? + stat.number(15)?;
    let pages = stat.number(24)?;
    Some(Sample {
        pid,
        state,
        ticks,
        rss: pages * page_size(),
    })
}

fn page_size() -> u64 {
    // SAFETY: sysconf with a valid name has no other effect.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// Clock ticks per second (`CLK_TCK`).
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf with a valid name has no other effect.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

/// Every process's parent, by pid.
pub fn parents() -> BTreeMap<i32, i32> {
    let parent = |pid: i32| proc::stat(Of::Pid(pid))?.number(4);
    proc::pids()
        .into_iter()
        .filter_map(|pid| Some((pid, parent(pid)? as i32)))
        .collect()
}

/// The processes started by `root`, and by those, ... (not `root`), in pid order.
pub fn descendants(root: i32, parents: &BTreeMap<i32, i32>) -> Vec<i32> {
    let mut found = Vec::new();
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        for (&kid, _) in parents.iter().filter(|(_, &p)| p == pid) {
            found.push(kid);
            todo.push(kid);
        }
    }
    found.sort_unstable();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_sampled_with_its_state_and_memory() {
        // The state is the main thread's: running, or asleep while a
        // test thread runs this.
        let me = std::process::id() as i32;
        let s = sample(me).unwrap();
        assert_eq!(s.pid, me);
        assert!(matches!(s.state, 'R' | 'S'), "{s:?}");
        assert!(s.rss > 1 << 20, "{s:?}");
        assert!(sample(-1).is_none());
    }

    #[test]
    fn descendants_are_the_whole_subtree() {
        let parents = BTreeMap::from([(2, 1), (3, 2), (4, 3), (5, 1), (6, 9)]);
        assert_eq!(descendants(2, &parents), [3, 4]);
        assert_eq!(descendants(1, &parents), [2, 3, 4, 5]);
        assert!(descendants(6, &parents).is_empty());
    }
}
