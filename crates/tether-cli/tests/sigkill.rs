//! tether killed with SIGKILL at any moment takes every process that any rank started with
//! it, in any session or process group, within a second.
//!
//! This test process makes itself a child subreaper so that what is re-parented when the
//! launcher dies (its supervisor, which then cleans up) comes here and is reaped here
//! rather than by init. That is why this binary has a single test: reaping any child would
//! race with other tests waiting for their own.

mod common;

use std::time::{Duration, Instant};

use common::{command, eventually, leaver, marked, Launcher, Scratch, MARK_VAR};

/// Starts a launcher for `ranks` ranks of `script` (with `$DIR` set) marked with `mark`.
fn start(mark: &str, dir: &Scratch, options: &[&str], script: &str) -> Launcher {
    let mut cmd = command(&[&["run"][..], options].concat());
    cmd.env(MARK_VAR, mark)
        .env("DIR", dir.path())
        .args(["--no-python", "sh", "-c", script]);
    Launcher::spawn(cmd)
}

/// SIGKILLs the launcher and checks that every marked process is gone within a second.
fn kill_and_check(launcher: Launcher, mark: &str, when: &str) {
    let before = marked(mark).len();
    // SAFETY: SIGKILL to the launcher this test started.
    assert_eq!(unsafe { libc::kill(launcher.pid(), libc::SIGKILL) }, 0);
    let killed = Instant::now();
    let gone = eventually(Duration::from_secs(1), || marked(mark).is_empty());
    assert!(
        gone,
        "{when}: {} of {before} marked processes outlived the launcher by {:?}: {:?}",
        marked(mark).len(),
        killed.elapsed(),
        describe(&marked(mark))
    );
    let out = launcher.finish(Duration::from_secs(5));
    assert_eq!(out.signal, Some(libc::SIGKILL), "{when}");
    reap_everything();
    eprintln!("{when}: {:?}", killed.elapsed());
}

/// Reaps what was re-parented here (the launcher's supervisor, once it has cleaned up).
fn reap_everything() {
    let reaped_all = eventually(Duration::from_secs(5), || {
        let mut status = 0;
        // SAFETY: reaping children of this test process; this binary has no other test.
        unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) < 0 }
    });
    assert!(reaped_all, "something re-parented here did not exit");
}

#[test]
fn sigkill_of_the_launcher_at_any_moment_leaves_no_descendant() {
    // SAFETY: prctl on this test process's own flags.
    let subreaper = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) };
    assert_eq!(subreaper, 0);
    let steady = leaver("trap '' TERM INT HUP; wait");
    // Ranks that fail at once, again and again: the kill lands while tether stops ranks,
    // cleans up after them or starts the next attempt.
    let churn = leaver("exit 1");
    let churn_opts = [
        "-n",
        "2",
        "--max-restarts",
        "1000",
        "--grace-period",
        "0.05",
    ];
    let steady_opts = ["-n", "2", "--grace-period", "30"];
    let me = std::process::id();
    for delay_ms in [0u64, 1, 2, 4, 7, 11, 17, 25, 40, 60, 90, 150, 250] {
        for (kind, opts, script) in [
            ("steady", &steady_opts[..], &steady),
            ("churn", &churn_opts[..], &churn),
        ] {
            let mark = format!("sigkill-{me}-{kind}-{delay_ms}");
            let dir = Scratch::new("sigkill");
            let launcher = start(&mark, &dir, opts, script);
            std::thread::sleep(Duration::from_millis(delay_ms));
            kill_and_check(launcher, &mark, &format!("{kind} after {delay_ms} ms"));
        }
    }
    // Once every rank is running and has started its leavers.
    let mark = format!("sigkill-{me}-ready");
    let dir = Scratch::new("sigkill");
    let launcher = start(&mark, &dir, &steady_opts, &steady);
    let ready = |r: usize| dir.path().join(format!("ready.{r}")).exists();
    assert!(eventually(Duration::from_secs(10), || ready(0) && ready(1)));
    assert!(marked(&mark).len() >= 10, "{:?}", marked(&mark));
    kill_and_check(launcher, &mark, "all running");
    // While stopping the ranks: one failed, the other ignores SIGTERM for 30 s.
    let mark = format!("sigkill-{me}-grace");
    let dir = Scratch::new("sigkill");
    let script = format!("trap '' TERM; {}", leaver("[ $RANK = 1 ] && exit 5; wait"));
    let launcher = start(&mark, &dir, &steady_opts, &script);
    assert!(eventually(Duration::from_secs(10), || ready_in(&dir, 2)));
    std::thread::sleep(Duration::from_millis(200));
    kill_and_check(launcher, &mark, "during the grace period");
}

/// `pid (parent) command` for each of `pids`.
fn describe(pids: &[i32]) -> Vec<String> {
    pids.iter()
        .map(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            format!("{pid} ({}) {cmd}", stat.rsplit(") ").next().unwrap_or(""))
        })
        .collect()
}

fn ready_in(dir: &Scratch, n: usize) -> bool {
    (0..n).all(|r| dir.path().join(format!("ready.{r}")).exists())
}
