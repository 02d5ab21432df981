//! Pseudo-terminals for ranks. A torchrun rank inherits torchrun's stdout and stderr, so when
//! they are a terminal the rank sees one: `isatty()` is true, `os.get_terminal_size()` gives
//! the terminal's size, colours and progress bars behave. tether reads each rank's output to
//! prefix its lines and keep ranks apart, so it gives a rank's stream that reaches a terminal
//! a pseudo-terminal (pty) instead of a pipe, and reads its master side as it reads a pipe
//! (see [`super::Pump`]).
//!
//! - The pty starts at the size of the launcher's terminal. On a resize the keeper forwards
//!   SIGWINCH to the supervisor, where a thread ([`watch_resizes`]) sets every open pty to
//!   the new size (TIOCSWINSZ) and then sends SIGWINCH to the ranks on a pty, as a terminal
//!   does to its foreground process group.
//! - What the launcher reads is what the rank wrote: the pty's `\n` to `\r\n` translation
//!   (ONLCR) and its echo are off, so log files keep the program's own bytes.
//! - The pty is not the rank's controlling terminal (the rank keeps its session, its process
//!   group and its stdin): no job control comes with it (a background child that changes the
//!   terminal's modes is not stopped, the rank's children get no SIGHUP when it exits), and
//!   `/dev/tty` stays what it was.
//! - Once every process holding the slave side has closed it, reading the master gives what
//!   is left and then EIO: the end of the stream, as a pipe's EOF.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rustix::pty::OpenptFlags;
use rustix::termios::{self, LocalModes, OptionalActions, OutputModes, Winsize};
use tether_core::Group;

use super::Stream;
use crate::signals::SignalFd;

/// A pty open for a rank: the master, read by a pump, and the slave, the rank's stream(s).
pub struct Pty {
    pub master: Arc<OwnedFd>,
    pub slave: OwnedFd,
}

/// A pty that follows the launcher's terminal.
struct Open {
    master: Weak<OwnedFd>,
    /// The launcher's stream whose terminal gives its size.
    stream: Stream,
    /// The local rank it belongs to.
    local: usize,
}

static OPEN: Mutex<Vec<Open>> = Mutex::new(Vec::new());
/// The ranks of the running attempt (member n is local rank n).
static RANKS: Mutex<Option<Group>> = Mutex::new(None);
static WATCHING: OnceLock<()> = OnceLock::new();

/// Whether the launcher's `stream` is a terminal (decided once: the launcher's standard
/// streams do not change).
pub fn is_terminal(stream: Stream) -> bool {
    static TERMINALS: OnceLock<[bool; 2]> = OnceLock::new();
    TERMINALS.get_or_init(|| [Stream::Stdout, Stream::Stderr].map(|s| termios::isatty(s.fd())))
        [stream as usize]
}

/// The size of the terminal that the launcher's `stream` is, now.
fn terminal_size(stream: Stream) -> Option<Winsize> {
    termios::tcgetwinsize(stream.fd()).ok()
}

/// A new pty for local rank `local`, of the size of the launcher's terminal on `stream`,
/// that follows its resizes; `None` (said once) when none can be opened: the rank gets a
/// pipe, as with `--no-tty`.
pub fn open(local: usize, stream: Stream) -> Option<Pty> {
    static WARNED: OnceLock<()> = OnceLock::new();
    match open_pty(local, stream) {
        Ok(pty) => Some(pty),
        Err(err) => {
            WARNED.get_or_init(|| {
                super::message(&format!(
                    "tether: warning: cannot open a pseudo-terminal for the ranks ({}); they \
                     write to pipes (as with --no-tty)",
                    tether_core::strerror(&err)
                ))
            });
            None
        }
    }
}

fn open_pty(local: usize, stream: Stream) -> io::Result<Pty> {
    let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
    let master = rustix::pty::openpt(flags)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let slave = rustix::pty::ioctl_tiocgptpeer(&master, flags)?;
    let mut modes = termios::tcgetattr(&slave)?;
    modes.output_modes.remove(OutputModes::ONLCR);
    modes
        .local_modes
        .remove(LocalModes::ECHO | LocalModes::ECHONL);
    termios::tcsetattr(&slave, OptionalActions::Now, &modes)?;
    if let Some(size) = terminal_size(stream) {
        termios::tcsetwinsize(&master, size)?;
    }
    let master = Arc::new(master);
    let mut open = lock(&OPEN);
    open.retain(|o| o.master.strong_count() > 0);
    open.push(Open {
        master: Arc::downgrade(&master),
        stream,
        local,
    });
    drop(open);
    watch_resizes();
    Ok(Pty { master, slave })
}

/// Makes `group` the ranks that a resize signals.
pub fn attach(group: &Group) {
    *lock(&RANKS) = Some(group.clone());
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts, once, the thread that forwards the launcher's terminal's resizes to every pty.
/// SIGWINCH is blocked in every thread (the keeper blocks it before it forks the
/// supervisor), so it waits for this thread's signalfd.
fn watch_resizes() {
    WATCHING.get_or_init(|| {
        let signals = match SignalFd::new(&[libc::SIGWINCH]) {
            Ok(fd) => fd,
            Err(err) => {
                log::info!(target: "tether::run", "cannot follow the terminal's resizes: {err}");
                return;
            }
        };
        let started = std::thread::Builder::new()
            .name("tether-resize".into())
            .spawn(move || loop {
                signals.wait(None);
                if std::iter::from_fn(|| signals.next()).count() > 0 {
                    resize();
                }
            });
        if let Err(err) = started {
            log::info!(target: "tether::run", "cannot follow the terminal's resizes: {err}");
        }
    });
}

/// Gives every open pty its terminal's size now, then SIGWINCH to the ranks that have one.
fn resize() {
    let ptys: Vec<(Arc<OwnedFd>, Stream, usize)> = lock(&OPEN)
        .iter()
        .filter_map(|o| Some((o.master.upgrade()?, o.stream, o.local)))
        .collect();
    let mut resized = BTreeSet::new();
    for (master, stream, local) in ptys {
        let Some(size) = terminal_size(stream) else {
            continue;
        };
        if termios::tcsetwinsize(master.as_fd(), size).is_ok() {
            resized.insert(local);
        }
    }
    let group = lock(&RANKS).clone();
    if let Some(group) = group {
        for local in resized {
            let _ = group.signal(local, libc::SIGWINCH);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pty_passes_the_programs_bytes_and_ends_in_eio() {
        let pty = open_pty(0, Stream::Stdout).unwrap();
        assert!(termios::isatty(&pty.slave));
        let size = Winsize {
            ws_row: 37,
            ws_col: 123,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        termios::tcsetwinsize(pty.master.as_fd(), size).unwrap();
        let seen = termios::tcgetwinsize(&pty.slave).unwrap();
        assert_eq!((seen.ws_row, seen.ws_col), (37, 123));
        rustix::io::write(&pty.slave, b"a\nb\r\n\x1b[31mc").unwrap();
        drop(pty.slave);
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        loop {
            match rustix::io::read(pty.master.as_fd(), &mut buf) {
                Ok(0) | Err(rustix::io::Errno::IO) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(err) => panic!("{err}"),
            }
        }
        assert_eq!(got, b"a\nb\r\n\x1b[31mc");
    }
}
