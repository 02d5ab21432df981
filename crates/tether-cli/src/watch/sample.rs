//! One look at the ranks: what /proc says of each rank's main thread before and after its
//! stack is asked (its state, CPU time, how many times it was put on a CPU, and the CPU time
//! of its children, its DataLoader workers), and where its main thread is (its stack, asked
//! with [`Request::main_thread`]: the dump signal alone, which restarts what it interrupts).
//! A rank that is stopped or a zombie is not asked: it could not answer.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tether_core::proc::{self, Of};
use tether_core::stacks::{self, Reply, Request};
use tether_core::Group;

use super::kinds::{Counters, Doing, Look, Place};

/// How long a look waits for the stacks (a rank that does not answer keeps its last place).
const ASK_TIMEOUT: Duration = Duration::from_millis(300);

/// Nanoseconds in a clock tick of /proc/PID/stat (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
fn tick_ns() -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    1_000_000_000 / u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100)
}

/// What /proc says of `pid` now; `None` once it is gone.
pub fn counters(pid: i32) -> Option<Counters> {
    let state = proc::process_state(pid)?;
    let main = format!("/proc/{pid}/task/{pid}");
    let sched = std::fs::read_to_string(format!("{main}/schedstat")).ok()?;
    let mut fields = sched.split_whitespace().map(|f| f.parse::<u64>().ok());
    let cpu_ns = fields.next()??;
    let runs = fields.nth(1)??;
    Some(Counters {
        state,
        cpu_ns,
        runs,
        children_ns: children_cpu(&main),
    })
}

/// The CPU time of the children of a thread (`main`: its /proc folder), all their threads.
fn children_cpu(main: &str) -> u64 {
    let Ok(children) = std::fs::read_to_string(format!("{main}/children")) else {
        return 0;
    };
    let tick = tick_ns();
    children
        .split_whitespace()
        .filter_map(|pid| pid.parse::<i32>().ok())
        .filter_map(|pid| {
            let stat = proc::stat(Of::Pid(pid))?;
            Some((stat.number(14)? + stat.number(15)?) * tick)
        })
        .sum()
}

/// What the main thread of `pid` waits in, as its system call says (`Waiting` when it runs
/// or /proc does not tell).
fn call_doing(pid: i32) -> Doing {
    let Some((number, _)) = proc::syscall(pid) else {
        return Doing::Waiting;
    };
    #[cfg(target_arch = "x86_64")]
    if number == libc::SYS_nanosleep {
        return Doing::Asleep;
    }
    if number == libc::SYS_clock_nanosleep {
        return Doing::Asleep;
    }
    if number == libc::SYS_futex {
        return Doing::Lock;
    }
    Doing::Waiting
}

/// What the frames of a main thread (file, function; most recent first) say it does.
pub fn frames_doing(frames: &[(String, String)]) -> Option<Doing> {
    const STARTING: [&str; 4] = [
        "init_process_group",
        "rendezvous",
        "_store_based_barrier",
        "_create_c10d_store",
    ];
    let dist = |f: &&(String, String)| f.0.contains("/torch/distributed/");
    if frames
        .iter()
        .filter(dist)
        .any(|f| STARTING.contains(&f.1.as_str()))
    {
        return Some(Doing::Starting);
    }
    if frames.iter().any(|f| dist(&f)) {
        return Some(Doing::Collective);
    }
    if frames.iter().any(|f| f.0.contains("/torch/utils/data/")) {
        return Some(Doing::DataLoading);
    }
    if frames
        .first()
        .is_some_and(|f| f.0.ends_with("/threading.py"))
    {
        return Some(Doing::Lock);
    }
    None
}

/// How long after the watch first sees a rank it begins to ask its stack: a rank forked a
/// moment ago is still setting up its interpreter and its handlers, and a dump from a signal
/// handler then has been seen to crash it.
const SETTLED: Duration = Duration::from_secs(3);

/// The longest a look waits for the ranks it woke to be off the CPU again.
const BACK_ASLEEP: Duration = Duration::from_millis(20);

/// Waits (up to [`BACK_ASLEEP`]) until the main thread of each of `pids`, asleep before the
/// dump signal woke it, is off the CPU again: on a busy machine a rank can be put off the
/// CPU between its answer and its return to the call the signal interrupted, and the rest
/// of that return, seen after the look, would count as the rank moving.
fn back_asleep(pids: &[i32]) {
    let deadline = Instant::now() + BACK_ASLEEP;
    for &pid in pids {
        while proc::process_state(pid) == Some('R') && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(500));
        }
    }
}

/// One look at every rank of `group`; `first_seen` keeps when each pid was first seen.
pub fn look(group: &Group, since: Instant, first_seen: &mut HashMap<i32, Instant>) -> Look {
    let n = group.len();
    let pids: Vec<Option<i32>> = (0..n)
        .map(|i| group.exit(i).is_none().then(|| group.pid(i)).flatten())
        .collect();
    let before_at = since.elapsed();
    let before: Vec<Option<Counters>> = pids.iter().map(|p| p.and_then(counters)).collect();
    let now = Instant::now();
    let mut settled = |i: usize| {
        pids[i]
            .is_some_and(|pid| now.duration_since(*first_seen.entry(pid).or_insert(now)) >= SETTLED)
    };
    let askable: Vec<(&Group, usize)> = (0..n)
        .filter(|&i| before[i].is_some_and(|c| !matches!(c.state, 'T' | 't' | 'Z' | 'X')))
        .filter(|&i| settled(i))
        .map(|i| (group, i))
        .collect();
    let answers = stacks::ask(&askable, &Request::main_thread(ASK_TIMEOUT)).unwrap_or_default();
    let mut places: Vec<Option<(Place, Doing)>> = vec![None; n];
    for (&(_, i), answer) in askable.iter().zip(&answers) {
        let Reply::Stack(text) = &answer.reply else {
            continue;
        };
        if let Some(at) = stacks::whereabouts(text) {
            let doing = frames_doing(&at.frames).unwrap_or_else(|| call_doing(answer.pid));
            places[i] = Some((Place::of(at), doing));
        }
    }
    let asleep: Vec<i32> = askable
        .iter()
        .filter(|&&(_, i)| before[i].is_some_and(|c| c.state != 'R'))
        .filter_map(|&(_, i)| pids[i])
        .collect();
    back_asleep(&asleep);
    let after_at = since.elapsed();
    let after = pids.iter().map(|p| p.and_then(counters)).collect();
    Look {
        before_at,
        after_at,
        pids,
        before,
        after,
        places,
    }
}
