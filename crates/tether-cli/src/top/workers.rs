//! The stacks of the processes each rank started (its DataLoader workers, a forkserver and
//! its children), for the blocks of stacks: asked at once through tether-core
//! ([`tether_core::stacks::ask_others`]), shown under their rank, and named in the summary
//! when the rank waits on them (its main thread in torch's DataLoader).

use tether_core::stacks::{self, Answer, Request};

use super::procs;

/// Every rank's started processes (pid, parent), by rank, in the order of `ranks` (the
/// ranks' pids).
pub fn of(ranks: &[i32]) -> Vec<Vec<(i32, i32)>> {
    let parents = procs::parents();
    ranks
        .iter()
        .map(|&rank| {
            procs::descendants(rank, &parents)
                .into_iter()
                .filter_map(|pid| Some((pid, *parents.get(&pid)?)))
                .collect()
        })
        .collect()
}

/// The answers of `workers` (see [`of`]), in the same shape; a rank with none gets none.
pub fn ask(workers: &[Vec<(i32, i32)>], request: &Request) -> Vec<Vec<Answer>> {
    let flat: Vec<(i32, i32)> = workers.iter().flatten().copied().collect();
    let mut answers = match flat.is_empty() {
        true => Vec::new(),
        false => stacks::ask_others(&flat, request).unwrap_or_default(),
    }
    .into_iter();
    workers
        .iter()
        .map(|w| answers.by_ref().take(w.len()).collect())
        .collect()
}

/// The lines that show the answers of a rank's `workers` under the rank's own.
pub fn lines(workers: &[Answer], timeout: std::time::Duration) -> Vec<String> {
    let mut lines = Vec::new();
    for answer in workers {
        let comm = tether_core::proc::stat(tether_core::proc::Of::Pid(answer.pid))
            .and_then(|s| s.command().map(str::to_string))
            .unwrap_or_else(|| "?".to_string());
        lines.push(format!(
            "-- a process this rank started (its DataLoader worker, or another): pid {} ({comm})",
            answer.pid
        ));
        lines.extend(answer.text(timeout).lines().map(str::to_string));
    }
    lines
}

/// "rank 0 waits on its DataLoader workers: pid 41 at data.py:31 in __getitem__, pid 42
/// did not answer", for a rank whose main thread is in torch's DataLoader and that has
/// workers; `None` otherwise.
pub fn waits_on(rank: usize, answer: &Answer, workers: &[Answer]) -> Option<String> {
    let stacks::Reply::Stack(text) = &answer.reply else {
        return None;
    };
    if workers.is_empty() || !text.contains("torch/utils/data/") {
        return None;
    }
    let each: Vec<String> = workers
        .iter()
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
