//! tether-core: start, watch and stop groups of processes on Linux without ever hanging
//! or leaving an orphan.
//!
//! - [`launch`]: what each child does to itself before it runs (own process group,
//!   parent-death signal, clean signal state, only the fds asked for).
//! - [`attrs`]: the caller's process attributes (umask, limits, affinity, ...) a child takes.
//! - [`supervisor`]: the long-lived thread that launches children and waits on their pidfds
//!   with epoll, drains their reports, records their exits and reaps them.
//! - [`group`]: [`Group`], the handle to a set of children (wait, signal, first failure,
//!   terminate).
//! - [`zygote`]: the fork server's protocol, both sides: the warm process that forks
//!   children on request, and its client in the parent.
//! - [`limits`]: how many more processes the user's and the cgroup's limits leave.
//! - [`report`]: a child's failure report as it arrives.
//! - [`stacks`]: every Python child's stacks on demand, through one channel per process.
//! - [`status`]: exit statuses and signal names.
//! - [`channel`]: message channels with fds between running processes.
//! - [`title`]: a process's title in `ps` and its name in `/proc/PID/comm`.
//! - [`logging`]: `TETHER_LOG=info|debug` sends the runtime's events to stderr.
//! - [`workers`]: a pool's worker set: its table of workers, task scheduling, deaths.

pub mod attrs;
pub mod channel;
pub mod group;
pub mod launch;
pub mod limits;
pub mod logging;
pub mod report;
pub mod stacks;
pub mod status;
pub mod supervisor;
pub mod title;
pub mod workers;
pub mod zygote;

pub use group::{Escalation, Exit, Group, Member, WaitFor};
pub use launch::LaunchSpec;
pub use status::{signal_name, ExitStatus};
pub use supervisor::{Adoption, Reserve};

use std::io;

/// Errors of tether-core.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start {program:?}: {}{}", strerror(source), limit_hint(source))]
    Launch {
        program: String,
        #[source]
        source: io::Error,
    },
    /// A system resource ran out (fds, processes, memory) or a system call failed while
    /// starting processes.
    #[error("{what}: {}{}", strerror(source), limit_hint(source))]
    Resource {
        what: String,
        #[source]
        source: io::Error,
    },
    /// The zygote died, stopped answering, or broke its protocol.
    #[error("{0}")]
    Zygote(String),
    #[error("the tether supervisor thread is gone")]
    SupervisorGone,
    #[error("{}{}", strerror(source), limit_hint(source))]
    Io {
        #[from]
        source: io::Error,
    },
}

impl Error {
    /// The errno behind the error, if one is.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Launch { source, .. }
            | Error::Resource { source, .. }
            | Error::Io { source } => source.raw_os_error(),
            Error::Zygote(_) | Error::SupervisorGone => None,
        }
    }

    /// `Error::Resource` for a failed step `what`.
    pub fn resource(what: impl Into<String>, source: impl Into<io::Error>) -> Error {
        Error::Resource {
            what: what.into(),
            source: source.into(),
        }
    }
}

impl From<rustix::io::Errno> for Error {
    fn from(errno: rustix::io::Errno) -> Error {
        Error::from(io::Error::from(errno))
    }
}

/// The error's text without Rust's " (os error N)" suffix (Python shows the errno itself).
pub fn strerror(err: &io::Error) -> String {
    let text = err.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_string(),
        _ => text,
    }
}

/// Which system limit an error most likely hit, as "; <sentence>" (empty when none).
pub fn limit_hint(err: &io::Error) -> String {
    let soft = |resource: libc::__rlimit_resource_t| {
        // SAFETY: getrlimit writes into a plain-data struct.
        let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::getrlimit(resource, &mut lim) } != 0
            || lim.rlim_cur == libc::RLIM_INFINITY
        {
            return "unlimited".to_string();
        }
        lim.rlim_cur.to_string()
    };
    match err.raw_os_error() {
        Some(libc::EMFILE) => format!(
            "; the open-file limit of this process is reached (RLIMIT_NOFILE = {}, `ulimit -n`)",
            soft(libc::RLIMIT_NOFILE)
        ),
        Some(libc::ENFILE) => "; the system-wide open-file limit is reached (fs.file-max)".into(),
        Some(libc::EAGAIN) => format!(
            "; the process limit is reached (RLIMIT_NPROC = {}, `ulimit -u`), or the system's \
             pid limit, or a cgroup's pids.max",
            soft(libc::RLIMIT_NPROC)
        ),
        Some(libc::ENOMEM) => format!(
            "; out of memory (or the address-space limit RLIMIT_AS = {})",
            soft(libc::RLIMIT_AS)
        ),
        _ => String::new(),
    }
}
