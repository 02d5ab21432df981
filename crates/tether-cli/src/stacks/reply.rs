//! The way back from `tether run` to `tether stacks PID`: the stacks reach the one who
//! asked, as well as the job's stderr.
//!
//! - The asker listens on an abstract Unix socket named `tether-stacks/{pid}/{nonce}` (a
//!   random nonce; the name vanishes with the socket, nothing is left on disk), then sends
//!   the stack signal queued (`sigqueue`) with the value `pid << 32 | nonce`. A nonce with its
//!   top bit set asks quietly (`tether top`): the block is not printed on the job's stderr
//!   unless someone else asked for it too.
//! - The keeper forwards that value with the signal to the supervisor; the supervisor,
//!   reading its signalfd, notes the asker ([`note`]).
//! - Once a block of stacks is ready (a request's, or one already being collected), the
//!   supervisor connects to every asker noted, checks that the listener is that asker
//!   (`SO_PEERCRED`: its pid, and this user or root), and writes the reply ([`Reply`]): a
//!   header of `silent RANK PID` lines (the ranks that did not answer) and `place RANK PID
//!   SECONDS WHERE` lines (each rank's place, and for how long the launcher has seen it
//!   there), or one `error ...` line, an empty line, then the block as the job's stderr shows
//!   it.
//! - A reply never holds up the launcher: each write has a time limit, and an asker gone
//!   meanwhile is skipped.

use std::hash::{BuildHasher, Hasher};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tether_core::stacks;
pub use tether_core::stacks::places::Place;

/// How long the launcher tries to hand a reply to one asker.
const WRITE_LIMIT: Duration = Duration::from_secs(5);

/// One who asked for the stacks and waits for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asker {
    pid: u32,
    nonce: u32,
}

/// The nonce's bit that asks quietly.
const QUIET: u32 = 1 << 31;

impl Asker {
    /// This process, with a new random nonce (with [`QUIET`] when `quiet`).
    fn new(quiet: bool) -> Asker {
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let nonce = (random as u32 & !QUIET).max(1);
        Asker {
            pid: std::process::id(),
            nonce: if quiet { nonce | QUIET } else { nonce },
        }
    }

    /// Whether it asked quietly (the block is for it alone, not for the job's stderr).
    pub fn quiet(self) -> bool {
        self.nonce & QUIET != 0
    }

    /// The asker a signal's queued value names (`None` for a plain signal).
    pub fn from_value(value: u64) -> Option<Asker> {
        let (pid, nonce) = ((value >> 32) as u32, value as u32);
        (pid > 0 && nonce > 0).then_some(Asker { pid, nonce })
    }

    /// The value queued with the signal.
    pub fn value(self) -> u64 {
        (u64::from(self.pid) << 32) | u64::from(self.nonce)
    }

    fn address(self) -> std::io::Result<SocketAddr> {
        let name = format!("tether-stacks/{}/{}", self.pid, self.nonce);
        SocketAddr::from_abstract_name(name.as_bytes())
    }
}

/// The askers noted, yet to get a reply.
static ASKERS: Mutex<Vec<Asker>> = Mutex::new(Vec::new());

/// Notes the asker of a stack signal read from a signalfd, if it was queued by one.
pub fn note(info: &libc::signalfd_siginfo) {
    if info.ssi_signo as i32 != stacks::signal() || info.ssi_code != libc::SI_QUEUE {
        return;
    }
    if let Some(asker) = Asker::from_value(info.ssi_ptr) {
        if let Ok(mut askers) = ASKERS.lock() {
            askers.push(asker);
        }
    }
}

/// Whether some asker noted (and not answered yet) wants the block on the job's stderr too;
/// false when there is none.
pub fn any_loud() -> bool {
    ASKERS
        .lock()
        .map(|a| a.iter().any(|asker| !asker.quiet()))
        .unwrap_or(true)
}

/// Whether every stack request noted came from a quiet asker (and there was one).
pub fn all_quiet() -> bool {
    ASKERS
        .lock()
        .map(|a| !a.is_empty() && a.iter().all(|asker| asker.quiet()))
        .unwrap_or(false)
}

/// The askers noted so far, taken.
pub fn take() -> Vec<Asker> {
    ASKERS
        .lock()
        .map(|mut a| std::mem::take(&mut *a))
        .unwrap_or_default()
}

/// What the launcher hands back.
pub enum Reply<'a> {
    /// The block, the ranks (rank, pid) that did not answer, and where each rank is.
    Stacks {
        block: &'a [u8],
        silent: &'a [(usize, i32)],
        places: &'a [Place],
    },
    /// Why there are no stacks.
    Error(&'a str),
}

impl Reply<'_> {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Reply::Stacks {
                block,
                silent,
                places,
            } => {
                let mut out: Vec<u8> = silent
                    .iter()
                    .flat_map(|(rank, pid)| format!("silent {rank} {pid}\n").into_bytes())
                    .collect();
                for place in places.iter() {
                    out.extend_from_slice(place.line().as_bytes());
                }
                out.push(b'\n');
                out.extend_from_slice(block);
                out
            }
            Reply::Error(why) => format!("error {}\n\n", why.replace('\n', " ")).into_bytes(),
        }
    }
}

/// Hands `reply` to every asker noted.
pub fn answer(reply: &Reply<'_>) {
    let askers = take();
    if askers.is_empty() {
        return;
    }
    let bytes = reply.bytes();
    for asker in askers {
        if let Err(err) = send(asker, &bytes) {
            log::info!(target: "tether::stacks", "no reply to {asker:?}: {err}");
        }
    }
}

fn send(asker: Asker, bytes: &[u8]) -> std::io::Result<()> {
    let mut stream = UnixStream::connect_addr(&asker.address()?)?;
    let peer = rustix::net::sockopt::socket_peercred(stream.as_fd())?;
    let uid = peer.uid.as_raw();
    let ours = rustix::process::geteuid().as_raw();
    if peer.pid.as_raw_nonzero().get() as u32 != asker.pid || (uid != ours && uid != 0) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the socket is not the asker's",
        ));
    }
    stream.set_write_timeout(Some(WRITE_LIMIT))?;
    stream.write_all(bytes)
}

/// What `tether stacks` got back.
#[derive(Debug, PartialEq)]
pub enum Got {
    /// The block, the ranks (rank, pid) that did not answer, and where each rank is.
    Stacks {
        block: Vec<u8>,
        silent: Vec<(usize, i32)>,
        places: Vec<Place>,
    },
    /// The launcher could not ask its ranks.
    Error(String),
}

/// Asks the launcher `pid` for its ranks' stacks with `signal` (`quiet`: not to be printed
/// on the job's stderr), and waits up to `wait` for the reply. An error of `sigqueue` (the
/// pid gone, another user's) comes back as such.
pub fn ask(
    pid: i32,
    signal: i32,
    wait: Duration,
    quiet: bool,
) -> Result<Option<Got>, std::io::Error> {
    let asker = Asker::new(quiet);
    let listener = UnixListener::bind_addr(&asker.address()?)?;
    listener.set_nonblocking(true)?;
    let value = libc::sigval {
        sival_ptr: asker.value() as usize as *mut libc::c_void,
    };
    // SAFETY: sigqueue(3) with a pid, a signal number and a plain value.
    if unsafe { libc::sigqueue(pid, signal, value) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let deadline = Instant::now() + wait;
    let Some(mut stream) = accept_until(&listener, pid, deadline) else {
        return Ok(None);
    };
    stream.set_nonblocking(false)?;
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    let mut bytes = Vec::new();
    if stream.read_to_end(&mut bytes).is_err() {
        return Ok(None);
    }
    Ok(parse(&bytes))
}

/// The launcher's connection to `listener`: from `launcher` or its child (the supervisor),
/// of this user or root; any other is dropped.
fn accept_until(listener: &UnixListener, launcher: i32, deadline: Instant) -> Option<UnixStream> {
    loop {
        match listener.accept() {
            Ok((stream, _)) if from_launcher(&stream, launcher) => return Some(stream),
            Ok(_) => continue,
            Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return None,
        }
        let left = deadline.checked_duration_since(Instant::now())?;
        let timeout = rustix::event::Timespec {
            tv_sec: left.as_secs() as _,
            tv_nsec: left.subsec_nanos() as _,
        };
        let mut fds = [rustix::event::PollFd::new(
            listener,
            rustix::event::PollFlags::IN,
        )];
        let _ = rustix::event::poll(&mut fds, Some(&timeout));
    }
}

fn from_launcher(stream: &UnixStream, launcher: i32) -> bool {
    let Ok(peer) = rustix::net::sockopt::socket_peercred(stream.as_fd()) else {
        return false;
    };
    let (pid, uid) = (peer.pid.as_raw_nonzero().get(), peer.uid.as_raw());
    let parent =
        tether_core::proc::status(tether_core::proc::Of::Pid(pid)).and_then(|s| s.number("PPid"));
    let ours = uid == rustix::process::geteuid().as_raw() || uid == 0;
    ours && (pid == launcher || parent == Some(launcher as u64))
}

/// The reply in `bytes` (`None` when it is cut short or malformed).
fn parse(bytes: &[u8]) -> Option<Got> {
    let split = bytes.windows(2).position(|w| w == b"\n\n");
    let (head, block) = match split {
        Some(at) => (&bytes[..at], &bytes[at + 2..]),
        None if bytes.first() == Some(&b'\n') => (&bytes[..0], &bytes[1..]),
        None => return None,
    };
    let head = std::str::from_utf8(head).ok()?;
    let mut silent = Vec::new();
    let mut places = Vec::new();
    for line in head.lines().filter(|l| !l.is_empty()) {
        if let Some(why) = line.strip_prefix("error ") {
            return Some(Got::Error(why.to_string()));
        }
        if line.starts_with("place ") {
            places.push(Place::parse(line)?);
            continue;
        }
        let mut words = line.strip_prefix("silent ")?.split(' ');
        let rank = words.next()?.parse().ok()?;
        let pid = words.next()?.parse().ok()?;
        silent.push((rank, pid));
    }
    Some(Got::Stacks {
        block: block.to_vec(),
        silent,
        places,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_read_back_as_written() {
        let silent = [(2, 4242), (5, 77)];
        let places = [Place {
            rank: 0,
            pid: 11,
            seconds: 1.5,
            place: "all_reduce called from train.py:57".into(),
        }];
        let reply = Reply::Stacks {
            block: b"tether: asked\n[rank 0]: x\n",
            silent: &silent,
            places: &places,
        };
        assert_eq!(
            parse(&reply.bytes()),
            Some(Got::Stacks {
                block: b"tether: asked\n[rank 0]: x\n".to_vec(),
                silent: silent.to_vec(),
                places: places.to_vec(),
            })
        );
        let all = Reply::Stacks {
            block: b"b\n",
            silent: &[],
            places: &[],
        };
        assert_eq!(
            parse(&all.bytes()),
            Some(Got::Stacks {
                block: b"b\n".to_vec(),
                silent: vec![],
                places: vec![],
            })
        );
        let error = Reply::Error("no\nranks");
        assert_eq!(parse(&error.bytes()), Some(Got::Error("no ranks".into())));
        assert_eq!(parse(b"silent 1 2"), None);
    }

    #[test]
    fn an_asker_travels_in_the_queued_value() {
        let asker = Asker::new(false);
        assert_eq!(Asker::from_value(asker.value()), Some(asker));
        assert!(!asker.quiet());
        let quiet = Asker::new(true);
        assert_eq!(Asker::from_value(quiet.value()), Some(quiet));
        assert!(quiet.quiet());
        assert_eq!(Asker::from_value(0), None);
        assert_eq!(Asker::from_value(7), None);
    }
}
