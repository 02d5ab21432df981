//! The process attributes a child takes from the caller, as a child forked by the caller
//! would have them: read in the caller when the request is made, applied in the child.
//!
//! A child started with `exec` inherits the process-wide ones (umask, resource limits,
//! working directory, environment) from the warden, but its CPU affinity and nice
//! value are per thread on Linux and would be the warden thread's: [`ThreadAttributes`]
//! carries the calling thread's. A fork of the zygote inherits nothing from the caller:
//! [`Attributes`] carries everything.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use rustix::fs::Mode;
use rustix::io::Errno;
use rustix::process::{
    getpriority_process, getrlimit, setpriority_process, setrlimit, umask as umask_set, Resource,
    Rlimit,
};
use rustix::thread::{sched_getaffinity, sched_setaffinity, CpuSet};

use crate::proc::{self, Of};

/// The resources whose limits a child takes (`RLIMIT_CPU` .. `RLIMIT_RTTIME`).
const RLIMITS: u32 = 16;

/// One resource limit: resource number, soft and hard limit.
pub type Limit = (u32, u64, u64);

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
        let set = sched_getaffinity(None)?;
        let mut affinity = vec![0u8; CpuSet::MAX_CPU / 8];
        for cpu in (0..CpuSet::MAX_CPU).filter(|&cpu| set.is_set(cpu)) {
            affinity[cpu / 8] |= 1 << (cpu % 8);
        }
        Ok(ThreadAttributes {
            affinity,
            nice: getpriority_process(None)?,
        })
    }

    /// Applies them to the calling thread. Only system calls, no allocation: safe between
    /// fork and exec. A nice value lower than the current one needs a privilege the caller
    /// may not have (it then keeps the higher one, as the kernel allows).
    pub fn apply(&self) -> io::Result<()> {
        if !self.affinity.is_empty() {
            let mut set = CpuSet::new();
            let cpus = (self.affinity.len() * 8).min(CpuSet::MAX_CPU);
            for cpu in (0..cpus).filter(|&cpu| self.affinity[cpu / 8] & (1 << (cpu % 8)) != 0) {
                set.set(cpu);
            }
            sched_setaffinity(None, &set)?;
        }
        match setpriority_process(None, self.nice) {
            Ok(()) | Err(Errno::ACCESS | Errno::PERM) => Ok(()),
            Err(err) => Err(err.into()),
        }
    }
}

/// Everything a fork of the zygote takes from the caller.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes {
    pub umask: u32,
    pub rlimits: Vec<Limit>,
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
        umask_set(Mode::from_bits_retain(self.umask));
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

/// Linux's resources in the order of their numbers, `RLIMIT_CPU` (0) to `RLIMIT_RTTIME`.
const RESOURCES: [Resource; RLIMITS as usize] = [
    Resource::Cpu,
    Resource::Fsize,
    Resource::Data,
    Resource::Stack,
    Resource::Core,
    Resource::Rss,
    Resource::Nproc,
    Resource::Nofile,
    Resource::Memlock,
    Resource::As,
    Resource::Locks,
    Resource::Sigpending,
    Resource::Msgqueue,
    Resource::Nice,
    Resource::Rtprio,
    Resource::Rttime,
];

/// `RLIM_INFINITY`, as the wire carries it.
const INFINITY: u64 = u64::MAX;

fn rlimits() -> io::Result<Vec<Limit>> {
    let limits = RESOURCES.iter().map(|&resource| {
        let limit = getrlimit(resource);
        let (soft, hard) = (limit.current, limit.maximum);
        (
            resource as u32,
            soft.unwrap_or(INFINITY),
            hard.unwrap_or(INFINITY),
        )
    });
    Ok(limits.collect())
}

fn set_rlimit(resource: u32, soft: u64, hard: u64) -> io::Result<()> {
    let unknown = || io::Error::new(io::ErrorKind::InvalidInput, "no such resource");
    let kind = *RESOURCES.get(resource as usize).ok_or_else(unknown)?;
    let limit = |v: u64| (v != INFINITY).then_some(v);
    let new = Rlimit {
        current: limit(soft),
        maximum: limit(hard),
    };
    setrlimit(kind, new).map_err(|errno| {
        let err = io::Error::from(errno);
        io::Error::new(
            err.kind(),
            format!("cannot set resource limit {resource} to ({soft}, {hard}): {err}"),
        )
    })
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
