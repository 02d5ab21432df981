//! Helpers of the `tether` binary's tests: run it with a deadline, in a private TMPDIR that
//! must be empty again when it exits.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// A directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Scratch {
        static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tether-cli-test-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a finished launcher left.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// The launcher's TMPDIR, removed when the output is dropped.
    pub tmp: Scratch,
}

/// A launcher started by a test, with a private TMPDIR.
pub struct Launcher {
    pub child: Child,
    pub tmp: Scratch,
    started: Instant,
    out: Option<std::thread::JoinHandle<Vec<u8>>>,
    err: Option<std::thread::JoinHandle<Vec<u8>>>,
    /// What the launcher has written to its stdout so far.
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    /// What the launcher has written to its stderr so far.
    seen_err: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

/// The launcher with `args`. Its scripts run cold (`PET_NO_WARM=1`): the tests' `python3` may
/// not have tether installed, which warm ranks need (`warm_ranks.rs` tests both cases).
pub fn command(args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    cmd.env("PET_NO_WARM", "1")
        .env_remove("OMP_NUM_THREADS")
        .env_remove("SLURM_JOB_ID")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

impl Launcher {
    pub fn spawn(mut cmd: Command) -> Launcher {
        let tmp = Scratch::new("tmpdir");
        cmd.env("TMPDIR", tmp.path());
        let mut child = cmd.spawn().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut stderr = child.stderr.take().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let so_far = seen.clone();
        let out = std::thread::spawn(move || {
            let mut chunk = [0u8; 1 << 16];
            while let Ok(n @ 1..) = stdout.read(&mut chunk) {
                so_far.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
            std::mem::take(&mut *so_far.lock().unwrap())
        });
        let seen_err = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let err_so_far = seen_err.clone();
        let err = std::thread::spawn(move || {
            let mut chunk = [0u8; 1 << 16];
            while let Ok(n @ 1..) = stderr.read(&mut chunk) {
                err_so_far.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
            std::mem::take(&mut *err_so_far.lock().unwrap())
        });
        Launcher {
            child,
            tmp,
            started: Instant::now(),
            out: Some(out),
            err: Some(err),
            seen,
            seen_err,
        }
    }

    /// What the launcher has written to its stdout so far.
    pub fn stdout_so_far(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    /// What the launcher has written to its stderr so far.
    pub fn stderr_so_far(&self) -> String {
        String::from_utf8_lossy(&self.seen_err.lock().unwrap()).into_owned()
    }

    fn signal_killed(&self, status: &std::process::ExitStatus) -> bool {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(libc::SIGKILL)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits up to `limit` for the launcher (killing it and failing past that), checks that
    /// it left nothing in its TMPDIR, and returns its output.
    pub fn finish(mut self, limit: Duration) -> Output {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("tether did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let elapsed = self.started.elapsed();
        let stdout =
            String::from_utf8_lossy(&self.out.take().unwrap().join().unwrap()).into_owned();
        let stderr =
            String::from_utf8_lossy(&self.err.take().unwrap().join().unwrap()).into_owned();
        // After a SIGKILL of tether its supervisor removes the directory, a moment later.
        // Log directories that tether makes (`tether-logs-*`) are meant to stay.
        let left = || -> Vec<_> {
            std::fs::read_dir(self.tmp.path())
                .unwrap()
                .filter_map(Result::ok)
                .map(|e| e.file_name())
                .filter(|n| !n.to_string_lossy().starts_with("tether-logs-"))
                .collect()
        };
        let ok =
            self.signal_killed(&status) && eventually(Duration::from_secs(1), || left().is_empty());
        let left = left();
        assert!(
            ok || left.is_empty(),
            "tether left temporary files: {left:?}"
        );
        use std::os::unix::process::ExitStatusExt;
        Output {
            code: status.code(),
            signal: status.signal(),
            stdout,
            stderr,
            elapsed,
            tmp: self.tmp,
        }
    }
}

/// Runs `tether` with `args` to the end (at most 60 s).
pub fn run(args: &[&str]) -> Output {
    Launcher::spawn(command(args)).finish(Duration::from_secs(60))
}

/// Runs `tether` with `args` and the extra environment `env`.
pub fn run_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = command(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Launcher::spawn(cmd).finish(Duration::from_secs(60))
}

/// Splits `[rank N]: text` lines into per-rank lists.
pub fn by_rank(text: &str) -> BTreeMap<usize, Vec<String>> {
    let mut map: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for line in text.lines() {
        let (rank, rest) = split_prefix(line).unwrap_or_else(|| panic!("unprefixed line {line:?}"));
        map.entry(rank).or_default().push(rest.to_string());
    }
    map
}

/// `[rank N]: rest` -> (N, rest).
pub fn split_prefix(line: &str) -> Option<(usize, &str)> {
    let rest = line.strip_prefix("[rank ")?;
    let (num, rest) = rest.split_once("]: ")?;
    Some((num.parse().ok()?, rest))
}

/// Whether `pid` is running (a zombie counts as dead).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next());
            !matches!(state, Some('Z') | Some('X') | None)
        }
        Err(_) => false,
    }
}

/// Polls `check` until it holds or `limit` passes.
pub fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Reads lines from a launcher's stdout pipe until `want` lines start with `prefix`.
pub fn pids_from(text: &str, marker: &str) -> Vec<i32> {
    text.lines()
        .filter_map(|l| l.split_once(marker).map(|(_, rest)| rest))
        .flat_map(|rest| rest.split_whitespace().map(|p| p.parse::<i32>().unwrap()))
        .collect()
}

/// Runs `tether` with `args` and `env` with its stdout and stderr on one pipe (as on a
/// terminal, or with `2>&1`); returns the exit code and what it wrote.
pub fn run_one_pipe(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let tmp = Scratch::new("tmpdir");
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
    let mut cmd = command(args);
    cmd.env("TMPDIR", tmp.path())
        .stdout(Stdio::from(write.try_clone().unwrap()))
        .stderr(Stdio::from(write));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    drop(cmd);
    let mut text = Vec::new();
    std::fs::File::from(read).read_to_end(&mut text).unwrap();
    let status = child.wait().unwrap();
    assert!(
        std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
        "tether left temporary files"
    );
    (status.code(), String::from_utf8_lossy(&text).into_owned())
}

/// The variable that marks every process of one test scenario (inherited by all that the
/// ranks start, whatever session or group they move to).
pub const MARK_VAR: &str = "TETHER_TEST_MARK";

/// The live processes (zombies excluded) whose environment has `MARK_VAR=mark`.
pub fn marked(mark: &str) -> Vec<i32> {
    let needle = format!("{MARK_VAR}={mark}");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == needle.as_bytes()))
                && alive(pid)
        })
        .collect()
}

/// A shell script for a rank that leaves processes in other sessions and process groups:
/// one `setsid` child, one double-forked daemon in a new session (its parent exits at once),
/// and a sleep in the rank's group. Their pids go to `$DIR/pids.<attempt>`; the rank writes
/// `$DIR/ready.$RANK` once they run, then runs `tail`.
pub fn leaver(tail: &str) -> String {
    let pids = r#""$DIR/pids.$TORCHELASTIC_RESTART_COUNT""#;
    format!(
        r#"setsid sleep 600 & echo $! >> {pids}; sh -c '(setsid sleep 601 & echo $! >> {pids}); exit 0' & sleep 602 & echo $! >> {pids}; sleep 0.05; echo $$ > "$DIR/ready.$RANK"; {tail}"#
    )
}
