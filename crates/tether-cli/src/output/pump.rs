//! A pump: the thread that drains one pipe of one rank, writes the raw bytes to the rank's
//! log file, and hands its lines to the tail, the filtered copy and the console.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use super::console::{lock_console, write_all, Console, Stream};
use super::line::Line;
use super::prefix::Prefix;
use super::tail::SharedTail;
use crate::clock;

/// Lines longer than this (64 MiB) are cut into pieces of this size.
pub const MAX_LINE: usize = 64 << 20;

/// The shared file that lines containing any of `needles` are copied to (torchrun's
/// `--duplicate-*-filters`), prefixed, from every rank.
#[derive(Debug, Clone)]
pub struct FilterSink {
    pub needles: Arc<Vec<String>>,
    pub file: Arc<Mutex<File>>,
}

impl FilterSink {
    fn matches(&self, line: &[u8]) -> bool {
        self.needles.iter().any(|n| {
            let n = n.as_bytes();
            n.is_empty() || line.windows(n.len()).any(|w| w == n)
        })
    }
}

/// When some rank last wrote output (`CLOCK_MONOTONIC` nanoseconds), kept by the pumps.
pub type Activity = Arc<AtomicU64>;

/// Records output now.
pub fn touch(activity: &Activity) {
    activity.store(clock::monotonic().as_nanos() as u64, Ordering::Relaxed);
}

/// Where one pipe of one rank goes.
pub struct Pump {
    /// The launcher's stream its lines are printed on, if they reach the console.
    pub console: Option<Stream>,
    /// `None` for `--no-prefix`.
    pub prefix: Option<Prefix>,
    pub file: Option<File>,
    pub tail: Option<SharedTail>,
    pub filter: Option<FilterSink>,
    /// Where the time of the last output is kept (for `--stall-timeout`).
    pub activity: Option<Activity>,
}

impl Pump {
    /// Starts the thread that drains `pipe` (a pipe's read end, or a pty's master) until
    /// EOF, then sends on `done`.
    pub fn spawn(self, pipe: Arc<OwnedFd>, done: mpsc::Sender<()>) -> std::io::Result<()> {
        std::thread::Builder::new()
            .name("tether-output".into())
            .spawn(move || {
                self.run(pipe);
                let _ = done.send(());
            })?;
        Ok(())
    }

    fn wants_lines(&self) -> bool {
        self.console.is_some() || self.tail.is_some() || self.filter.is_some()
    }

    fn run(mut self, pipe: Arc<OwnedFd>) {
        let mut buf = vec![0u8; 1 << 16];
        let mut line = Line::new(self.prefix.clone());
        loop {
            if let Some(due) = line.due().filter(|_| self.console.is_some()) {
                let left = due.saturating_duration_since(Instant::now());
                if !readable_within(pipe.as_fd(), left) {
                    if let Some(stream) = self.console {
                        line.show_partial(stream);
                    }
                    continue;
                }
            }
            let n = match rustix::io::read(pipe.as_fd(), &mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(Errno::INTR) | Err(Errno::AGAIN) => continue,
                // EIO: a pty whose every holder closed it (the end, once drained).
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(activity) = &self.activity {
                touch(activity);
            }
            if let Some(file) = &mut self.file {
                if file.write_all(chunk).is_err() {
                    self.file = None;
                }
            }
            if self.wants_lines() {
                self.feed(&mut line, chunk);
            }
        }
        if self.wants_lines() && !line.bytes.is_empty() {
            self.feed(&mut line, b"\n");
        }
    }

    /// Takes in what a rank wrote: complete lines go to the tail, the filtered copy and the
    /// console; the console also gets what is new of an unfinished line that has a `\r`.
    fn feed(&self, line: &mut Line, chunk: &[u8]) {
        let mut out = Vec::new();
        let mut console = self.console.map(|stream| (stream, lock_console()));
        let mut open = console
            .as_mut()
            .and_then(|(stream, c)| c.open[Console::slot(*stream)].take());
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(pos + 1);
            rest = tail;
            if line.bytes.is_empty() && open.is_none() {
                // The common case: a whole line in the chunk, with nothing shown of it yet.
                self.keep(head);
                if console.is_some() {
                    Line::render_fresh(self.prefix.as_ref(), head, &mut out);
                }
                continue;
            }
            line.bytes.extend_from_slice(head);
            if console.is_some() {
                open = line.render(open, line.bytes.len(), &mut out);
            }
            self.keep(&line.bytes);
            line.clear();
        }
        line.bytes.extend_from_slice(rest);
        if line.bytes.len() >= MAX_LINE {
            line.bytes.push(b'\n');
            if console.is_some() {
                open = line.render(open, line.bytes.len(), &mut out);
            }
            self.keep(&line.bytes);
            line.clear();
        }
        if let Some((stream, mut console)) = console.take() {
            if line.bytes[line.shown..].contains(&b'\r') {
                if let Some(upto) = line.showable() {
                    open = line.render(open, upto, &mut out);
                }
            }
            line.note_unshown();
            console.open[Console::slot(stream)] = open;
            write_all(stream, &out);
        }
    }

    /// A complete line, for the tail and the filtered copy.
    fn keep(&self, line: &[u8]) {
        if let Some(filter) = self.filter.as_ref().filter(|f| f.matches(line)) {
            let prefix = match &self.prefix {
                Some(p) if !p.is_own(line) => p.text(),
                _ => &[],
            };
            let mut file = filter.file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = file.write_all(&[prefix, line].concat());
        }
        if let Some(tail) = &self.tail {
            tail.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
    }
}

/// Whether `pipe` has something to read (or its end) within `left`.
fn readable_within(pipe: BorrowedFd<'_>, left: Duration) -> bool {
    let timeout = rustix::event::Timespec {
        tv_sec: left.as_secs() as _,
        tv_nsec: left.subsec_nanos() as _,
    };
    let mut fds = [rustix::event::PollFd::from_borrowed_fd(
        pipe,
        rustix::event::PollFlags::IN,
    )];
    match rustix::event::poll(&mut fds, Some(&timeout)) {
        Ok(n) => n > 0,
        Err(_) => true,
    }
}
