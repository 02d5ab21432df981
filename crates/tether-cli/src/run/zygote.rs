//! A node's zygote, for warm ranks: one Python process per node, started with the ranks'
//! common environment as soon as the supervisor starts, which imports once the installed
//! packages the script imports (torch, ...); every rank of every attempt, and the node's
//! rendezvous helper, is a fork of it. What a rank sees is `tether.run.warm`'s to make equal to
//! `python -u SCRIPT ARGS` (see there); this side starts the zygote, reads what it
//! preloaded, and asks it for each process.
//!
//! The zygote starts as `PYTHON -c BOOTSTRAP` with [`VARIABLE`] set, which makes tether's
//! start-up hook (`tether_warm.pth`, `_tether_warm`) replace that interpreter by one started
//! with the ranks' own command line, and make it the zygote right before the script would
//! run: its command line, `sys.argv`, `sys.path[0]` and flags are the ranks' own. An
//! interpreter without the hook (tether is not installed for it) runs the bootstrap itself,
//! which exits with [`NO_HOOK`] and runs nothing of the user's. Whatever keeps a zygote from
//! serving, the run goes on with cold ranks (see `run/warm.rs`).

use std::ffi::OsString;
use std::os::fd::BorrowedFd;
use std::os::unix::ffi::OsStrExt;

use serde_json::{json, Value};
use tether_core::attrs::Attributes;
use tether_core::zygote::{ForkRequest, Zygote};
use tether_core::{Group, LaunchSpec};

use super::env;
use crate::config::Config;

/// The variable that carries the zygote's configuration (JSON) to the start-up hook.
const VARIABLE: &str = "TETHER_WARM";
/// A variable whose value only makes room in the zygote's environment strings, so that each
/// rank can show its own environment in `/proc/PID/environ` (it has more variables).
const ROOM: &str = "TETHER_WARM_ROOM";
/// The configuration's version, which the hook checks.
const VERSION: u32 = 1;
/// The exit status of a bootstrap that no hook took over.
pub const NO_HOOK: i32 = 75;
const BOOTSTRAP: &str = "raise SystemExit(75)";

/// What a node's rendezvous helper needs of torch and tether: the zygote imports it too when
/// the script imports torch (a script that does not keeps its ranks free of torch, and its
/// helper starts as a new interpreter).
pub const HELPER_MODULES: [&str; 5] = [
    "torch.distributed.elastic.rendezvous",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.utils",
    "tether.run.rendezvous.helper",
];

/// The launcher's handle on its node's zygote.
pub struct NodeZygote {
    zygote: Zygote,
    python: OsString,
    ready: bool,
    /// Whether it has imported what the rendezvous helper needs (said once ready).
    hosts_helper: bool,
    /// Whether it has preloaded torch (said once ready).
    torch: bool,
}

impl NodeZygote {
    /// Starts the zygote of `cfg`'s ranks (with `helper`, it also imports what the
    /// rendezvous helper needs); returns at once, the zygote importing in the background.
    pub fn start(cfg: &Config, omp_unset: bool, helper: bool) -> Result<NodeZygote, String> {
        let python = cfg.command.first().cloned().unwrap_or_default();
        let mut spec = LaunchSpec::new([python.clone(), "-c".into(), BOOTSTRAP.into()]);
        let varying = env::varying(cfg);
        let helper_modules: &[&str] = if helper { &HELPER_MODULES } else { &[] };
        let config = json!({
            "version": VERSION,
            "phase": "boot",
            "argv": cfg.command.iter().map(|a| hex(a.as_bytes())).collect::<Vec<_>>(),
            "varying": varying,
            "extra": [],
            "helper": helper_modules,
            "blanks": cfg.nproc,
        });
        spec.env = env::common(cfg, omp_unset);
        spec.env.push((VARIABLE.into(), config.to_string().into()));
        spec.env
            .push((ROOM.into(), " ".repeat(room(cfg, omp_unset)).into()));
        spec.env_remove = varying.iter().map(OsString::from).collect();
        spec.env_remove.push(tether_core::stacks::FD_ENV.into());
        let zygote = Zygote::start(spec).map_err(|e| e.to_string())?;
        log::info!(target: "tether::run", "started the zygote of the warm ranks: pid {}", zygote.pid());
        Ok(NodeZygote {
            zygote,
            python,
            ready: false,
            hosts_helper: false,
            torch: false,
        })
    }

    pub fn pid(&self) -> i32 {
        self.zygote.pid()
    }

    /// The pids of the children it keeps forked ahead (a restart's ranks cost no fork).
    pub fn blanks(&self) -> Vec<i32> {
        self.zygote.blanks()
    }

    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Whether the rendezvous helper is to be forked from it (it imported what the helper
    /// needs: the script imports torch).
    pub fn hosts_helper(&self) -> bool {
        self.ready && self.hosts_helper
    }

    /// Whether it has preloaded torch: its ranks are likely to meet through torch's store.
    pub fn preloaded_torch(&self) -> bool {
        self.ready && self.torch
    }

    /// The fd to poll while it gets ready (readable once it is ready, or gone).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.zygote.fd()
    }

    /// Waits for the zygote to be ready; returns the notes about its preload (the modules it
    /// left to the ranks, and why), or why it cannot serve.
    pub fn wait_ready(&mut self) -> Result<Vec<String>, String> {
        let said = match self.zygote.wait_ready() {
            Ok(said) => said.to_vec(),
            Err(err) => return Err(self.why(err)),
        };
        self.ready = true;
        let said: Value = serde_json::from_slice(&said).unwrap_or_default();
        self.hosts_helper = said["helper"].as_bool().unwrap_or(false);
        let list = |key: &str| -> Vec<(String, String)> {
            let pairs = said[key].as_array().cloned().unwrap_or_default();
            pairs
                .iter()
                .filter_map(|p| Some((p[0].as_str()?.to_string(), p[1].as_str()?.to_string())))
                .collect()
        };
        let mut notes: Vec<String> = list("left_out")
            .into_iter()
            .map(|(module, why)| {
                format!(
                    "tether: warning: warm ranks: {module} is left out of the zygote's preload \
                     ({why}); each rank imports it itself"
                )
            })
            .collect();
        notes.extend(list("failed").into_iter().map(|(module, error)| {
            format!(
                "tether: warning: warm ranks: cannot preload {module} ({error}); each rank \
                 imports it itself"
            )
        }));
        let preloaded: Vec<&str> = said["preloaded"].as_array().map_or(Vec::new(), |all| {
            all.iter().filter_map(Value::as_str).collect()
        });
        self.torch = preloaded
            .iter()
            .any(|m| m.split('.').next() == Some("torch"));
        let preloaded = preloaded.len();
        log::info!(target: "tether::run", "the zygote (pid {}) is ready: {preloaded} module(s) preloaded", self.pid());
        Ok(notes)
    }

    /// Why the zygote cannot serve, in words, from the error its client gave.
    fn why(&self, err: tether_core::Error) -> String {
        let no_hook = self
            .zygote
            .exit()
            .is_some_and(|e| e.status == tether_core::ExitStatus::Exited(NO_HOOK));
        if no_hook {
            return format!(
                "{} has no tether start-up hook (tether is not installed for it)",
                self.python.to_string_lossy()
            );
        }
        err.to_string()
    }

    /// Forks local rank `local` of `spec` (its environment, stdout and stderr, stacks
    /// channel) into `group`.
    pub fn fork_rank(
        &mut self,
        group: &Group,
        spec: &LaunchSpec,
        local: u32,
    ) -> Result<(), tether_core::Error> {
        let mut attrs = Attributes::of_caller().map_err(|e| {
            tether_core::Error::resource("cannot read this process's attributes", e)
        })?;
        attrs.env = environment(attrs.env, spec);
        let stdin = standard(0);
        let stdout = borrow(spec.stdout.unwrap_or(1));
        let stderr = borrow(spec.stderr.unwrap_or(2));
        let mut shared: Vec<(BorrowedFd<'_>, i32)> = stdin.map(|fd| (fd, 0)).into_iter().collect();
        shared.extend([(stdout, 1), (stderr, 2)]);
        let mut stacks = Value::Null;
        if spec.stacks {
            if let Ok((fd, inode)) = tether_core::stacks::channel_fd() {
                shared.push((borrow(fd), fd));
                stacks = json!([fd, inode]);
            }
        }
        let payload = json!({"kind": "rank", "stacks": stacks}).to_string();
        let request = ForkRequest {
            ranks: &[local],
            shared: &shared,
            payload: payload.as_bytes(),
            attrs,
        };
        self.zygote.fork(&request, group).map(drop)
    }

    /// Forks the node's rendezvous helper into `group`, with `stdin` and `stdout` as its
    /// own and the launcher's stderr; `options` is its argument (JSON).
    pub fn fork_helper(
        &mut self,
        group: &Group,
        stdin: BorrowedFd<'_>,
        stdout: BorrowedFd<'_>,
        options: &str,
    ) -> Result<(), tether_core::Error> {
        let attrs = Attributes::of_caller().map_err(|e| {
            tether_core::Error::resource("cannot read this process's attributes", e)
        })?;
        let shared = [(stdin, 0), (stdout, 1), (borrow(2), 2)];
        let payload = json!({"kind": "helper", "options": options}).to_string();
        let request = ForkRequest {
            ranks: &[0],
            shared: &shared,
            payload: payload.as_bytes(),
            attrs,
        };
        self.zygote.fork(&request, group).map(drop)
    }

    /// Stops the zygote (the processes it made are not affected).
    pub fn close(&mut self) {
        self.zygote.close(std::time::Duration::from_secs(1));
    }
}

/// `base` (this process's environment) with `spec`'s variables set and removed.
fn environment(base: Vec<(Vec<u8>, Vec<u8>)>, spec: &LaunchSpec) -> Vec<(Vec<u8>, Vec<u8>)> {
    let removed = |key: &[u8]| {
        spec.env_remove.iter().any(|r| r.as_bytes() == key)
            || spec.env.iter().any(|(k, _)| k.as_bytes() == key)
    };
    let mut env: Vec<(Vec<u8>, Vec<u8>)> = base.into_iter().filter(|(k, _)| !removed(k)).collect();
    env.extend(
        spec.env
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())),
    );
    env
}

/// How many bytes the zygote's environment strings keep free for a rank's own variables.
fn room(cfg: &Config, omp_unset: bool) -> usize {
    let last = cfg.nproc.saturating_sub(1);
    let long_path = std::path::PathBuf::from("/".repeat(512));
    let vars = env::rank_env(cfg, last, cfg.max_restarts, &long_path, omp_unset);
    // The variables as `KEY=VALUE\0`, and room for an address and a port a round may give.
    vars.iter()
        .map(|(k, v)| k.len() + v.len() + 2)
        .sum::<usize>()
        + 512
}

/// The fd of a standard stream, when it is open.
fn standard(fd: i32) -> Option<BorrowedFd<'static>> {
    let fd = borrow(fd);
    rustix::io::fcntl_getfd(fd).ok().map(|_| fd)
}

fn borrow(fd: i32) -> BorrowedFd<'static> {
    // SAFETY: the fds borrowed here (the standard streams, a rank's pipes, the stacks
    // channel) stay open in this process for the whole fork request that uses them.
    unsafe { BorrowedFd::borrow_raw(fd) }
}

/// Bytes as lowercase hexadecimal (JSON carries a command line's bytes, whatever they are).
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_gets_this_environment_with_its_own_variables() {
        let base = vec![
            (b"A".to_vec(), b"1".to_vec()),
            (b"RANK".to_vec(), b"9".to_vec()),
            (b"GONE".to_vec(), b"x".to_vec()),
        ];
        let mut spec = LaunchSpec::new(["python"]);
        spec.env = vec![("RANK".into(), "3".into())];
        spec.env_remove = vec!["GONE".into()];
        let env = environment(base, &spec);
        assert_eq!(
            env,
            [
                (b"A".to_vec(), b"1".to_vec()),
                (b"RANK".to_vec(), b"3".to_vec())
            ]
        );
        assert_eq!(hex(b"\x00a\xff"), "0061ff");
    }
}
