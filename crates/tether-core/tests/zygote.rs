//! The zygote protocol end to end, without Python: this binary is both the test and (run
//! again with `ZYGOTE_HELPER` set) a zygote that forks with a plain `clone(CLONE_PARENT)`.
//! Its children write what they got (rank, payload, umask, fds) to their report pipe.
//!
//! It has its own `main` (no test harness): a zygote must be single-threaded.

mod common;

use std::io::Read;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use tether_core::attrs::Attributes;
use tether_core::zygote::{self, ForkRequest, Served, Zygote};
use tether_core::{Group, LaunchSpec, WaitFor};

const HELPER: &str = "ZYGOTE_HELPER";
const LIMIT: Option<Duration> = Some(Duration::from_secs(30));

fn main() {
    if std::env::var_os(HELPER).is_some() {
        zygote_main();
    }
    let tests: [(&str, fn()); 4] = [
        (
            "ranks_get_their_part_of_a_request",
            ranks_get_their_part_of_a_request,
        ),
        ("hundreds_of_ranks_in_batches", hundreds_of_ranks_in_batches),
        (
            "blanks_are_followed_and_go_with_the_zygote",
            blanks_are_followed_and_go_with_the_zygote,
        ),
        (
            "a_stopped_zygote_fails_the_start",
            a_stopped_zygote_fails_the_start,
        ),
    ];
    for (name, test) in tests {
        print!("test {name} ... ");
        test();
        println!("ok");
    }
}

/// The zygote: serves requests; each child reports "rank umask payload fds" and exits.
fn zygote_main() -> ! {
    let fds = std::env::var(zygote::FDS_ENV).expect("zygote fds");
    let (request, notices) = fds.split_once(',').expect("two fds");
    let own = |fd: &str| {
        // SAFETY: the parent handed these fds to this process.
        unsafe { OwnedFd::from_raw_fd(fd.parse().expect("an fd")) }
    };
    let mut config = Vec::new();
    let payload_fd: i32 = std::env::var("TETHER_PAYLOAD_FD").unwrap().parse().unwrap();
    // SAFETY: as above.
    let mut payload = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(payload_fd) });
    payload.read_to_end(&mut config).unwrap();
    let blanks: usize = String::from_utf8(config).unwrap().trim().parse().unwrap();
    // SAFETY: this process is single-threaded (no test harness) and needs nothing around a
    // fork.
    let mut fork = || unsafe { zygote::clone_parent() };
    // SAFETY: getppid cannot fail.
    let parent = unsafe { libc::getppid() };
    let served = zygote::serve(
        own(request),
        own(notices),
        parent,
        b"ready",
        (blanks, std::time::Duration::ZERO),
        &mut fork,
    );
    match served {
        Ok(Served::Child(job)) => {
            let payload = job.read_payload().unwrap();
            let line = format!(
                "{} {:o} {} {:?}",
                job.rank,
                umask(),
                String::from_utf8_lossy(&payload),
                common::fds(std::process::id() as i32),
            );
            let _ = rustix::io::write(&job.report, line.as_bytes());
            std::process::exit(0)
        }
        Ok(Served::Exit(code)) => std::process::exit(code),
        Err(_) => std::process::exit(1),
    }
}

fn umask() -> u32 {
    // SAFETY: reads and restores this process's umask.
    unsafe {
        let old = libc::umask(0);
        libc::umask(old);
        old
    }
}

fn start(blanks: usize) -> Zygote {
    let exe = std::env::current_exe().unwrap();
    let mut spec = LaunchSpec::new([exe]);
    spec.env.push((HELPER.into(), "1".into()));
    spec.payload = Some(blanks.to_string().into_bytes());
    let mut zygote = Zygote::start(spec).unwrap();
    assert_eq!(zygote.wait_ready().unwrap(), b"ready");
    zygote
}

fn fork(
    zygote: &mut Zygote,
    ranks: &[u32],
    shared: &[(std::os::fd::BorrowedFd<'_>, i32)],
) -> Group {
    let group = Group::new();
    let request = ForkRequest {
        ranks,
        shared,
        payload: b"the payload",
        attrs: Attributes::of_caller().unwrap(),
    };
    let indices = zygote.fork(&request, &group).unwrap();
    assert_eq!(indices, (0..ranks.len()).collect::<Vec<_>>());
    assert!(group.wait(None, WaitFor::AllExited, LIMIT));
    group
}

fn reports(group: &Group) -> Vec<String> {
    (0..group.len())
        .map(|i| {
            group
                .with_member(i, |m| String::from_utf8_lossy(m.report()).into_owned())
                .unwrap()
        })
        .collect()
}

fn ranks_get_their_part_of_a_request() {
    let mut zygote = start(2);
    // SAFETY: umask only sets a process attribute; restored below.
    let old = unsafe { libc::umask(0o027) };
    let extra = std::fs::File::open("/dev/null").unwrap();
    let shared = [(extra.as_fd(), 40)];
    let group = fork(&mut zygote, &[7, 3, 5], &shared);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    for (i, report) in reports(&group).iter().enumerate() {
        let rank = [7, 3, 5][i];
        assert!(
            report.starts_with(&format!("{rank} 27 the payload ")),
            "{report}"
        );
        // The shared fd at its number; the zygote's own fds are gone.
        assert!(report.contains(", 40"), "{report}");
        assert_eq!(
            group.exit(i).unwrap().status,
            tether_core::ExitStatus::Exited(0)
        );
    }
    zygote.close(Duration::from_secs(5));
}

fn hundreds_of_ranks_in_batches() {
    let mut zygote = start(4);
    let ranks: Vec<u32> = (0..300).collect();
    let group = fork(&mut zygote, &ranks, &[]);
    let mut seen: Vec<u32> = reports(&group)
        .iter()
        .map(|r| r.split(' ').next().unwrap().parse().unwrap())
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, ranks);
    zygote.close(Duration::from_secs(5));
}

fn blanks_are_followed_and_go_with_the_zygote() {
    let mut zygote = start(3);
    assert!(common::eventually(Duration::from_secs(10), || zygote
        .blanks()
        .len()
        == 3));
    let blanks = zygote.blanks();
    // A blank that dies is reaped at once: never a zombie.
    // SAFETY: killing our own blank child.
    unsafe { libc::kill(blanks[0], libc::SIGKILL) };
    assert!(common::eventually(Duration::from_secs(5), || common::gone(
        blanks[0]
    )));
    zygote.close(Duration::from_secs(5));
    for pid in &blanks[1..] {
        assert!(common::eventually(Duration::from_secs(5), || common::gone(
            *pid
        )));
    }
}

fn a_stopped_zygote_fails_the_start() {
    let mut zygote = start(0);
    let pid = zygote.pid();
    // SAFETY: stopping our own child.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let began = Instant::now();
    let request = ForkRequest {
        ranks: &[0],
        shared: &[],
        payload: b"",
        attrs: Attributes::of_caller().unwrap(),
    };
    let err = zygote.fork(&request, &Group::new()).unwrap_err();
    assert!(began.elapsed() < Duration::from_secs(10));
    let text = err.to_string();
    assert!(
        text.contains(&format!("pid {pid}")) && text.contains("stopped"),
        "{text}"
    );
    assert!(!zygote.usable(&Attributes::of_caller().unwrap()));
    assert!(common::eventually(Duration::from_secs(5), || common::gone(
        pid
    )));
}
