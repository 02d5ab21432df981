//! The launcher's console: its stdout and stderr, written under one lock so that a line is
//! never split or interleaved with another, and the record of whose partial line each
//! stream's cursor sits after (see [`super`]).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use rustix::io::Errno;

static CONSOLE: Mutex<Console> = Mutex::new(Console { open: [None, None] });
static SILENCED: AtomicBool = AtomicBool::new(false);
static ONE_FILE: OnceLock<bool> = OnceLock::new();

/// What the console's terminal lines end with: for each of the launcher's streams (one slot
/// for both when they are one file), the pump whose partial line the cursor sits after.
pub(super) struct Console {
    pub(super) open: [Option<u64>; 2],
}

impl Console {
    pub(super) fn slot(stream: Stream) -> usize {
        if *ONE_FILE.get_or_init(console_is_one_file) {
            0
        } else {
            stream as usize
        }
    }
}

/// One of the launcher's own output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout = 0,
    Stderr = 1,
}

impl Stream {
    pub(super) fn fd(self) -> BorrowedFd<'static> {
        let raw = match self {
            Stream::Stdout => libc::STDOUT_FILENO,
            Stream::Stderr => libc::STDERR_FILENO,
        };
        // SAFETY: fds 1 and 2 stay open for the life of the process (nothing here closes
        // them).
        unsafe { BorrowedFd::borrow_raw(raw) }
    }
}

/// Whether the launcher's stdout and stderr are the same file (one terminal, `2>&1`, one
/// pipe): then a rank's two streams can share one pipe and keep their order.
pub fn console_is_one_file() -> bool {
    let id = |s: Stream| {
        rustix::fs::fstat(s.fd())
            .ok()
            .map(|st| (st.st_dev, st.st_ino))
    };
    matches!((id(Stream::Stdout), id(Stream::Stderr)), (Some(a), Some(b)) if a == b)
}

pub(super) fn lock_console() -> MutexGuard<'static, Console> {
    CONSOLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Writes `bytes` to the launcher's `stream` under the console lock, on a line of its own
/// (a rank's partial line there is ended first). Errors such as a closed pipe are ignored:
/// the ranks' output keeps being drained.
pub fn write_console(stream: Stream, bytes: &[u8]) {
    let mut console = lock_console();
    let slot = Console::slot(stream);
    if console.open[slot].take().is_some() {
        write_all(stream, b"\n");
    }
    write_all(stream, bytes);
}

/// Writes `bytes` to `stream`; the console lock is held.
pub(super) fn write_all(stream: Stream, bytes: &[u8]) {
    if SILENCED.load(Ordering::Relaxed) {
        return;
    }
    let fd = stream.fd();
    let mut rest = bytes;
    while !rest.is_empty() {
        match rustix::io::write(fd, rest) {
            Ok(0) => return,
            Ok(n) => rest = &rest[n..],
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                let mut fds = [rustix::event::PollFd::new(
                    &fd,
                    rustix::event::PollFlags::OUT,
                )];
                let _ = rustix::event::poll(&mut fds, None);
            }
            Err(_) => return,
        }
    }
}

/// Ends every console write of this process: a supervisor whose keeper is gone reports
/// nothing more (what the ranks print as they are killed, and the report of their deaths,
/// would only mislead).
pub fn silence() {
    let _guard = lock_console();
    SILENCED.store(true, Ordering::Relaxed);
}

/// A message of the launcher itself, on its stderr.
pub fn message(text: &str) {
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    if !line.ends_with('\n') {
        line.push('\n');
    }
    write_console(Stream::Stderr, line.as_bytes());
}
