//! `tether top PID` for a process that started its ranks itself (`tether.spawn`,
//! `start_processes`): such a process listens on the abstract Unix socket
//! `tether-top/{pid}` (nothing on disk; the name goes with the process), from a thread of
//! its own started with its first group of ranks. Whoever connects, if of this user or root
//! (`SO_PEERCRED`), gets one [`Place`] line per rank of every group still held (rank 0.. of
//! each, in the order the groups started), then an empty line. The stacks are asked as
//! `ProcessContext.stacks()` asks them, one request at a time in the process.
//!
//! A child forked from the process does not listen: its copy of the socket is closed in the
//! child (`pthread_atfork`), and the groups it inherited are not its to ask.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use super::places::{Place, Since};
use super::{place, Request};
use crate::group::{Group, WeakGroup};

/// How long the ranks have to answer one request.
pub const TIMEOUT: Duration = Duration::from_secs(2);

/// How long a reply may take to be written.
const WRITE_LIMIT: Duration = Duration::from_secs(5);

/// The groups whose members are this process's ranks, and the pid they belong to (a forked
/// child's inherited list is not its own).
static GROUPS: Mutex<(i32, Vec<WeakGroup>)> = Mutex::new((0, Vec::new()));

/// The pid of the process whose thread listens (0: none), and the listening fd (-1: none).
static SERVING: AtomicI32 = AtomicI32::new(0);
static LISTENER: AtomicI32 = AtomicI32::new(-1);

/// Where each rank was seen.
static SINCE: Since = Since::new();

static AT_FORK: Once = Once::new();

fn address(pid: i32) -> std::io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("tether-top/{pid}").as_bytes())
}

/// Makes the members of `group` answer `tether top` as ranks of this process, listening
/// from now on if this process does not yet.
pub fn serve(group: &Group) -> std::io::Result<()> {
    let me = std::process::id() as i32;
    {
        let mut groups = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
        if groups.0 != me {
            *groups = (me, Vec::new());
        }
        groups.1.retain(|g| g.upgrade().is_some());
        groups.1.push(group.downgrade());
    }
    if SERVING.load(Ordering::SeqCst) == me {
        return Ok(());
    }
    // SAFETY: registers a handler that only closes an fd and stores atomics, which is
    // async-signal-safe in a forked child.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(after_fork_in_child));
    });
    let listener = UnixListener::bind_addr(&address(me)?)?;
    LISTENER.store(listener.as_raw_fd(), Ordering::SeqCst);
    SERVING.store(me, Ordering::SeqCst);
    std::thread::Builder::new()
        .name("tether-top".into())
        .spawn(move || listen(&listener))
        .map(drop)
}

extern "C" fn after_fork_in_child() {
    let fd = LISTENER.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: the child's copy of the listening socket, which no one else in the
        // child uses (the thread that did was not forked).
        unsafe { libc::close(fd) };
    }
    SERVING.store(0, Ordering::SeqCst);
}

fn listen(listener: &UnixListener) {
    loop {
        let mut stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionAborted => continue,
            Err(err) => {
                log::info!(target: "tether::stacks", "tether top: no longer listening: {err}");
                return;
            }
        };
        if peer(&stream).is_some_and(|(_, uid)| ours(uid)) {
            let _ = stream.set_write_timeout(Some(WRITE_LIMIT));
            let _ = stream.write_all(&reply());
        }
    }
}

/// The peer's pid and uid.
fn peer(stream: &UnixStream) -> Option<(i32, u32)> {
    let cred = rustix::net::sockopt::socket_peercred(stream.as_fd()).ok()?;
    Some((cred.pid.as_raw_nonzero().get(), cred.uid.as_raw()))
}

fn ours(uid: u32) -> bool {
    uid == rustix::process::geteuid().as_raw() || uid == 0
}

/// Every rank's place line, then an empty line.
fn reply() -> Vec<u8> {
    let groups: Vec<Group> = {
        let held = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
        held.1.iter().filter_map(WeakGroup::upgrade).collect()
    };
    let mut ranks = Vec::new();
    for group in &groups {
        let answers = group
            .stacks(&Request::new(TIMEOUT, None))
            .unwrap_or_default();
        ranks.extend(
            answers
                .iter()
                .enumerate()
                .map(|(rank, answer)| (rank, answer.pid, place(answer))),
        );
    }
    let mut out: String = SINCE
        .note(Instant::now(), &ranks)
        .iter()
        .map(Place::line)
        .collect();
    out.push('\n');
    out.into_bytes()
}

/// Asks the process `pid` where its ranks are, waiting up to `wait`: `Ok(None)` when it
/// started no ranks that answer `tether top` (nothing listens), or did not reply in time.
pub fn ask(pid: i32, wait: Duration) -> std::io::Result<Option<Vec<Place>>> {
    let mut stream = match UnixStream::connect_addr(&address(pid)?) {
        Ok(stream) => stream,
        Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(None),
        Err(err) => return Err(err),
    };
    if !peer(&stream).is_some_and(|(from, uid)| from == pid && ours(uid)) {
        return Ok(None);
    }
    stream.set_read_timeout(Some(wait))?;
    let mut bytes = Vec::new();
    if stream.read_to_end(&mut bytes).is_err() || !bytes.ends_with(b"\n\n") && bytes != b"\n" {
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&bytes);
    Ok(Some(text.lines().filter_map(Place::parse).collect()))
}
