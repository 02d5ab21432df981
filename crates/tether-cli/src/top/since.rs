//! The launcher's memory of where each rank was: for every block of stacks it collects
//! (asked by `tether stacks`, `tether top`, SIGUSR1 or a limit), each rank's place and when
//! the launcher first saw it there, so that `tether top` can say for how long a rank has been
//! in its place. The time is a lower bound, as good as the requests are frequent: a rank
//! that left its place and came back between two requests is taken as never having left.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::stacks_reply::Place;

/// Where a rank was seen: its pid, its place, and when it was first seen there.
type Seen = (i32, String, Instant);

/// rank -> where it was seen.
static SEEN: Mutex<Option<HashMap<usize, Seen>>> = Mutex::new(None);

/// Notes where each rank (rank, pid, place) is now; returns each one's [`Place`], with the
/// seconds since the launcher first saw it there (a new pid starts again at 0).
pub fn note(now: Instant, ranks: &[(usize, i32, String)]) -> Vec<Place> {
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    let seen = seen.get_or_insert_with(HashMap::new);
    ranks
        .iter()
        .map(|(rank, pid, place)| {
            let entry = seen
                .entry(*rank)
                .or_insert_with(|| (*pid, place.clone(), now));
            if entry.0 != *pid || entry.1 != *place {
                *entry = (*pid, place.clone(), now);
            }
            Place {
                rank: *rank,
                pid: *pid,
                seconds: now.saturating_duration_since(entry.2).as_secs_f64(),
                place: place.clone(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_place_is_timed_from_when_it_was_first_seen_and_a_move_starts_again() {
        let t0 = Instant::now();
        let at = |s: &str| vec![(900, 5, s.to_string())];
        assert_eq!(note(t0, &at("a.py:1 in f"))[0].seconds, 0.0);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(note(later, &at("a.py:1 in f"))[0].seconds, 2.0);
        let moved = later + Duration::from_secs(1);
        assert_eq!(note(moved, &at("a.py:2 in g"))[0].seconds, 0.0);
        let again = vec![(900, 6, "a.py:2 in g".to_string())];
        assert_eq!(note(moved + Duration::from_secs(1), &again)[0].seconds, 0.0);
    }
}
