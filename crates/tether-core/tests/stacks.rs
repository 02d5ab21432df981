//! Stacks on demand end to end, without Python: this binary is both the test and (run again
//! with `STACKS_HELPER` set) a child whose "dump handler" writes a fixed stack in several
//! pieces, as faulthandler writes its lines, wrapped by tether's marker handler.
//!
//! It has its own `main` (no test harness) so that the helper runs no test machinery.

mod common;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use tether_core::stacks::{self, Reply, Request};
use tether_core::{Group, LaunchSpec, WaitFor};

const HELPER: &str = "STACKS_HELPER";

fn main() {
    if std::env::var_os(HELPER).is_some() {
        helper_main();
    }
    let tests: [(&str, fn()); 4] = [
        (
            "every_child_answers_at_once_with_its_whole_stack",
            every_child_answers_at_once_with_its_whole_stack,
        ),
        (
            "a_child_without_a_handler_is_never_signalled",
            a_child_without_a_handler_is_never_signalled,
        ),
        (
            "a_stopped_child_is_reported_without_holding_up_the_others",
            a_stopped_child_is_reported_without_holding_up_the_others,
        ),
        (
            "a_late_dump_never_passes_for_a_later_answer",
            a_late_dump_never_passes_for_a_later_answer,
        ),
    ];
    for (name, test) in tests {
        print!("test {name} ... ");
        test();
        println!("ok");
    }
}

static FD: AtomicI32 = AtomicI32::new(-1);

/// The helper's stand-in for faulthandler: a few writes, one line each.
extern "C" fn fake_dump(_signal: libc::c_int) {
    let fd = FD.load(Ordering::SeqCst);
    for piece in [
        &b"Current thread 0x0001 (most recent call first):\n"[..],
        &b"  File \"helper.rs\", line 7 in stuck_here\n"[..],
        &b"  File \"helper.rs\", line 3 in main\n"[..],
    ] {
        // SAFETY: send on the fd the parent passed; async-signal-safe.
        unsafe { libc::send(fd, piece.as_ptr().cast(), piece.len(), libc::MSG_NOSIGNAL) };
    }
}

/// A child: installs the fake handler on the stacks channel, wraps it, and waits.
fn helper_main() -> ! {
    let value = std::env::var(stacks::FD_ENV).unwrap();
    let (fd, inode) = stacks::handler::parse_env_value(&value).unwrap();
    let fd: RawFd = stacks::handler::adopt(fd, Some(inode)).unwrap();
    FD.store(fd, Ordering::SeqCst);
    // SAFETY: installs a plain handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(
            stacks::signal(),
            fake_dump as *const () as libc::sighandler_t,
        )
    };
    stacks::handler::wrap(stacks::signal()).unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

fn launch(n: usize, helper: bool) -> Group {
    let argv: Vec<std::ffi::OsString> = if helper {
        vec![std::env::current_exe().unwrap().into()]
    } else {
        vec!["sleep".into(), "30".into()]
    };
    let specs = (0..n)
        .map(|_| LaunchSpec {
            env: vec![(HELPER.into(), "1".into())],
            stacks: true,
            ..LaunchSpec::new(argv.clone())
        })
        .collect();
    let group = Group::new();
    group.launch(specs).unwrap();
    group
}

fn request(timeout: Duration) -> Request {
    Request::new(timeout, None)
}

/// Asks until every member answers (their handlers are installed a moment after start).
fn ready(group: &Group) -> Vec<stacks::Answer> {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let answers = group.stacks(&request(Duration::from_secs(2))).unwrap();
        if answers.iter().all(|a| a.answered()) || Instant::now() > end {
            return answers;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stop(group: &Group) {
    group.terminate(libc::SIGKILL, Duration::ZERO);
    assert!(group.wait(None, WaitFor::AllExited, Some(Duration::from_secs(10))));
}

const WHOLE: &str = "Current thread 0x0001 (most recent call first):\n  File \"helper.rs\", \
                     line 7 in stuck_here\n  File \"helper.rs\", line 3 in main";

/// A whole dump from the signal handler: the helper's lines, then the line that says only
/// the interrupted thread is shown.
fn whole() -> String {
    format!("{WHOLE}\n{}", stacks::handler::ONE_THREAD)
}

fn every_child_answers_at_once_with_its_whole_stack() {
    let group = launch(8, true);
    let answers = ready(&group);
    for (i, answer) in answers.iter().enumerate() {
        assert_eq!(Some(answer.pid), group.pid(i));
        assert_eq!(answer.reply, Reply::Stack(whole()), "{answer:?}");
        assert_eq!(answer.text(Duration::from_secs(1)), whole().trim_end());
    }
    stop(&group);
}

fn a_child_without_a_handler_is_never_signalled() {
    let group = launch(1, false);
    let answer = &group.stacks(&request(Duration::from_secs(1))).unwrap()[0];
    assert_eq!(answer.reply, Reply::NoHandler);
    assert!(answer
        .text(Duration::from_secs(1))
        .contains("not a Python process started by tether's Python"));
    // The signal's default action would have ended it.
    assert!(common::alive(answer.pid));
    stop(&group);
}

fn a_stopped_child_is_reported_without_holding_up_the_others() {
    let group = launch(3, true);
    ready(&group);
    let stopped = group.pid(1).unwrap();
    // SAFETY: SIGSTOP to our own running child.
    unsafe { libc::kill(stopped, libc::SIGSTOP) };
    while common::status_field(stopped, "State").is_some_and(|s| !s.starts_with('T')) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    let answers = group.stacks(&request(Duration::from_millis(500))).unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(5),
        "{took:?}"
    );
    assert!(answers[0].answered() && answers[2].answered());
    assert_eq!(answers[1].reply, Reply::Silent { state: Some('T') });
    let text = answers[1].text(Duration::from_millis(500));
    assert!(
        text.contains(&format!("pid {stopped} did not answer within 0.5 s")),
        "{text}"
    );
    assert!(text.contains("stopped (state T)"), "{text}");
    stop(&group);
}

fn a_late_dump_never_passes_for_a_later_answer() {
    let group = launch(1, true);
    ready(&group);
    let pid = group.pid(0).unwrap();
    // SAFETY: SIGSTOP, then SIGCONT, to our own running child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    while common::status_field(pid, "State").is_some_and(|s| !s.starts_with('T')) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let first = group.stacks(&request(Duration::from_millis(200))).unwrap();
    assert!(!first[0].answered());
    // The pending request is served as the child goes on: its dump belongs to nobody now.
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    let second = group.stacks(&request(Duration::from_secs(5))).unwrap();
    assert_eq!(second[0].reply, Reply::Stack(whole()));
    stop(&group);
}
