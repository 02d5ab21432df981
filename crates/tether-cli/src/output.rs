//! Rank output: one pump thread per pipe reads a rank's stdout or stderr, writes the raw
//! bytes to its log file, and sends complete lines, each with its `[rank N]: ` prefix, to
//! the launcher's own stdout or stderr.
//!
//! All console writes, the launcher's own messages included, go through one lock, and the
//! lines of a chunk are written together under it: a line is never split or interleaved
//! with another rank's, however long it is (up to [`MAX_LINE`]; a longer line without a
//! newline is cut there). A last line without a newline is printed, with one, at EOF.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{mpsc, Arc, Mutex};

use rustix::io::Errno;

/// Lines longer than this (64 MiB) are cut into pieces of this size.
pub const MAX_LINE: usize = 64 << 20;
/// Lines kept per rank for the failure report.
pub const TAIL_LINES: usize = 20;
/// Bytes of each kept line.
const TAIL_LINE_BYTES: usize = 4096;

static CONSOLE: Mutex<()> = Mutex::new(());

/// One of the launcher's own output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// Writes `bytes` to the launcher's `stream` under the console lock (errors such as a closed
/// pipe are ignored: the ranks' output keeps being drained).
pub fn write_console(stream: Stream, bytes: &[u8]) {
    let _guard = CONSOLE.lock().unwrap_or_else(|e| e.into_inner());
    let raw = match stream {
        Stream::Stdout => libc::STDOUT_FILENO,
        Stream::Stderr => libc::STDERR_FILENO,
    };
    // SAFETY: fds 1 and 2 stay open for the life of the process (nothing here closes them).
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) };
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

/// A message of the launcher itself, on its stderr.
pub fn message(text: &str) {
    let mut line = String::with_capacity(text.len() + 1);
    line.push_str(text);
    if !line.ends_with('\n') {
        line.push('\n');
    }
    write_console(Stream::Stderr, line.as_bytes());
}

/// The last lines a rank wrote to stderr.
#[derive(Debug, Default)]
pub struct Tail {
    lines: VecDeque<String>,
}

impl Tail {
    fn push(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let mut text =
            String::from_utf8_lossy(&line[..line.len().min(TAIL_LINE_BYTES)]).into_owned();
        if line.len() > TAIL_LINE_BYTES {
            text.push_str(" [...]");
        }
        if self.lines.len() == TAIL_LINES {
            self.lines.pop_front();
        }
        self.lines.push_back(text);
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

pub type SharedTail = Arc<Mutex<Tail>>;

/// Where one pipe of one rank goes.
pub struct Pump {
    pub stream: Stream,
    /// `[rank N]: `, or empty for `--no-prefix`.
    pub prefix: Vec<u8>,
    /// Whether the lines reach the console.
    pub console: bool,
    pub file: Option<File>,
    pub tail: Option<SharedTail>,
}

impl Pump {
    /// Starts the thread that drains `pipe` until EOF, then sends on `done`.
    pub fn spawn(self, pipe: OwnedFd, done: mpsc::Sender<()>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name(format!("tether-{}", self.stream.name()))
            .spawn(move || {
                self.run(pipe);
                let _ = done.send(());
            })?;
        Ok(())
    }

    fn run(mut self, pipe: OwnedFd) {
        let mut buf = vec![0u8; 1 << 16];
        let mut pending: Vec<u8> = Vec::new();
        let mut out: Vec<u8> = Vec::new();
        let lines = self.console || self.tail.is_some();
        loop {
            let n = match rustix::io::read(pipe.as_fd(), &mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(Errno::INTR) | Err(Errno::AGAIN) => continue,
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(file) = &mut self.file {
                if file.write_all(chunk).is_err() {
                    self.file = None;
                }
            }
            if !lines {
                continue;
            }
            out.clear();
            let mut start = 0;
            while let Some(pos) = chunk[start..].iter().position(|&b| b == b'\n') {
                let end = start + pos + 1;
                if pending.is_empty() {
                    self.emit(&chunk[start..end], &mut out);
                } else {
                    pending.extend_from_slice(&chunk[start..end]);
                    self.emit(&pending, &mut out);
                    pending.clear();
                }
                start = end;
            }
            pending.extend_from_slice(&chunk[start..]);
            if pending.len() >= MAX_LINE {
                pending.push(b'\n');
                self.emit(&pending, &mut out);
                pending.clear();
            }
            if !out.is_empty() {
                write_console(self.stream, &out);
            }
        }
        if lines && !pending.is_empty() {
            pending.push(b'\n');
            out.clear();
            self.emit(&pending, &mut out);
            if !out.is_empty() {
                write_console(self.stream, &out);
            }
        }
    }

    /// Adds one complete line (with its newline) to the console batch and the tail.
    fn emit(&self, line: &[u8], out: &mut Vec<u8>) {
        if self.console {
            out.extend_from_slice(&self.prefix);
            out.extend_from_slice(line);
        }
        if let Some(tail) = &self.tail {
            tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_keeps_the_last_lines() {
        let mut tail = Tail::default();
        for i in 0..30 {
            tail.push(format!("line {i}\n").as_bytes());
        }
        let lines = tail.lines();
        assert_eq!(lines.len(), TAIL_LINES);
        assert_eq!(lines[0], "line 10");
        assert_eq!(lines[19], "line 29");
    }
}
