//! Pseudo-terminals for ranks. A torchrun rank inherits torchrun's stdout and stderr, so when
//! they are a terminal the rank sees one: `isatty()` is true, `os.get_terminal_size()` gives
//! the terminal's size, colours and progress bars behave. tether reads each rank's output to
//! prefix its lines and keep ranks apart, so it gives a rank's stream that reaches a terminal
//! a pseudo-terminal (pty) instead of a pipe, and reads its master side as it reads a pipe
//! (see [`super::Pump`]).
//!
//! - The pty starts at the size of the launcher's terminal, less the width of the rank's line
//!   prefix (`[rank 0]: ` takes 10 columns): a line that fills the rank's pty (a progress
//!   bar) fills the terminal with its prefix, and redraws in place as under torchrun, whose
//!   ranks write to the terminal itself. Under `--no-prefix` the rank has the whole width.
//!   On a resize the keeper forwards SIGWINCH to the supervisor, where a thread
//!   ([`follow_resizes`]) sets every open pty to the new size (TIOCSWINSZ, the prefix's width
//!   taken off again) and then sends SIGWINCH to the ranks on a pty, as a terminal does to
//!   its foreground process group.
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
use crate::signalfd::SignalFd;

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
    /// The columns its line prefix takes.
    narrower: u16,
}

static OPEN: Mutex<Vec<Open>> = Mutex::new(Vec::new());
/// The ranks of the running attempt (member n is local rank n).
static RANKS: Mutex<Option<Group>> = Mutex::new(None);
static FOLLOWING: OnceLock<()> = OnceLock::new();

/// Whether the launcher's `stream` is a terminal (decided once: the launcher's standard
/// streams do not change).
pub fn is_terminal(stream: Stream) -> bool {
    static TERMINALS: OnceLock<[bool; 2]> = OnceLock::new();
    TERMINALS.get_or_init(|| [Stream::Stdout, Stream::Stderr].map(|s| termios::isatty(s.fd())))
        [stream as usize]
}

/// The size of the terminal that the launcher's `stream` is, now, less `narrower` columns
/// (a rank's line prefix).
fn terminal_size(stream: Stream, narrower: u16) -> Option<Winsize> {
    termios::tcgetwinsize(stream.fd())
        .ok()
        .map(|size| less_columns(size, narrower))
}

/// `size` with `narrower` columns fewer (one column at least); the pixel width shrinks in
/// proportion.
fn less_columns(size: Winsize, narrower: u16) -> Winsize {
    if size.ws_col == 0 || narrower == 0 {
        return size;
    }
    let cols = size.ws_col.saturating_sub(narrower).max(1);
    let xpixel = u32::from(size.ws_xpixel) * u32::from(cols) / u32::from(size.ws_col);
    Winsize {
        ws_col: cols,
        ws_xpixel: xpixel as u16,
        ..size
    }
}

/// The columns a line prefix takes on a terminal (one per character; a prefix is plain
/// text in practice, its escape sequences, if any, are not counted).
pub fn width(prefix: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(prefix);
    let mut cols = 0usize;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // CSI: ESC [ ... final byte in @..~
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        if !c.is_control() {
            cols += 1;
        }
    }
    u16::try_from(cols).unwrap_or(u16::MAX)
}

/// A new pty for local rank `local`, of the size of the launcher's terminal on `stream` less
/// `narrower` columns (its line prefix), that follows its resizes; `None` (said once) when
/// none can be opened: the rank gets a pipe, as with `--no-tty`.
pub fn open(local: usize, stream: Stream, narrower: u16) -> Option<Pty> {
    static WARNED: OnceLock<()> = OnceLock::new();
    match open_pty(local, stream, narrower) {
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

fn open_pty(local: usize, stream: Stream, narrower: u16) -> io::Result<Pty> {
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
    if let Some(size) = terminal_size(stream, narrower) {
        termios::tcsetwinsize(&master, size)?;
    }
    let master = Arc::new(master);
    let mut open = lock(&OPEN);
    open.retain(|o| o.master.strong_count() > 0);
    open.push(Open {
        master: Arc::downgrade(&master),
        stream,
        local,
        narrower,
    });
    drop(open);
    follow_resizes();
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
fn follow_resizes() {
    FOLLOWING.get_or_init(|| {
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
    let ptys: Vec<(Arc<OwnedFd>, Stream, usize, u16)> = lock(&OPEN)
        .iter()
        .filter_map(|o| Some((o.master.upgrade()?, o.stream, o.local, o.narrower)))
        .collect();
    let mut resized = BTreeSet::new();
    for (master, stream, local, narrower) in ptys {
        let Some(size) = terminal_size(stream, narrower) else {
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
        let pty = open_pty(0, Stream::Stdout, 10).unwrap();
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

    #[test]
    fn a_prefix_takes_its_width_off_the_terminal() {
        assert_eq!(width(b"[rank 0]: "), 10);
        assert_eq!(width(b"\x1b[1m[rank 12]:\x1b[0m "), 11);
        assert_eq!(width("é: ".as_bytes()), 3);
        let size = Winsize {
            ws_row: 24,
            ws_col: 80,
            ws_xpixel: 800,
            ws_ypixel: 480,
        };
        let less = less_columns(size, 10);
        assert_eq!((less.ws_row, less.ws_col, less.ws_xpixel), (24, 70, 700));
        assert_eq!(less_columns(size, 0).ws_col, 80);
        assert_eq!(less_columns(size, 200).ws_col, 1);
    }
}
