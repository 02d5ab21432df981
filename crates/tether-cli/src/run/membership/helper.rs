//! The rendezvous helper of torchrun's dynamic forms (`--rdzv-backend c10d`, `etcd`, `etcd-v2`
//! on several nodes, or an elastic `--nnodes MIN:MAX`): torch's own rendezvous handler runs
//! in a helper process, `python -m tether.run.rendezvous` (or a fork of the node's zygote), one
//! per node, and tells the membership this node's place in each round. The launcher keeps
//! the ranks, their output and the reports.
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

use serde_json::{json, Value};

use tether_core::{Group, WaitFor};

use crate::config::{Place, Rendezvous};
use crate::run::zygote::NodeZygote;

/// What the helper said.
#[derive(Debug)]
pub enum Message {
    /// A round formed: this node's place, and the round's number.
    Round(Place, u64),
    /// The membership of round `round` moved on (nodes waiting, a node gone).
    Restart {
        round: u64,
        why: String,
        /// A node is gone and the nodes left are fewer than MIN.
        short: bool,
    },
    /// Another node ended the job; its root cause.
    Ended(Value),
    /// The job's root cause, after this node's final failure.
    Cause(Value),
    /// The job moved on while this node was away (stopped, or cut off from the store): what
    /// happened meanwhile, and the job's root cause if it ended.
    Away {
        why: String,
        cause: Value,
    },
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
            Some("round") => match place_of_round(&v) {
                Some(place) => Message::Round(place, round),
                None => Message::Error(format!("the rendezvous helper said {line:?}")),
            },
            Some("restart") => Message::Restart {
                round,
                why: v["why"]
                    .as_str()
                    .unwrap_or("the membership changed")
                    .to_string(),
                short: v["short"].as_bool().unwrap_or(false),
            },
            Some("ended") => Message::Ended(v["cause"].clone()),
            Some("cause") => Message::Cause(v["cause"].clone()),
            Some("away") => Message::Away {
                why: v["why"]
                    .as_str()
                    .unwrap_or("the job moved on while this node was away")
                    .to_string(),
                cause: v["cause"].clone(),
            },
            Some("bye") => Message::Bye,
            _ => Message::Error(v["message"].as_str().map_or_else(
                || format!("the rendezvous helper said {line:?}"),
                str::to_string,
            )),
        }
    }
}

/// A place as the helper gives it for a round.
fn place_of_round(v: &Value) -> Option<Place> {
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
    /// Starts `python -m tether.run.rendezvous`; it gets SIGTERM (and leaves the job) when the
    /// launcher dies.
    pub fn spawn(python: &OsString, rdzv: &Rendezvous) -> io::Result<Helper> {
        let mut command = Command::new(python);
        command
            .args(["-m", "tether.run.rendezvous"])
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

    /// The helper, forked from `zygote`, with a pipe for its stdin and one for its stdout.
    /// (It arms SIGTERM as its parent-death signal itself.)
    pub fn fork(zygote: &mut NodeZygote, rdzv: &Rendezvous) -> Result<Helper, tether_core::Error> {
        let pipe = || {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map_err(|e| tether_core::Error::resource("cannot create a pipe", e))
        };
        let ((their_in, stdin), (stdout, their_out)) = (pipe()?, pipe()?);
        let group = Group::new();
        let options = rdzv.options().to_string();
        zygote.fork_helper(&group, their_in.as_fd(), their_out.as_fd(), &options)?;
        let pid = group.pid(0).unwrap_or(0);
        HELPER.store(pid, Ordering::SeqCst);
        Ok(Helper {
            process: Process::Warm(group),
            pid,
            stdin: Some(File::from(stdin)),
            stdout: BufReader::new(File::from(stdout)),
        })
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

    /// A rank of this node failed: its record goes to the other nodes at once, before the
    /// node's other ranks are stopped.
    pub fn failing(&mut self, record: Value) {
        self.send(json!({"cmd": "failing", "record": record}));
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
                crate::run::report::describe_std,
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
