//! Adaptive spinning before a wait sleeps.
//!
//! A thread that sleeps costs a wake-up when its message comes (tens of microseconds on a
//! virtual machine), so polling for a little while first wins when the answer is near and
//! a core is free. When the cores are busy, polling only takes a core from the process that
//! would answer. So each waiting role keeps a [`Spin`]: it polls up to `max`, and after a
//! few polls in a row found nothing it stops polling for a while (then tries once more).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Polls in a row that found nothing before polling stops for a while.
const MISSES: u32 = 4;
/// How many waits go without polling after that.
const REST: u32 = 256;

/// The spin policy of one waiting role (see the module's documentation).
#[derive(Debug)]
pub struct Spin {
    max: Duration,
    misses: AtomicU32,
    resting: AtomicU32,
}

impl Spin {
    pub const fn new(max: Duration) -> Spin {
        Spin {
            max,
            misses: AtomicU32::new(0),
            resting: AtomicU32::new(0),
        }
    }

    /// How long the next wait may poll before it sleeps.
    pub fn budget(&self) -> Duration {
        if self.max.is_zero() {
            return Duration::ZERO;
        }
        let resting = self.resting.load(Ordering::Relaxed);
        if resting > 0 {
            self.resting.store(resting - 1, Ordering::Relaxed);
            return Duration::ZERO;
        }
        self.max
    }

    /// Records whether polling found what it waited for.
    pub fn record(&self, hit: bool) {
        if hit {
            self.misses.store(0, Ordering::Relaxed);
            return;
        }
        let misses = self.misses.load(Ordering::Relaxed) + 1;
        if misses >= MISSES {
            self.misses.store(0, Ordering::Relaxed);
            self.resting.store(REST, Ordering::Relaxed);
        } else {
            self.misses.store(misses, Ordering::Relaxed);
        }
    }

    /// Calls `ready` until it returns `Some` or this wait's polling budget is spent; the
    /// result, recorded as a hit or a miss. `None` when there was no budget or it ran out.
    pub fn poll<T, E>(
        &self,
        mut ready: impl FnMut() -> Result<Option<T>, E>,
    ) -> Result<Option<T>, E> {
        let budget = self.budget();
        if budget.is_zero() {
            return Ok(None);
        }
        let start = Instant::now();
        loop {
            if let Some(found) = ready()? {
                self.record(true);
                return Ok(Some(found));
            }
            if start.elapsed() >= budget {
                self.record(false);
                return Ok(None);
            }
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polling_rests_after_misses_and_comes_back() {
        let spin = Spin::new(Duration::from_micros(50));
        assert_eq!(spin.poll(|| Ok::<_, ()>(Some(1))), Ok(Some(1)));
        for _ in 0..MISSES {
            assert_eq!(spin.poll(|| Ok::<Option<i32>, ()>(None)), Ok(None));
        }
        for _ in 0..REST {
            assert_eq!(spin.budget(), Duration::ZERO);
        }
        assert_eq!(spin.budget(), Duration::from_micros(50));
        assert_eq!(Spin::new(Duration::ZERO).budget(), Duration::ZERO);
    }
}
