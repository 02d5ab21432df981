//! The stacks of the processes each rank started (its DataLoader workers, a forkserver and
//! its children, the workers of its `tether.Pool`), for the blocks of stacks: a pool's
//! workers answer to the rank, which carries their stacks in its own answer
//! ([`stacks::relay`]); the others are asked at once through tether-core
//! ([`tether_core::stacks::others::ask_others`]). They are shown under their rank, and named in the
//! summary when the rank waits on them (its main thread in torch's DataLoader).

use tether_core::stacks::{self, Answer, Request};

use crate::procs;

/// A process a rank started, and what it answered.
#[derive(Debug, Clone)]
pub struct Worker {
    pub answer: Answer,
    /// Whether it is a worker of the rank's `tether.Pool` (its stack came in the rank's).
    pub pooled: bool,
}

/// The processes `rank` started (and theirs), but tether's idle helpers (a pool's zygote and
/// its blanks, ready to become workers: `tether_core::zygote::IDLE_COMMS`).
pub fn started(rank: i32, parents: &std::collections::BTreeMap<i32, i32>) -> Vec<i32> {
    procs::descendants(rank, parents)
        .into_iter()
        .filter(|&pid| !tether_core::zygote::idle_named(pid))
        .collect()
}

/// The ranks' `answers` without the stacks they carried for their pools' workers, and every
/// rank's workers with their answers, in the same order: the pools' workers first (from the
/// rank's answer), then every other process the rank started, asked now with `request`.
pub fn gather(answers: Vec<Answer>, request: &Request) -> (Vec<Answer>, Vec<Vec<Worker>>) {
    let (ranks, pooled): (Vec<Answer>, Vec<Vec<Answer>>) =
        answers.into_iter().map(stacks::relay::split).unzip();
    let parents = procs::parents();
    let others: Vec<Vec<(i32, i32)>> = ranks
        .iter()
        .zip(&pooled)
        .map(|(rank, pool)| {
            started(rank.pid, &parents)
                .into_iter()
                .filter(|pid| pool.iter().all(|w| w.pid != *pid))
                .filter_map(|pid| Some((pid, *parents.get(&pid)?)))
                .collect()
        })
        .collect();
    let flat: Vec<(i32, i32)> = others.iter().flatten().copied().collect();
    let mut asked = match flat.is_empty() {
        true => Vec::new(),
        false => stacks::others::ask_others(&flat, request).unwrap_or_default(),
    }
    .into_iter();
    let workers = pooled
        .into_iter()
        .zip(&others)
        .map(|(pool, other)| {
            let pool = pool.into_iter().map(|answer| Worker {
                answer,
                pooled: true,
            });
            let other = asked.by_ref().take(other.len()).map(|answer| Worker {
                answer,
                pooled: false,
            });
            pool.chain(other).collect()
        })
        .collect();
    (ranks, workers)
}

/// The lines that show the answers of a rank's `workers` under the rank's own.
pub fn lines(workers: &[Worker], timeout: std::time::Duration) -> Vec<String> {
    let mut lines = Vec::new();
    for Worker { answer, pooled } in workers {
        let comm = tether_core::proc::stat(tether_core::proc::Of::Pid(answer.pid))
            .and_then(|s| s.command().map(str::to_string))
            .unwrap_or_else(|| "?".to_string());
        let what = match pooled {
            true => "a worker of this rank's tether.Pool",
            false => "a process this rank started (its DataLoader worker, or another)",
        };
        lines.push(format!("-- {what}: pid {} ({comm})", answer.pid));
        lines.extend(answer.text(timeout).lines().map(str::to_string));
    }
    lines
}

/// "rank 0 waits on its DataLoader workers: pid 41 at data.py:31 in __getitem__, pid 42
/// did not answer", for a rank whose main thread is in torch's DataLoader and that has
/// workers; `None` otherwise.
pub fn waits_on(rank: usize, answer: &Answer, workers: &[Worker]) -> Option<String> {
    let stacks::Reply::Stack(text) = &answer.reply else {
        return None;
    };
    if workers.is_empty() || !text.contains("torch/utils/data/") {
        return None;
    }
    let each: Vec<String> = workers
        .iter()
        .map(|w| &w.answer)
        .map(|w| match &w.reply {
            stacks::Reply::Stack(_) => format!("pid {} at {}", w.pid, stacks::place(w)),
            stacks::Reply::NoHandler => {
                format!("pid {} has no stack handler (a new interpreter)", w.pid)
            }
            _ => format!("pid {} {}", w.pid, stacks::place(w)),
        })
        .collect();
    Some(format!(
        "rank {rank} waits on its DataLoader workers: {}",
        each.join(", ")
    ))
}
