//! What one process answered a request for its stacks, and its words: the whole dump,
//! the start of one cut by the timeout, or why there is none (it exited, has no handler,
//! was left alone, could not be asked).

use std::time::Duration;

use crate::status::ExitStatus;

/// What one process answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Its whole dump.
    Stack(String),
    /// The start of a dump that did not end within the timeout, and its state then.
    Cut { text: String, state: Option<char> },
    /// Nothing within the timeout, and its state then.
    Silent { state: Option<char> },
    /// It handles no stack request: not a Python process started by tether's Python (or
    /// one still starting up).
    NoHandler,
    /// It had exited (with this status, when known).
    Exited(Option<ExitStatus>),
    /// The request could not be sent.
    Unreachable(String),
    /// It was not asked, since asking would change what it does (see [`Untouched`]).
    LeftAlone(Untouched),
}

/// Why a process was not sent a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Untouched {
    /// It no longer holds the stacks channel: it closed the fd, or reused its number.
    ChannelGone,
    /// It installed its own handler for one of tether's signals.
    OwnHandler,
    /// Its main thread blocks the request signal, or waits for it (`sigwait`).
    Blocked,
    /// Its main thread waits in `pause()` or `sigsuspend()`.
    Paused,
}

/// One process's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub pid: i32,
    pub reply: Reply,
    /// py-spy's view (or why there is none), when it was asked for.
    pub native: Option<String>,
}

impl Answer {
    /// Whether the whole Python stack arrived.
    pub fn answered(&self) -> bool {
        matches!(self.reply, Reply::Stack(_))
    }

    /// The stack as text, or a line saying why there is none (naming the pid, the timeout
    /// and the process's state), then py-spy's view if any.
    pub fn text(&self, timeout: Duration) -> String {
        let pid = self.pid;
        let within = seconds(timeout);
        let mut text = match &self.reply {
            Reply::Stack(text) => text.trim_end().to_string(),
            Reply::Cut { text, state } => format!(
                "{}\n(the dump was cut short: pid {pid} did not finish it within {within}; it \
                 is {})",
                text.trim_end(),
                state_words(*state)
            ),
            Reply::Silent { state } => format!(
                "(no Python stack: pid {pid} did not answer within {within}; it is {})",
                state_words(*state)
            ),
            Reply::NoHandler => format!(
                "(no Python stack: pid {pid} cannot answer: it is not a Python process started \
                 by tether's Python, or it is still starting up)"
            ),
            Reply::Exited(Some(status)) => {
                format!("(no Python stack: pid {pid} has exited with {status})")
            }
            Reply::Exited(None) => format!("(no Python stack: pid {pid} has exited)"),
            Reply::Unreachable(why) => format!("(no Python stack: cannot ask pid {pid}: {why})"),
            Reply::LeftAlone(why) => format!("(no Python stack: pid {pid} {})", why.words()),
        };
        if let Some(native) = &self.native {
            text.push_str("\n\nNative stack (py-spy dump --native):\n");
            text.push_str(native.trim_end());
        }
        text
    }
}

impl Untouched {
    fn words(self) -> &'static str {
        match self {
            Untouched::ChannelGone => {
                "closed its stacks channel or reused its fd number; tether writes into no fd \
                 it does not own, so this process cannot answer"
            }
            Untouched::OwnHandler => {
                "installed its own handler for tether's stack signals (SIGRTMIN+4, \
                 SIGRTMIN+5); tether no longer sends them"
            }
            Untouched::Blocked => {
                "blocks or waits for tether's stack signal (SIGRTMIN+4) in its main \
                 thread, where a sigwait or signalfd of its own would take it; it was not \
                 asked"
            }
            Untouched::Paused => {
                "waits in signal.pause() (or sigsuspend) in its main thread, which any \
                 signal handler would end; it was not asked"
            }
        }
    }
}

/// `5 s`, `0.5 s`.
fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{} s", format!("{s:.3}").trim_end_matches('0'))
    }
}

/// A process's state in words, with a hint where the state explains the silence.
fn state_words(state: Option<char>) -> String {
    match state {
        Some('T') => "stopped (state T): a stopped process answers only once continued \
                      (SIGCONT)"
            .into(),
        Some('t') => "stopped by a debugger (state t)".into(),
        Some('D') => "in uninterruptible sleep in the kernel (state D), where no signal \
                      handler runs"
            .into(),
        Some('Z') => "a zombie (state Z): it has exited".into(),
        Some('R') => "running (state R): it may block the signal, or be too busy".into(),
        Some('S') => "sleeping (state S): it may block the signal".into(),
        Some(c) => format!("in state {c}"),
        None => "gone".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_read_as_seconds() {
        assert_eq!(seconds(Duration::from_secs(5)), "5 s");
        assert_eq!(seconds(Duration::from_millis(500)), "0.5 s");
        assert_eq!(seconds(Duration::from_millis(1250)), "1.25 s");
    }
}
