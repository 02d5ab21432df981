//! What a rank writes without a newline reaches the console while the rank is still on that
//! line: a progress bar redrawn with `\r` update by update, a prompt after a short wait,
//! each rank's prefix at the start of every terminal line, UTF-8 characters whole, and the
//! log files byte for byte.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{command, Launcher, Scratch};

/// A tqdm-style bar: `\rstep i` without a newline, then a wait until the test has seen the
/// update on tether's stdout (it creates `ack.<rank>.<i>`), or 5 s; a newline at the end.
const BAR: &str = r#"
import os, sys, time
rank, steps = os.environ["RANK"], int(sys.argv[1])
for i in range(steps):
    print(f"\rstep {i}", end="", flush=True)
    ack = os.path.join(os.environ["DIR"], f"ack.{rank}.{i}")
    deadline = time.monotonic() + 5
    while not os.path.exists(ack) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)
print()
"#;

fn bar_script(dir: &Scratch) -> String {
    let path = dir.path().join("bar.py");
    std::fs::write(&path, BAR).unwrap();
    path.to_str().unwrap().to_string()
}

fn start(dir: &Scratch, args: &[&str]) -> Launcher {
    let mut cmd = command(args);
    cmd.env("DIR", dir.path());
    Launcher::spawn(cmd)
}

/// Waits (at most `limit`) until tether's stdout holds `text`; returns how long it took.
fn seen_within(launcher: &Launcher, text: &str, limit: Duration) -> Option<Duration> {
    let began = Instant::now();
    while began.elapsed() < limit {
        if launcher.stdout_so_far().contains(text) {
            return Some(began.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

fn ack(dir: &Path, rank: usize, step: usize) {
    std::fs::write(dir.join(format!("ack.{rank}.{step}")), b"").unwrap();
}

/// Runs the bar in one rank and acknowledges each update once it is on tether's stdout,
/// where it must arrive before the rank writes the next one.
fn draw_bar(options: &[&str]) -> String {
    let dir = Scratch::new("bar");
    let script = bar_script(&dir);
    let mut args = vec!["run", "-n", "1"];
    args.extend_from_slice(options);
    args.extend_from_slice(&[&script, "8"]);
    let launcher = start(&dir, &args);
    for i in 0..8 {
        let update = format!("step {i}");
        let limit = if i == 0 { 30 } else { 2 };
        assert!(
            seen_within(&launcher, &update, Duration::from_secs(limit)).is_some(),
            "{update:?} was not shown while the rank waited: {:?}",
            launcher.stdout_so_far()
        );
        assert!(
            !launcher
                .stdout_so_far()
                .contains(&format!("step {}", i + 1)),
            "the rank went on before its update was seen"
        );
        ack(dir.path(), 0, i);
    }
    let out = launcher.finish(Duration::from_secs(30));
    assert_eq!(out.code, Some(0), "{out:?}");
    out.stdout
}

#[test]
fn a_progress_bar_shows_each_update_before_the_next_is_written() {
    let stdout = draw_bar(&[]);
    let expected: Vec<String> = (0..8).map(|i| format!("[rank 0]: step {i}")).collect();
    assert_eq!(stdout, format!("{}\n", expected.join("\r")));
}

#[test]
fn a_progress_bar_without_prefixes_streams_as_written() {
    let stdout = draw_bar(&["--no-prefix"]);
    let expected: Vec<String> = (0..8).map(|i| format!("step {i}")).collect();
    assert_eq!(stdout, format!("{}\n", expected.join("\r")));
}

#[test]
fn a_line_without_a_newline_shows_after_a_short_wait_and_is_completed_in_place() {
    let dir = Scratch::new("prompt");
    let script =
        r#"printf 'loading... '; while [ ! -e "$DIR/ack" ]; do sleep 0.01; done; echo done"#;
    let launcher = start(
        &dir,
        &["run", "-n", "1", "--no-python", "--", "sh", "-c", script],
    );
    let took = seen_within(&launcher, "[rank 0]: loading... ", Duration::from_secs(10));
    std::fs::write(dir.path().join("ack"), b"").unwrap();
    let out = launcher.finish(Duration::from_secs(10));
    assert!(took.is_some(), "the partial line was not shown: {out:?}");
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.stdout, "[rank 0]: loading... done\n");
}

#[test]
fn two_ranks_drawing_bars_never_share_a_terminal_line() {
    let dir = Scratch::new("bars");
    let script = bar_script(&dir);
    let launcher = start(&dir, &["run", "-n", "2", &script, "6"]);
    for i in 0..6 {
        for rank in 0..2 {
            let update = format!("[rank {rank}]: step {i}");
            let limit = if i == 0 { 30 } else { 2 };
            assert!(
                seen_within(&launcher, &update, Duration::from_secs(limit)).is_some(),
                "{update:?} not shown: {:?}",
                launcher.stdout_so_far()
            );
            ack(dir.path(), rank, i);
        }
    }
    let out = launcher.finish(Duration::from_secs(30));
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut last = [None; 2];
    for line in out.stdout.split('\n').filter(|l| !l.is_empty()) {
        let mut owner = None;
        for segment in line.split('\r') {
            let (rank, text) = common::split_prefix(segment)
                .unwrap_or_else(|| panic!("{segment:?} has no prefix in {line:?}"));
            assert!(
                owner.map_or(true, |o| o == rank),
                "two ranks on one line: {line:?}"
            );
            owner = Some(rank);
            let step: usize = text.strip_prefix("step ").unwrap().parse().unwrap();
            assert!(last[rank].map_or(true, |l| l <= step), "{line:?}");
            last[rank] = Some(step);
        }
    }
    assert_eq!(last, [Some(5), Some(5)], "{}", out.stdout);
}

#[test]
fn a_partial_line_is_never_cut_inside_a_character_and_logs_keep_the_bytes() {
    let dir = Scratch::new("utf8");
    let logs = dir.path().join("logs");
    // "café" with the two bytes of "é" in two writes, the rank waiting in between.
    let script =
        r#"printf 'caf\303'; while [ ! -e "$DIR/ack" ]; do sleep 0.01; done; printf '\251\r\n'"#;
    let launcher = start(
        &dir,
        &[
            "run",
            "-n",
            "1",
            "--log-dir",
            logs.to_str().unwrap(),
            "--run-id",
            "u",
            "--no-python",
            "--",
            "sh",
            "-c",
            script,
        ],
    );
    let shown = seen_within(&launcher, "[rank 0]: caf", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(200));
    let meanwhile = launcher.stdout_so_far();
    std::fs::write(dir.path().join("ack"), b"").unwrap();
    let out = launcher.finish(Duration::from_secs(10));
    assert!(shown.is_some(), "{out:?}");
    assert_eq!(meanwhile, "[rank 0]: caf");
    assert_eq!(out.stdout, "[rank 0]: café\r\n");
    let logged = std::fs::read(logs.join("u/attempt_0/rank_0/stdout.log")).unwrap();
    assert_eq!(logged, "café\r\n".as_bytes());
}
