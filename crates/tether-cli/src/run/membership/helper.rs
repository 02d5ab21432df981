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

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// What the helper writes, one JSON object per line tagged by its `kind` (in the helper,
/// `say.Say` has one method per message).
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
enum Said {
    Round {
        round: u64,
        #[serde(flatten)]
        place: Place,
    },
    Restart {
        round: u64,
        why: String,
        #[serde(default)]
        short: bool,
    },
    Ended {
        cause: Value,
    },
    Cause {
        cause: Value,
    },
    Away {
        why: String,
        cause: Value,
    },
    Bye,
    Error {
        message: String,
    },
}

impl From<Said> for Message {
    fn from(said: Said) -> Message {
        match said {
            Said::Round { round, place } => Message::Round(place, round),
            Said::Restart { round, why, short } => Message::Restart { round, why, short },
            Said::Ended { cause } => Message::Ended(cause),
            Said::Cause { cause } => Message::Cause(cause),
            Said::Away { why, cause } => Message::Away { why, cause },
            Said::Bye => Message::Bye,
            Said::Error { message } => Message::Error(message),
        }
    }
}

impl Message {
    fn parse(line: &str) -> Message {
        match serde_json::from_str::<Said>(line) {
            Ok(said) => said.into(),
            Err(err) => Message::Error(format!("the rendezvous helper said {line:?} ({err})")),
        }
    }
}

/// What the launcher tells the helper, one JSON object per line tagged by its `cmd`.
#[derive(Debug, Serialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
enum Told {
    /// Join the next round.
    Next,
    /// A rank of this node failed: publish its record at once.
    Failing { record: Value },
    /// This node's ranks stopped after a failure (`final`: no restart is left).
    Failed {
        record: Value,
        #[serde(rename = "final")]
        last: bool,
    },
    /// This node's ranks succeeded.
    Done,
    /// Leave the job.
    Leave,
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

    fn send(&mut self, told: Told) {
        if let Some(stdin) = &mut self.stdin {
            let Ok(line) = serde_json::to_string(&told) else {
                return; // (a Value and plain fields always serialize)
            };
            // A helper that is gone says so at the next read.
            let _ = writeln!(stdin, "{line}").and_then(|()| stdin.flush());
        }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    pub fn next_round(&mut self) {
        self.send(Told::Next);
    }

    /// A rank of this node failed: its record goes to the other nodes at once, before the
    /// node's other ranks are stopped.
    pub fn failing(&mut self, record: Value) {
        self.send(Told::Failing { record });
    }

    pub fn failed(&mut self, record: Value, last: bool) {
        self.send(Told::Failed { record, last });
    }

    pub fn done(&mut self) {
        self.send(Told::Done);
    }

    /// Leaves the job (the other nodes start a new round without this one) and waits for the
    /// helper to end.
    pub fn leave(&mut self) {
        self.send(Told::Leave);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_message_of_the_helper_is_read_as_its_kind() {
        let round = r#"{"kind": "round", "round": 2, "group_rank": 1, "group_world_size": 2,
            "rank_base": 4, "world_size": 8, "role_rank_base": 4, "role_world_size": 8,
            "master_addr": "node0", "master_port": 29500, "agent_store": true}"#;
        match Message::parse(&round.replace('\n', " ")) {
            Message::Round(place, 2) => {
                assert_eq!((place.node_rank, place.nnodes, place.rank_base), (1, 2, 4));
                assert_eq!(
                    (place.master_addr.as_str(), place.master_port),
                    ("node0", 29500)
                );
            }
            other => panic!("{other:?}"),
        }
        let restart = r#"{"kind": "restart", "round": 3, "why": "node 1 left", "short": true}"#;
        assert!(matches!(
            Message::parse(restart),
            Message::Restart {
                round: 3,
                short: true,
                ..
            }
        ));
        let away = r#"{"kind": "away", "round": 1, "why": "gone", "cause": null}"#;
        assert!(matches!(
            Message::parse(away),
            Message::Away {
                cause: Value::Null,
                ..
            }
        ));
        assert!(matches!(Message::parse(r#"{"kind": "bye"}"#), Message::Bye));
        let error = r#"{"kind": "error", "message": "no store at x:1"}"#;
        assert!(matches!(Message::parse(error), Message::Error(m) if m == "no store at x:1"));
        let unknown = Message::parse(r#"{"kind": "what"}"#);
        assert!(matches!(unknown, Message::Error(m) if m.contains("the rendezvous helper said")));
    }

    #[test]
    fn each_command_is_written_tagged_by_cmd() {
        let record = serde_json::json!({"rank": 0});
        let failed = Told::Failed { record, last: true };
        assert_eq!(
            serde_json::to_string(&failed).unwrap(),
            r#"{"cmd":"failed","record":{"rank":0},"final":true}"#
        );
        assert_eq!(
            serde_json::to_string(&Told::Next).unwrap(),
            r#"{"cmd":"next"}"#
        );
    }
}
