//! `tether top PID`: a live view of a running `tether run` or `tether.spawn` job (PID: the
//! launcher, or the process that called `tether.spawn`), one row per rank: its pid, state,
//! CPU %, resident memory, its place (the innermost frame of the user's code, as the stacks'
//! summary names it), for how long it has been there, and its DataLoader workers (every
//! process the rank started) with their CPU %.
//!
//! - The places come from the launcher, asked quietly for the stacks as `tether stacks`
//!   asks ([`crate::stacks::reply`]): the block is not printed on the job's stderr; or from
//!   the process that called `tether.spawn`, which listens for `tether top`
//!   ([`tether_core::stacks::served`]). Either remembers where it last saw each rank
//!   ([`crate::stacks::hangs`] in the launcher): "seconds" is the time since it first saw the rank in its
//!   present place, over every request it answered (a lower bound, as fine as the requests
//!   are frequent).
//! - CPU % is measured between two samples of /proc ([`procs`]), 0.5 s apart.
//! - On a terminal the view is redrawn every 0.5 s until the job ends or Ctrl-C; `--once` (or
//!   a stdout that is no terminal) prints one snapshot; `--json` prints it as a JSON list of
//!   objects (`rank`, `pid`, `state`, `cpu`, `rss`, `place`, `seconds`, `workers`).

use std::ffi::OsString;
use std::io::Write;
use std::time::{Duration, Instant};

use serde_json::json;
use tether_core::stacks::{self, served};

use crate::procs;
use crate::stacks::reply::{self, Got, Place};
use crate::stacks::workers;

const USAGE: &str = "usage: tether top PID [--once] [--json]  (PID: a running `tether run`, \
                     or a process that called `tether.spawn`)";

/// What PID is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Job {
    /// A `tether run`.
    Run,
    /// A process that started ranks with `tether.spawn` (or `start_processes`).
    Spawn,
}

impl Job {
    /// What `pid` is, if it is either.
    fn of(pid: i32) -> Option<Job> {
        if crate::stacks::is_launcher(pid) {
            return Some(Job::Run);
        }
        matches!(served::ask(pid, served::TIMEOUT), Ok(Some(_))).then_some(Job::Spawn)
    }

    fn words(self) -> &'static str {
        match self {
            Job::Run => "`tether run`",
            Job::Spawn => "`tether.spawn` job",
        }
    }
}

/// The time between two samples.
const PERIOD: Duration = Duration::from_millis(500);

/// One rank's row.
#[derive(Debug, Clone)]
struct Row {
    place: Place,
    now: Option<procs::Sample>,
    cpu: f64,
    workers: Vec<(procs::Sample, f64)>,
}

/// `tether top ARGS`: 0 once the view ends, 1 when PID is no `tether run` or does not
/// answer, 2 (and the usage) for bad usage.
pub fn main(args: &[OsString]) -> i32 {
    let (mut pid, mut once, mut as_json) = (None, false, false);
    for arg in args {
        match arg.to_str() {
            Some("--once") => once = true,
            Some("--json") => as_json = true,
            Some("-h" | "--help") => return usage(0),
            Some(n) if pid.is_none() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                pid = Some(n.parse::<i32>().unwrap_or(0))
            }
            _ => return usage(2),
        }
    }
    let Some(pid) = pid else {
        return usage(2);
    };
    let Some(job) = (pid > 0).then(|| Job::of(pid)).flatten() else {
        crate::output::message(&format!(
            "tether top: pid {pid} is not a running `tether run` nor a process that called \
             `tether.spawn`"
        ));
        return 1;
    };
    let live = !once && !as_json && rustix::termios::isatty(std::io::stdout());
    let mut before = match snapshot(pid, job) {
        Ok(rows) => rows,
        Err(code) => return code,
    };
    loop {
        let started = Instant::now();
        std::thread::sleep(PERIOD);
        let rows = match snapshot(pid, job) {
            Ok(rows) => rows,
            Err(code) => return if live { 0 } else { code },
        };
        let rows = with_cpu(rows, &before, started.elapsed());
        let text = match as_json {
            true => format!("{}\n", to_json(&rows)),
            false => table(pid, job, &rows),
        };
        let mut out = std::io::stdout().lock();
        let clear = if live { "\x1b[H\x1b[2J" } else { "" };
        let _ = write!(out, "{clear}{text}").and_then(|()| out.flush());
        if !live {
            return 0;
        }
        before = rows;
    }
}

fn usage(code: i32) -> i32 {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{USAGE}").and_then(|()| out.flush());
    code
}

/// Every rank's place (from `pid`, a `job`) and /proc sample, with its workers'.
fn snapshot(pid: i32, job: Job) -> Result<Vec<Row>, i32> {
    let got = match job {
        Job::Run => reply::ask(pid, stacks::signal(), crate::stacks::WAIT, true),
        Job::Spawn => served::ask(pid, crate::stacks::WAIT).map(|places| {
            places.map(|places| Got::Stacks {
                block: Vec::new(),
                silent: Vec::new(),
                places,
            })
        }),
    };
    let places = match got {
        Ok(Some(Got::Stacks { places, .. })) => places,
        Ok(Some(Got::Error(why))) => {
            crate::output::message(&format!("tether top: {} (pid {pid}): {why}", job.words()));
            return Err(1);
        }
        Ok(None) | Err(_) => {
            let when = match job {
                Job::Run => "gone, or between attempts",
                Job::Spawn => "gone",
            };
            crate::output::message(&format!(
                "tether top: {} (pid {pid}) did not answer ({when})",
                job.words()
            ));
            return Err(1);
        }
    };
    let parents = procs::parents();
    Ok(places
        .into_iter()
        .map(|place| {
            let workers = workers::started(place.pid, &parents)
                .into_iter()
                .filter_map(procs::sample)
                .map(|s| (s, 0.0))
                .collect();
            Row {
                now: procs::sample(place.pid),
                place,
                cpu: 0.0,
                workers,
            }
        })
        .collect())
}

/// `rows` with the CPU % of each process since `before` (`elapsed` earlier).
fn with_cpu(mut rows: Vec<Row>, before: &[Row], elapsed: Duration) -> Vec<Row> {
    let hz = procs::ticks_per_second();
    let seconds = elapsed.as_secs_f64().max(1e-3);
    let mut earlier = std::collections::HashMap::new();
    for row in before {
        earlier.extend(row.now.iter().map(|s| (s.pid, s.ticks)));
        earlier.extend(row.workers.iter().map(|(s, _)| (s.pid, s.ticks)));
    }
    let percent = |s: &procs::Sample| {
        let then = earlier.get(&s.pid).copied().unwrap_or(s.ticks);
        (s.ticks.saturating_sub(then)) as f64 / hz / seconds * 100.0
    };
    for row in rows.iter_mut() {
        row.cpu = row.now.as_ref().map_or(0.0, percent);
        for (sample, cpu) in row.workers.iter_mut() {
            *cpu = percent(sample);
        }
    }
    rows
}

fn to_json(rows: &[Row]) -> serde_json::Value {
    let round = |x: f64| (x * 10.0).round() / 10.0;
    let list: Vec<serde_json::Value> = rows
        .iter()
        .map(|row| {
            let workers: Vec<serde_json::Value> = row
                .workers
                .iter()
                .map(|(s, cpu)| {
                    json!({"pid": s.pid, "state": s.state.to_string(), "cpu": round(*cpu), "rss": s.rss})
                })
                .collect();
            json!({
                "rank": row.place.rank,
                "pid": row.place.pid,
                "state": row.now.as_ref().map_or("?".to_string(), |s| s.state.to_string()),
                "cpu": round(row.cpu),
                "rss": row.now.as_ref().map_or(0, |s| s.rss),
                "place": row.place.place,
                "seconds": round(row.place.seconds),
                "workers": workers,
            })
        })
        .collect();
    serde_json::Value::Array(list)
}

/// The view as a table, one line per rank and one more for its workers.
fn table(pid: i32, job: Job, rows: &[Row]) -> String {
    let mut lines = vec![
        format!(
            "tether top: {} pid {pid}, {} rank(s)",
            job.words(),
            rows.len()
        ),
        format!(
            "{:>5} {:>8} {:1} {:>6} {:>9} {:>7}  PLACE",
            "RANK", "PID", "S", "CPU%", "RSS", "SECS"
        ),
    ];
    for row in rows {
        let state = row.now.as_ref().map_or('?', |s| s.state);
        let rss = row.now.as_ref().map_or(0, |s| s.rss);
        lines.push(format!(
            "{:>5} {:>8} {state:1} {:>6.1} {:>9} {:>7.1}  {}",
            row.place.rank,
            row.place.pid,
            row.cpu,
            megabytes(rss),
            row.place.seconds,
            row.place.place
        ));
        if !row.workers.is_empty() {
            let workers: Vec<String> = row
                .workers
                .iter()
                .map(|(s, cpu)| format!("{} {} {cpu:.0}%", s.pid, s.state))
                .collect();
            lines.push(format!("{:>15} workers: {}", "", workers.join(", ")));
        }
    }
    lines.join("\n") + "\n"
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1}M", bytes as f64 / (1024.0 * 1024.0))
}
