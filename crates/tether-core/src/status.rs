//! How a process ended: an exit code, or a signal (with its name and whether it dumped core),
//! and every sentence Rust says about it: the status in words (its `Display`), with a hint
//! where one helps ([`ExitStatus::describe`], [`ExitStatus::hint`]). Python's sentences, fed by
//! the same facts, live in `python/tether/_words.py`.

use std::fmt;

/// The way a child process ended, as reported by `waitid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// The process called `exit(code)` (or returned from `main`).
    Exited(i32),
    /// The process was killed by `signal`; `core_dumped` is set when it left a core dump.
    Signaled { signal: i32, core_dumped: bool },
    /// The status was lost: something else in the process reaped the child (a SIGCHLD
    /// disposition of SIG_IGN, or a `waitpid(-1)` of the program's own). Neither a success
    /// nor a failure.
    Unknown,
}

impl ExitStatus {
    /// True for `exit(0)` only.
    pub fn success(self) -> bool {
        self == ExitStatus::Exited(0)
    }

    /// True for a non-zero exit or a signal; an [`ExitStatus::Unknown`] is not a failure.
    pub fn failure(self) -> bool {
        match self {
            ExitStatus::Exited(code) => code != 0,
            ExitStatus::Signaled { .. } => true,
            ExitStatus::Unknown => false,
        }
    }

    /// The exit code in the convention of Python's `multiprocessing`: the code itself, or the
    /// negated signal number for a process killed by a signal; `None` when unknown.
    pub fn as_exitcode(self) -> Option<i32> {
        match self {
            ExitStatus::Exited(code) => Some(code),
            ExitStatus::Signaled { signal, .. } => Some(-signal),
            ExitStatus::Unknown => None,
        }
    }

    /// Whether the process dumped core.
    pub fn core_dumped(self) -> bool {
        matches!(
            self,
            ExitStatus::Signaled {
                core_dumped: true,
                ..
            }
        )
    }

    /// The status in words, with a hint for the signals that have one: "exit code 3",
    /// "signal SIGKILL; SIGKILL often means the kernel's OOM killer ended the process".
    pub fn describe(self) -> String {
        match self.signal().and_then(signal_hint) {
            Some(hint) => format!("{self}; {hint}"),
            None => self.to_string(),
        }
    }

    /// "`who` died with signal SIGKILL": a process that ended on its own, unasked.
    pub fn died(self, who: &str) -> String {
        format!("{who} died with {self}")
    }

    /// What a death by signal may mean: for SIGKILL, the kernel OOM killer, named as the
    /// cause when the cgroup's `oom_kill` count (`oom_kills`, before and after) rose.
    pub fn hint(self, oom_kills: Option<(u64, u64)>) -> Option<String> {
        let signal = self.signal()?;
        match oom_kills {
            Some((before, after)) if signal == libc::SIGKILL && after > before => Some(format!(
                "the kernel OOM killer killed it: this cgroup's oom_kill count rose from \
                 {before} to {after}"
            )),
            _ => signal_hint(signal).map(str::to_string),
        }
    }

    /// The exit code in the convention of a shell: the code itself, or 128 + signal.
    pub fn as_shell_code(self) -> i32 {
        match self {
            ExitStatus::Exited(code) => code,
            ExitStatus::Signaled { signal, .. } => 128 + signal,
            ExitStatus::Unknown => 255,
        }
    }

    /// The signal that killed the process, if one did.
    pub fn signal(self) -> Option<i32> {
        match self {
            ExitStatus::Exited(_) | ExitStatus::Unknown => None,
            ExitStatus::Signaled { signal, .. } => Some(signal),
        }
    }

    /// The status `waitpid` reports as `status` (an exit code in bits 8-15, or a signal in
    /// the low 7 bits with the core-dump bit).
    pub fn from_wait_status(status: i32) -> ExitStatus {
        match status & 0x7f {
            0 => ExitStatus::Exited((status >> 8) & 0xff),
            signal => ExitStatus::Signaled {
                signal,
                core_dumped: status & 0x80 != 0,
            },
        }
    }

    /// Classify the `si_code` / `si_status` pair that `waitid` reports for an exited child.
    pub fn from_siginfo(code: i32, status: i32) -> Option<ExitStatus> {
        match code {
            libc::CLD_EXITED => Some(ExitStatus::Exited(status)),
            libc::CLD_KILLED => Some(ExitStatus::Signaled {
                signal: status,
                core_dumped: false,
            }),
            libc::CLD_DUMPED => Some(ExitStatus::Signaled {
                signal: status,
                core_dumped: true,
            }),
            _ => None,
        }
    }
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            ExitStatus::Exited(code) => write!(f, "exit code {code}"),
            ExitStatus::Signaled {
                signal,
                core_dumped,
            } => {
                write!(f, "signal {}", signal_name(signal))?;
                if core_dumped {
                    write!(f, " (core dumped)")?;
                }
                Ok(())
            }
            ExitStatus::Unknown => write!(f, "exit status unavailable (reaped outside tether)"),
        }
    }
}

const NAMES: [&str; 31] = [
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGILL",
    "SIGTRAP",
    "SIGABRT",
    "SIGBUS",
    "SIGFPE",
    "SIGKILL",
    "SIGUSR1",
    "SIGSEGV",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGSTKFLT",
    "SIGCHLD",
    "SIGCONT",
    "SIGSTOP",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGURG",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGVTALRM",
    "SIGPROF",
    "SIGWINCH",
    "SIGIO",
    "SIGPWR",
    "SIGSYS",
];

/// The conventional name of a signal (`SIGKILL`), `SIGRTMIN+n` for real-time signals, or
/// `<Unknown signal N>` for a number Linux does not define.
pub fn signal_name(signal: i32) -> String {
    let rtmin = libc::SIGRTMIN();
    let rtmax = libc::SIGRTMAX();
    match signal {
        1..=31 => NAMES[(signal - 1) as usize].to_string(),
        s if s == rtmin => "SIGRTMIN".to_string(),
        s if s == rtmax => "SIGRTMAX".to_string(),
        s if s > rtmin && s < rtmax => format!("SIGRTMIN+{}", s - rtmin),
        s => format!("<Unknown signal {s}>"),
    }
}

/// The number of a signal given by name, with or without the `SIG` prefix (`"TERM"`,
/// `"SIGTERM"`), or as a number (`"15"`).
pub fn signal_from_name(name: &str) -> Option<i32> {
    if let Ok(n) = name.parse::<i32>() {
        return (1..=libc::SIGRTMAX()).contains(&n).then_some(n);
    }
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    if full == "SIGIOT" {
        return Some(libc::SIGABRT);
    }
    NAMES.iter().position(|n| *n == full).map(|i| i as i32 + 1)
}

/// A hint that helps the reader of an error about a process killed by `signal`.
pub fn signal_hint(signal: i32) -> Option<&'static str> {
    match signal {
        libc::SIGKILL => Some(
            "SIGKILL often means the kernel's OOM killer ended the process (check `dmesg` or \
             the memory limit)",
        ),
        libc::SIGBUS => Some("SIGBUS often means /dev/shm is too small for shared memory"),
        libc::SIGSEGV => Some("SIGSEGV is a crash in native code"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_linux_numbers() {
        assert_eq!(signal_name(libc::SIGHUP), "SIGHUP");
        assert_eq!(signal_name(libc::SIGABRT), "SIGABRT");
        assert_eq!(signal_name(libc::SIGKILL), "SIGKILL");
        assert_eq!(signal_name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(signal_name(libc::SIGTERM), "SIGTERM");
        assert_eq!(signal_name(libc::SIGSYS), "SIGSYS");
        assert_eq!(signal_name(libc::SIGRTMIN() + 2), "SIGRTMIN+2");
        assert_eq!(signal_name(0), "<Unknown signal 0>");
        assert_eq!(signal_name(200), "<Unknown signal 200>");
    }

    #[test]
    fn names_parse_back() {
        for n in 1..=31 {
            assert_eq!(signal_from_name(&signal_name(n)), Some(n));
        }
        assert_eq!(signal_from_name("term"), Some(libc::SIGTERM));
        assert_eq!(signal_from_name("SIGIOT"), Some(libc::SIGABRT));
        assert_eq!(signal_from_name("9"), Some(9));
        assert_eq!(signal_from_name("SIGNOPE"), None);
    }

    #[test]
    fn classification() {
        let exited = ExitStatus::from_siginfo(libc::CLD_EXITED, 3).unwrap();
        assert_eq!(exited, ExitStatus::Exited(3));
        assert_eq!(exited.as_exitcode(), Some(3));
        assert!(!exited.success());
        let killed = ExitStatus::from_siginfo(libc::CLD_KILLED, libc::SIGKILL).unwrap();
        assert_eq!(killed.as_exitcode(), Some(-9));
        assert_eq!(killed.as_shell_code(), 137);
        assert_eq!(killed.to_string(), "signal SIGKILL");
        let dumped = ExitStatus::from_siginfo(libc::CLD_DUMPED, libc::SIGABRT).unwrap();
        assert_eq!(dumped.to_string(), "signal SIGABRT (core dumped)");
        assert_eq!(ExitStatus::from_siginfo(libc::CLD_STOPPED, 19), None);
        assert!(ExitStatus::Exited(0).success());
    }

    #[test]
    fn unknown_is_neither_success_nor_failure() {
        let unknown = ExitStatus::Unknown;
        assert!(!unknown.success() && !unknown.failure());
        assert_eq!(unknown.as_exitcode(), None);
        assert_eq!(
            unknown.to_string(),
            "exit status unavailable (reaped outside tether)"
        );
        assert!(ExitStatus::Exited(1).failure());
    }

    #[test]
    fn descriptions_carry_hints() {
        let killed = ExitStatus::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false,
        };
        assert!(killed.describe().starts_with("signal SIGKILL; "));
        assert!(killed.describe().contains("OOM"));
        assert_eq!(ExitStatus::Exited(2).describe(), "exit code 2");
        let bus = ExitStatus::Signaled {
            signal: libc::SIGBUS,
            core_dumped: true,
        };
        assert_eq!(
            bus.describe(),
            "signal SIGBUS (core dumped); SIGBUS often means /dev/shm is too small for shared \
             memory"
        );
    }

    #[test]
    fn a_process_that_ended_unasked_died_with_its_status() {
        let killed = ExitStatus::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false,
        };
        assert_eq!(
            killed.died("the tether zygote (pid 7)"),
            "the tether zygote (pid 7) died with signal SIGKILL"
        );
        assert_eq!(ExitStatus::Exited(1).died("it"), "it died with exit code 1");
    }

    #[test]
    fn a_sigkill_hint_names_the_oom_killer_when_its_count_rose() {
        let killed = ExitStatus::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false,
        };
        assert_eq!(
            killed.hint(Some((1, 2))).as_deref(),
            Some("the kernel OOM killer killed it: this cgroup's oom_kill count rose from 1 to 2")
        );
        assert_eq!(
            killed.hint(Some((2, 2))).as_deref(),
            Some(
                "SIGKILL often means the kernel's OOM killer ended the process (check `dmesg` \
                 or the memory limit)"
            )
        );
        assert_eq!(killed.hint(None), killed.hint(Some((2, 2))));
        assert_eq!(ExitStatus::Exited(1).hint(Some((1, 2))), None);
        let term = ExitStatus::Signaled {
            signal: libc::SIGTERM,
            core_dumped: false,
        };
        assert_eq!(term.hint(None), None);
    }
}
