//! The watch of `tether run` (on by default; `--no-watch` or `PET_NO_WATCH=1` turn it off):
//! a thread that looks at an attempt's ranks a few times a second, with no change to the
//! script, and names what is wrong on stderr before anyone asks. The run goes on: only
//! `--timeout` and `--stall-timeout` stop it.
//!
//! - Each look ([`sample`]) reads /proc for each rank's main thread (state, CPU time, how
//!   often it ran, its children's CPU time) and asks its main thread's stack (the dump
//!   signal alone, which restarts what it interrupts; about a millisecond for all ranks):
//!   its place, the innermost frame of the user's code, and what it does: in a collective
//!   or barrier, in data loading, asleep, blocked on a lock, stopped, busy.
//! - The judgement ([`judge`]): a hang when a rank has not moved on for `max(2 s, 3 x the
//!   step)`, with the culprits (the ranks not where the others wait) and where the others
//!   wait, printed again only when the picture changes; a slow rank, once.
//! - The words ([`words`]): a block whose first line starts with `tether: hang`, a line
//!   that starts with `tether: slow`.
//!
//! The watch stops as soon as a rank fails (its ranks are being stopped), and with the
//! attempt (dropping the [`Watch`] ends and joins its thread, within one look).

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tether_core::Group;

use crate::output::{self, Stream};

mod judge;
mod kinds;
mod sample;
mod words;

/// The time between looks, on average (each is drawn within a quarter of it either way, so
/// that looks never keep in step with a job's step).
pub const INTERVAL: Duration = Duration::from_millis(200);

/// The running watch of one attempt.
pub struct Watch {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts watching `group`, whose local rank `i` is global rank `ranks[i]`; `None` (said
    /// in the log) when no thread can be started.
    pub fn start(group: &Group, ranks: Vec<usize>) -> Option<Watch> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let (group, flag) = (group.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("tether-watch".into())
            .spawn(move || watch(&group, &ranks, &flag));
        match thread {
            Ok(thread) => Some(Watch {
                stop,
                thread: Some(thread),
            }),
            Err(err) => {
                log::info!(target: "tether::watch", "cannot start the watch: {err}");
                None
            }
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let (lock, wake) = &*self.stop;
        *lock.lock().unwrap_or_else(|e| e.into_inner()) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The watch's loop: a look every [`INTERVAL`] or so, until told to stop or a rank fails.
fn watch(group: &Group, ranks: &[usize], stop: &(Mutex<bool>, Condvar)) {
    let since = Instant::now();
    let mut judge = judge::Judge::new(ranks);
    let mut draw = Jitter::new();
    let mut first_seen = std::collections::HashMap::new();
    loop {
        let (lock, wake) = stop;
        let stopped = lock.lock().unwrap_or_else(|e| e.into_inner());
        let pause = draw.interval();
        let (stopped, _) = wake
            .wait_timeout_while(stopped, pause, |stopped| !*stopped)
            .unwrap_or_else(|e| e.into_inner());
        if *stopped || group.first_failure().is_some() {
            return;
        }
        drop(stopped);
        let look = sample::look(group, since, &mut first_seen);
        if group.first_failure().is_some() {
            return;
        }
        for block in judge.look(&look) {
            output::write_console(Stream::Stderr, block.as_bytes());
        }
    }
}

/// A small random generator for the looks' intervals (xorshift, seeded by the clock).
struct Jitter(u64);

impl Jitter {
    fn new() -> Jitter {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Jitter(seed | 1)
    }

    fn interval(&mut self) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let spread = INTERVAL.as_micros() as u64 / 2;
        let low = INTERVAL.as_micros() as u64 - spread / 2;
        Duration::from_micros(low + self.0 % spread.max(1))
    }
}
