//! The watch's judgement, from the looks alone (no process, no clock of its own, so that
//! tests feed it made-up looks):
//!
//! - A rank *moved* between two looks when its main thread was put on a CPU or used CPU
//!   time in the clean part of the interval (from the end of one look to the start of the
//!   next: the look's own signal is outside it), its children (DataLoader workers) used CPU
//!   time, or its place changed. A rank that did not move is *still*, since the start of the
//!   first clean interval in which it did not; a stopped rank is still.
//! - The *step*: each rank passes its most frequent place when it is seen there after being
//!   elsewhere or after moving; the step is the median, over the ranks, of the lower
//!   quartile of the times between passes over the last [`HISTORY`], over the ranks that
//!   have [`LEAST_GAPS`] of them (unknown until one has).
//! - A *hang*: some rank has been still for `max(2 s, 3 x step)`, other than in
//!   torch.distributed's start (`init_process_group`). The ranks still for [`GROUPED`] in
//!   the same place doing the same thing (the most of them; a collective first when as
//!   many), stopped ones aside, are where the others wait; every other rank is a culprit. A block is printed when the picture (who is where)
//!   differs from the last one printed; it is forgotten once no rank has been still that
//!   long for [`CLEARED`].
//! - A *slow* rank: over the last [`SLOW_WINDOW`] (in which no rank was still for
//!   [`GROUPED`]), the share of its looks outside a
//!   collective (its own work in a step) is at least [`SLOW_RATIO`] times the median share
//!   of the others. Said once, again only after it fell below [`SLOW_AGAIN`].

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

pub use super::kinds::{Counters, Doing, Look, Place};
use super::words::{self, SLOW_WINDOW};

/// How much of each rank's past the step and the slow ranks are read from.
pub const HISTORY: Duration = Duration::from_secs(30);
/// The shortest time still that is a hang.
pub const MIN_HANG: Duration = Duration::from_secs(2);
/// How long no rank must be still for a printed picture to be forgotten.
pub const CLEARED: Duration = Duration::from_secs(2);
/// A slow rank's own time over the median of the others' (1.3x, less the error of sampling
/// a few times a second over ten seconds).
pub const SLOW_RATIO: f64 = 1.25;
/// The ratio under which a rank named slow may be named again.
pub const SLOW_AGAIN: f64 = 1.1;
/// How long a rank must have been still to be one of those that wait, in a hang.
pub const GROUPED: Duration = Duration::from_secs(1);
/// The fewest gaps between passes a rank's step is read from (fewer, at a job's start, say
/// little: the step is then not known, and a hang is [`MIN_HANG`]).
const LEAST_GAPS: usize = 4;
/// CPU time of a main thread in an interval that is more than the noise of /proc.
const MOVED_CPU_NS: u64 = 2_000_000;

/// One rank seen at one look.
#[derive(Debug, Clone)]
struct Seen {
    at: Duration,
    place: Option<Place>,
    moved: bool,
    waiting: bool,
}

/// What the watch knows of one rank.
#[derive(Debug, Clone, Default)]
pub struct Track {
    pub rank: usize,
    pub pid: i32,
    pub place: Option<Place>,
    pub doing: Option<Doing>,
    pub still_since: Option<Duration>,
    pub exited: bool,
    last_after: Option<(Duration, Counters)>,
    cpu: VecDeque<(Duration, u64)>,
    seen: VecDeque<Seen>,
    named_slow: bool,
}

/// The judge of one attempt's ranks.
pub struct Judge {
    pub tracks: Vec<Track>,
    /// The picture last printed, and since when no rank has been still long enough.
    printed: Option<(words::Picture, Option<Duration>)>,
    /// The last time a rank was still for [`GROUPED`] (a pause, a hang): slow ranks are
    /// judged on the [`SLOW_WINDOW`] after it only.
    unsettled: Duration,
}

impl Judge {
    /// A judge for ranks `ranks` (the global rank of each local rank).
    pub fn new(ranks: &[usize]) -> Judge {
        let tracks = ranks
            .iter()
            .map(|&rank| Track {
                rank,
                ..Track::default()
            })
            .collect();
        Judge {
            tracks,
            printed: None,
            unsettled: Duration::ZERO,
        }
    }

    /// Takes `look` in; returns what to print (each a block of lines).
    pub fn look(&mut self, look: &Look) -> Vec<String> {
        for (i, track) in self.tracks.iter_mut().enumerate() {
            track.take(look, i);
        }
        let now = look.after_at;
        let mut said = Vec::new();
        let hang = self.hang(now);
        if let Some(block) = self.hang_words(hang, now) {
            said.push(block);
        }
        if self.printed.is_none() {
            said.extend(self.slow(now));
        }
        said
    }

    /// The step: the median over the ranks of each one's time between passes.
    pub fn step(&self) -> Option<Duration> {
        let mut periods: Vec<Duration> = self.tracks.iter().filter_map(Track::period).collect();
        periods.sort_unstable();
        periods.get(periods.len() / 2).copied()
    }

    /// How long a rank must be still for a hang.
    pub fn hang_after(&self) -> Duration {
        self.step().map_or(MIN_HANG, |s| MIN_HANG.max(s * 3))
    }

    /// The picture of a hang now, if there is one.
    fn hang(&self, now: Duration) -> Option<words::Picture> {
        let after = self.hang_after();
        let live = || self.tracks.iter().filter(|t| !t.exited);
        let longest = live()
            .filter(|t| t.doing != Some(Doing::Starting))
            .map(|t| t.still_for(now))
            .max()?;
        if longest < after {
            return None;
        }
        let mut groups: BTreeMap<(Option<Place>, Option<Doing>), Vec<usize>> = BTreeMap::new();
        for track in
            live().filter(|t| t.still_for(now) >= GROUPED && t.doing != Some(Doing::Stopped))
        {
            let key = (track.place.clone(), track.doing);
            groups.entry(key).or_default().push(track.rank);
        }
        let key = groups
            .iter()
            .max_by_key(|((_, doing), ranks)| {
                let collective = *doing == Some(Doing::Collective);
                (ranks.len(), collective, std::cmp::Reverse(ranks[0]))
            })
            .map(|(key, _)| key.clone());
        let waits = |t: &Track| {
            !t.exited
                && key
                    .as_ref()
                    .is_some_and(|k| (&t.place, &t.doing) == (&k.0, &k.1))
        };
        let (place, doing) = key.clone().unwrap_or_default();
        Some(words::Picture {
            waiting: self
                .tracks
                .iter()
                .filter(|t| waits(t))
                .map(|t| t.rank)
                .collect(),
            place,
            doing,
            culprits: self
                .tracks
                .iter()
                .filter(|t| !waits(t))
                .map(Track::culprit)
                .collect(),
            still_for: longest,
            after,
            step: self.step(),
        })
    }

    /// The block to print for `hang` (now), when the picture changed.
    fn hang_words(&mut self, hang: Option<words::Picture>, now: Duration) -> Option<String> {
        match hang {
            Some(picture) => {
                let same = self.printed.as_ref().is_some_and(|(p, _)| p.same(&picture));
                if same {
                    if let Some((_, cleared)) = &mut self.printed {
                        *cleared = None;
                    }
                    return None;
                }
                let block = picture.block();
                self.printed = Some((picture, None));
                Some(block)
            }
            None => {
                if let Some((_, cleared)) = &mut self.printed {
                    let since = *cleared.get_or_insert(now);
                    if now.saturating_sub(since) >= CLEARED {
                        self.printed = None;
                    }
                }
                None
            }
        }
    }

    /// The lines naming slow ranks, now.
    fn slow(&mut self, now: Duration) -> Vec<String> {
        let shares: Vec<Option<f64>> = self.tracks.iter().map(|t| t.own_share(now)).collect();
        let mut said = Vec::new();
        if self
            .tracks
            .iter()
            .any(|t| !t.exited && t.still_for(now) >= GROUPED)
        {
            self.unsettled = now;
        }
        if now.saturating_sub(self.unsettled) < SLOW_WINDOW {
            return said;
        }
        for i in 0..self.tracks.len() {
            let Some(own) = shares[i] else { continue };
            let mut others: Vec<f64> = (0..shares.len())
                .filter(|&j| j != i)
                .filter_map(|j| shares[j])
                .collect();
            if others.is_empty() {
                continue;
            }
            others.sort_by(f64::total_cmp);
            let half = others.len() / 2;
            let median = match others.len() % 2 {
                1 => others[half],
                _ => (others[half - 1] + others[half]) / 2.0,
            };
            if median < 0.05 {
                continue;
            }
            let ratio = own / median;
            let track = &mut self.tracks[i];
            if ratio >= SLOW_RATIO && !track.named_slow {
                track.named_slow = true;
                said.push(words::slow(
                    track.rank,
                    track.pid,
                    ratio,
                    track.usual_place(now),
                ));
            } else if ratio < SLOW_AGAIN {
                track.named_slow = false;
            }
        }
        said
    }
}

impl Track {
    /// This rank as a culprit of a hang.
    fn culprit(&self) -> words::Culprit {
        words::Culprit {
            rank: self.rank,
            pid: self.pid,
            place: self.place.clone(),
            doing: self.doing,
        }
    }

    /// Takes in what look `look` saw of local rank `i`.
    fn take(&mut self, look: &Look, i: usize) {
        let Some(pid) = look.pids.get(i).copied().flatten() else {
            self.exited = true;
            self.doing = Some(Doing::Exited);
            self.still_since = None;
            return;
        };
        self.pid = pid;
        let Some(before) = look.before.get(i).copied().flatten() else {
            return;
        };
        let stopped = matches!(before.state, 'T' | 't');
        let found = look.places.get(i).cloned().flatten();
        let changed = found
            .as_ref()
            .is_some_and(|(p, _)| Some(p) != self.place.as_ref());
        let moved = !stopped && (changed || self.ran_since(&before, look.before_at));
        if let Some((place, doing)) = found {
            self.place = Some(place);
            self.doing = Some(doing);
        }
        self.cpu.push_back((look.before_at, before.cpu_ns));
        while self.cpu.len() > 2 && look.before_at - self.cpu[0].0 > Duration::from_secs(1) {
            self.cpu.pop_front();
        }
        self.doing = self.doing_now(stopped);
        self.still_since = match (moved, self.last_after) {
            (false, Some((since, _))) => Some(self.still_since.unwrap_or(since)),
            _ => None,
        };
        if let Some(after) = look.after.get(i).copied().flatten() {
            self.last_after = Some((look.after_at, after));
        }
        self.remember(look.before_at, moved);
    }

    /// Whether the main thread ran, or its children used CPU time, in the clean interval
    /// that ends with `before` (at `at`).
    fn ran_since(&self, before: &Counters, at: Duration) -> bool {
        let Some((since, after)) = self.last_after else {
            return true;
        };
        let window = at.saturating_sub(since).as_nanos() as u64;
        before.runs != after.runs
            || before.cpu_ns.saturating_sub(after.cpu_ns) > MOVED_CPU_NS
            || before.children_ns.saturating_sub(after.children_ns) > window / 20
    }

    /// What it does now: stopped, or busy when its main thread used most of a CPU over the
    /// last second (unless a collective, its start or data loading says more).
    fn doing_now(&self, stopped: bool) -> Option<Doing> {
        if stopped {
            return Some(Doing::Stopped);
        }
        let busy = match (self.cpu.front(), self.cpu.back()) {
            (Some(&(t0, c0)), Some(&(t1, c1))) if t1 > t0 => {
                let share = c1.saturating_sub(c0) as f64 / (t1 - t0).as_nanos() as f64;
                (share >= 0.8).then(|| (share * 100.0).round().min(100.0) as u32)
            }
            _ => None,
        };
        match (self.doing, busy) {
            (Some(Doing::Collective | Doing::Starting | Doing::DataLoading), _) => self.doing,
            (_, Some(percent)) => Some(Doing::Busy(percent)),
            (Some(Doing::Busy(_) | Doing::Stopped), None) => Some(Doing::Waiting),
            (doing, None) => doing,
        }
    }

    fn remember(&mut self, at: Duration, moved: bool) {
        self.seen.push_back(Seen {
            at,
            place: self.place.clone(),
            moved,
            waiting: self.doing == Some(Doing::Collective),
        });
        while self.seen.front().is_some_and(|s| at - s.at > HISTORY) {
            self.seen.pop_front();
        }
    }

    /// How long it has been still at `now`.
    fn still_for(&self, now: Duration) -> Duration {
        self.still_since
            .map_or(Duration::ZERO, |s| now.saturating_sub(s))
    }

    /// Its most frequent place since `from`.
    fn usual(&self, from: Duration) -> Option<Place> {
        let mut count: BTreeMap<&Place, usize> = BTreeMap::new();
        for seen in self.seen.iter().filter(|s| s.at >= from) {
            if let Some(place) = &seen.place {
                *count.entry(place).or_default() += 1;
            }
        }
        let most = count.into_iter().max_by_key(|&(_, n)| n)?;
        Some(most.0.clone())
    }

    fn usual_place(&self, now: Duration) -> Option<Place> {
        self.usual(now.saturating_sub(SLOW_WINDOW))
    }

    /// The time between its passes of its most frequent place: the lower quartile of at
    /// least [`LEAST_GAPS`] gaps, so that the time it spent elsewhere (at its start, in a
    /// pause) does not count, nor the passes a look missed (a step shorter than the time
    /// between looks is seen at its place at only some of them).
    fn period(&self) -> Option<Duration> {
        let usual = self.usual(Duration::ZERO)?;
        let mut passes = Vec::new();
        let mut before: Option<&Place> = None;
        for seen in &self.seen {
            let here = seen.place.as_ref() == Some(&usual);
            if here && (seen.moved || before != Some(&usual)) {
                passes.push(seen.at);
            }
            before = seen.place.as_ref();
        }
        let mut gaps: Vec<Duration> = passes.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort_unstable();
        (gaps.len() >= LEAST_GAPS).then(|| gaps[gaps.len() / 4])
    }

    /// The share of its looks outside a collective over the last [`SLOW_WINDOW`], once it
    /// has been seen that long (and not while it is still).
    fn own_share(&self, now: Duration) -> Option<f64> {
        let from = now.checked_sub(SLOW_WINDOW)?;
        if self.exited || !self.seen.front().is_some_and(|s| s.at <= from) {
            return None;
        }
        let window: Vec<&Seen> = self.seen.iter().filter(|s| s.at >= from).collect();
        if window.len() < 20 {
            return None;
        }
        let own = window.iter().filter(|s| !s.waiting).count();
        Some(own as f64 / window.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(line: u32, callee: Option<&str>) -> Place {
        Place {
            file: "/u/train.py".into(),
            line: line.to_string(),
            function: "main".into(),
            callee: callee.map(str::to_string),
        }
    }

    /// A look at `at` ms: each rank's place, whether it ran since the last look, its state.
    fn look(at: u64, ranks: &[(Place, Doing, bool, char)], runs: &mut [u64]) -> Look {
        let mut look = Look {
            before_at: Duration::from_millis(at),
            after_at: Duration::from_millis(at + 5),
            ..Look::default()
        };
        for (i, (place, doing, ran, state)) in ranks.iter().enumerate() {
            runs[i] += u64::from(*ran);
            let counters = Counters {
                state: *state,
                cpu_ns: 0,
                runs: runs[i],
                children_ns: 0,
            };
            look.pids.push(Some(100 + i as i32));
            look.before.push(Some(counters));
            look.after.push(Some(counters));
            look.places.push(Some((place.clone(), *doing)));
        }
        look
    }

    #[test]
    fn a_rank_asleep_elsewhere_is_named_once_and_the_others_wait_in_the_collective() {
        let mut judge = Judge::new(&[0, 1, 2]);
        let mut runs = [0; 3];
        let (nap, reduce) = (place(10, None), place(20, Some("all_reduce")));
        let mut said = Vec::new();
        for tick in 0..40u64 {
            let healthy = tick < 10;
            let ranks: Vec<(Place, Doing, bool, char)> = (0..3)
                .map(|r| match (healthy, r) {
                    (true, _) => (nap.clone(), Doing::Asleep, true, 'S'),
                    (false, 1) => (nap.clone(), Doing::DataLoading, false, 'S'),
                    _ => (reduce.clone(), Doing::Collective, false, 'S'),
                })
                .collect();
            said.extend(judge.look(&look(tick * 200, &ranks, &mut runs)));
        }
        assert_eq!(said.len(), 1, "{said:?}");
        let lines: Vec<&str> = said[0].lines().collect();
        assert!(
            lines[0].starts_with("tether: hang: rank 1 is not where"),
            "{lines:?}"
        );
        assert!(
            lines[1].contains("rank 1 (pid 101) is in data loading"),
            "{lines:?}"
        );
        assert!(
            lines[2].contains("ranks 0, 2 wait in a collective"),
            "{lines:?}"
        );
    }

    #[test]
    fn ranks_that_keep_running_are_no_hang_and_a_stopped_rank_is_the_culprit() {
        let mut judge = Judge::new(&[0, 1]);
        let mut runs = [0; 2];
        let nap = place(10, None);
        for tick in 0..50u64 {
            let ranks = [
                (nap.clone(), Doing::Asleep, true, 'S'),
                (nap.clone(), Doing::Asleep, true, 'S'),
            ];
            assert!(judge.look(&look(tick * 200, &ranks, &mut runs)).is_empty());
        }
        let reduce = place(20, Some("all_reduce"));
        let mut said = Vec::new();
        for tick in 50..70u64 {
            let ranks = [
                (reduce.clone(), Doing::Collective, false, 'S'),
                (nap.clone(), Doing::Asleep, false, 'T'),
            ];
            said.extend(judge.look(&look(tick * 200, &ranks, &mut runs)));
        }
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].contains("rank 1 (pid 101) is stopped (SIGSTOP)"),
            "{said:?}"
        );
    }

    #[test]
    fn every_rank_in_one_place_names_no_culprit() {
        let mut judge = Judge::new(&[0, 1]);
        let mut runs = [0; 2];
        let barrier = place(30, Some("barrier"));
        let mut said = Vec::new();
        for tick in 0..20u64 {
            let ranks = [
                (barrier.clone(), Doing::Collective, tick == 0, 'S'),
                (barrier.clone(), Doing::Collective, tick == 0, 'S'),
            ];
            said.extend(judge.look(&look(tick * 200, &ranks, &mut runs)));
        }
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0]
            .starts_with("tether: hang: every rank is in the same place, none is the culprit"));
    }

    #[test]
    fn a_rank_whose_own_work_takes_twice_the_others_is_named_slow_once() {
        let mut judge = Judge::new(&[0, 1, 2]);
        let mut runs = [0; 3];
        let (work, reduce) = (place(10, None), place(20, Some("all_reduce")));
        let mut said = Vec::new();
        for tick in 0..100u64 {
            // Ranks 0 and 2 wait in the collective one look in two; rank 1 never does.
            let ranks: Vec<(Place, Doing, bool, char)> = (0..3)
                .map(|r| match r != 1 && tick % 2 == 0 {
                    true => (reduce.clone(), Doing::Collective, true, 'S'),
                    false => (work.clone(), Doing::Asleep, true, 'S'),
                })
                .collect();
            said.extend(judge.look(&look(tick * 200, &ranks, &mut runs)));
        }
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].starts_with("tether: slow: rank 1 (pid 101) takes 2.00x"),
            "{said:?}"
        );
    }

    #[test]
    fn the_step_is_unknown_at_first_then_read_from_the_shortest_gaps_not_the_median() {
        // Two ranks step faster than the looks come: a look finds each in the collective
        // (its most frequent place) at some looks only, one, two or three looks apart.
        let mut judge = Judge::new(&[0, 1]);
        let mut runs = [0; 2];
        let (nap, reduce) = (place(10, None), place(20, Some("all_reduce")));
        let at_reduce = [
            true, false, false, true, true, false, true, false, true, true,
        ];
        let mut steps = Vec::new();
        for (k, &here) in at_reduce.iter().cycle().take(30).enumerate() {
            let spot = match here {
                true => (reduce.clone(), Doing::Collective, true, 'S'),
                false => (nap.clone(), Doing::Asleep, true, 'S'),
            };
            judge.look(&look(200 * k as u64, &[spot.clone(), spot], &mut runs));
            steps.push(judge.step());
        }
        assert_eq!(
            steps[..5],
            [None; 5],
            "too few passes say nothing of the step"
        );
        let last = steps
            .last()
            .copied()
            .flatten()
            .expect("a step once passes are many");
        assert_eq!(last, Duration::from_millis(200));
        assert_eq!(judge.hang_after(), MIN_HANG);
    }
}
