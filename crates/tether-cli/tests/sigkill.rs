//! tether killed with SIGKILL takes every rank and the processes in the ranks' process
//! groups with it, within a second. This test process makes itself a child subreaper so
//! that it can see (and reap) what is re-parented, which is why it has a binary of its own.

mod common;

use std::time::Duration;

use common::{alive, command, eventually, Launcher, Scratch};

#[test]
fn sigkill_of_the_launcher_leaves_nothing() {
    // SAFETY: prctl on this test process's own flags.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong) },
        0
    );
    let dir = Scratch::new("sigkill");
    let mut cmd = command(&["run", "-n", "2", "--grace-period", "30"]);
    cmd.env("DIR", dir.path()).args([
        "--",
        "sh",
        "-c",
        r#"trap '' TERM INT HUP; sleep 60 & sh -c 'trap "" TERM; sleep 61' & echo "$$ $!" > "$DIR/ready.$RANK"; wait"#,
    ]);
    let launcher = Launcher::spawn(cmd);
    let ready = |r: usize| dir.path().join(format!("ready.{r}"));
    assert!(eventually(Duration::from_secs(10), || (0..2)
        .all(|r| ready(r).exists())));
    std::thread::sleep(Duration::from_millis(100));
    let mut pids: Vec<i32> = (0..2)
        .flat_map(|r| {
            std::fs::read_to_string(ready(r))
                .unwrap()
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect::<Vec<i32>>()
        })
        .collect();
    // The sleeps in each rank's process group, too.
    for pgid in pids.clone() {
        for entry in std::fs::read_dir("/proc").unwrap().filter_map(Result::ok) {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            // SAFETY: getpgid reads another process's group id.
            if unsafe { libc::getpgid(pid) } == pgid && !pids.contains(&pid) {
                pids.push(pid);
            }
        }
    }
    assert!(pids.len() >= 6, "{pids:?}");
    assert!(pids.iter().all(|&p| alive(p)));
    let launcher_pid = launcher.pid();
    // SAFETY: SIGKILL to the launcher this test started.
    assert_eq!(unsafe { libc::kill(launcher_pid, libc::SIGKILL) }, 0);
    assert!(
        eventually(Duration::from_secs(1), || pids.iter().all(|&p| !alive(p))),
        "survivors: {:?}",
        pids.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
    let out = launcher.finish(Duration::from_secs(5));
    assert_eq!(out.signal, Some(libc::SIGKILL));
    // Reap everything re-parented here (the ranks' leftovers and the watchdog).
    let reaped_all = eventually(Duration::from_secs(2), || {
        let mut status = 0;
        // SAFETY: reaping children of this test process; this binary has no other test.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        pid < 0
    });
    assert!(reaped_all, "something re-parented here did not exit");
}
