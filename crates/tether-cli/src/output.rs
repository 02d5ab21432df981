//! Rank output: one pump thread per pipe reads what a rank wrote (its stdout, its stderr, or
//! both through one pipe), writes the raw bytes to its log file, and sends complete lines,
//! each with the rank's prefix, to the launcher's own stdout or stderr.
//!
//! All console writes, the launcher's own messages included, go through one lock, and the
//! lines of a chunk are written together under it: a line is never split or interleaved
//! with another rank's, however long it is (up to [`MAX_LINE`]; a longer line without a
//! newline is cut there). A last line without a newline is printed, with one, at EOF.
//!
//! The prefix is left out of a line that already starts with the rank's own prefix: the
//! rendered prefix itself, or `[rank N]`/`[rankN]` with the rank's global number (torch
//! prints `[rank1]: ` before each line of an error in a process group).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use rustix::io::Errno;

/// Lines longer than this (64 MiB) are cut into pieces of this size.
pub const MAX_LINE: usize = 64 << 20;
/// Lines kept per rank for the failure report.
pub const TAIL_LINES: usize = 20;
/// Bytes of each kept line.
const TAIL_LINE_BYTES: usize = 4096;

static CONSOLE: Mutex<()> = Mutex::new(());
static SILENCED: AtomicBool = AtomicBool::new(false);

/// One of the launcher's own output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn fd(self) -> BorrowedFd<'static> {
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

/// Writes `bytes` to the launcher's `stream` under the console lock (errors such as a closed
/// pipe are ignored: the ranks' output keeps being drained).
pub fn write_console(stream: Stream, bytes: &[u8]) {
    let _guard = CONSOLE.lock().unwrap_or_else(|e| e.into_inner());
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
    let _guard = CONSOLE.lock().unwrap_or_else(|e| e.into_inner());
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

/// The last lines a rank wrote to stderr (or to its one pipe).
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

/// A rank's console prefix, and the rule that leaves it off lines that carry it already.
#[derive(Debug, Clone)]
pub struct Prefix {
    text: Vec<u8>,
    rank: usize,
}

/// What a prefix template's macros stand for.
pub struct RankNames<'a> {
    pub rank: usize,
    pub local_rank: usize,
    pub role: &'a str,
    pub hostname: &'a str,
}

impl Prefix {
    /// Renders `template` (`${rank}`, `${local_rank}`, `${role_name}`, `${hostname}`).
    pub fn render(template: &str, names: &RankNames<'_>) -> Prefix {
        let text = template
            .replace("${rank}", &names.rank.to_string())
            .replace("${local_rank}", &names.local_rank.to_string())
            .replace("${role_name}", names.role)
            .replace("${hostname}", names.hostname);
        Prefix {
            text: text.into_bytes(),
            rank: names.rank,
        }
    }

    /// The rendered prefix.
    pub fn text(&self) -> &[u8] {
        &self.text
    }

    /// Whether `line` starts with this rank's own prefix: the rendered prefix (without its
    /// trailing blanks), `[rank N]` or `[rankN]`.
    pub fn is_own(&self, line: &[u8]) -> bool {
        let end = self.text.iter().rposition(|b| !b.is_ascii_whitespace());
        let rendered = &self.text[..end.map_or(0, |e| e + 1)];
        if !rendered.is_empty() && line.starts_with(rendered) {
            return true;
        }
        let Some(rest) = line.strip_prefix(b"[rank") else {
            return false;
        };
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        digits > 0
            && rest.get(digits) == Some(&b']')
            && std::str::from_utf8(&rest[..digits])
                .ok()
                .and_then(|d| d.parse::<usize>().ok())
                == Some(self.rank)
    }
}

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
    pub activity: Option<crate::hangs::Activity>,
}

impl Pump {
    /// Starts the thread that drains `pipe` until EOF, then sends on `done`.
    pub fn spawn(self, pipe: OwnedFd, done: mpsc::Sender<()>) -> std::io::Result<()> {
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

    fn run(mut self, pipe: OwnedFd) {
        let mut buf = vec![0u8; 1 << 16];
        let mut pending: Vec<u8> = Vec::new();
        let mut out: Vec<u8> = Vec::new();
        loop {
            let n = match rustix::io::read(pipe.as_fd(), &mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(Errno::INTR) | Err(Errno::AGAIN) => continue,
                Err(_) => break,
            };
            let chunk = &buf[..n];
            if let Some(activity) = &self.activity {
                crate::hangs::touch(activity);
            }
            if let Some(file) = &mut self.file {
                if file.write_all(chunk).is_err() {
                    self.file = None;
                }
            }
            if self.wants_lines() {
                self.lines_of(chunk, &mut pending, &mut out);
            }
        }
        if self.wants_lines() && !pending.is_empty() {
            pending.push(b'\n');
            out.clear();
            self.emit(&pending, &mut out);
            self.flush(&out);
        }
    }

    /// Emits the complete lines of `chunk` (after what is `pending` from earlier chunks).
    fn lines_of(&self, chunk: &[u8], pending: &mut Vec<u8>, out: &mut Vec<u8>) {
        out.clear();
        let mut start = 0;
        while let Some(pos) = chunk[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos + 1;
            if pending.is_empty() {
                self.emit(&chunk[start..end], out);
            } else {
                pending.extend_from_slice(&chunk[start..end]);
                self.emit(pending, out);
                pending.clear();
            }
            start = end;
        }
        pending.extend_from_slice(&chunk[start..]);
        if pending.len() >= MAX_LINE {
            pending.push(b'\n');
            self.emit(pending, out);
            pending.clear();
        }
        self.flush(out);
    }

    fn flush(&self, out: &[u8]) {
        if let (Some(stream), false) = (self.console, out.is_empty()) {
            write_console(stream, out);
        }
    }

    /// Adds one complete line (with its newline) to the console batch, the filtered copy
    /// and the tail.
    fn emit(&self, line: &[u8], out: &mut Vec<u8>) {
        let prefix = match &self.prefix {
            Some(p) if !p.is_own(line) => p.text.as_slice(),
            _ => &[],
        };
        if self.console.is_some() {
            out.extend_from_slice(prefix);
            out.extend_from_slice(line);
        }
        if let Some(filter) = self.filter.as_ref().filter(|f| f.matches(line)) {
            let mut file = filter.file.lock().unwrap_or_else(|e| e.into_inner());
            let _ = file.write_all(&[prefix, line].concat());
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

    fn prefix(template: &str, rank: usize) -> Prefix {
        let names = RankNames {
            rank,
            local_rank: rank % 2,
            role: "trainer",
            hostname: "h1",
        };
        Prefix::render(template, &names)
    }

    #[test]
    fn own_prefixes_are_not_doubled() {
        let p = prefix(crate::config::DEFAULT_PREFIX, 1);
        assert_eq!(p.text, b"[rank 1]: ");
        for own in [
            "[rank1]: Traceback",
            "[rank 1]: x",
            "[rank1]:x",
            "[rank1] x",
            "[rank 1]",
        ] {
            assert!(p.is_own(own.as_bytes()), "{own}");
        }
        for other in [
            "[rank10]: x",
            "[rank0]: x",
            "[rank 2]: x",
            "rank1: x",
            "[rank]: x",
            "x",
        ] {
            assert!(!p.is_own(other.as_bytes()), "{other}");
        }
    }

    #[test]
    fn templates_render_their_macros() {
        let p = prefix("${hostname}:${role_name}${local_rank}/${rank}> ", 3);
        assert_eq!(p.text, b"h1:trainer1/3> ");
        assert!(p.is_own(b"h1:trainer1/3> already"));
        assert!(p.is_own(b"[rank3]: from torch"));
        assert!(!p.is_own(b"h1:trainer1/2> another"));
    }
}
