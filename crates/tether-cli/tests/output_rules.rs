//! Output that reads well: a rank's lines in the order it wrote them when tether's stdout
//! and stderr are one file, no doubled prefix, report times in local ISO-8601.

mod common;

use common::{by_rank, run, run_env, run_one_pipe, split_prefix, Scratch};

/// Each rank writes 300 numbered lines, alternating between stdout and stderr.
const ALTERNATE: &str = r#"
import os, sys
r = os.environ["RANK"]
for i in range(300):
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    stream.write(f"r{r} n{i} {'out' if i % 2 == 0 else 'err'}\n")
"#;

#[test]
fn one_console_keeps_each_ranks_lines_in_order() {
    let dir = Scratch::new("order");
    let script = dir.path().join("alternate.py");
    std::fs::write(&script, ALTERNATE).unwrap();
    let (code, text) = run_one_pipe(&["run", "-n", "3", script.to_str().unwrap()], &[]);
    assert_eq!(code, Some(0), "{text}");
    let lines = by_rank(&text);
    assert_eq!(lines.len(), 3);
    for (rank, lines) in lines {
        let numbers: Vec<usize> = lines
            .iter()
            .map(|l| {
                assert!(l.starts_with(&format!("r{rank} ")), "{l}");
                l.split(' ').nth(1).unwrap()[1..].parse().unwrap()
            })
            .collect();
        assert_eq!(numbers, (0..300).collect::<Vec<_>>(), "rank {rank}");
    }
}

#[test]
fn separate_consoles_keep_the_streams_apart() {
    let dir = Scratch::new("order");
    let script = dir.path().join("alternate.py");
    std::fs::write(&script, ALTERNATE).unwrap();
    let out = run(&["run", "-n", "2", script.to_str().unwrap()]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stdout.lines().filter(|l| l.ends_with(" out")).count(),
        300
    );
    assert_eq!(
        out.stderr.lines().filter(|l| l.ends_with(" err")).count(),
        300
    );
    assert!(!out.stdout.contains(" err") && !out.stderr.contains(" out"));
}

#[test]
fn a_line_that_carries_the_ranks_own_prefix_is_not_prefixed_again() {
    let script = r#"
        if [ $RANK = 1 ]; then
            echo "[rank1]: Traceback (most recent call last):" >&2
            echo "[rank 1]: already prefixed"
            echo "[rank1]:ValueError: no space"
        else
            echo "[rank1]: not rank 0's own"
            echo "[rank10]: nor this"
        fi"#;
    let (code, text) = run_one_pipe(&["run", "-n", "2", "--no-python", "sh", "-c", script], &[]);
    assert_eq!(code, Some(0), "{text}");
    let mut lines: Vec<&str> = text.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            "[rank 0]: [rank10]: nor this",
            "[rank 0]: [rank1]: not rank 0's own",
            "[rank 1]: already prefixed",
            "[rank1]: Traceback (most recent call last):",
            "[rank1]:ValueError: no space",
        ]
    );
    // The rank's own order on one console: stderr's first line comes first.
    let ones: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("[rank1]") || l.starts_with("[rank 1]"))
        .collect();
    assert_eq!(
        ones[0], "[rank1]: Traceback (most recent call last):",
        "{text}"
    );
}

#[test]
fn report_times_are_local_iso_8601_with_milliseconds() {
    // A POSIX zone rule needs no zone files: 5 h 30 min east of UTC.
    let tz = [("TZ", "TET-5:30")];
    let error = r#"{"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback\nValueError: bad", "timestamp": "1700000000"}}}"#;
    let script = format!("printf '%s' '{error}' > \"$TORCHELASTIC_ERROR_FILE\"; exit 3");
    let out = run_env(&["run", "-n", "1", "--no-python", "sh", "-c", &script], &tz);
    assert_eq!(out.code, Some(3), "{out:?}");
    assert!(
        out.stderr
            .contains("timestamp  : 2023-11-15T03:43:20.000+05:30\n"),
        "{}",
        out.stderr
    );
    let time = out
        .stderr
        .lines()
        .find_map(|l| l.strip_prefix("  time       : "))
        .unwrap_or_else(|| panic!("{}", out.stderr));
    assert_iso_local(time, "+05:30");
    let out = run_env(
        &[
            "run",
            "-n",
            "1",
            "--max-restarts",
            "1",
            "--no-python",
            "sh",
            "-c",
            "exit 1",
        ],
        &tz,
    );
    let restart = out
        .stderr
        .lines()
        .find(|l| l.contains("attempt 0 failed at "))
        .unwrap();
    let time = restart
        .split("failed at ")
        .nth(1)
        .unwrap()
        .split(':')
        .collect::<Vec<_>>();
    assert_iso_local(&time[..4].join(":"), "+05:30");
}

/// `YYYY-MM-DDTHH:MM:SS.mmm+HH:MM` with the given offset.
fn assert_iso_local(text: &str, offset: &str) {
    let shape: String = text
        .chars()
        .map(|c| if c.is_ascii_digit() { 'd' } else { c })
        .collect();
    assert_eq!(shape, "dddd-dd-ddTdd:dd:dd.ddd+dd:dd", "{text}");
    assert!(text.ends_with(offset), "{text}");
}

#[test]
fn a_prefix_template_renders_torchruns_macros() {
    let out = run(&[
        "run",
        "-n",
        "2",
        "--role",
        "w",
        "--log-line-prefix-template",
        "${role_name}${local_rank}/${rank}|",
        "--no-python",
        "echo",
        "hi",
    ]);
    let mut lines: Vec<&str> = out.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["w0/0|hi", "w1/1|hi"], "{out:?}");
    assert!(split_prefix("[rank 3]: x").is_some());
}
