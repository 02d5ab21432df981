//! The worker set against real worker processes: this test binary, started again in worker
//! mode (`worker_main`), serving tasks whose bytes say what to do.

use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd};

use std::io;

use rustix::io::Errno;

use super::end::{Incoming, IncomingTask, WorkerEnd};
use super::error::WorkersError;
use super::lease::LeaseEnd;
use super::set::{wait_exit, WorkerSet};
use super::types::{Config, Crash, Death, Event, Link, Task};
use super::wait::Waited;
use super::wire::Kind;
use crate::group::Group;
use crate::launch::LaunchSpec;

const WORKER_ENV: &str = "TETHER_TEST_WORKER_FDS";

/// In worker mode, serves tasks until the pool closes the link: `echo:X` answers `X`,
/// `hold:X` answers `X` only at the end of its batch, `sleep:MS` sleeps then answers,
/// `abort` dies of SIGABRT, `step:N` reaches item N and dies, `exit:N` exits with N; a lease
/// sleeps for the milliseconds its bytes give, then reports exit code 0; `notes` answers the
/// notes received so far, joined by commas.
#[test]
fn worker_main() {
    let Ok(fds) = std::env::var(WORKER_ENV) else {
        return;
    };
    let mut fds = fds.split(',').filter_map(|f| f.parse::<i32>().ok());
    let (Some(ctl), Some(gate)) = (fds.next(), fds.next()) else {
        std::process::exit(2);
    };
    // SAFETY: the pool passed these fds to this process, which owns them from now on.
    let (ctl, gate) = unsafe { (OwnedFd::from_raw_fd(ctl), OwnedFd::from_raw_fd(gate)) };
    let Ok(end) = WorkerEnd::new(ctl, gate, Duration::from_micros(100)) else {
        std::process::exit(3);
    };
    let _ = end.hello(std::process::id() as i32);
    let mut notes = Vec::new();
    loop {
        match end.recv(None) {
            Ok(Incoming::Batch(tasks)) => serve_batch(&end, tasks, &notes),
            Ok(Incoming::Note(data)) => notes.push(String::from_utf8_lossy(&data).into_owned()),
            Ok(Incoming::Lease { id, data, .. }) => {
                let ms = String::from_utf8_lossy(&data).parse().unwrap_or(0);
                std::thread::sleep(Duration::from_millis(ms));
                let _ = end.send_done(id, 0);
            }
            _ => std::process::exit(0),
        }
    }
}

fn serve_batch(end: &WorkerEnd, tasks: Vec<IncomingTask>, notes: &[String]) {
    let mut held: Vec<(u64, String)> = Vec::new();
    for task in tasks {
        if !end.start(task.seq, task.id) {
            let _ = end.send_results(&[(task.id, Kind::Skipped, b"", vec![])]);
            continue;
        }
        let text = String::from_utf8_lossy(&task.data).into_owned();
        let answer = match text.split_once(':') {
            Some(("echo", x)) => x.to_string(),
            Some(("sleep", ms)) => {
                std::thread::sleep(Duration::from_millis(ms.parse().unwrap_or(0)));
                text.clone()
            }
            Some(("exit", code)) => std::process::exit(code.parse().unwrap_or(1)),
            Some(("step", item)) => {
                end.step(item.parse().unwrap_or(0));
                std::process::abort()
            }
            Some(("hold", x)) => {
                held.push((task.id, x.to_string()));
                continue;
            }
            _ if text == "abort" => std::process::abort(),
            _ if text == "notes" => notes.join(","),
            _ => text.clone(),
        };
        let _ = end.send_results(&[(task.id, Kind::Ok, answer.as_bytes(), vec![])]);
    }
    for (id, answer) in held {
        let _ = end.send_results(&[(id, Kind::Ok, answer.as_bytes(), vec![])]);
    }
    end.idle();
}

/// Starts a worker process in `slot`.
fn start_worker(set: &WorkerSet, slot: usize) -> Result<i32, WorkersError> {
    let link = Link::new()?;
    let (ctl, gate) = link.child_fds();
    let (ctl, gate) = (ctl.as_raw_fd(), gate.as_raw_fd());
    let exe = std::env::current_exe()?;
    let mut spec = LaunchSpec::new([
        exe.into_os_string(),
        "workers::tests::worker_main".into(),
        "--exact".into(),
        "--nocapture".into(),
        "--quiet".into(),
    ]);
    spec.env
        .push((WORKER_ENV.into(), format!("{ctl},{gate}").into()));
    spec.keep_fds = vec![ctl, gate];
    let group = Group::new();
    group
        .launch(vec![spec])
        .map_err(|e| io::Error::other(e.to_string()))?;
    set.add(slot, link, group, 0)
}

fn pool(n: usize) -> Result<WorkerSet, WorkersError> {
    let set = WorkerSet::new(Config::default())?;
    for slot in 0..n {
        start_worker(&set, slot)?;
    }
    Ok(set)
}

fn task(id: u64, text: &str) -> Task {
    Task {
        id,
        data: text.as_bytes().to_vec(),
        fds: Vec::new(),
    }
}

/// Polls until `done` says enough events came (at most 20 s); returns them all.
fn collect(
    set: &WorkerSet,
    mut done: impl FnMut(&[Event]) -> bool,
) -> Result<Vec<Event>, WorkersError> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut all = Vec::new();
    while !done(&all) {
        assert!(
            Instant::now() < deadline,
            "timed out; events so far: {all:?}"
        );
        all.extend(set.poll(Some(Duration::from_millis(100)))?);
    }
    Ok(all)
}

fn answers(events: &[Event]) -> Vec<(u64, String)> {
    let mut out: Vec<(u64, String)> = events
        .iter()
        .flat_map(|e| match e {
            Event::Results { outcomes, .. } => outcomes
                .iter()
                .map(|o| (o.id, String::from_utf8_lossy(&o.data).into_owned()))
                .collect(),
            _ => Vec::new(),
        })
        .collect();
    out.sort();
    out
}

fn deaths(events: &[Event]) -> Vec<&Death> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Died(d) => Some(d),
            _ => None,
        })
        .collect()
}

#[test]
fn notes_come_in_order_before_what_follows_and_nothing_answers_them() -> Result<(), WorkersError> {
    let set = pool(1)?;
    collect(&set, |e| e.iter().any(|e| matches!(e, Event::Ready { .. })))?;
    assert!(set.note(0, b"a"));
    assert!(set.note(0, b"b"));
    assert!(!set.note(1, b"c"), "no worker in slot 1");
    set.submit(vec![task(1, "notes")])?;
    let events = collect(&set, |e| answers(e).len() == 1)?;
    assert_eq!(answers(&events), [(1, "a,b".to_string())]);
    assert!(!set.busy());
    let _closing = set.close(false, Duration::from_secs(5));
    assert!(!set.note(0, b"d"), "the set is closed");
    Ok(())
}

#[test]
fn tasks_are_spread_and_answered() -> Result<(), WorkersError> {
    let set = pool(2)?;
    let ready = |e: &[Event]| {
        e.iter()
            .filter(|e| matches!(e, Event::Ready { .. }))
            .count()
    };
    collect(&set, |e| ready(e) == 2)?;
    set.submit((1..=500).map(|i| task(i, &format!("echo:{i}"))).collect())?;
    let events = collect(&set, |e| answers(e).len() == 500)?;
    let got = answers(&events);
    assert!(got.iter().all(|(id, text)| text == &id.to_string()));
    let by_worker: HashSet<usize> = events
        .iter()
        .filter_map(|e| match e {
            Event::Results { slot, .. } => Some(*slot),
            _ => None,
        })
        .collect();
    assert_eq!(by_worker.len(), 2, "both workers served");
    assert!(!set.busy());
    let closing = set.close(false, Duration::from_secs(5));
    assert!(closing.tasks.is_empty());
    Ok(())
}

#[test]
fn a_death_fails_the_running_task_and_requeues_the_unstarted() -> Result<(), WorkersError> {
    let set = pool(1)?;
    let pid = set.pids()[0];
    // One message: the worker answers 1, dies in 2, never starts 3 and 4.
    set.submit(vec![
        task(1, "echo:a"),
        task(2, "abort"),
        task(3, "echo:c"),
        task(4, "echo:d"),
    ])?;
    let events = collect(&set, |e| !deaths(e).is_empty())?;
    let death = deaths(&events)[0];
    assert_eq!(death.pid, pid);
    assert_eq!(death.status.signal(), Some(libc::SIGABRT));
    assert!(death.ready);
    assert_eq!(death.crashed, Some(Crash { id: 2, item: 0 }));
    assert!(death.lost.is_empty());
    assert_eq!(answers(&events), vec![(1, "a".to_string())]);
    assert!(set.busy(), "3 and 4 wait for a worker");
    assert_eq!(set.queued(), 2, "queued, sent to no worker");
    let fresh = start_worker(&set, 0)?;
    assert_ne!(fresh, pid);
    let events = collect(&set, |e| answers(e).len() == 2)?;
    assert_eq!(answers(&events), vec![(3, "c".into()), (4, "d".into())]);
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn results_sent_before_a_death_arrive_though_the_worker_left_messages_unread(
) -> Result<(), WorkersError> {
    let set = pool(1)?;
    collect(&set, |e| e.iter().any(|e| matches!(e, Event::Ready { .. })))?;
    // Two messages in flight: [1, 2, abort] and [4, 5, 6], the second never read. The
    // kernel then reports ECONNRESET ahead of the results 1 and 2.
    let texts = ["echo:1", "echo:2", "abort", "echo:4", "echo:5", "echo:6"];
    set.submit((1..=6).zip(texts).map(|(i, t)| task(i, t)).collect())?;
    // Nobody reads meanwhile: the results wait in the socket when the worker dies.
    std::thread::sleep(Duration::from_millis(300));
    let events = collect(&set, |e| !deaths(e).is_empty())?;
    assert_eq!(answers(&events), vec![(1, "1".into()), (2, "2".into())]);
    assert_eq!(deaths(&events)[0].crashed.map(|c| c.id), Some(3));
    start_worker(&set, 0)?;
    let events = collect(&set, |e| answers(e).len() == 3)?;
    assert_eq!(answers(&events).len(), 3);
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn a_death_tells_the_item_reached_and_the_results_lost() -> Result<(), WorkersError> {
    let set = pool(1)?;
    set.submit(vec![
        task(1, "hold:a"),
        task(2, "step:7"),
        task(3, "echo:c"),
    ])?;
    let events = collect(&set, |e| !deaths(e).is_empty())?;
    let death = deaths(&events)[0];
    assert_eq!(death.crashed, Some(Crash { id: 2, item: 7 }));
    assert_eq!(death.lost, vec![1]);
    assert!(answers(&events).is_empty());
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn fds_travel_with_tasks_and_results() -> Result<(), WorkersError> {
    let set = pool(1)?;
    let (r, w) = rustix::pipe::pipe()?;
    rustix::io::write(&w, b"through")?;
    set.submit(vec![Task {
        id: 1,
        data: b"echo:x".to_vec(),
        fds: vec![r],
    }])?;
    let events = collect(&set, |e| answers(e).len() == 1)?;
    assert_eq!(answers(&events), vec![(1, "x".into())]);
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn unstarted_tasks_are_cancelled_wherever_they_wait() -> Result<(), WorkersError> {
    let set = pool(1)?;
    set.submit(vec![task(1, "sleep:300")])?;
    // Wait until the worker runs task 1, then queue more: 2 and 3 go to its socket (the
    // window), the rest stay here.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !set.started(1) {
        assert!(Instant::now() < deadline);
        set.poll(Some(Duration::from_millis(5)))?;
    }
    set.submit((2..=6).map(|i| task(i, &format!("echo:{i}"))).collect())?;
    assert!(
        set.cancel(&[1]).is_empty(),
        "a running task cannot be cancelled"
    );
    let mut cancelled = set.cancel_all();
    cancelled.sort();
    assert_eq!(cancelled, vec![2, 3, 4, 5, 6]);
    let events = collect(&set, |e| !answers(e).is_empty())?;
    assert_eq!(answers(&events), vec![(1, "sleep:300".into())]);
    // The skipped tasks leave nothing in flight.
    let deadline = Instant::now() + Duration::from_secs(20);
    while set.busy() {
        assert!(Instant::now() < deadline);
        set.poll(Some(Duration::from_millis(50)))?;
    }
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn cancelling_in_order_lets_every_task_before_the_last_started_one_run() -> Result<(), WorkersError>
{
    let set = pool(2)?;
    let ready = |e: &[Event]| {
        e.iter()
            .filter(|e| matches!(e, Event::Ready { .. }))
            .count()
    };
    collect(&set, |e| ready(e) == 2)?;
    // Worker A runs task 1 for long, 4 and 5 waiting behind it; worker B runs 2 and 3,
    // then starts 6 (7 waits behind it, 8 and 9 here): 4 and 5 must run though not started.
    set.submit(vec![task(1, "sleep:1500")])?;
    let later = [
        (2, "sleep:20"),
        (3, "sleep:20"),
        (4, "echo:4"),
        (5, "echo:5"),
    ];
    let later = later
        .iter()
        .chain(&[(6, "sleep:300"), (7, "echo:7"), (8, "echo:8")]);
    set.submit(
        later
            .chain(&[(9, "echo:9")])
            .map(|(i, t)| task(*i, t))
            .collect(),
    )?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut events = Vec::new();
    while !set.started(6) {
        assert!(Instant::now() < deadline && !set.started(4), "{events:?}");
        events.extend(set.poll(Some(Duration::from_millis(5)))?);
    }
    let mut cancelled = set.cancel_after_started();
    cancelled.sort();
    assert_eq!(cancelled, vec![7, 8, 9]);
    events.extend(collect(&set, |e| {
        answers(e).len() + answers(&events).len() == 6
    })?);
    let ran: Vec<u64> = answers(&events).into_iter().map(|(id, _)| id).collect();
    assert_eq!(ran, vec![1, 2, 3, 4, 5, 6]);
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn leased_workers_take_no_tasks_and_end_their_lease() -> Result<(), WorkersError> {
    let set = pool(2)?;
    let slots = set
        .reserve(1)
        .map_err(|n| io::Error::other(format!("{n} free")))?;
    assert_eq!(set.reserve(2), Err(1));
    let lease = set.lease(slots[0], 100, b"200", &[])?;
    assert_eq!(lease.end(), None);
    set.submit((1..=20).map(|i| task(i, &format!("echo:{i}"))).collect())?;
    let events = collect(&set, |e| answers(e).len() == 20)?;
    assert!(events
        .iter()
        .all(|e| !matches!(e, Event::Results { slot, .. } if *slot == slots[0])));
    collect(&set, |e| {
        e.iter().any(|e| matches!(e, Event::LeaseEnded { .. }))
    })?;
    assert_eq!(
        lease.wait(Some(Duration::ZERO)),
        Some(LeaseEnd {
            code: 0,
            died: false
        })
    );
    // A lease whose worker is killed ends with the worker's status.
    let lease = set.lease(slots[0], 101, b"10000", &[])?;
    assert!(set.signal_lease(&lease, libc::SIGKILL)?);
    let events = collect(&set, |e| !deaths(e).is_empty())?;
    assert_eq!(deaths(&events)[0].lease.as_ref().map(|l| l.id()), Some(101));
    assert_eq!(
        lease.end(),
        Some(LeaseEnd {
            code: -libc::SIGKILL,
            died: true
        })
    );
    assert!(!set.signal_lease(&lease, libc::SIGKILL)?);
    set.close(false, Duration::from_secs(5));
    Ok(())
}

#[test]
fn close_returns_what_was_never_answered_and_stops_every_worker() -> Result<(), WorkersError> {
    let set = pool(1)?;
    let pid = rustix::process::Pid::from_raw(set.pids()[0]).ok_or(Errno::SRCH)?;
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())?;
    set.submit(vec![task(1, "sleep:10000"), task(2, "echo:x")])?;
    let slots = set.reserve(1);
    assert!(slots.is_ok());
    let started = Instant::now();
    let closing = set.close(false, Duration::from_millis(200));
    assert!(started.elapsed() < Duration::from_secs(5));
    let mut tasks = closing.tasks;
    tasks.sort();
    assert_eq!(tasks, vec![1, 2]);
    assert!(matches!(
        set.submit(vec![task(3, "x")]),
        Err(WorkersError::Closed)
    ));
    assert!(matches!(
        set.poll(Some(Duration::ZERO)),
        Err(WorkersError::Closed)
    ));
    assert!(
        wait_exit(pidfd.as_fd(), Some(Instant::now())),
        "the worker has exited"
    );
    Ok(())
}

#[test]
fn a_waiting_thread_takes_its_result_and_leaves_the_rest_to_poll() -> Result<(), WorkersError> {
    let set = pool(1)?;
    collect(&set, |e| e.iter().any(|e| matches!(e, Event::Ready { .. })))?;
    set.submit(vec![task(1, "sleep:100"), task(2, "echo:b")])?;
    assert!(matches!(
        set.wait_for(99, Some(Duration::ZERO))?,
        Waited::Elsewhere
    ));
    let Waited::Outcome(outcome) = set.wait_for(2, Some(Duration::from_secs(20)))? else {
        panic!("no outcome for task 2");
    };
    assert_eq!((outcome.id, outcome.data.as_slice()), (2, &b"b"[..]));
    // Task 1's result came on the same socket: poll hands it out.
    let events = set.poll(Some(Duration::ZERO))?;
    assert_eq!(answers(&events), vec![(1, "sleep:100".into())]);
    assert!(!set.busy());
    set.close(false, Duration::from_secs(5));
    Ok(())
}
