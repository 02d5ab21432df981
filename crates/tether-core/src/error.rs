//! [`Error`], the errors of tether-core, and the words that explain an errno to a user.

use std::io;

use rustix::process::{getrlimit, Resource};

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
    #[error("the tether warden thread is gone")]
    WardenGone,
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
            Error::Zygote(_) | Error::WardenGone => None,
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
    let soft = |resource: Resource| match getrlimit(resource).current {
        Some(limit) => limit.to_string(),
        None => "unlimited".to_string(),
    };
    match err.raw_os_error() {
        Some(libc::EMFILE) => format!(
            "; the open-file limit of this process is reached (RLIMIT_NOFILE = {}, `ulimit -n`)",
            soft(Resource::Nofile)
        ),
        Some(libc::ENFILE) => "; the system-wide open-file limit is reached (fs.file-max)".into(),
        Some(libc::EAGAIN) => format!(
            "; the process limit is reached (RLIMIT_NPROC = {}, `ulimit -u`), or the system's \
             pid limit, or a cgroup's pids.max",
            soft(Resource::Nproc)
        ),
        Some(libc::ENOMEM) => format!(
            "; out of memory (or the address-space limit RLIMIT_AS = {})",
            soft(Resource::As)
        ),
        _ => String::new(),
    }
}
