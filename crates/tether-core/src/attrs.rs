//! The process attributes a child takes from the caller, as a child forked by the caller
//! would have them: read in the caller when the request is made, applied in the child.
//!
//! A child started with `exec` inherits the process-wide ones (umask, resource limits,
//! working directory, environment) from the supervisor, but its CPU affinity and nice
//! value are per thread on Linux and would be the supervisor thread's: [`ThreadAttributes`]
//! carries the calling thread's. A fork of the zygote inherits nothing from the caller:
//! [`Attributes`] carries everything.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use crate::proc::{self, Of};

/// The resources whose limits a child takes (`RLIMIT_CPU` .. `RLIMIT_RTTIME`).
const RLIMITS: u32 = 16;

/// One resource limit: resource number, soft and hard limit.
pub type Rlimit = (u32, u64, u64);

/// The attributes Linux keeps per thread: CPU affinity and nice value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ThreadAttributes {
    /// The raw `cpu_set_t` of the calling thread.
    pub affinity: Vec<u8>,
    pub nice: i32,
}

impl ThreadAttributes {
    /// The calling thread's.
    pub fn of_calling_thread() -> io::Result<ThreadAttributes> {
        // SAFETY: cpu_set_t is plain data; zeroed is an empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: sched_getaffinity writes at most `size` bytes into `set`.
        if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `set` is a plain-data struct of `size` bytes.
        let affinity = unsafe { std::slice::from_raw_parts((&set as *const _) as *const u8, size) };
        Ok(ThreadAttributes {
            affinity: affinity.to_vec(),
            nice: nice_of_calling_thread()?,
        })
    }

    /// Applies them to the calling thread. Only system calls, no allocation: safe between
    /// fork and exec. A nice value lower than the current one needs a privilege the caller
    /// may not have (it then keeps the higher one, as the kernel allows).
    pub fn apply(&self) -> io::Result<()> {
        if !self.affinity.is_empty() {
            // SAFETY: `affinity` holds the bytes of a cpu_set_t read by `of_calling_thread`.
            let rc = unsafe {
                libc::sched_setaffinity(
                    0,
                    self.affinity.len(),
                    self.affinity.as_ptr() as *const libc::cpu_set_t,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: setpriority on the calling thread touches no memory.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, self.nice) } != 0 {
            let err = io::Error::last_os_error();
            if !matches!(err.raw_os_error(), Some(libc::EACCES) | Some(libc::EPERM)) {
                return Err(err);
            }
        }
        Ok(())
    }
}

fn nice_of_calling_thread() -> io::Result<i32> {
    // getpriority may return -1 as a value: errno tells an error apart.
    // SAFETY: errno is thread-local; getpriority touches no memory.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        if nice == -1 && *libc::__errno_location() != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(nice)
    }
}

/// Everything a fork of the zygote takes from the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes {
    pub umask: u32,
    pub rlimits: Vec<Rlimit>,
    pub thread: ThreadAttributes,
    pub cwd: Vec<u8>,
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The error for a working directory that cannot be read: one that no longer exists says
/// so, since a child is to start in it.
pub fn working_directory_error(err: io::Error) -> io::Error {
    match err.kind() {
        io::ErrorKind::NotFound => io::Error::new(
            err.kind(),
            "the working directory of this process no longer exists (deleted, or its mount \
             is gone): a 'spawn' or 'forkserver' child starts in it; change to a directory \
             that exists ('fork' children share the deleted one)",
        ),
        _ => io::Error::new(
            err.kind(),
            format!("cannot read the working directory of this process: {err}"),
        ),
    }
}

impl Attributes {
    /// The calling process's (and calling thread's), now.
    pub fn of_caller() -> io::Result<Attributes> {
        Ok(Attributes {
            umask: umask()?,
            rlimits: rlimits()?,
            thread: ThreadAttributes::of_calling_thread()?,
            cwd: std::env::current_dir()
                .map_err(working_directory_error)?
                .into_os_string()
                .into_vec(),
            env: std::env::vars_os()
                .map(|(k, v)| (k.into_vec(), v.into_vec()))
                .collect(),
        })
    }

    /// Applies working directory, umask, resource limits, affinity and nice value to this
    /// process (the environment is the caller's to apply: Python keeps its own copy).
    pub fn apply(&self) -> io::Result<()> {
        let cwd = OsString::from_vec(self.cwd.clone());
        std::env::set_current_dir(&cwd).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot enter {:?}: {e}", cwd.as_bytes().escape_ascii()),
            )
        })?;
        // SAFETY: umask only sets a process attribute.
        unsafe { libc::umask(self.umask as libc::mode_t) };
        for &(resource, soft, hard) in &self.rlimits {
            set_rlimit(resource, soft, hard)?;
        }
        self.thread.apply()
    }

    /// Whether a process started with `self`'s limits can take `other`'s: no hard limit of
    /// `other` is above `self`'s (raising one needs a privilege).
    pub fn limits_allow(&self, other: &Attributes) -> bool {
        other.rlimits.iter().all(|&(resource, _, hard)| {
            self.rlimits
                .iter()
                .find(|r| r.0 == resource)
                .map_or(true, |&(_, _, ours)| hard <= ours)
        })
    }
}

/// The process's file mode creation mask, read without changing it.
fn umask() -> io::Result<u32> {
    let umask = proc::status(Of::This).and_then(|s| s.radix("Umask", 8));
    let missing = || io::Error::new(io::ErrorKind::InvalidData, "no Umask in /proc/self/status");
    umask.map(|u| u as u32).ok_or_else(missing)
}

fn rlimits() -> io::Result<Vec<Rlimit>> {
    (0..RLIMITS)
        .map(|resource| {
            // SAFETY: rlimit is plain data, filled by getrlimit.
            let mut lim: libc::rlimit = unsafe { std::mem::zeroed() };
            // SAFETY: getrlimit writes into `lim`.
            if unsafe { libc::getrlimit(resource as _, &mut lim) } != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok((resource, lim.rlim_cur, lim.rlim_max))
        })
        .collect()
}

fn set_rlimit(resource: u32, soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads `lim`.
    if unsafe { libc::setrlimit(resource as _, &lim) } != 0 {
        let err = io::Error::last_os_error();
        return Err(io::Error::new(
            err.kind(),
            format!("cannot set resource limit {resource} to ({soft}, {hard}): {err}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_attributes_are_read() {
        let attrs = Attributes::of_caller().unwrap();
        assert_eq!(attrs.rlimits.len(), RLIMITS as usize);
        assert!(!attrs.thread.affinity.is_empty());
        assert_eq!(
            attrs.cwd,
            std::env::current_dir().unwrap().into_os_string().into_vec()
        );
        assert!(attrs.umask <= 0o777);
    }

    #[test]
    fn a_higher_hard_limit_is_not_allowed() {
        let base = Attributes {
            rlimits: vec![(7, 10, 100)],
            ..Attributes::default()
        };
        let lower = Attributes {
            rlimits: vec![(7, 5, 50)],
            ..Attributes::default()
        };
        let higher = Attributes {
            rlimits: vec![(7, 5, 500)],
            ..Attributes::default()
        };
        assert!(base.limits_allow(&lower));
        assert!(!base.limits_allow(&higher));
    }
}
