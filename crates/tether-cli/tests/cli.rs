//! `tether run` end to end: environment, output, logs, failures, restarts, signals, usage.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{alive, by_rank, command, eventually, run, run_env, split_prefix, Launcher, Scratch};

fn env_of(out: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    by_rank(out)
        .into_iter()
        .map(|(rank, lines)| {
            let vars = lines
                .iter()
                .filter_map(|l| l.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (rank, vars)
        })
        .collect()
}

const PRINT_ENV: &str =
    "test -d \"$(dirname \"$TORCHELASTIC_ERROR_FILE\")\" && echo ERRDIR=ok; env";

#[test]
fn every_rank_gets_torchruns_environment() {
    let out = run(&[
        "run",
        "-n",
        "3",
        "--master-port",
        "1234",
        "--no-python",
        "--",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let envs = env_of(&out.stdout);
    assert_eq!(envs.len(), 3);
    let run_id = envs[&0]["TORCHELASTIC_RUN_ID"].clone();
    assert!(!run_id.is_empty());
    let mut error_files = Vec::new();
    for (rank, env) in &envs {
        let r = rank.to_string();
        for (key, want) in [
            ("RANK", r.as_str()),
            ("LOCAL_RANK", &r),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_RANK", &r),
            ("ROLE_WORLD_SIZE", "3"),
            ("ROLE_NAME", "default"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", &run_id),
            (
                "TORCHELASTIC_SIGNALS_TO_HANDLE",
                "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
            ),
            ("OMP_NUM_THREADS", "1"),
            ("ERRDIR", "ok"),
        ] {
            assert_eq!(
                env.get(key).map(String::as_str),
                Some(want),
                "rank {rank} {key}"
            );
        }
        error_files.push(env["TORCHELASTIC_ERROR_FILE"].clone());
    }
    error_files.sort();
    error_files.dedup();
    assert_eq!(error_files.len(), 3, "error files must differ per rank");
}

#[test]
fn node_rank_gives_global_ranks_and_defaults_follow_torchrun() {
    let out = run(&[
        "run",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "10.0.0.1",
        "--rdzv-id",
        "job7",
        "--max-restarts",
        "0",
        "--no-python",
        "sh",
        "-c",
        PRINT_ENV,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let envs = env_of(&out.stdout);
    assert_eq!(envs.keys().copied().collect::<Vec<_>>(), [2, 3]);
    for (rank, env) in &envs {
        assert_eq!(env["RANK"], rank.to_string());
        assert_eq!(env["LOCAL_RANK"], (rank - 2).to_string());
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["GROUP_WORLD_SIZE"], "2");
        assert_eq!(env["MASTER_ADDR"], "10.0.0.1");
        assert_eq!(env["MASTER_PORT"], "29500");
        assert_eq!(env["TORCHELASTIC_RUN_ID"], "job7");
    }
}

#[test]
fn omp_num_threads_rules() {
    let show = ["sh", "-c", "echo OMP=${OMP_NUM_THREADS-unset}"];
    let one = run(&[&["run", "-n", "1", "--no-python", "--"][..], &show].concat());
    assert_eq!(one.stdout.trim(), "[rank 0]: OMP=unset", "{one:?}");
    let kept = run_env(
        &[&["run", "-n", "2", "--no-python", "--"][..], &show].concat(),
        &[("OMP_NUM_THREADS", "7")],
    );
    assert!(
        kept.stdout.lines().all(|l| l.ends_with("OMP=7")),
        "{kept:?}"
    );
    let set = run(&[&["run", "-n", "2", "--no-python", "--"][..], &show].concat());
    assert_eq!(
        set.stdout.lines().filter(|l| l.ends_with("OMP=1")).count(),
        2,
        "{set:?}"
    );
}

#[test]
fn slurm_sets_nodes_and_master() {
    let out = run_env(
        &["run", "-n", "2", "--no-python", "sh", "-c", PRINT_ENV],
        &[
            ("SLURM_JOB_ID", "99"),
            ("SLURM_JOB_NUM_NODES", "3"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NODELIST", "gpu[03-05,07],cpu1"),
        ],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    let envs = env_of(&out.stdout);
    assert_eq!(envs.keys().copied().collect::<Vec<_>>(), [4, 5]);
    assert_eq!(envs[&4]["MASTER_ADDR"], "gpu03");
    assert_eq!(envs[&4]["GROUP_WORLD_SIZE"], "3");
}

#[test]
fn under_slurm_standalone_and_one_node_run_two_local_ranks_on_localhost() {
    let slurm = [
        ("SLURM_JOB_ID", "99"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("SLURM_NODEID", "1"),
        ("SLURM_JOB_NODELIST", "gpu[03-04]"),
    ];
    for form in [
        &["--standalone"][..],
        &["--nnodes", "1"],
        &["--nnodes", "1", "--node-rank", "0"],
    ] {
        let args = [
            &["run"][..],
            form,
            &["-n", "2", "--no-python", "sh", "-c", PRINT_ENV],
        ]
        .concat();
        let out = run_env(&args, &slurm);
        assert_eq!(out.code, Some(0), "{form:?}: {out:?}");
        let envs = env_of(&out.stdout);
        assert_eq!(envs.keys().copied().collect::<Vec<_>>(), [0, 1], "{form:?}");
        assert_eq!(envs[&0]["MASTER_ADDR"], "localhost", "{form:?}");
        assert_eq!(envs[&1]["WORLD_SIZE"], "2", "{form:?}");
    }
}

const FLOOD: &str = r#"
import os, random, sys
r = int(os.environ["RANK"])
rng = random.Random(r)
for i in range(2000):
    n = rng.randint(100, 3000)
    stream = sys.stdout if i % 2 == 0 else sys.stderr
    stream.write(f"R{r} L{i} N{n} " + "x" * n + " END\n")
"#;

fn check_flood_lines(text: &str, stream_lines: usize) {
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for line in text.lines() {
        let (rank, rest) = split_prefix(line).unwrap_or_else(|| panic!("bad line {:.80}", line));
        let mut words = rest.splitn(4, ' ');
        let r = words.next().unwrap();
        let _l = words.next().unwrap();
        let n: usize = words.next().unwrap()[1..].parse().unwrap();
        let body = words.next().unwrap();
        assert_eq!(
            r,
            format!("R{rank}"),
            "line of another rank under [rank {rank}]"
        );
        assert_eq!(body.len(), n + 4, "torn line from rank {rank}");
        assert!(body.bytes().take(n).all(|b| b == b'x') && body.ends_with(" END"));
        *seen.entry(rank).or_default() += 1;
    }
    assert_eq!(seen.len(), 4);
    assert!(seen.values().all(|&c| c == stream_lines), "{seen:?}");
}

#[test]
fn heavy_concurrent_output_keeps_lines_whole() {
    let out = run(&[
        "run",
        "-n",
        "4",
        "--no-python",
        "--",
        "python3",
        "-c",
        FLOOD,
    ]);
    assert_eq!(
        out.code,
        Some(0),
        "{}",
        &out.stderr[..out.stderr.len().min(2000)]
    );
    check_flood_lines(&out.stdout, 1000);
    check_flood_lines(&out.stderr, 1000);
}

#[test]
fn very_long_lines_stay_whole() {
    let script = "import os, sys\nc = chr(ord('a') + int(os.environ['RANK']))\nfor _ in range(4):\n    sys.stdout.write(c * 700000 + '\\n')\n";
    let out = run(&[
        "run",
        "-n",
        "3",
        "--no-python",
        "--",
        "python3",
        "-c",
        script,
    ]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let lines = by_rank(&out.stdout);
    assert_eq!(lines.len(), 3);
    for (rank, lines) in lines {
        let c = (b'a' + rank as u8) as char;
        assert_eq!(lines.len(), 4);
        assert!(lines
            .iter()
            .all(|l| l.len() == 700000 && l.chars().all(|x| x == c)));
    }
}

#[test]
fn no_prefix_and_final_line_without_newline() {
    let out = run(&[
        "run",
        "-n",
        "2",
        "--no-prefix",
        "--no-python",
        "--",
        "sh",
        "-c",
        "echo a$RANK; printf b$RANK",
    ]);
    assert_eq!(out.code, Some(0));
    let mut lines: Vec<&str> = out.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["a0", "a1", "b0", "b1"]);
    let out = run(&[
        "run",
        "-n",
        "1",
        "--no-python",
        "--",
        "sh",
        "-c",
        "printf 'no newline'",
    ]);
    assert_eq!(out.stdout, "[rank 0]: no newline\n");
}

#[test]
fn ranks_filter_limits_the_console() {
    let out = run(&[
        "run",
        "-n",
        "4",
        "--ranks-filter",
        "0,3",
        "--no-python",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2",
    ]);
    assert_eq!(out.code, Some(0));
    assert_eq!(
        by_rank(&out.stdout).keys().copied().collect::<Vec<_>>(),
        [0, 3]
    );
    assert_eq!(
        by_rank(&out.stderr).keys().copied().collect::<Vec<_>>(),
        [0, 3]
    );
    let out = run(&[
        "run",
        "-n",
        "3",
        "--local-ranks-filter",
        "1",
        "--no-python",
        "--",
        "sh",
        "-c",
        "echo out",
    ]);
    assert_eq!(out.stdout, "[rank 1]: out\n");
}

fn log_run(dir: &str, id: &str, options: &[&str]) -> common::Output {
    let script = "echo out$RANK; echo err$RANK >&2; printf last$RANK";
    let head = ["run", "-n", "2", "--log-dir", dir, "--rdzv-id", id];
    let tail = ["--no-python", "--", "sh", "-c", script];
    run(&[&head[..], options, &tail].concat())
}

#[test]
fn log_dir_keeps_streams_apart_and_prints_the_runs_directory() {
    let logs = Scratch::new("logs");
    let dir = logs.path().to_str().unwrap();
    let out = log_run(dir, "r1", &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let run_dir = logs.path().join("r1");
    assert!(
        out.stderr.contains(&format!(
            "tether: logs of run r1 in {}\n",
            run_dir.display()
        )),
        "{out:?}"
    );
    for rank in 0..2 {
        let base = run_dir.join(format!("attempt_0/rank_{rank}"));
        let stdout = std::fs::read_to_string(base.join("stdout.log")).unwrap();
        let stderr = std::fs::read_to_string(base.join("stderr.log")).unwrap();
        assert_eq!(stdout, format!("out{rank}\nlast{rank}"));
        assert_eq!(stderr, format!("err{rank}\n"));
        // As with torchrun, streams that are not redirected still reach the console.
        assert!(
            out.stdout.contains(&format!("[rank {rank}]: out{rank}\n")),
            "{out:?}"
        );
        assert!(
            out.stderr.contains(&format!("[rank {rank}]: err{rank}\n")),
            "{out:?}"
        );
    }
}

#[test]
fn redirects_and_tee_choose_what_reaches_the_console() {
    let logs = Scratch::new("logs");
    let dir = logs.path().to_str().unwrap();
    let out = log_run(dir, "r2", &["--redirects", "3"]);
    assert_eq!(out.code, Some(0));
    assert_eq!(out.stdout, "", "{out:?}");
    assert!(!out.stderr.contains("[rank"), "{out:?}");
    let file = logs.path().join("r2/attempt_0/rank_1/stdout.log");
    assert_eq!(std::fs::read_to_string(file).unwrap(), "out1\nlast1");
    let out = log_run(dir, "r3", &["-r", "3", "-t", "2"]);
    assert_eq!(out.stdout, "", "{out:?}");
    assert!(out.stderr.contains("[rank 0]: err0\n") && out.stderr.contains("[rank 1]: err1\n"));
    let out = log_run(dir, "r4", &["-r", "0:3,1:1", "--tee"]);
    assert_eq!(by_rank(&out.stdout).len(), 2, "{out:?}");
    let out = log_run(dir, "r5", &["-r", "0:3,1:1"]);
    assert_eq!(out.stdout, "", "{out:?}");
    assert!(out.stderr.contains("[rank 1]: err1\n") && !out.stderr.contains("err0"));
}

#[test]
fn redirects_without_a_log_dir_go_to_a_new_directory() {
    let out = run(&[
        "run",
        "-n",
        "1",
        "--rdzv-id",
        "auto",
        "-r",
        "3",
        "--no-python",
        "echo",
        "hi",
    ]);
    assert_eq!((out.code, out.stdout.as_str()), (Some(0), ""), "{out:?}");
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with("tether: logs of run auto in "));
    let dir = line.unwrap_or_else(|| panic!("{out:?}"))["tether: logs of run auto in ".len()..]
        .to_string();
    assert!(dir.contains("/tether-logs-"), "{dir}");
    let log = std::path::Path::new(&dir).join("attempt_0/rank_0/stdout.log");
    assert_eq!(std::fs::read_to_string(log).unwrap(), "hi\n");
}

#[test]
fn duplicate_filters_copy_matching_lines() {
    let logs = Scratch::new("logs");
    let dir = logs.path().to_str().unwrap();
    let script = "echo loss=$RANK; echo noise; echo warn,x >&2";
    let out = run(&[
        "run",
        "-n",
        "2",
        "--log-dir",
        dir,
        "--rdzv-id",
        "f",
        "--duplicate-stdout-filters",
        "loss=",
        "--duplicate_stderr_filters",
        "warn,,x",
        "--no-python",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let read =
        |name: &str| std::fs::read_to_string(logs.path().join("f/attempt_0").join(name)).unwrap();
    let mut lines: Vec<String> = read("filtered_stdout.log")
        .lines()
        .map(String::from)
        .collect();
    lines.sort();
    assert_eq!(lines, ["[rank 0]: loss=0", "[rank 1]: loss=1"]);
    assert_eq!(read("filtered_stderr.log").lines().count(), 2);
}

#[test]
fn first_failure_in_time_is_the_root_cause() {
    let script = r#"
        case $RANK in
          2) echo "rank two breaks" >&2; exit 3 ;;
          0) trap '' TERM; sleep 0.4; echo "rank zero breaks later" >&2; exit 1 ;;
          *) exec sleep 30 ;;
        esac"#;
    let out = run(&[
        "run",
        "-n",
        "3",
        "--grace-period",
        "5",
        "--no-python",
        "--",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.code, Some(3), "{}", out.stderr);
    let report = out.stderr;
    assert!(
        report.contains("rank 2 failed first (root cause)"),
        "{report}"
    );
    assert!(report.contains("exit code 3"), "{report}");
    assert!(report.contains("rank two breaks"), "{report}");
    assert!(report.contains("rank 0 (local rank 0, pid"), "{report}");
    assert!(
        report.contains("rank 1 (local rank 1, pid") && report.contains("SIGTERM"),
        "{report}"
    );
}

#[test]
fn signal_deaths_are_named() {
    let out = run(&[
        "run",
        "-n",
        "2",
        "--grace-period",
        "2",
        "--no-python",
        "--",
        "sh",
        "-c",
        "[ $RANK = 1 ] && kill -SEGV $$; sleep 30",
    ]);
    assert_eq!(out.code, Some(139), "{}", out.stderr);
    assert!(out.stderr.contains("signal SIGSEGV"), "{}", out.stderr);
    let out = run(&[
        "run",
        "-n",
        "1",
        "--no-python",
        "--",
        "sh",
        "-c",
        "echo dying >&2; kill -KILL $$",
    ]);
    assert_eq!(out.code, Some(137), "{}", out.stderr);
    assert!(out.stderr.contains("signal SIGKILL"), "{}", out.stderr);
    assert!(out.stderr.contains("OOM killer"), "{}", out.stderr);
    assert!(out.stderr.contains("dying"), "{}", out.stderr);
}

#[test]
fn restarts_until_it_works() {
    let script = r#"[ "$TORCHELASTIC_RESTART_COUNT" = 2 ] || { echo "attempt $TORCHELASTIC_RESTART_COUNT fails" >&2; exit 4; }; echo ok"#;
    let logs = Scratch::new("restart-logs");
    let dir = logs.path().to_str().unwrap();
    let out = run(&[
        "run",
        "-n",
        "2",
        "--max-restarts",
        "2",
        "--grace-period",
        "1",
        "--log-dir",
        dir,
        "--run-id",
        "x",
        "--tee",
        "--no-python",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(
        out.stderr.matches("restarting all 2 ranks").count(),
        2,
        "{}",
        out.stderr
    );
    assert_eq!(
        out.stdout.lines().filter(|l| l.ends_with(": ok")).count(),
        2
    );
    for attempt in 0..3 {
        assert!(logs
            .path()
            .join(format!("x/attempt_{attempt}/rank_1/stderr.log"))
            .exists());
    }
    let out = run(&[
        "run",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--grace-period",
        "1",
        "--no-python",
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(out.code, Some(4), "{}", out.stderr);
    assert!(out.stderr.contains("attempt    : 1"), "{}", out.stderr);
}

#[test]
fn a_missing_command_is_exit_127() {
    let out = run(&[
        "run",
        "-n",
        "2",
        "--no-python",
        "--",
        "/nonexistent/tether-test-program",
    ]);
    assert_eq!(out.code, Some(127), "{out:?}");
    assert!(out.stderr.contains("cannot start"), "{}", out.stderr);
}

/// Starts `script` in `n` ranks that each write `$DIR/ready.$RANK` with their pid, and
/// waits until all have.
fn start_ready(args: &[&str], n: usize, script: &str) -> (Launcher, Scratch, Vec<i32>) {
    let dir = Scratch::new("ready");
    let mut cmd = command(args);
    cmd.env("DIR", dir.path())
        .args(["--no-python", "--", "sh", "-c", script]);
    let launcher = Launcher::spawn(cmd);
    let ready = |r: usize| dir.path().join(format!("ready.{r}"));
    assert!(
        eventually(Duration::from_secs(10), || (0..n)
            .all(|r| ready(r).exists())),
        "ranks did not start"
    );
    std::thread::sleep(Duration::from_millis(50));
    let pids = (0..n)
        .map(|r| {
            std::fs::read_to_string(ready(r))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    (launcher, dir, pids)
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a process this test started.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

#[test]
fn sigterm_is_forwarded_and_exit_is_143() {
    let script = r#"trap 'echo "got TERM"; exit 0' TERM; echo $$ > "$DIR/ready.$RANK"; while :; do sleep 0.05; done"#;
    let (launcher, _dir, pids) = start_ready(&["run", "-n", "2", "--grace-period", "5"], 2, script);
    signal(launcher.pid(), libc::SIGTERM);
    let out = launcher.finish(Duration::from_secs(10));
    assert_eq!(out.code, Some(143), "{out:?}");
    assert_eq!(out.stdout.matches("got TERM").count(), 2, "{out:?}");
    assert!(out.elapsed < Duration::from_secs(4), "{out:?}");
    assert!(pids.iter().all(|&p| !alive(p)));
}

#[test]
fn a_rank_ignoring_sigterm_is_killed_after_the_grace_period() {
    let script = r#"trap '' TERM; echo $$ > "$DIR/ready.$RANK"; while :; do sleep 0.05; done"#;
    let (launcher, _dir, pids) = start_ready(&["run", "-n", "2", "--grace-period", "1"], 2, script);
    let sent = std::time::Instant::now();
    signal(launcher.pid(), libc::SIGTERM);
    let out = launcher.finish(Duration::from_secs(10));
    let took = sent.elapsed();
    assert_eq!(out.code, Some(143), "{out:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert!(pids.iter().all(|&p| !alive(p)));
}

#[test]
fn sighup_is_forwarded_too() {
    let script = r#"trap 'echo "got HUP"; exit 0' HUP; echo $$ > "$DIR/ready.$RANK"; while :; do sleep 0.05; done"#;
    let (launcher, _dir, _) = start_ready(&["run", "-n", "1", "--grace-period", "5"], 1, script);
    signal(launcher.pid(), libc::SIGHUP);
    let out = launcher.finish(Duration::from_secs(10));
    assert_eq!(out.code, Some(128 + libc::SIGHUP), "{out:?}");
    assert_eq!(out.stdout, "[rank 0]: got HUP\n");
}

#[test]
fn a_second_sigint_kills_at_once() {
    let script = r#"trap '' INT TERM; echo $$ > "$DIR/ready.$RANK"; while :; do sleep 0.05; done"#;
    let (launcher, _dir, pids) =
        start_ready(&["run", "-n", "2", "--grace-period", "30"], 2, script);
    let sent = std::time::Instant::now();
    signal(launcher.pid(), libc::SIGINT);
    std::thread::sleep(Duration::from_millis(100));
    signal(launcher.pid(), libc::SIGINT);
    let out = launcher.finish(Duration::from_secs(10));
    assert_eq!(out.code, Some(130), "{out:?}");
    assert!(sent.elapsed() < Duration::from_secs(3));
    assert!(pids.iter().all(|&p| !alive(p)));
}

/// Rank 0 ignores SIGINT; rank 1 is stuck in a C wait that retries on EINTR (a mutex, as in
/// a C++ TCPStore connect: Python's SIGINT handler only sets a flag that nothing reads
/// there); rank 2 ignores SIGINT and SIGTERM.
const DEAF_TO_CTRL_C: &str = r#"
import ctypes, os, signal, time
rank = int(os.environ["RANK"])
if rank in (0, 2):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
if rank == 2:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
ready = os.path.join(os.environ["DIR"], f"ready.{rank}")
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(ready + ".tmp", ready)
if rank == 1:
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
while True:
    time.sleep(0.05)
"#;

#[test]
fn ctrl_c_says_how_ranks_stop_and_escalates_to_sigterm_then_sigkill() {
    let dir = Scratch::new("ctrl-c");
    let script = dir.path().join("deaf.py");
    std::fs::write(&script, DEAF_TO_CTRL_C).unwrap();
    let command = format!("exec python3 {}", script.display());
    let (launcher, _dir, pids) =
        start_ready(&["run", "-n", "3", "--grace-period", "4"], 3, &command);
    let sent = std::time::Instant::now();
    signal(launcher.pid(), libc::SIGINT);
    let mut ended = [None; 3];
    while sent.elapsed() < Duration::from_secs(10) && ended.iter().any(Option::is_none) {
        for (rank, &pid) in pids.iter().enumerate() {
            if ended[rank].is_none() && !alive(pid) {
                ended[rank] = Some(sent.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = launcher.finish(Duration::from_secs(10));
    assert_eq!(out.code, Some(130), "{out:?}");
    let ended: Vec<Duration> = ended
        .iter()
        .map(|e| e.expect("a rank outlived tether"))
        .collect();
    // SIGTERM at half the grace period (2 s): ranks 0 and 1 end then, rank 2 at SIGKILL.
    for (rank, at) in ended.iter().enumerate().take(2) {
        assert!(
            *at >= Duration::from_millis(1800) && *at < Duration::from_millis(3500),
            "rank {rank} ended {at:?} after the SIGINT\n{}",
            out.stderr
        );
    }
    assert!(
        ended[2] >= Duration::from_millis(3800) && ended[2] < Duration::from_secs(7),
        "rank 2 ended {:?} after the SIGINT",
        ended[2]
    );
    let said: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.starts_with("tether: "))
        .collect();
    assert_eq!(
        said,
        [
            "tether: got SIGINT; forwarding it to 3 rank(s); those still running 2s later get \
             SIGTERM, and SIGKILL 4s after the SIGINT; press Ctrl-C again to kill them at once",
            "tether: 3 rank(s) still running 2s after SIGINT: SIGTERM; SIGKILL in 2s",
            "tether: 1 rank(s) still running at the end of the grace period (4s): SIGKILL",
        ],
        "{}",
        out.stderr
    );
}

#[test]
fn what_a_rank_leaves_behind_is_killed() {
    // A grandchild in its own session (out of reach of the rank's process group).
    let script = r#"setsid sh -c 'echo $$ > "$DIR/escaped.$RANK"; exec sleep 30' & sleep 0.2; echo $$ > "$DIR/ready.$RANK""#;
    let (launcher, dir, _) = start_ready(&["run", "-n", "2"], 2, script);
    let out = launcher.finish(Duration::from_secs(10));
    assert_eq!(out.code, Some(0), "{out:?}");
    for r in 0..2 {
        let pid: i32 = std::fs::read_to_string(dir.path().join(format!("escaped.{r}")))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(!alive(pid), "escaped grandchild {pid} outlived tether");
    }
}

#[test]
fn bad_usage_is_exit_2_with_usage() {
    for args in [
        &["run"][..],
        &["run", "-n", "0", "true"],
        &["run", "--nnodes", "2", "--node-rank", "2", "true"],
        &["run", "--bogus", "true"],
        &["run", "--nnodes", "2", "--max-restarts", "1", "true"],
        &[],
    ] {
        let out = run(args);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("Usage: tether"),
            "{args:?}: {}",
            out.stderr
        );
    }
    let out = run(&["run", "--nnodes", "2", "--max-restarts", "1", "true"]);
    assert!(out.stderr.contains("--max-restarts"), "{}", out.stderr);
}

#[test]
fn help_wraps_to_the_terminals_width() {
    for columns in ["80", "120"] {
        for args in [&["run", "--help"][..], &["--help"]] {
            let out = run_env(args, &[("COLUMNS", columns)]);
            assert_eq!(out.code, Some(0), "{out:?}");
            let widest = out.stdout.lines().map(|l| l.chars().count()).max();
            let limit: usize = columns.parse().unwrap();
            assert!(
                widest.is_some_and(|w| w <= limit),
                "{args:?} at {columns}: {widest:?}"
            );
        }
    }
}

#[test]
fn help_and_version() {
    let out = run(&["--help"]);
    assert_eq!(out.code, Some(0));
    assert!(out.stdout.contains("run"));
    let out = run(&["run", "--help"]);
    assert_eq!(out.code, Some(0));
    assert!(out.stdout.contains("--nproc-per-node") && out.stdout.contains("[rank N]: "));
    let out = run(&["--version"]);
    assert_eq!(
        out.stdout.trim(),
        format!("tether {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn an_invalid_tether_log_is_a_warning_and_a_level_is_none() {
    let args = ["run", "-n", "1", "--no-python", "true"];
    let out = run_env(&args, &[("TETHER_LOG", "loud")]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stderr,
        "tether: warning: TETHER_LOG=\"loud\" is not a log level (off, error, warn, info, \
         debug, trace): nothing is logged\n"
    );
    let out = run_env(&args, &[("TETHER_LOG", "Warning")]);
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
}

#[test]
fn the_ranks_of_a_job_share_one_job_id_and_another_job_has_another() {
    let job_ids = || {
        let out = run(&[
            "run",
            "-n",
            "2",
            "--no-python",
            "--",
            "sh",
            "-c",
            "echo TETHER_JOB_ID=$TETHER_JOB_ID",
        ]);
        assert_eq!(out.code, Some(0), "{out:?}");
        let envs = env_of(&out.stdout);
        let ids: Vec<String> = envs.values().map(|e| e["TETHER_JOB_ID"].clone()).collect();
        assert_eq!(ids.len(), 2);
        assert!(!ids[0].is_empty() && ids[0] == ids[1], "{ids:?}");
        ids[0].clone()
    };
    assert_ne!(job_ids(), job_ids());
}
