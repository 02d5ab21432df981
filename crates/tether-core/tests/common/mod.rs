#![allow(dead_code)]
//! Helpers shared by the integration tests: reading /proc, waiting for a pid to vanish.

use std::time::{Duration, Instant};

/// A field of /proc/PID/status (`SigIgn`, `SigBlk`, ...), or None once the pid is gone.
pub fn status_field(pid: i32, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .map(|v| v.trim().to_string())
}

/// The process group id from /proc/PID/stat.
pub fn pgid(pid: i32) -> Option<i32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 2..];
    after.split_whitespace().nth(2)?.parse().ok()
}

/// The open fd numbers of a process.
pub fn fds(pid: i32) -> Vec<i32> {
    let mut fds: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    fds.sort();
    fds
}

/// True when `pid` exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    matches!(status_field(pid, "State"), Some(s) if !s.starts_with('Z'))
}

/// True when no process (not even a zombie) has `pid`.
pub fn gone(pid: i32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Polls `check` until it holds or `limit` passes.
pub fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    check()
}

/// Waits until the child has set itself up (left our process group) and exec'd `comm`.
pub fn wait_exec(pid: i32, comm: &str) {
    assert!(
        eventually(Duration::from_secs(5), || {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim() == comm)
                .unwrap_or(false)
        }),
        "child {pid} never ran {comm}"
    );
}
