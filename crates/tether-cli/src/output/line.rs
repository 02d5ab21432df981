//! The line a pump is in the middle of: what of it is on the console, and how the rest is
//! rendered there (the prefix again after each `\r`, an interrupted line started again on a
//! terminal line of its own, never a UTF-8 character cut).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::console::{lock_console, write_all, Console, Stream};
use super::prefix::Prefix;

static NEXT_PUMP: AtomicU64 = AtomicU64::new(1);

/// How long a rank's line without a newline waits before it is shown (a line written in
/// several pieces, as `print(a, b)` does unbuffered, usually arrives whole within it).
pub const PARTIAL_WAIT: Duration = Duration::from_millis(40);
/// A partial line is shown only while what a terminal would show of it (the part after its
/// last `\r`) is at most this long: a longer one is not a bar or a prompt but a long line
/// on its way, which is printed whole.
const PARTIAL_MAX: usize = 4096;

/// Where the part of `line[..upto]` that a terminal shows begins: after its last `\r` that
/// is followed by something other than a newline.
pub(super) fn segment_start(line: &[u8], upto: usize) -> usize {
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
pub(super) struct Line {
    /// Which pump this is, in the console's record of whose partial line ends it.
    id: u64,
    prefix: Option<Prefix>,
    /// What the rank wrote since its last newline.
    pub(super) bytes: Vec<u8>,
    /// How much of `bytes` has been written to the console.
    pub(super) shown: usize,
    /// The last byte shown was a `\r`: the prefix is written before what comes next.
    after_cr: bool,
    /// Only the prefix is on the terminal line yet (a `\r` there would change nothing).
    blank: bool,
    /// When the oldest byte not yet shown arrived.
    since: Option<Instant>,
}

impl Line {
    pub(super) fn new(prefix: Option<Prefix>) -> Line {
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

    pub(super) fn clear(&mut self) {
        self.bytes.clear();
        self.shown = 0;
        self.after_cr = false;
        self.blank = false;
        self.since = None;
    }

    /// When what is not yet shown of the line is due on the console.
    pub(super) fn due(&self) -> Option<Instant> {
        self.since.map(|t| t + PARTIAL_WAIT)
    }

    /// Starts the wait of bytes not yet shown, if it has not started.
    pub(super) fn note_unshown(&mut self) {
        if self.bytes.len() > self.shown {
            self.since.get_or_insert_with(Instant::now);
        } else {
            self.since = None;
        }
    }

    /// How much of the line may be shown now, when that is more than what has been.
    pub(super) fn showable(&self) -> Option<usize> {
        let upto = utf8_end(&self.bytes);
        let visible = upto - segment_start(&self.bytes, upto);
        (upto > self.shown && visible <= PARTIAL_MAX).then_some(upto)
    }

    /// Shows what the line has that is not on the console yet (the wait is over).
    pub(super) fn show_partial(&mut self, stream: Stream) {
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
            out.extend_from_slice(p.text());
        }
    }

    /// A whole line none of which was shown: the prefix, and the prefix again after every
    /// `\r` (but one right after it).
    pub(super) fn render_fresh(prefix: Option<&Prefix>, line: &[u8], out: &mut Vec<u8>) {
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
    pub(super) fn render(
        &mut self,
        open: Option<u64>,
        upto: usize,
        out: &mut Vec<u8>,
    ) -> Option<u64> {
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
    use crate::output::prefix::tests::prefix;

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
}
