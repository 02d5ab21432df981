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

mod console;
mod line;
mod prefix;
pub mod pty;
mod pump;
mod tail;

pub use console::{console_is_one_file, message, silence, write_console, Stream};
pub use prefix::{Prefix, RankNames};
pub use pump::{touch, Activity, FilterSink, Pump};
pub use tail::{SharedTail, Tail};
