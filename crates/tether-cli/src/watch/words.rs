//! What the watch prints: a hang's block, whose first line starts with `tether: hang` and
//! names every culprit as `rank R`, then one line for each culprit (its pid, what it does
//! and where) and one for where the others wait; a slow rank's line, which starts with
//! `tether: slow`.

use std::time::Duration;

use tether_core::stacks::ranks_words;

use super::kinds::{Doing, Place};

/// The window over which a rank's own time per step is compared with the others'.
pub const SLOW_WINDOW: Duration = Duration::from_secs(10);

/// A rank that is not where the others wait.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Culprit {
    pub rank: usize,
    pub pid: i32,
    pub place: Option<Place>,
    pub doing: Option<Doing>,
}

impl Culprit {
    /// What tells one picture from another: the rank, the function it is in, what it does
    /// (a busy rank's line and CPU share change as it spins).
    fn key(&self) -> (usize, Option<(&str, &str)>, Option<Doing>) {
        let doing = match self.doing {
            Some(Doing::Busy(_)) => Some(Doing::Busy(100)),
            doing => doing,
        };
        let place = self.place.as_ref().map(|p| (&*p.file, &*p.function));
        (self.rank, place, doing)
    }
}

/// A hang: who waits where, and who is elsewhere.
#[derive(Debug, Clone)]
pub struct Picture {
    /// The ranks where the others wait.
    pub waiting: Vec<usize>,
    pub place: Option<Place>,
    pub doing: Option<Doing>,
    pub culprits: Vec<Culprit>,
    /// How long the stillest rank has been still.
    pub still_for: Duration,
    /// How long a rank must be still for a hang.
    pub after: Duration,
    pub step: Option<Duration>,
}

impl Picture {
    /// Whether `other` shows the same ranks in the same places.
    pub fn same(&self, other: &Picture) -> bool {
        self.waiting == other.waiting
            && self.place == other.place
            && self.doing == other.doing
            && self.culprits.len() == other.culprits.len()
            && self
                .culprits
                .iter()
                .zip(&other.culprits)
                .all(|(a, b)| a.key() == b.key())
    }

    /// The block printed for it.
    pub fn block(&self) -> String {
        let still = format!(
            "no rank has moved on for {:.1} s (a hang after {})",
            self.still_for.as_secs_f64(),
            self.threshold()
        );
        let mut lines = match self.culprits.is_empty() {
            true => vec![format!(
                "tether: hang: every rank is in the same place, none is the culprit; {still}; \
                 the run goes on"
            )],
            false => {
                let ranks: Vec<usize> = self.culprits.iter().map(|c| c.rank).collect();
                let verb = if ranks.len() == 1 { "is" } else { "are" };
                vec![format!(
                    "tether: hang: {} {verb} not where the others wait; {still}; the run goes on",
                    ranks_words(&ranks)
                )]
            }
        };
        for culprit in &self.culprits {
            lines.push(format!("tether:   {}", culprit_line(culprit)));
        }
        if self.waiting.is_empty() {
            return lines.join("\n") + "\n";
        }
        let verb = if self.waiting.len() == 1 {
            "waits"
        } else {
            "wait"
        };
        lines.push(format!(
            "tether:   {} {verb} {}",
            ranks_words(&self.waiting),
            doing_at(self.doing, self.place.as_ref())
        ));
        lines.join("\n") + "\n"
    }

    fn threshold(&self) -> String {
        match self.step {
            Some(step) => format!(
                "{:.1} s: max(2 s, 3 x the {:.2} s step)",
                self.after.as_secs_f64(),
                step.as_secs_f64()
            ),
            None => format!("{:.1} s", self.after.as_secs_f64()),
        }
    }
}

/// "rank 2 (pid 4242) is in data loading: data.py:31 in __getitem__".
fn culprit_line(c: &Culprit) -> String {
    let who = format!("rank {} (pid {})", c.rank, c.pid);
    let at = c.place.as_ref().map(place_words);
    match (c.doing, at) {
        (Some(Doing::Exited), _) => format!("{who} has exited"),
        (Some(Doing::Stopped), at) => format!(
            "{who} is stopped (SIGSTOP){}; `kill -CONT {}` resumes it",
            at.map(|a| format!(", last seen {}", at_words(&a)))
                .unwrap_or_default(),
            c.pid
        ),
        (doing, Some(at)) => format!("{who} is {}: {at}", doing_words(doing)),
        (doing, None) => format!("{who} is {} (no Python frame seen)", doing_words(doing)),
    }
}

/// "in all_reduce called from train.py:57", "at data.py:31 in __getitem__".
fn at_words(place: &str) -> String {
    match place.starts_with("in ") {
        true => place.to_string(),
        false => format!("at {place}"),
    }
}

/// "in a collective or barrier: in all_reduce called from train.py:57".
fn doing_at(doing: Option<Doing>, place: Option<&Place>) -> String {
    match (place, doing) {
        (Some(place), _) => format!("{}: {}", doing_words(doing), place_words(place)),
        (None, Some(Doing::Waiting) | None) => "(no Python frame seen yet)".into(),
        (None, doing) => format!("{} (no Python frame seen yet)", doing_words(doing)),
    }
}

/// What a rank does, in words.
pub fn doing_words(doing: Option<Doing>) -> String {
    match doing {
        Some(Doing::Collective) => "in a collective or barrier".into(),
        Some(Doing::Starting) => "in torch.distributed's start".into(),
        Some(Doing::DataLoading) => "in data loading".into(),
        Some(Doing::Lock) => "blocked on a lock".into(),
        Some(Doing::Asleep) => "asleep".into(),
        Some(Doing::Busy(percent)) => format!("busy at {percent}% CPU"),
        Some(Doing::Stopped) => "stopped (SIGSTOP)".into(),
        Some(Doing::Exited) => "exited".into(),
        Some(Doing::Waiting) | None => "waiting".into(),
    }
}

/// "in all_reduce called from train.py:57", "data.py:31 in __getitem__".
pub fn place_words(place: &Place) -> String {
    let file = match place.file.starts_with('<') {
        true => place.file.as_str(),
        false => place.file.rsplit('/').next().unwrap_or(&place.file),
    };
    match &place.callee {
        Some(callee) => format!("in {callee} called from {file}:{}", place.line),
        None => format!("{file}:{} in {}", place.line, place.function),
    }
}

/// "tether: slow: rank 3 (pid 4242) takes 1.52x the median time of the others per step
/// (over the last 10 s), mostly at train.py:40 in step".
pub fn slow(rank: usize, pid: i32, ratio: f64, place: Option<Place>) -> String {
    let at = place
        .map(|p| format!(", mostly {}", place_words(&p)))
        .unwrap_or_default();
    format!(
        "tether: slow: rank {rank} (pid {pid}) takes {ratio:.2}x the median time of the others \
         per step (its own work, outside collectives, over the last {} s){at}\n",
        SLOW_WINDOW.as_secs()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picture(waiting: Vec<usize>, doing: Option<Doing>) -> Picture {
        Picture {
            waiting,
            place: None,
            doing,
            culprits: Vec::new(),
            still_for: Duration::from_millis(2100),
            after: Duration::from_secs(2),
            step: None,
        }
    }

    #[test]
    fn ranks_whose_place_is_not_known_yet_say_so() {
        let block = picture(vec![0], Some(Doing::Waiting)).block();
        assert!(
            block.contains("tether:   rank 0 waits (no Python frame seen yet)\n"),
            "{block}"
        );
        let block = picture(vec![0, 1], Some(Doing::Asleep)).block();
        assert!(
            block.contains("ranks 0-1 wait asleep (no Python frame seen yet)"),
            "{block}"
        );
    }
}
