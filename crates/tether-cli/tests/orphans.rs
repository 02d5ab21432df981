//! Nothing a rank starts outlives tether, in any session or process group: after a normal
//! exit, a failure, a restart, and when tether's supervising process is killed.

mod common;

use std::time::Duration;

use common::{command, eventually, leaver, marked, Launcher, Scratch, MARK_VAR};

fn launcher(mark: &str, dir: &Scratch, options: &[&str], script: &str) -> Launcher {
    let mut cmd = command(&[&["run", "-n", "2"][..], options].concat());
    cmd.env(MARK_VAR, mark)
        .env("DIR", dir.path())
        .args(["--no-python", "sh", "-c", script]);
    Launcher::spawn(cmd)
}

fn assert_all_gone(mark: &str, when: &str) {
    assert!(
        eventually(Duration::from_secs(1), || marked(mark).is_empty()),
        "{when}: left behind {:?}",
        marked(mark)
    );
}

#[test]
fn nothing_outlives_a_normal_exit() {
    let mark = format!("orphans-{}-exit", std::process::id());
    let dir = Scratch::new("orphans");
    let out = launcher(&mark, &dir, &[], &leaver("exit 0")).finish(Duration::from_secs(20));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_all_gone(&mark, "after a normal exit");
}

#[test]
fn nothing_outlives_a_failure() {
    let mark = format!("orphans-{}-failure", std::process::id());
    let dir = Scratch::new("orphans");
    let script = leaver("[ $RANK = 1 ] && exit 7; trap '' TERM; wait");
    let out =
        launcher(&mark, &dir, &["--grace-period", "1"], &script).finish(Duration::from_secs(20));
    assert_eq!(out.code, Some(7), "{out:?}");
    assert_all_gone(&mark, "after a failure");
}

#[test]
fn nothing_from_an_attempt_survives_into_the_next() {
    let mark = format!("orphans-{}-restart", std::process::id());
    let dir = Scratch::new("orphans");
    // At the start of attempt k, rank 0 lists the processes of attempt k-1 still alive; the
    // other rank fails only once that list is written (its failure stops rank 0).
    let script = leaver(
        r#"k=$TORCHELASTIC_RESTART_COUNT; if [ $k -gt 0 ]; then if [ $RANK = 0 ]; then for p in $(cat "$DIR/pids.$((k-1))"); do kill -0 $p 2>/dev/null && echo $p; done > "$DIR/alive.$k"; touch "$DIR/checked.$k"; else n=0; while [ ! -e "$DIR/checked.$k" ] && [ $n -lt 1000 ]; do sleep 0.01; n=$((n+1)); done; fi; fi; [ $k = 2 ] || exit 3"#,
    );
    let out = launcher(
        &mark,
        &dir,
        &["--max-restarts", "2", "--grace-period", "1"],
        &script,
    )
    .finish(Duration::from_secs(30));
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_all_gone(&mark, "after restarts");
    for k in 1..3 {
        let before = std::fs::read_to_string(dir.path().join(format!("pids.{}", k - 1))).unwrap();
        assert!(
            before.lines().count() >= 4,
            "attempt {} left {before:?}",
            k - 1
        );
        let alive = std::fs::read_to_string(dir.path().join(format!("alive.{k}"))).unwrap();
        assert_eq!(alive, "", "attempt {k} saw processes of attempt {}", k - 1);
    }
}

#[test]
fn a_killed_supervisor_takes_everything_with_it() {
    let mark = format!("orphans-{}-supervisor", std::process::id());
    let dir = Scratch::new("orphans");
    let launcher = launcher(&mark, &dir, &["--grace-period", "30"], &leaver("wait"));
    let ready = |r: usize| dir.path().join(format!("ready.{r}")).exists();
    assert!(eventually(Duration::from_secs(10), || ready(0) && ready(1)));
    let children = format!("/proc/{0}/task/{0}/children", launcher.pid());
    let supervisor: i32 = std::fs::read_to_string(children)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    // SAFETY: SIGKILL to the supervisor of the launcher this test started.
    assert_eq!(unsafe { libc::kill(supervisor, libc::SIGKILL) }, 0);
    assert_all_gone(&mark, "after the supervisor was killed");
    let out = launcher.finish(Duration::from_secs(5));
    assert_eq!(out.code, Some(128 + libc::SIGKILL), "{out:?}");
    assert!(
        out.stderr.contains("the supervisor") && out.stderr.contains("SIGKILL"),
        "{}",
        out.stderr
    );
}
