//! torchrun's dynamic forms (`--rdzv-backend c10d`, `etcd`, `etcd-v2` on several nodes, or an
//! elastic `--nnodes MIN:MAX`): torch's own rendezvous handler runs in a helper process,
//! `python -m tether._rendezvous`, one per node, and tells the launcher this node's place in
//! each round. The launcher keeps the ranks, their output and the reports.
//!
//! The conversation is JSON lines: commands on the helper's stdin, answers and events on its
//! stdout (its module documentation lists them).

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use clap::error::ErrorKind;
use serde_json::{json, Value};

use tether_core::{Group, WaitFor};

use crate::args::{usage_error, RunArgs};

/// The rendezvous backend named by `--rdzv-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Node ranks from `--node-rank`: tether's own, pure Rust.
    Static,
    C10d,
    Etcd,
    EtcdV2,
}

impl Backend {
    /// `--standalone` is c10d on one node (run locally, without torch's handler).
    pub fn parse(backend: Option<&str>, standalone: bool) -> Result<Backend, clap::Error> {
        if standalone {
            return Ok(Backend::C10d);
        }
        match backend.map(str::trim) {
            None | Some("static") => Ok(Backend::Static),
            Some("c10d") => Ok(Backend::C10d),
            Some("etcd") => Ok(Backend::Etcd),
            Some("etcd-v2") => Ok(Backend::EtcdV2),
            Some(other) => Err(usage_error(
                ErrorKind::ValueValidation,
                format!(
                    "--rdzv-backend {other} is not supported: use static (with each node's \
                     --node-rank), c10d (torch's rendezvous over a TCPStore at \
                     --rdzv-endpoint), or etcd / etcd-v2 where python-etcd is installed"
                ),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Static => "static",
            Backend::C10d => "c10d",
            Backend::Etcd => "etcd",
            Backend::EtcdV2 => "etcd-v2",
        }
    }
}

/// This node's place in the job for one attempt: what its ranks' environment says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub node_rank: usize,
    pub nnodes: usize,
    /// The global rank of local rank 0.
    pub rank_base: usize,
    pub world_size: usize,
    pub role_rank_base: usize,
    pub role_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Whether the ranks join the launcher's store (`TORCHELASTIC_USE_AGENT_STORE`).
    pub agent_store: bool,
}

impl Place {
    /// A fixed place: `nnodes` nodes of `nproc` ranks each.
    pub fn fixed(node_rank: usize, nnodes: usize, nproc: usize, addr: String, port: u16) -> Place {
        Place {
            node_rank,
            nnodes,
            rank_base: node_rank * nproc,
            world_size: nnodes * nproc,
            role_rank_base: node_rank * nproc,
            role_world_size: nnodes * nproc,
            master_addr: addr,
            master_port: port,
            agent_store: false,
        }
    }

    /// The place before the first round of a dynamic rendezvous.
    pub fn unknown(nproc: usize) -> Place {
        Place::fixed(0, 1, nproc, String::new(), 0)
    }

    fn from_round(v: &Value) -> Option<Place> {
        let n = |key: &str| v[key].as_u64().map(|x| x as usize);
        Some(Place {
            node_rank: n("group_rank")?,
            nnodes: n("group_world_size")?,
            rank_base: n("rank_base")?,
            world_size: n("world_size")?,
            role_rank_base: n("role_rank_base")?,
            role_world_size: n("role_world_size")?,
            master_addr: v["master_addr"].as_str()?.to_string(),
            master_port: u16::try_from(v["master_port"].as_u64()?).ok()?,
            agent_store: v["agent_store"].as_bool()?,
        })
    }
}

/// The options torch's handler is built from, as torchrun builds it.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub backend: Backend,
    pub endpoint: String,
    pub run_id: String,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub conf: String,
    pub local_addr: Option<String>,
    pub role: String,
    pub nproc: usize,
}

impl Rendezvous {
    pub fn resolve(
        args: &RunArgs,
        backend: Backend,
        (min_nodes, max_nodes): (usize, usize),
        nproc: usize,
        run_id: &str,
    ) -> Result<Rendezvous, clap::Error> {
        let Some(endpoint) = args.rdzv.endpoint.clone().filter(|e| !e.trim().is_empty()) else {
            return Err(usage_error(
                ErrorKind::MissingRequiredArgument,
                format!(
                    "--rdzv-backend {} with --nnodes {} needs --rdzv-endpoint HOST[:PORT]: the \
                     address where the nodes meet (the node at that address hosts the store)",
                    backend.name(),
                    nodes_spec(min_nodes, max_nodes)
                ),
            ));
        };
        parse_endpoint(&endpoint)?;
        Ok(Rendezvous {
            backend,
            endpoint: endpoint.trim().to_string(),
            run_id: run_id.to_string(),
            min_nodes,
            max_nodes,
            conf: args.rdzv.conf.clone().unwrap_or_default(),
            local_addr: args.accepted.local_addr.clone(),
            role: args.program.role.clone(),
            nproc,
        })
    }

    /// The helper's argument: the options as JSON.
    pub fn options(&self) -> Value {
        json!({
            "backend": self.backend.name(),
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "conf": self.conf,
            "local_addr": self.local_addr,
            "role": self.role,
            "nproc": self.nproc,
        })
    }
}

/// `N` or `MIN:MAX`.
pub fn nodes_spec(min: usize, max: usize) -> String {
    if min == max {
        min.to_string()
    } else {
        format!("{min}:{max}")
    }
}

/// What the helper said.
#[derive(Debug)]
pub enum Message {
    /// A round formed: this node's place, and the round's number.
    Round(Place, u64),
    /// The membership of round `round` moved on (nodes waiting, a node gone).
    Restart {
        round: u64,
        why: String,
    },
    /// Another node ended the job; its root cause.
    Ended(Value),
    /// The job's root cause, after this node's final failure.
    Cause(Value),
    Bye,
    /// The rendezvous failed: a sentence naming the endpoint, the option or the node.
    Error(String),
}

impl Message {
    fn parse(line: &str) -> Message {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            return Message::Error(format!("the rendezvous helper said {line:?}"));
        };
        let round = v["round"].as_u64().unwrap_or(0);
        match v["kind"].as_str() {
            Some("round") => match Place::from_round(&v) {
                Some(place) => Message::Round(place, round),
                None => Message::Error(format!("the rendezvous helper said {line:?}")),
            },
            Some("restart") => Message::Restart {
                round,
                why: v["why"]
                    .as_str()
                    .unwrap_or("the membership changed")
                    .to_string(),
            },
            Some("ended") => Message::Ended(v["cause"].clone()),
            Some("cause") => Message::Cause(v["cause"].clone()),
            Some("bye") => Message::Bye,
            _ => Message::Error(v["message"].as_str().map_or_else(
                || format!("the rendezvous helper said {line:?}"),
                str::to_string,
            )),
        }
    }
}

/// The helper's pid, for [`let_the_helper_leave`] (0 when there is none).
static HELPER: AtomicI32 = AtomicI32::new(0);

/// The launcher is going away at once (its keeper is gone): SIGTERM lets the helper tell the
/// other nodes that this one left, before everything here is killed; waits up to `limit`.
pub fn let_the_helper_leave(limit: Duration) {
    let pid = HELPER.load(Ordering::SeqCst);
    if pid <= 0 {
        return;
    }
    // SAFETY: signals our own child, which is not reaped before this process ends (the
    // keeper's thread runs this last).
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline
        && tether_core::proc::process_state(pid).is_some_and(|s| s != 'Z')
    {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The helper's process: a new interpreter, or a fork of the node's zygote (warm ranks),
/// which tether-core watches and reaps.
enum Process {
    Cold(Child),
    Warm(Group),
}

/// The helper process of this node.
pub struct Helper {
    process: Process,
    pid: i32,
    stdin: Option<File>,
    stdout: BufReader<File>,
}

impl Helper {
    /// Starts `python -m tether._rendezvous`; it gets SIGTERM (and leaves the job) when the
    /// launcher dies.
    pub fn spawn(python: &OsString, rdzv: &Rendezvous) -> io::Result<Helper> {
        let mut command = Command::new(python);
        command
            .args(["-m", "tether._rendezvous"])
            .arg(rdzv.options().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl is async-signal-safe and touches only the child being started.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command.spawn()?;
        let pid = child.id() as i32;
        HELPER.store(pid, Ordering::SeqCst);
        let stdin = child.stdin.take().map(|s| File::from(OwnedFd::from(s)));
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        Ok(Helper {
            process: Process::Cold(child),
            pid,
            stdin,
            stdout: BufReader::new(File::from(OwnedFd::from(stdout))),
        })
    }

    /// The helper made by a fork of the node's zygote, the only member of `group`; `stdin`
    /// and `stdout` are the launcher's ends of its pipes. (It arms SIGTERM as its
    /// parent-death signal itself.)
    pub fn forked(group: Group, stdin: OwnedFd, stdout: OwnedFd) -> Helper {
        let pid = group.pid(0).unwrap_or(0);
        HELPER.store(pid, Ordering::SeqCst);
        Helper {
            process: Process::Warm(group),
            pid,
            stdin: Some(File::from(stdin)),
            stdout: BufReader::new(File::from(stdout)),
        }
    }

    /// The fd to poll for the helper's next message.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.stdout.get_ref().as_fd()
    }

    /// Whether a whole message is already buffered (poll would not say so).
    pub fn has_buffered(&self) -> bool {
        self.stdout.buffer().contains(&b'\n')
    }

    fn send(&mut self, message: Value) {
        if let Some(stdin) = &mut self.stdin {
            // A helper that is gone says so at the next read.
            let _ = writeln!(stdin, "{message}").and_then(|()| stdin.flush());
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn next_round(&mut self) {
        self.send(json!({"cmd": "next"}));
    }

    pub fn failed(&mut self, record: Value, last: bool) {
        self.send(json!({"cmd": "failed", "record": record, "final": last}));
    }

    pub fn done(&mut self) {
        self.send(json!({"cmd": "done"}));
    }

    /// Leaves the job (the other nodes start a new round without this one) and waits for the
    /// helper to end.
    pub fn leave(&mut self) {
        self.send(json!({"cmd": "leave"}));
        self.stdin = None;
        self.wait();
    }

    /// Waits for the helper to end; how it ended, in words.
    fn wait(&mut self) -> String {
        match &mut self.process {
            Process::Cold(child) => child.wait().map_or_else(
                |e| format!("cannot be waited for ({e})"),
                crate::report::describe_std,
            ),
            Process::Warm(group) => {
                group.wait(None, WaitFor::AllExited, None);
                group
                    .exit(0)
                    .map_or_else(|| "ended".to_string(), |e| e.status.to_string())
            }
        }
    }

    /// The next message; blocks until a whole line (or the end) arrives.
    pub fn read(&mut self) -> Message {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) | Err(_) => {
                let status = self.wait();
                Message::Error(format!(
                    "the rendezvous helper (pid {}) ended: {status}",
                    self.pid
                ))
            }
            Ok(_) => Message::parse(line.trim_end()),
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        HELPER.store(0, Ordering::SeqCst);
        self.stdin = None;
        match &mut self.process {
            Process::Cold(child) => {
                if matches!(child.try_wait(), Ok(None)) {
                    let _ = child.kill();
                }
                let _ = child.wait();
            }
            Process::Warm(group) => {
                group.signal_all(libc::SIGKILL);
                group.wait(None, WaitFor::AllExited, None);
            }
        }
    }
}

/// `HOST[:PORT]`, `[IPV6]:PORT` or `[IPV6]`, as torch reads a rendezvous endpoint.
pub fn parse_endpoint(endpoint: &str) -> Result<(String, Option<u16>), clap::Error> {
    let bad = |why: &str| {
        usage_error(
            ErrorKind::ValueValidation,
            format!("invalid --rdzv-endpoint {endpoint:?}: {why}"),
        )
    };
    let ep = endpoint.trim();
    let (host, port) = if ep.starts_with('[') && ep.ends_with(']') {
        (ep, None)
    } else {
        match ep.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (ep, None),
        }
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = match port {
        None => None,
        Some(p) if (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => Some(
            p.parse::<u16>()
                .map_err(|_| bad("the port must be below 65536"))?,
        ),
        Some(_) => return Err(bad("expected HOST:PORT with a numeric port")),
    };
    let host_ok = |c: char| c.is_alphanumeric() || matches!(c, '_' | '.' | ':' | '-');
    if host.is_empty() || !host.chars().all(host_ok) {
        return Err(bad(
            "expected a host name, an IPv4 address or an [IPv6] address",
        ));
    }
    Ok((host.to_string(), port))
}
