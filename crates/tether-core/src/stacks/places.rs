//! Where each rank is, as `tether top` shows it: its place (see [`super::place`]) and for
//! how long the process that asks its ranks has seen it there, written one line per rank
//! (`place RANK PID SECONDS WHERE`), by a `tether run` and by a process that started ranks
//! itself (see [`super::served`]) alike.

use std::sync::Mutex;
use std::time::Instant;

/// Where a rank is, as its asker saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Place {
    pub rank: usize,
    pub pid: i32,
    /// For how long the asker has seen it there (from every request it answered).
    pub seconds: f64,
    /// Where: see [`super::place`].
    pub place: String,
}

impl Place {
    /// The place as one line (with its newline).
    pub fn line(&self) -> String {
        let place = self.place.replace('\n', " ");
        format!(
            "place {} {} {:.3} {place}\n",
            self.rank, self.pid, self.seconds
        )
    }

    /// The place a line (without its newline) gives; `None` for another line.
    pub fn parse(line: &str) -> Option<Place> {
        let mut words = line.strip_prefix("place ")?.splitn(4, ' ');
        Some(Place {
            rank: words.next()?.parse().ok()?,
            pid: words.next()?.parse().ok()?,
            seconds: words.next()?.parse().ok()?,
            place: words.next().unwrap_or("").to_string(),
        })
    }
}

/// An asker's memory of where each process was: its place, and when it was first seen
/// there. The time is a lower bound, as good as the requests are frequent: a process that
/// left its place and came back between two requests is taken as never having left.
#[derive(Debug, Default)]
pub struct Since(Mutex<Vec<(i32, String, Instant)>>);

impl Since {
    pub const fn new() -> Since {
        Since(Mutex::new(Vec::new()))
    }

    /// Notes where each rank (rank, pid, place) is now; returns each one's [`Place`], with
    /// the seconds since it was first seen there (a new pid starts at 0). Processes not in
    /// `ranks` are forgotten.
    pub fn note(&self, now: Instant, ranks: &[(usize, i32, String)]) -> Vec<Place> {
        let mut seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let before = std::mem::take(&mut *seen);
        for (_, pid, place) in ranks {
            let first = before
                .iter()
                .find(|(p, at, _)| p == pid && at == place)
                .map_or(now, |&(_, _, first)| first);
            seen.push((*pid, place.clone(), first));
        }
        ranks
            .iter()
            .zip(seen.iter())
            .map(|((rank, pid, place), (_, _, first))| Place {
                rank: *rank,
                pid: *pid,
                seconds: now.saturating_duration_since(*first).as_secs_f64(),
                place: place.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_place_is_timed_from_when_it_was_first_seen_and_a_move_starts_again() {
        let since = Since::new();
        let t0 = Instant::now();
        let at = |s: &str| vec![(3, 5, s.to_string())];
        assert_eq!(since.note(t0, &at("a.py:1 in f"))[0].seconds, 0.0);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(since.note(later, &at("a.py:1 in f"))[0].seconds, 2.0);
        let moved = later + Duration::from_secs(1);
        assert_eq!(since.note(moved, &at("a.py:2 in g"))[0].seconds, 0.0);
        let again = vec![(3, 6, "a.py:2 in g".to_string())];
        assert_eq!(
            since.note(moved + Duration::from_secs(1), &again)[0].seconds,
            0.0
        );
    }

    #[test]
    fn a_place_reads_back_as_written() {
        let place = Place {
            rank: 2,
            pid: 41,
            seconds: 1.5,
            place: "all_reduce called from train.py:57".into(),
        };
        let line = place.line();
        assert_eq!(Place::parse(line.trim_end()), Some(place));
        assert_eq!(Place::parse("silent 1 2"), None);
    }
}
