//! `tether ps` and `tether stacks PID` of the `tether` binary, against a real `tether run`.

mod common;

use std::collections::BTreeMap;
use std::process::Output;
use std::time::Duration;

use common::{command, eventually, Launcher, BIN};

/// Ranks that say their rank and pid, then sleep as `sleep 30`.
fn sleeping_job(ranks: usize) -> (Launcher, BTreeMap<usize, i32>) {
    let n = ranks.to_string();
    let mut cmd = command(&["run", "-n", &n, "--rdzv-id", "psjob", "--no-python"]);
    cmd.args(["sh", "-c", "echo \"ready $RANK $$\"; exec sleep 30"]);
    let job = Launcher::spawn(cmd);
    let ready = |out: &str| {
        let pairs = out
            .lines()
            .filter_map(|l| l.split_once("ready ").map(|(_, r)| r.to_owned()));
        pairs
            .filter_map(|p| {
                let (rank, pid) = p.split_once(' ')?;
                Some((rank.parse().ok()?, pid.trim().parse().ok()?))
            })
            .collect::<BTreeMap<usize, i32>>()
    };
    let all = eventually(Duration::from_secs(30), || {
        ready(&job.stdout_so_far()).len() == ranks
    });
    assert!(all, "the ranks did not start: {}", job.stdout_so_far());
    // Every rank has exec'd its sleep once it said so (`sleep` shows in its command line).
    let ranks_pids = ready(&job.stdout_so_far());
    let slept = eventually(Duration::from_secs(10), || {
        ranks_pids.values().all(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| c.starts_with(b"sleep"))
        })
    });
    assert!(slept);
    (job, ranks_pids)
}

fn tether(args: &[&str]) -> Output {
    std::process::Command::new(BIN).args(args).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn ppid(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    after.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Stops a job of [`sleeping_job`] and returns its stderr.
fn stop(job: Launcher) -> String {
    // SAFETY: SIGTERM to the launcher this test started.
    assert_eq!(unsafe { libc::kill(job.pid(), libc::SIGTERM) }, 0);
    let out = job.finish(Duration::from_secs(30));
    assert_eq!(out.code, Some(128 + libc::SIGTERM), "{}", out.stderr);
    out.stderr
}

#[test]
fn ps_shows_a_tether_run_job_whole_and_never_itself() {
    let (job, ranks) = sleeping_job(2);
    let ps = std::process::Command::new(BIN)
        .arg("ps")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let me = ps.id() as i32;
    let ps = ps.wait_with_output().unwrap();
    let keeper = job.pid();
    let supervisor = ppid(ranks[&0]);
    stop(job);
    let out = text(&ps.stdout);
    assert_eq!(ps.status.code(), Some(0), "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "    PID  WHAT");
    let at: BTreeMap<i32, usize> = lines[1..]
        .iter()
        .enumerate()
        .map(|(n, line)| {
            (
                line.split_whitespace().next().unwrap().parse().unwrap(),
                n + 1,
            )
        })
        .collect();
    assert!(!at.contains_key(&me), "{out}");
    assert!(
        lines[at[&keeper]].contains("tether run keeper: ") && out.contains("--rdzv-id psjob"),
        "{out}"
    );
    let supervised = format!("└─ tether supervisor of run psjob (keeper {keeper}, 2 rank(s))");
    assert!(lines[at[&supervisor]].ends_with(&supervised), "{out}");
    // The ranks, by the supervisor (other jobs of this user may show beside this one).
    for (rank, pid) in &ranks {
        let line = lines[at[pid]];
        let arm = if *rank == 0 { "├─" } else { "└─" };
        let what = format!("{arm} rank {rank} (local {rank}): sleep 30");
        assert!(
            line.starts_with(&format!("{pid:>7}  ")) && line.ends_with(&what),
            "{out}"
        );
    }
    // The tree: keeper, then its supervisor, then the ranks under it.
    assert!(
        at[&keeper] < at[&supervisor] && at[&supervisor] < at[&ranks[&0]],
        "{out}"
    );
}

#[test]
fn ps_takes_no_argument() {
    let ps = tether(&["ps", "--all"]);
    assert_eq!(ps.status.code(), Some(2));
    assert_eq!(text(&ps.stdout), "usage: tether ps\n");
}

#[test]
fn stacks_prints_every_rank_stack_to_its_caller_and_the_run_goes_on() {
    let (job, ranks) = sleeping_job(2);
    let asked = tether(&["stacks", &job.pid().to_string()]);
    let both = |err: &str| {
        ranks
            .keys()
            .all(|r| err.contains(&format!("[rank {r}]: (no Python stack: pid")))
    };
    let shown = eventually(Duration::from_secs(20), || both(&job.stderr_so_far()));
    let alive = ranks.values().all(|&pid| common::alive(pid));
    let err = stop(job);
    let out = text(&asked.stdout);
    assert!(shown && alive, "{err}");
    // The caller gets the block the job's stderr shows; no rank of `sleep` can answer.
    let pids: Vec<String> = ranks.values().map(|pid| pid.to_string()).collect();
    let named: Vec<String> = ranks
        .iter()
        .map(|(rank, pid)| format!("rank {rank} (pid {pid})"))
        .collect();
    assert_eq!(
        (asked.status.code(), text(&asked.stderr)),
        (
            Some(3),
            format!(
                "tether stacks: 2 of the ranks did not answer: {}; their lines above say why\n",
                named.join(", ")
            )
        ),
        "{out}"
    );
    assert!(out.starts_with("tether: `tether stacks` asked: the stack of every rank (0 of 2"));
    for (rank, pid) in &ranks {
        let line = format!("[rank {rank}]: (no Python stack: pid {pid} cannot answer: it is not");
        assert!(out.contains(&line) && err.contains(&line), "{out}");
    }
    let summary = format!(
        "tether: summary: no place holds most of the ranks; ranks 0-1 did not answer (pids {})\n",
        pids.join(", ")
    );
    assert!(out.ends_with(&summary) && err.contains(&summary), "{out}");
}

#[test]
fn stacks_refuses_a_pid_that_is_no_tether_run() {
    let me = std::process::id();
    let asked = tether(&["stacks", &me.to_string()]);
    assert_eq!(asked.status.code(), Some(1));
    assert_eq!(
        text(&asked.stderr),
        format!("tether stacks: pid {me} is not a running `tether run`\n")
    );
    let gone = tether(&["stacks", "99999999999"]);
    assert_eq!(gone.status.code(), Some(1));
    assert!(text(&gone.stderr).contains("pid 99999999999 is not a running"));
}

#[test]
fn stacks_wants_one_pid() {
    let usage = "usage: tether stacks PID  (PID: the pid of a running `tether run`)\n";
    for (args, code) in [
        (&["stacks"][..], 2),
        (&["stacks", "12", "13"], 2),
        (&["stacks", "twelve"], 2),
        (&["stacks", "-h"], 0),
        (&["stacks", "--help"], 0),
    ] {
        let asked = tether(args);
        assert_eq!(asked.status.code(), Some(code), "{args:?}");
        assert_eq!(text(&asked.stdout), usage, "{args:?}");
    }
}
