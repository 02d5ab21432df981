//! A child's failure report as the warden collects it from the report pipe.
//!
//! A report is one frame: a little-endian u64 length, then that many bytes. The moment the
//! whole frame has arrived the child counts as failed, even while it is still shutting down
//! (an interpreter with torch loaded takes most of a second to exit). A frame larger than
//! [`REPORT_LIMIT`] is kept up to the limit and the rest is counted, not stored: it still
//! counts as whole once its last byte has been read, so a child is never treated as done
//! while it is still writing.
//!
//! The frame's body, written by [`encode`]: the exception's type name (u32 length, then
//! UTF-8), its traceback text (u64 length, then UTF-8), then the pickled exception (the
//! rest, possibly empty). Type and text come first, so that a cut report keeps them.

use std::time::Duration;

use crate::codec::{Reader, Writer};

/// The most report bytes kept per child (the frame header included).
pub const REPORT_LIMIT: usize = 512 << 20;

const HEADER: u64 = 8;

/// What a child has written to its report pipe so far.
#[derive(Debug, Default)]
pub struct Report {
    data: Vec<u8>,
    /// Bytes read from the pipe, kept or not.
    received: u64,
    /// When the whole frame had arrived (`CLOCK_MONOTONIC`).
    complete_at: Option<Duration>,
    /// Whether the pipe has reached its end (or was never opened).
    closed: bool,
}

impl Report {
    /// A report that will never receive anything (a child without a report pipe).
    pub fn none() -> Report {
        Report {
            closed: true,
            ..Report::default()
        }
    }

    /// Takes in bytes read from the pipe at time `now`; returns true when they complete the
    /// frame.
    pub fn push(&mut self, bytes: &[u8], now: Duration) -> bool {
        let room = REPORT_LIMIT.saturating_sub(self.data.len());
        self.data.extend_from_slice(&bytes[..bytes.len().min(room)]);
        self.received += bytes.len() as u64;
        if self.complete_at.is_none() && self.frame_len().is_some_and(|n| self.received >= n) {
            self.complete_at = Some(now);
            return true;
        }
        false
    }

    /// The pipe has reached its end: the child closed it or exited.
    pub fn close(&mut self) {
        self.closed = true;
    }

    /// The frame's whole length (header included), once its header has arrived.
    fn frame_len(&self) -> Option<u64> {
        let body_len = Reader::new(&self.data, "failure report").u64().ok()?;
        Some(body_len.saturating_add(HEADER))
    }

    /// The bytes kept (at most [`REPORT_LIMIT`]).
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// When the whole frame had arrived.
    pub fn complete_at(&self) -> Option<Duration> {
        self.complete_at
    }

    /// True while the child has begun a frame and not finished it, with the pipe still open:
    /// it must not be signalled then.
    pub fn writing(&self) -> bool {
        !self.closed && self.received > 0 && self.complete_at.is_none()
    }
}

/// A failure report frame.
pub fn encode(type_name: &str, text: &[u8], pickled: &[u8]) -> Vec<u8> {
    let body_len = 4 + type_name.len() + 8 + text.len() + pickled.len();
    Writer::with_capacity(8 + body_len)
        .u64(body_len as u64)
        .u32(type_name.len() as u32)
        .raw(type_name.as_bytes())
        .bytes(text)
        .raw(pickled)
        .finish()
}

/// A report as read back, perhaps cut short.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    pub type_name: String,
    pub text: Vec<u8>,
    /// The pickled exception, when it arrived whole and was there.
    pub pickled: Option<Vec<u8>>,
    /// How many bytes of the frame are missing (cut at the limit, or never written).
    pub missing: u64,
}

/// Reads back what [`encode`] wrote, from `data` (a report's kept bytes); `None` when not
/// even the type name arrived.
pub fn decode(data: &[u8]) -> Option<Decoded> {
    let mut r = Reader::new(data, "failure report");
    let body_len = r.u64().ok()?;
    let missing = body_len.saturating_sub((data.len() - 8) as u64);
    let type_len = r.u32().ok()? as usize;
    let type_name = std::str::from_utf8(r.take(type_len).ok()?)
        .ok()?
        .to_string();
    let text_len = r.u64().ok()?;
    let text = r.take_up_to(text_len).to_vec();
    let pickled = Some(r.rest()).filter(|p| missing == 0 && !p.is_empty());
    Some(Decoded {
        type_name,
        text,
        pickled: pickled.map(<[u8]>::to_vec),
        missing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_read_back_whole_or_cut() {
        let frame = encode("ValueError", b"Traceback...\nValueError: boom\n", b"PICKLE");
        let whole = decode(&frame).unwrap();
        assert_eq!(whole.type_name, "ValueError");
        assert_eq!(whole.text, b"Traceback...\nValueError: boom\n");
        assert_eq!(whole.pickled.as_deref(), Some(&b"PICKLE"[..]));
        assert_eq!(whole.missing, 0);
        let cut = decode(&frame[..42]).unwrap();
        assert_eq!(cut.type_name, "ValueError");
        assert_eq!(cut.text, b"Traceback...");
        assert_eq!(cut.pickled, None);
        assert_eq!(cut.missing, (frame.len() - 42) as u64);
        assert_eq!(decode(&frame[..12]), None);
        let bare = decode(&encode("OSError", b"text", b"")).unwrap();
        assert_eq!(bare.pickled, None);
    }

    fn frame(body: &[u8]) -> Vec<u8> {
        Writer::new().bytes(body).finish()
    }

    #[test]
    fn a_frame_completes_with_its_last_byte() {
        let mut report = Report::default();
        let data = frame(b"hello");
        assert!(!report.push(&data[..3], Duration::from_secs(1)));
        assert!(report.writing());
        assert!(!report.push(&data[3..10], Duration::from_secs(2)));
        assert!(report.push(&data[10..], Duration::from_secs(3)));
        assert_eq!(report.complete_at(), Some(Duration::from_secs(3)));
        assert!(!report.writing());
        assert_eq!(report.bytes(), &data[..]);
    }

    #[test]
    fn a_frame_beyond_the_limit_is_cut_but_completes() {
        let mut report = Report::default();
        let len = REPORT_LIMIT as u64 + 100;
        assert!(!report.push(&Writer::new().u64(len).finish(), Duration::ZERO));
        let chunk = vec![b'x'; 1 << 20];
        let mut sent = 0u64;
        let mut complete = false;
        while sent < len {
            let n = chunk.len().min((len - sent) as usize);
            complete = report.push(&chunk[..n], Duration::ZERO);
            sent += n as u64;
        }
        assert!(complete);
        assert_eq!(report.bytes().len(), REPORT_LIMIT);
    }

    #[test]
    fn an_unfinished_frame_stops_writing_at_the_end_of_the_pipe() {
        let mut report = Report::default();
        report.push(&frame(b"abc")[..5], Duration::ZERO);
        assert!(report.writing());
        report.close();
        assert!(!report.writing());
        assert!(report.complete_at().is_none());
        assert!(!Report::none().writing());
    }
}
