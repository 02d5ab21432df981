//! Meeting points within one test process: each "process" is a claim of its own, with its
//! own sockets, as a rank would make.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use super::{claim, Claim, Meeting, Outcome, Waiter, Who};

fn name(test: &str) -> Vec<u8> {
    format!("tether-share-test.{}.{test}", std::process::id()).into_bytes()
}

const ME: Who = Who { rank: 0, pid: 1 };

fn build(name: &[u8]) -> io::Result<Meeting> {
    match claim(name, ME)? {
        Claim::Build(meeting) => Ok(meeting),
        Claim::Wait(_) => Err(io::Error::other("expected to build")),
    }
}

fn wait(name: &[u8]) -> io::Result<Waiter> {
    match claim(name, Who { rank: 1, pid: 2 })? {
        Claim::Wait(waiter) => Ok(waiter),
        Claim::Build(_) => Err(io::Error::other("expected to wait")),
    }
}

fn outcome(waiter: &mut Waiter) -> io::Result<Outcome> {
    for _ in 0..100 {
        if let Some(outcome) = waiter.wait(Duration::from_millis(50))? {
            return Ok(outcome);
        }
    }
    Err(io::Error::other("no outcome within 5 s"))
}

fn memfd(data: &[u8]) -> io::Result<OwnedFd> {
    crate::memfd::sealed_memfd("test data", &[data])
}

fn read(fd: &OwnedFd) -> io::Result<Vec<u8>> {
    let len = rustix::fs::fstat(fd)?.st_size as usize;
    crate::memfd::read_memfd(fd, len)
}

#[test]
fn the_first_claim_builds_and_the_others_wait_for_its_data() -> io::Result<()> {
    let name = name("first");
    let builder = build(&name)?;
    let mut waiter = wait(&name)?;
    assert!(waiter.wait(Duration::from_millis(100))?.is_none());
    assert_eq!(waiter.builder(), Some(ME));
    builder.publish(memfd(b"data")?);
    match outcome(&mut waiter)? {
        Outcome::Ready { memfd, from, .. } => {
            assert_eq!(read(&memfd)?, b"data");
            assert_eq!(from, ME);
        }
        other => return Err(io::Error::other(format!("{other:?}"))),
    }
    Ok(())
}

#[test]
fn a_late_asker_gets_the_data_from_a_holder_once_the_builder_is_gone() -> io::Result<()> {
    let name = name("late");
    let builder = build(&name)?;
    let mut waiter = wait(&name)?;
    builder.publish(memfd(b"late data")?);
    let holder = match outcome(&mut waiter)? {
        Outcome::Ready {
            memfd, listener, ..
        } => Meeting::hold(&name, listener, memfd, Who { rank: 1, pid: 2 })?,
        other => return Err(io::Error::other(format!("{other:?}"))),
    };
    drop(builder);
    let mut late = wait(&name)?;
    match outcome(&mut late)? {
        Outcome::Ready { memfd, from, .. } => {
            assert_eq!(read(&memfd)?, b"late data");
            assert_eq!(from.rank, 1);
        }
        other => return Err(io::Error::other(format!("{other:?}"))),
    }
    drop(holder);
    // The last holder is gone: so is the name, and the next claim builds.
    drop(build(&name)?);
    Ok(())
}

#[test]
fn a_failed_build_is_told_to_waiters_and_later_askers() -> io::Result<()> {
    let name = name("failed");
    let builder = build(&name)?;
    let mut waiter = wait(&name)?;
    builder.fail(b"report".to_vec());
    for mut w in [waiter_outcome_first(&mut waiter)?, wait(&name)?] {
        match outcome(&mut w)? {
            Outcome::Failed { report, from } => {
                assert_eq!(report, b"report");
                assert_eq!(from, ME);
            }
            other => return Err(io::Error::other(format!("{other:?}"))),
        }
    }
    builder.rebuild();
    let mut again = wait(&name)?;
    assert!(again.wait(Duration::from_millis(100))?.is_none());
    builder.publish(memfd(b"")?);
    assert!(matches!(outcome(&mut again)?, Outcome::Ready { .. }));
    Ok(())
}

/// The waiter itself, for a loop over waiters (it has its outcome pending).
fn waiter_outcome_first(waiter: &mut Waiter) -> io::Result<Waiter> {
    let conn = waiter.conn.as_fd().try_clone_to_owned()?;
    Ok(Waiter {
        conn: crate::channel::Endpoint::from_fd(conn),
        builder: None,
        builder_pidfd: None,
    })
}

#[test]
fn a_builder_that_goes_away_frees_the_name_for_a_waiter() -> io::Result<()> {
    let name = name("gone");
    let builder = build(&name)?;
    let mut waiter = wait(&name)?;
    assert!(waiter.wait(Duration::from_millis(100))?.is_none());
    drop(builder);
    match outcome(&mut waiter)? {
        // It is this live process: no exit status to tell.
        Outcome::BuilderDied { builder, status } => {
            assert_eq!(builder, ME);
            assert_eq!(status, None);
        }
        other => return Err(io::Error::other(format!("{other:?}"))),
    }
    drop(build(&name)?);
    Ok(())
}

#[test]
fn different_names_never_meet() -> io::Result<()> {
    let a = build(&name("job-a"))?;
    let b = build(&name("job-b"))?;
    drop((a, b));
    Ok(())
}

#[test]
fn the_vault_answers_once_every_rank_that_held_the_copy_is_gone() -> io::Result<()> {
    let job = format!("vault-test-{}", std::process::id());
    let name = super::meeting_name(&job, "imagenet");
    let vault = crate::share::vault::Vault::start(&job)?;
    let builder = build(&name)?;
    assert!(!builder.hand_over(&super::vault_name(&job))?); // nothing built yet
    builder.publish(memfd(b"kept")?);
    assert!(builder.hand_over(&super::vault_name(&job))?);
    for _ in 0..100 {
        if vault.held() == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(vault.held(), 1);
    drop(builder);
    let mut late = wait(&name)?;
    match outcome(&mut late)? {
        Outcome::Ready { memfd, from, .. } => {
            assert_eq!(read(&memfd)?, b"kept");
            assert_eq!(from.rank, -1);
        }
        other => return Err(io::Error::other(format!("{other:?}"))),
    }
    drop(late);
    drop(vault);
    drop(build(&name)?); // the job is over: the name is free
    Ok(())
}

#[test]
fn without_a_vault_a_hand_over_is_refused_quietly() -> io::Result<()> {
    let builder = build(&name("no-vault"))?;
    builder.publish(memfd(b"x")?);
    assert!(!builder.hand_over(&super::vault_name("no-such-job"))?);
    Ok(())
}

#[test]
fn names_hold_the_job_and_a_hash_of_the_key() {
    let a = super::meeting_name("123-abc", "imagenet");
    assert!(a.starts_with(b"tether-share/123-abc/"));
    assert_ne!(a, super::meeting_name("123-abd", "imagenet"));
    assert_ne!(a, super::meeting_name("123-abc", "imagenet2"));
    assert_eq!(super::vault_name("123-abc"), b"tether-share/123-abc/vault");
    let long = "x".repeat(200) + "/odd";
    let name = super::meeting_name(&long, "k");
    assert!(name.len() < 100 && !name[13..].contains(&b'x'));
    assert_ne!(
        super::vault_name(&long),
        super::vault_name(&("y".repeat(200) + "/odd"))
    );
}
