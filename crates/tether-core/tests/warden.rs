//! The warden: exit statuses, reports, payloads, exit times, reaping, termination.

mod common;

use std::time::{Duration, Instant};

use tether_core::{Error, ExitStatus, Group, LaunchSpec, WaitFor};

const LIMIT: Option<Duration> = Some(Duration::from_secs(20));

fn sh(script: &str) -> LaunchSpec {
    let mut spec = LaunchSpec::new(["bash", "-c", script]);
    spec.report = true;
    spec
}

fn report_pid(group: &Group, idx: usize) -> i32 {
    let mut pid = 0;
    assert!(common::eventually(Duration::from_secs(5), || {
        let text = group
            .with_member(idx, |m| String::from_utf8_lossy(m.report()).into_owned())
            .unwrap();
        pid = text.trim().parse().unwrap_or(0);
        pid > 0
    }));
    pid
}

#[test]
fn exit_statuses_are_classified() {
    let group = Group::new();
    group
        .launch(vec![
            sh("exit 0"),
            sh("exit 3"),
            sh("kill -ABRT $$"),
            sh("kill -KILL $$"),
        ])
        .unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert_eq!(group.exit(0).unwrap().status, ExitStatus::Exited(0));
    assert_eq!(group.exit(1).unwrap().status, ExitStatus::Exited(3));
    assert_eq!(group.exit(2).unwrap().status.signal(), Some(libc::SIGABRT));
    assert_eq!(
        group.exit(3).unwrap().status,
        ExitStatus::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false
        }
    );
}

#[test]
fn every_child_is_reaped() {
    let group = Group::new();
    let pids: Vec<i32> = group
        .launch((0..4).map(|i| sh(&format!("exit {i}"))).collect())
        .unwrap()
        .into_iter()
        .map(|i| group.pid(i).unwrap())
        .collect();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    for pid in pids {
        assert!(common::gone(pid), "pid {pid} left as a zombie");
    }
}

#[test]
fn a_large_report_is_drained_while_the_child_runs() {
    let group = Group::new();
    // 8 MiB is far more than a pipe holds: the child finishes only if it is drained.
    group
        .launch(vec![sh(
            "head -c 8388608 /dev/zero | tr '\\0' x >&$TETHER_REPORT_FD; exit 1",
        )])
        .unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    let report = group.with_member(0, |m| m.report().to_vec()).unwrap();
    assert_eq!(report.len(), 8 << 20);
    assert!(report.iter().all(|&b| b == b'x'));
}

#[test]
fn the_payload_reaches_the_child_whole() {
    let group = Group::new();
    let payload: Vec<u8> = (0..(3 << 20)).map(|i| (i % 251) as u8).collect();
    let mut spec = sh("cat <&$TETHER_PAYLOAD_FD >&$TETHER_REPORT_FD");
    spec.payload = Some(payload.clone());
    group.launch(vec![spec]).unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert_eq!(group.exit(0).unwrap().status, ExitStatus::Exited(0));
    assert!(group.with_member(0, |m| m.report() == payload).unwrap());
}

#[test]
fn exit_times_are_recorded_in_order() {
    let group = Group::new();
    group
        .launch(vec![sh("sleep 0.4; exit 2"), sh("sleep 0.05; exit 1")])
        .unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    let (late, early) = (group.exit(0).unwrap(), group.exit(1).unwrap());
    assert!(early.at < late.at);
    assert!(late.at - early.at >= Duration::from_millis(200));
}

#[test]
fn wait_stops_at_the_first_failure_or_the_timeout() {
    let group = Group::new();
    group
        .launch(vec![sh("exec sleep 30"), sh("exit 5")])
        .unwrap();
    assert!(group.wait(None, WaitFor::AllExitedOrFailure, LIMIT));
    assert!(group.exit(0).is_none());
    assert!(!group.wait(
        Some(&[0]),
        WaitFor::AllExited,
        Some(Duration::from_millis(50))
    ));
    group.terminate(libc::SIGTERM, Duration::from_secs(5));
    assert!(group.exit(0).is_some());
}

#[test]
fn children_outlive_the_thread_that_asked_for_them() {
    let group = Group::new();
    let g = group.clone();
    std::thread::spawn(move || g.launch(vec![LaunchSpec::new(["sleep", "30"])]).unwrap())
        .join()
        .unwrap();
    let pid = group.pid(0).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        common::alive(pid),
        "the child died with the thread that launched it"
    );
    group.terminate(libc::SIGTERM, Duration::from_secs(5));
}

#[test]
fn terminate_escalates_to_sigkill_and_takes_grandchildren() {
    let group = Group::new();
    // The child and its grandchild ignore SIGTERM.
    group
        .launch(vec![sh(
            "trap '' TERM; sleep 30 & echo $! >&$TETHER_REPORT_FD; wait",
        )])
        .unwrap();
    let grandchild = report_pid(&group, 0);
    let start = Instant::now();
    group.terminate(libc::SIGTERM, Duration::from_millis(300));
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_eq!(group.exit(0).unwrap().status.signal(), Some(libc::SIGKILL));
    assert!(common::eventually(Duration::from_secs(1), || {
        !common::alive(grandchild)
    }));
}

#[test]
fn terminate_is_quick_when_children_obey_sigterm() {
    let group = Group::new();
    group
        .launch(vec![sh("exec sleep 30"), sh("exec sleep 30")])
        .unwrap();
    let start = Instant::now();
    group.terminate(libc::SIGTERM, Duration::from_secs(10));
    assert!(start.elapsed() < Duration::from_secs(5));
    for i in 0..2 {
        assert_eq!(group.exit(i).unwrap().status.signal(), Some(libc::SIGTERM));
    }
}

#[test]
fn what_a_child_leaves_in_its_group_is_killed_when_it_exits() {
    let group = Group::new();
    group
        .launch(vec![sh(
            "sleep 30 & echo $! >&$TETHER_REPORT_FD; sleep 0.2; exit 0",
        )])
        .unwrap();
    let grandchild = report_pid(&group, 0);
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert!(common::eventually(Duration::from_secs(1), || {
        !common::alive(grandchild)
    }));
}

#[test]
fn signal_after_exit_reports_false() {
    let group = Group::new();
    group.launch(vec![sh("exit 0")]).unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert!(!group.signal(0, libc::SIGTERM).unwrap());
    assert!(group.signal(7, libc::SIGTERM).is_err());
}

#[test]
fn adopted_fork_children_are_supervised() {
    // SAFETY: the child calls only async-signal-safe functions before _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            libc::usleep(50_000);
            libc::_exit(7);
        }
    }
    let group = Group::new();
    group.adopt(pid, None).unwrap();
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert_eq!(group.exit(0).unwrap().status, ExitStatus::Exited(7));
    assert!(common::gone(pid));
}

#[test]
fn a_program_that_does_not_exist_is_a_clear_error() {
    let group = Group::new();
    let err = group
        .launch(vec![
            LaunchSpec::new(["sleep", "30"]),
            LaunchSpec::new(["/nonexistent/tether-test"]),
        ])
        .unwrap_err();
    assert!(matches!(err, Error::Launch { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/tether-test"));
    // The child of the same call that did start is stopped.
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    assert_eq!(group.exit(0).unwrap().status.signal(), Some(libc::SIGKILL));
}

#[test]
fn a_whole_report_counts_as_a_failure_before_the_exit() {
    let group = Group::new();
    group
        .launch(vec![
            sh("exec sleep 30"),
            sh("printf '\\x03\\0\\0\\0\\0\\0\\0\\0ab' >&$TETHER_REPORT_FD; sleep 0.2; printf c >&$TETHER_REPORT_FD; exec sleep 30"),
        ])
        .unwrap();
    assert!(group.wait(None, WaitFor::AllExitedOrFailure, LIMIT));
    let (report, reported, failed, exit) = group
        .with_member(1, |m| {
            (
                m.report().to_vec(),
                m.reported_at(),
                m.failed_at(),
                m.exit(),
            )
        })
        .unwrap();
    assert_eq!(&report[8..], b"abc");
    assert!(reported.is_some() && failed == reported && exit.is_none());
    assert!(group.with_member(0, |m| m.failed_at()).unwrap().is_none());
    group.terminate(libc::SIGTERM, Duration::from_secs(5));
}
