//! The last lines a rank wrote to stderr (or to its one pipe), for the failure report.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use super::line::segment_start;

/// Lines kept per rank for the failure report.
pub const TAIL_LINES: usize = 20;
/// Bytes of each kept line.
const TAIL_LINE_BYTES: usize = 4096;

/// The last lines a rank wrote to stderr (or to its one pipe).
#[derive(Debug, Default)]
pub struct Tail {
    lines: VecDeque<String>,
}

impl Tail {
    /// Keeps `line` as a terminal shows it: the part after its last `\r`.
    pub(super) fn push(&mut self, line: &[u8]) {
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

    #[test]
    fn the_tail_keeps_what_a_terminal_shows_of_a_redrawn_line() {
        let mut tail = Tail::default();
        tail.push(b"\rstep 0\rstep 1\r\n");
        tail.push(b"plain\r\n");
        assert_eq!(tail.lines(), ["step 1", "plain"]);
    }
}
