//! Rank output: one pump thread per pipe reads what a rank wrote (its stdout, its stderr, or
//! both through one pipe), writes the raw bytes to its log file, and sends its lines, each
//! with the rank's prefix, to the launcher's own stdout or stderr.
//!
//! All console writes, the launcher's own messages included, go through one lock, and the
//! lines of a chunk are written together under it: a line is never split or interleaved
//! with another rank's, however long it is (up to [`MAX_LINE`]; a longer line without a
//! newline is cut there). A last line without a newline is printed, with one, at EOF.
//!
//! A line still being written (a progress bar redrawn with `\r`, a prompt) is shown without
//! waiting for its newline: at once when the rank writes a `\r`, otherwise once the rank has
//! been silent for [`PARTIAL_WAIT`]. The console remembers whose partial line its cursor
//! sits after. The same pump goes on writing on that terminal line, with its prefix written
//! again after every `\r` so that it stays at the start of the line; anyone else first ends
//! the line with a newline, and the interrupted rank then starts a new terminal line with
//! its prefix and the part of its line after its last `\r`. A partial line is never cut
//! inside a UTF-8 character.
//!
//! The prefix is left out of a line that already starts with the rank's own prefix: the
//! rendered prefix itself, or `[rank N]`/`[rankN]` with the rank's global number (torch
//! prints `[rank1]: ` before each line of an error in a process group).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use rustix::io::Errno;

use crate::clock;

pub mod pty;

/// Lines longer than this (64 MiB) are cut into pieces of this size.
pub const MAX_LINE: usize = 64 << 20;
/// Lines kept per rank for the failure report.
pub const TAIL_LINES: usize = 20;
/// Bytes of each kept line.
const TAIL_LINE_BYTES: usize = 4096;

static CONSOLE: Mutex<Console> = Mutex::new(Console { open: [None, None] });
static SILENCED: AtomicBool = AtomicBool::new(false);
static ONE_FILE: OnceLock<bool> = OnceLock::new();
static NEXT_PUMP: AtomicU64 = AtomicU64::new(1);

/// How long a rank's line without a newline waits before it is shown (a line written in
/// several pieces, as `print(a, b)` does unbuffered, usually arrives whole within it).
pub const PARTIAL_WAIT: Duration = Duration::from_millis(40);
/// A partial line is shown only while what a terminal would show of it (the part after its
/// last `\r`) is at most this long: a longer one is not a bar or a prompt but a long line
/// on its way, which is printed whole.
const PARTIAL_MAX: usize = 4096;

/// What the console's terminal lines end with: for each of the launcher's streams (one slot
/// for both when they are one file), the pump whose partial line the cursor sits after.
struct Console {
    open: [Option<u64>; 2],
}

impl Console {
    fn slot(stream: Stream) -> usize {
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

fn lock_console() -> MutexGuard<'static, Console> {
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
fn write_all(stream: Stream, bytes: &[u8]) {
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

/// The last lines a rank wrote to stderr (or to its one pipe).
#[derive(Debug, Default)]
pub struct Tail {
    lines: VecDeque<String>,
}

impl Tail {
    /// Keeps `line` as a terminal shows it: the part after its last `\r`.
    fn push(&mut self, line: &[u8]) {
        let line = &line[segment_start(line, line.len())..];
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
    pub rank: usize,
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
                Some(p) if !p.is_own(line) => p.text.as_slice(),
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

/// Where the part of `line[..upto]` that a terminal shows begins: after its last `\r` that
/// is followed by something other than a newline.
fn segment_start(line: &[u8], upto: usize) -> usize {
    let mut text = &line[..upto];
    text = text.strip_suffix(b"\n").unwrap_or(text);
    while let Some(t) = text.strip_suffix(b"\r") {
        text = t;
    }
    text.iter().rposition(|&b| b == b'\r').map_or(0, |p| p + 1)
}

/// The length of the longest start of `bytes` that does not end inside a UTF-8 character
/// (bytes that cannot begin one are let through as they are).
fn utf8_end(bytes: &[u8]) -> usize {
    let n = bytes.len();
    for back in 1..=n.min(3) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue;
        }
        let needs = match b {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if needs > back { n - back } else { n };
    }
    n
}

/// The line a pump is in the middle of, and what of it is on the console.
struct Line {
    /// Which pump this is, in the console's record of whose partial line ends it.
    id: u64,
    prefix: Option<Prefix>,
    /// What the rank wrote since its last newline.
    bytes: Vec<u8>,
    /// How much of `bytes` has been written to the console.
    shown: usize,
    /// The last byte shown was a `\r`: the prefix is written before what comes next.
    after_cr: bool,
    /// Only the prefix is on the terminal line yet (a `\r` there would change nothing).
    blank: bool,
    /// When the oldest byte not yet shown arrived.
    since: Option<Instant>,
}

impl Line {
    fn new(prefix: Option<Prefix>) -> Line {
        Line {
            id: NEXT_PUMP.fetch_add(1, Ordering::Relaxed),
            prefix,
            bytes: Vec::new(),
            shown: 0,
            after_cr: false,
            blank: false,
            since: None,
        }
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.shown = 0;
        self.after_cr = false;
        self.blank = false;
        self.since = None;
    }

    /// When what is not yet shown of the line is due on the console.
    fn due(&self) -> Option<Instant> {
        self.since.map(|t| t + PARTIAL_WAIT)
    }

    /// Starts the wait of bytes not yet shown, if it has not started.
    fn note_unshown(&mut self) {
        if self.bytes.len() > self.shown {
            self.since.get_or_insert_with(Instant::now);
        } else {
            self.since = None;
        }
    }

    /// How much of the line may be shown now, when that is more than what has been.
    fn showable(&self) -> Option<usize> {
        let upto = utf8_end(&self.bytes);
        let visible = upto - segment_start(&self.bytes, upto);
        (upto > self.shown && visible <= PARTIAL_MAX).then_some(upto)
    }

    /// Shows what the line has that is not on the console yet (the wait is over).
    fn show_partial(&mut self, stream: Stream) {
        let mut console = lock_console();
        let slot = Console::slot(stream);
        self.since = None;
        let Some(upto) = self.showable() else {
            return;
        };
        let mut out = Vec::new();
        let open = console.open[slot];
        console.open[slot] = self.render(open, upto, &mut out);
        write_all(stream, &out);
    }

    /// The prefix, unless the text at `line` starts with the rank's own.
    fn push_prefix(prefix: Option<&Prefix>, line: &[u8], out: &mut Vec<u8>) {
        if let Some(p) = prefix.filter(|p| !p.is_own(line)) {
            out.extend_from_slice(&p.text);
        }
    }

    /// A whole line none of which was shown: the prefix, and the prefix again after every
    /// `\r` (but one right after it).
    fn render_fresh(prefix: Option<&Prefix>, line: &[u8], out: &mut Vec<u8>) {
        if !line.contains(&b'\r') {
            Line::push_prefix(prefix, line, out);
            out.extend_from_slice(line);
            return;
        }
        let mut fresh = Line {
            id: 0,
            prefix: prefix.cloned(),
            bytes: Vec::new(),
            shown: 0,
            after_cr: false,
            blank: false,
            since: None,
        };
        fresh.bytes.extend_from_slice(line);
        fresh.render(None, line.len(), out);
    }

    /// Adds `bytes[shown..upto]` to `out`, given whose partial line the console's terminal
    /// line ends with (`open`): this one's goes on, anyone else's is ended first and this
    /// line starts again on a terminal line of its own, from what a terminal would show.
    /// Returns whose partial line the console ends with then.
    fn render(&mut self, open: Option<u64>, upto: usize, out: &mut Vec<u8>) -> Option<u64> {
        let prefix = self.prefix.as_ref();
        let mut at = self.shown;
        let ends = |bytes: &[u8]| bytes.iter().all(|&b| b == b'\r' || b == b'\n');
        if open != Some(self.id) && self.shown > 0 && ends(&self.bytes[self.shown..upto]) {
            // All of the line was shown; only its end is new, and a newline ended it already.
            self.shown = upto;
            return open;
        }
        if open != Some(self.id) || self.shown == 0 {
            if open.is_some() && open != Some(self.id) {
                out.push(b'\n');
            }
            at = if self.shown == 0 {
                0
            } else {
                segment_start(&self.bytes, upto)
            };
            Line::push_prefix(prefix, &self.bytes[at..upto], out);
            self.after_cr = false;
            self.blank = true;
        }
        for i in at..upto {
            let b = self.bytes[i];
            if self.after_cr && b != b'\n' && b != b'\r' {
                Line::push_prefix(prefix, &self.bytes[i..upto], out);
                self.blank = true;
            }
            self.after_cr = false;
            match b {
                b'\r' if self.blank => continue,
                b'\r' => self.after_cr = true,
                b'\n' => {}
                _ => self.blank = false,
            }
            out.push(b);
        }
        self.shown = upto;
        match self.bytes[..upto].last() {
            Some(b'\n') => None,
            _ => Some(self.id),
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

    fn line(template: Option<&str>) -> Line {
        Line::new(template.map(|t| prefix(t, 0)))
    }

    /// Appends `bytes` to the line and renders all of it, given whose partial line the
    /// console ends with.
    fn show(line: &mut Line, bytes: &[u8], open: Option<u64>) -> String {
        line.bytes.extend_from_slice(bytes);
        let mut out = Vec::new();
        line.render(open, line.bytes.len(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_redrawn_line_keeps_the_prefix_at_the_start_of_the_terminal_line() {
        let mut bar = line(Some("[rank 0]: "));
        assert_eq!(show(&mut bar, b"\rstep 0", None), "[rank 0]: step 0");
        let me = Some(bar.id);
        assert_eq!(show(&mut bar, b"\rstep 1", me), "\r[rank 0]: step 1");
        assert_eq!(show(&mut bar, b"\r", me), "\r");
        assert_eq!(show(&mut bar, b"step 2", me), "[rank 0]: step 2");
        assert_eq!(show(&mut bar, b"\r\n", me), "\r\n");
    }

    #[test]
    fn an_interrupted_line_starts_again_on_its_own_terminal_line() {
        let mut prompt = line(Some("[rank 0]: "));
        assert_eq!(
            show(&mut prompt, b"loading... ", None),
            "[rank 0]: loading... "
        );
        let other = Some(prompt.id + 1000);
        assert_eq!(
            show(&mut prompt, b"done\n", other),
            "\n[rank 0]: loading... done\n"
        );
        let mut bar = line(Some("[rank 0]: "));
        assert_eq!(show(&mut bar, b"\rstep 0", None), "[rank 0]: step 0");
        assert_eq!(
            show(&mut bar, b"\rstep 1\rstep 2", other),
            "\n[rank 0]: step 2"
        );
        // A launcher message ended the line: no newline is owed.
        assert_eq!(show(&mut bar, b"\rstep 3", None), "[rank 0]: step 3");
        // Only the newline is new: the line is on the console whole already.
        let mut out = Vec::new();
        bar.bytes.extend_from_slice(b"\n");
        assert_eq!(bar.render(other, bar.bytes.len(), &mut out), other);
        assert!(out.is_empty());
    }

    #[test]
    fn without_a_prefix_a_redrawn_line_is_written_as_it_came() {
        let mut bar = line(None);
        assert_eq!(show(&mut bar, b"\rstep 0", None), "step 0");
        let me = Some(bar.id);
        assert_eq!(show(&mut bar, b"\rstep 1\n", me), "\rstep 1\n");
    }

    #[test]
    fn a_whole_line_with_carriage_returns_gets_the_prefix_after_each() {
        let p = prefix(crate::config::DEFAULT_PREFIX, 2);
        let mut out = Vec::new();
        Line::render_fresh(Some(&p), b"a\rb\r\n", &mut out);
        assert_eq!(out, b"[rank 2]: a\r[rank 2]: b\r\n");
        out.clear();
        Line::render_fresh(Some(&p), b"[rank2]: own\n", &mut out);
        assert_eq!(out, b"[rank2]: own\n");
    }

    #[test]
    fn utf8_characters_are_never_cut() {
        let cafe = "café".as_bytes();
        assert_eq!(utf8_end(cafe), cafe.len());
        assert_eq!(utf8_end(&cafe[..cafe.len() - 1]), 3);
        let crab = "a🦀".as_bytes();
        for cut in 2..crab.len() {
            assert_eq!(utf8_end(&crab[..cut]), 1, "{cut}");
        }
        assert_eq!(utf8_end(b"\xff\xfe"), 2);
        assert_eq!(utf8_end(b""), 0);
    }

    #[test]
    fn the_tail_keeps_what_a_terminal_shows_of_a_redrawn_line() {
        let mut tail = Tail::default();
        tail.push(b"\rstep 0\rstep 1\r\n");
        tail.push(b"plain\r\n");
        assert_eq!(tail.lines(), ["step 1", "plain"]);
    }
}
