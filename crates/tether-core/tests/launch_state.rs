//! The state a child starts in, whatever the parent's: run alone in this test binary
//! because it changes the signal state of the whole process.

mod common;

use std::os::fd::AsRawFd;
use std::time::Duration;

use tether_core::{Group, LaunchSpec, WaitFor};

#[test]
fn child_starts_clean_in_its_own_group() {
    // The parent ignores SIGINT (as a background job of a non-interactive shell does) and
    // blocks SIGTERM and SIGUSR1 in the thread that first starts the warden, so that the
    // warden thread inherits that mask.
    // SAFETY: plain signal-state calls on this test process.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    // Two fds the parent holds: one inheritable (no CLOEXEC) and not asked for, one asked for.
    let stray = std::fs::File::open("/dev/null").unwrap();
    // SAFETY: dup of an open fd, owned by the test until the end.
    let stray_inheritable = unsafe { libc::dup(stray.as_raw_fd()) };
    let kept = std::fs::File::open("/dev/zero").unwrap();

    let group = Group::new();
    let mut spec = LaunchSpec::new(["sleep", "30"]);
    spec.keep_fds = vec![kept.as_raw_fd()];
    let idx = group.launch(vec![spec]).unwrap()[0];
    let pid = group.pid(idx).unwrap();
    common::wait_exec(pid, "sleep");

    assert_eq!(
        common::pgid(pid),
        Some(pid),
        "child leads its own process group"
    );
    assert_eq!(
        common::status_field(pid, "SigIgn").unwrap(),
        "0000000000000000"
    );
    assert_eq!(
        common::status_field(pid, "SigBlk").unwrap(),
        "0000000000000000"
    );
    // The kernel names the new program before it closes the close-on-exec fds, and the
    // program opens files of its own as it starts (the loader's cache, its libraries): give
    // it time to settle, on a busy machine too.
    let expected = vec![0, 1, 2, kept.as_raw_fd()];
    common::eventually(Duration::from_secs(20), || common::fds(pid) == expected);
    assert_eq!(common::fds(pid), expected);
    assert!(!common::fds(pid).contains(&stray_inheritable));

    // SIGTERM to the group stops it, though the parent ignores SIGINT and blocks SIGTERM.
    group.terminate(libc::SIGTERM, Duration::from_secs(5));
    let exit = group.exit(idx).unwrap();
    assert_eq!(exit.status.signal(), Some(libc::SIGTERM));
    assert!(group.wait(None, WaitFor::AllExited, Some(Duration::ZERO)));
    assert!(common::gone(pid), "child reaped");
    // SAFETY: closing the fd dup'd above.
    unsafe { libc::close(stray_inheritable) };
}
