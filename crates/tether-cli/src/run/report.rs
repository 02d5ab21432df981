//! The failure report: which rank failed first, how, and why (the error file that torch's
//! `@record` writes, or the last lines of the rank's stderr), and the OOM evidence.

use std::fmt::Write as _;
use std::path::Path;
use std::time::SystemTime;

use tether_core::ExitStatus;

use crate::clock;

/// The error that `torch.distributed.elastic.multiprocessing.errors.record` wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFile {
    pub message: String,
    pub traceback: Option<String>,
    pub timestamp: Option<String>,
}

impl ErrorFile {
    /// Reads `path`; `None` when the rank wrote nothing there.
    pub fn read(path: &Path) -> Option<ErrorFile> {
        let text = std::fs::read_to_string(path).ok()?;
        if text.trim().is_empty() {
            return None;
        }
        Some(ErrorFile::parse(&text))
    }

    /// `{"message": {"message": "<Type>: <msg>", "extraInfo": {"py_callstack": ...,
    /// "timestamp": ...}}}`; a plain `{"message": "..."}` and text that is not JSON at all
    /// are shown as they are.
    pub fn parse(text: &str) -> ErrorFile {
        let raw = || ErrorFile {
            message: text.trim_end().to_string(),
            traceback: None,
            timestamp: None,
        };
        let Ok(json) = serde_json::from_str::<serde_json::Value>(text) else {
            return raw();
        };
        let outer = &json["message"];
        if let Some(message) = outer.as_str() {
            return ErrorFile {
                message: message.to_string(),
                traceback: None,
                timestamp: None,
            };
        }
        let Some(message) = outer["message"].as_str() else {
            return raw();
        };
        let extra = &outer["extraInfo"];
        let as_text = |v: &serde_json::Value| match v {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        };
        ErrorFile {
            message: message.to_string(),
            traceback: as_text(&extra["py_callstack"]),
            timestamp: as_text(&extra["timestamp"]),
        }
    }
}

/// The OOM-kill counter of this process's memory cgroup (v2 `memory.events`, or v1
/// `memory.oom_control`), when it can be read.
pub fn oom_kills() -> Option<u64> {
    let mut candidates = Vec::new();
    for cgroup in tether_core::proc::cgroups() {
        let (controllers, path) = (&cgroup.controllers, cgroup.path.trim_start_matches('/'));
        if controllers.is_empty() {
            candidates.push(Path::new("/sys/fs/cgroup").join(path).join("memory.events"));
            candidates.push(Path::new("/sys/fs/cgroup/memory.events").to_path_buf());
        } else if controllers.split(',').any(|c| c == "memory") {
            let root = Path::new("/sys/fs/cgroup/memory");
            candidates.push(root.join(path).join("memory.oom_control"));
            candidates.push(root.join("memory.oom_control"));
        }
    }
    candidates.into_iter().find_map(|file| {
        let text = std::fs::read_to_string(file).ok()?;
        text.lines().find_map(|l| {
            l.strip_prefix("oom_kill ")
                .and_then(|n| n.trim().parse().ok())
        })
    })
}

/// One rank at the end of an attempt.
#[derive(Debug, Clone)]
pub struct RankEnd {
    pub rank: usize,
    pub local_rank: usize,
    pub pid: i32,
    pub status: ExitStatus,
    /// True when it exited after tether began stopping the ranks.
    pub stopped: bool,
}

/// Everything the report says about the root cause.
#[derive(Debug, Clone)]
pub struct Failure {
    pub root: RankEnd,
    pub node_rank: usize,
    /// This node's host name.
    pub host: String,
    pub attempt: u32,
    /// When the root cause's exit was seen.
    pub ended_at: SystemTime,
    pub error: Option<ErrorFile>,
    /// The last lines of its stderr (of its output, when both streams shared one pipe).
    pub tail: Vec<String>,
    pub tail_is_merged: bool,
    /// OOM-kill counter at launch and at the failure.
    pub oom: Option<(u64, u64)>,
    pub others: Vec<RankEnd>,
    pub log_dir: Option<String>,
}

/// How a process that `std::process` waited for ended, in the exit status's own words.
pub fn describe_std(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    let status = match (status.code(), status.signal()) {
        (Some(code), _) => ExitStatus::Exited(code),
        (None, Some(signal)) => ExitStatus::Signaled {
            signal,
            core_dumped: status.core_dumped(),
        },
        _ => ExitStatus::Unknown,
    };
    status.to_string()
}

const RULE: &str = "==============================================================================";

impl Failure {
    pub fn render(&self) -> String {
        let mut s = self.render_open();
        let _ = writeln!(s, "{RULE}");
        s
    }

    /// The report of this node's failure when it is the root cause of a job of several
    /// nodes (`cause`, as the rendezvous chose it): with the later failures of every node.
    pub fn render_in_job(&self, cause: &serde_json::Value) -> String {
        let mut s = self.render_open();
        write_consequences(&mut s, cause);
        let _ = writeln!(s, "{RULE}");
        s
    }

    /// The report without its closing rule.
    fn render_open(&self) -> String {
        let r = &self.root;
        let mut s = String::new();
        let _ = writeln!(s, "{RULE}");
        let _ = writeln!(s, "tether run: rank {} failed first (root cause)", r.rank);
        let _ = writeln!(s, "  rank       : {}", r.rank);
        let _ = writeln!(
            s,
            "  local rank : {} (node rank {}, host {})",
            r.local_rank, self.node_rank, self.host
        );
        let _ = writeln!(s, "  pid        : {}", r.pid);
        let _ = writeln!(s, "  exit       : {}", r.status);
        let _ = writeln!(s, "  attempt    : {}", self.attempt);
        let _ = writeln!(s, "  time       : {}", clock::local_iso(self.ended_at));
        if let Some(hint) = self.hint() {
            let _ = writeln!(s, "  hint       : {hint}");
        }
        self.render_error(&mut s);
        if let Some(dir) = &self.log_dir {
            let _ = writeln!(s, "  logs       : {dir}");
        }
        self.render_others(&mut s);
        s
    }

    /// The root cause as the other nodes of the job see it (the rendezvous's store carries
    /// it): rank, pid, how it ended, when, and its error or last lines.
    pub fn record(&self) -> serde_json::Value {
        let r = &self.root;
        let unix = self
            .ended_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        serde_json::json!({
            "rank": r.rank,
            "local_rank": r.local_rank,
            "pid": r.pid,
            "exit": r.status.to_string(),
            "code": r.status.as_shell_code(),
            "time": unix,
            "attempt": self.attempt,
            "hint": self.hint(),
            "error": self.error.as_ref().map(|e| e.message.clone()),
            "traceback": self.error.as_ref().and_then(|e| e.traceback.clone()),
            "lines": self.tail,
            "stream": if self.tail_is_merged { "output" } else { "stderr" },
        })
    }

    /// What a signal death may mean; for SIGKILL, the OOM evidence.
    fn hint(&self) -> Option<String> {
        self.root.status.hint(self.oom)
    }

    /// The error file's message and traceback, else the rank's last lines.
    fn render_error(&self, s: &mut String) {
        if let Some(err) = &self.error {
            let _ = writeln!(s, "  error      : {}", err.message);
            if let Some(ts) = &err.timestamp {
                let _ = writeln!(s, "  timestamp  : {}", clock::local_iso_from_unix(ts));
            }
            if let Some(tb) = &err.traceback {
                let _ = writeln!(s, "--- traceback (from TORCHELASTIC_ERROR_FILE) ---");
                let _ = writeln!(s, "{}", tb.trim_end());
            }
        } else if !self.tail.is_empty() {
            let what = if self.tail_is_merged {
                "output"
            } else {
                "stderr"
            };
            let (n, rank) = (self.tail.len(), self.root.rank);
            let _ = writeln!(s, "--- last {n} lines of rank {rank}'s {what} ---");
            for line in &self.tail {
                let _ = writeln!(s, "{line}");
            }
        } else {
            let _ = writeln!(s, "  (no error file and nothing on stderr)");
        }
    }

    fn render_others(&self, s: &mut String) {
        if self.others.is_empty() {
            return;
        }
        let _ = writeln!(s, "--- other ranks ---");
        for o in &self.others {
            let note = if o.stopped && !o.status.success() {
                " (stopped by tether)"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "  rank {} (local rank {}, pid {}): {}{note}",
                o.rank, o.local_rank, o.pid, o.status
            );
        }
    }
}

/// The job's root cause, from its record (see [`Failure::record`]), as every node reports it.
pub fn render_cause(cause: &serde_json::Value) -> String {
    let text = |key: &str| cause[key].as_str().map(str::to_string);
    let number = |key: &str| {
        cause[key]
            .as_i64()
            .map_or("?".to_string(), |n| n.to_string())
    };
    let rank = number("rank");
    let mut s = String::new();
    let _ = writeln!(s, "{RULE}");
    let _ = writeln!(
        s,
        "tether run: rank {rank} on node {} failed first (root cause of the job)",
        number("node_rank")
    );
    let _ = writeln!(s, "  rank       : {rank}");
    let _ = writeln!(
        s,
        "  node       : node rank {}, host {}, local rank {}",
        number("node_rank"),
        text("host").unwrap_or_else(|| "?".into()),
        number("local_rank")
    );
    let _ = writeln!(s, "  pid        : {}", number("pid"));
    let _ = writeln!(s, "  exit       : {}", text("exit").unwrap_or_default());
    let _ = writeln!(s, "  attempt    : {}", number("attempt"));
    if let Some(t) = cause["time"].as_f64() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(t.max(0.0));
        let _ = writeln!(s, "  time       : {}", clock::local_iso(at));
    }
    if let Some(hint) = text("hint") {
        let _ = writeln!(s, "  hint       : {hint}");
    }
    write_evidence(&mut s, cause, &rank);
    write_consequences(&mut s, cause);
    let _ = writeln!(s, "{RULE}");
    s
}

/// The failures on any node that came after the root cause (its consequences), in time
/// order, as the rendezvous's store holds them: one line each, with the delay after it.
fn write_consequences(s: &mut String, cause: &serde_json::Value) {
    let Some(later) = cause["consequences"].as_array().filter(|l| !l.is_empty()) else {
        return;
    };
    let root_time = cause["time"].as_f64().unwrap_or(0.0);
    let _ = writeln!(
        s,
        "--- later failures on the job's nodes (consequences), in time order ---"
    );
    for c in later {
        let number = |key: &str| c[key].as_i64().map_or("?".to_string(), |n| n.to_string());
        let after = c["time"]
            .as_f64()
            .map_or(String::new(), |t| format!("{:+.3} s  ", t - root_time));
        let why = c["error"]
            .as_str()
            .map_or(String::new(), |e| format!(": {e}"));
        let _ = writeln!(
            s,
            "  {after}rank {} on node {} (host {}, local rank {}, pid {}): {}{why}",
            number("rank"),
            number("node_rank"),
            c["host"].as_str().unwrap_or("?"),
            number("local_rank"),
            number("pid"),
            c["exit"].as_str().unwrap_or("?"),
        );
    }
}

/// What a root cause's record holds of the rank's own account: its error and traceback,
/// else the last lines of its output.
fn write_evidence(s: &mut String, cause: &serde_json::Value, rank: &str) {
    let text = |key: &str| cause[key].as_str().map(str::to_string);
    if let Some(error) = text("error") {
        let _ = writeln!(s, "  error      : {error}");
        if let Some(tb) = text("traceback") {
            let _ = writeln!(s, "--- traceback (from TORCHELASTIC_ERROR_FILE) ---");
            let _ = writeln!(s, "{}", tb.trim_end());
        }
    } else {
        let lines: Vec<&str> = cause["lines"]
            .as_array()
            .map(|a| a.iter().filter_map(|l| l.as_str()).collect())
            .unwrap_or_default();
        if lines.is_empty() {
            let _ = writeln!(s, "  (no error file and nothing on stderr)");
        } else {
            let stream = text("stream").unwrap_or_else(|| "stderr".into());
            let _ = writeln!(
                s,
                "--- last {} lines of rank {rank}'s {stream} ---",
                lines.len()
            );
            for line in lines {
                let _ = writeln!(s, "{line}");
            }
        }
    }
}

/// The exit status a node ends with for the job's root cause.
pub fn cause_code(cause: &serde_json::Value) -> i32 {
    cause["code"]
        .as_i64()
        .and_then(|c| i32::try_from(c).ok())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_torch_error_files() {
        let text = r#"{"message": {"message": "ValueError: bad", "extraInfo": {"py_callstack": "Traceback (most recent call last):\n  x\nValueError: bad\n", "timestamp": "1700000000"}}}"#;
        let e = ErrorFile::parse(text);
        assert_eq!(e.message, "ValueError: bad");
        assert!(e.traceback.unwrap().starts_with("Traceback"));
        assert_eq!(e.timestamp.as_deref(), Some("1700000000"));
        assert_eq!(ErrorFile::parse(r#"{"message": "plain"}"#).message, "plain");
        assert_eq!(ErrorFile::parse("not json").message, "not json");
    }

    #[test]
    fn lists_the_consequences_of_a_root_cause_in_time_order_with_their_delay() {
        let cause = serde_json::json!({
            "rank": 1, "node_rank": 1, "host": "a", "local_rank": 0, "pid": 10,
            "exit": "signal SIGSEGV", "code": 139, "time": 100.0,
            "consequences": [
                {"rank": 0, "node_rank": 0, "host": "b", "local_rank": 0, "pid": 20,
                 "exit": "exit code 1", "time": 100.25, "error": "Connection closed by peer"},
            ],
        });
        let text = render_cause(&cause);
        assert!(text.contains("rank 1 on node 1 failed first"), "{text}");
        let later = &text[text.find("consequences").expect("a list of consequences")..];
        assert!(
            later.contains("+0.250 s  rank 0 on node 0 (host b, local rank 0, pid 20): exit code 1: Connection closed by peer"),
            "{text}"
        );
        assert_eq!(cause_code(&cause), 139);
        let alone = render_cause(&serde_json::json!({"rank": 1, "consequences": []}));
        assert!(!alone.contains("consequences"), "{alone}");
    }

    #[test]
    fn renders_signal_names_and_hints() {
        let f = Failure {
            root: RankEnd {
                rank: 2,
                local_rank: 2,
                pid: 99,
                status: ExitStatus::Signaled {
                    signal: libc::SIGKILL,
                    core_dumped: false,
                },
                stopped: false,
            },
            node_rank: 0,
            host: "h".into(),
            attempt: 0,
            ended_at: SystemTime::now(),
            error: None,
            tail: vec!["last words".into()],
            tail_is_merged: false,
            oom: Some((1, 2)),
            others: vec![],
            log_dir: None,
        };
        let text = f.render();
        assert!(text.contains("SIGKILL"), "{text}");
        assert!(text.contains("OOM killer killed it"), "{text}");
        assert!(text.contains("last words"), "{text}");
    }
}
