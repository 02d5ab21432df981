//! The parent killed with SIGKILL takes its children with it, even children that ignore
//! SIGINT and SIGTERM and were launched from a thread that has since ended.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use tether_core::{Group, LaunchSpec};

const HELPER: &str = "TETHER_TEST_PARENT_HELPER";

/// Not a test of its own: the parent process of `children_die_with_their_parent`.
#[test]
fn helper_parent() {
    if std::env::var_os(HELPER).is_none() {
        return;
    }
    // Like a background job of a non-interactive shell.
    // SAFETY: changing this helper process's own dispositions.
    unsafe { libc::signal(libc::SIGINT, libc::SIG_IGN) };
    let group = Group::new();
    let g = group.clone();
    std::thread::spawn(move || {
        let spec = LaunchSpec::new(["sh", "-c", "trap '' INT TERM HUP; exec sleep 60"]);
        g.launch(vec![spec.clone(), spec]).unwrap();
    })
    .join()
    .unwrap();
    println!("\nPIDS {} {}", group.pid(0).unwrap(), group.pid(1).unwrap());
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn children_die_with_their_parent() {
    let mut helper = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "helper_parent",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER, "1")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut out = BufReader::new(helper.stdout.take().unwrap());
    while !line.starts_with("PIDS ") {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "helper exited early");
    }
    let pids: Vec<i32> = line
        .split_whitespace()
        .skip(1)
        .map(|w| w.parse().unwrap())
        .collect();
    for &pid in &pids {
        common::wait_exec(pid, "sleep");
    }
    helper.kill().unwrap();
    helper.wait().unwrap();
    for pid in pids {
        assert!(
            common::eventually(Duration::from_secs(1), || !common::alive(pid)),
            "child {pid} outlived its parent"
        );
    }
}
