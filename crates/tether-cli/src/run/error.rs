//! What can stop an attempt before its ranks run, or while the launcher watches them.

use std::io;

use tether_core::{limit_hint, strerror};

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start {program:?}: {}{}", strerror(source), limit_hint(source))]
    Start { program: String, source: io::Error },
    #[error("{what}: {}{}", strerror(source), limit_hint(source))]
    Io { what: String, source: io::Error },
    #[error(transparent)]
    Core(#[from] tether_core::Error),
}

impl RunError {
    /// A failed launch of the ranks: the command's own error when it could not be started.
    pub fn from_launch(err: tether_core::Error) -> RunError {
        match err {
            tether_core::Error::Launch { program, source } => RunError::Start { program, source },
            other => RunError::Core(other),
        }
    }

    /// The launcher's exit status for this error: 127 for a command that does not exist,
    /// 126 for one that cannot be run, 1 otherwise (a shell's convention).
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Start { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => 127,
                _ => 126,
            },
            _ => 1,
        }
    }
}

/// Maps an I/O error to a [`RunError`] that says what failed.
pub fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}
