//! The plumbing of a rank before its launch: its launch spec, the pipes (or pseudo-terminals)
//! of its stdout and stderr, its log files, its error file and the pumps that read them.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};

use tether_core::LaunchSpec;

use crate::config::{Config, Streams};
use crate::output::{pty, FilterSink, Prefix, Pump, SharedTail, Stream, Tail};
use crate::run::env::rank_env;
use crate::run::error::{io_err, RunError};
use crate::run::node::Node;

/// The duplicate-filter files of an attempt.
#[derive(Default)]
pub struct Sinks {
    stdout: Option<FilterSink>,
    stderr: Option<FilterSink>,
}

impl Sinks {
    /// The attempt's `filtered_stdout.log` and `filtered_stderr.log` in `logs`, when asked
    /// for.
    pub fn open(cfg: &Config, logs: Option<&Path>) -> Result<Sinks, RunError> {
        let (Some(dir), out) = (logs, &cfg.output) else {
            return Ok(Sinks::default());
        };
        std::fs::create_dir_all(dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
        let sink = |needles: &Vec<String>, name: &str| -> Result<Option<FilterSink>, RunError> {
            if needles.is_empty() {
                return Ok(None);
            }
            let path = dir.join(name);
            let file =
                File::create(&path).map_err(io_err(format!("cannot create {}", path.display())))?;
            Ok(Some(FilterSink {
                needles: Arc::new(needles.clone()),
                file: Arc::new(Mutex::new(file)),
            }))
        };
        Ok(Sinks {
            stdout: sink(&out.stdout_filters, "filtered_stdout.log")?,
            stderr: sink(&out.stderr_filters, "filtered_stderr.log")?,
        })
    }
}

/// The pipes and files of one rank, ready for its launch.
pub struct Plumbed {
    pub spec: LaunchSpec,
    pub write_ends: Vec<OwnedFd>,
    pub pumps: usize,
    pub tail: SharedTail,
    /// Whether the tail holds both streams (one pipe).
    pub merged: bool,
    pub error_file: PathBuf,
}

impl Plumbed {
    /// Makes local rank `local`'s launch spec, pipes, log files and pumps for attempt
    /// `attempt`. Its stdout and stderr share one pipe when both reach a console that is one
    /// file and neither goes to a log file, so that its lines keep their order. A stream that
    /// reaches a terminal of the launcher's is a pseudo-terminal instead of a pipe (one for
    /// both when they share).
    pub fn new(
        node: &Node,
        local: usize,
        attempt: u32,
        logs: Option<&Path>,
        sinks: &Sinks,
        done: &mpsc::Sender<()>,
    ) -> Result<Plumbed, RunError> {
        let cfg = &node.cfg;
        let rank = cfg.global_rank(local);
        let error_file = error_file(node, attempt, rank)?;
        let mut spec = LaunchSpec::new(cfg.command.clone());
        spec.env = rank_env(cfg, local, attempt, &error_file, node.omp_unset);
        spec.stacks = cfg.python_ranks;
        let console = cfg.output.console(local);
        let merged = logs.is_none() && console == Streams::BOTH && node.one_console;
        let tty = cfg.output.tty(local);
        let ttys = Streams {
            stdout: tty.stdout && pty::is_terminal(Stream::Stdout),
            stderr: tty.stderr && pty::is_terminal(Stream::Stderr),
        };
        let mut plumbed = Plumbed {
            spec,
            write_ends: Vec::with_capacity(2),
            pumps: 0,
            tail: Arc::new(Mutex::new(Tail::default())),
            merged,
            error_file,
        };
        let prefix = node.prefix(local);
        if merged {
            let pump = Pump {
                console: Some(Stream::Stdout),
                prefix,
                file: None,
                tail: Some(plumbed.tail.clone()),
                filter: None,
                activity: Some(node.deadlines.activity.clone()),
            };
            let shared = [Stream::Stdout, Stream::Stderr];
            let tty = (ttys == Streams::BOTH).then_some(local);
            plumbed.plumb(pump, &shared, tty, done)?;
            return Ok(plumbed);
        }
        let files = match logs {
            Some(root) => open_logs(&root.join(format!("rank_{rank}")))?,
            None => (None, None),
        };
        let ptys = [ttys.stdout, ttys.stderr].map(|tty| tty.then_some(local));
        plumbed.plumb_apart(node, (console, ptys), files, prefix, sinks, done)?;
        Ok(plumbed)
    }

    /// Gives the rank's stdout and stderr a pipe and a pump each: its console streams, log
    /// files (`files`) and filters; the tail keeps stderr. A stream whose `ptys` entry names
    /// the rank's local rank gets a pty instead of a pipe.
    fn plumb_apart(
        &mut self,
        node: &Node,
        (console, ptys): (Streams, [Option<usize>; 2]),
        files: (Option<File>, Option<File>),
        prefix: Option<Prefix>,
        sinks: &Sinks,
        done: &mpsc::Sender<()>,
    ) -> Result<(), RunError> {
        let (out_file, err_file) = files;
        let streams = [
            (
                Stream::Stdout,
                console.stdout,
                out_file,
                None,
                &sinks.stdout,
                ptys[0],
            ),
            (
                Stream::Stderr,
                console.stderr,
                err_file,
                Some(self.tail.clone()),
                &sinks.stderr,
                ptys[1],
            ),
        ];
        for (stream, shown, file, tail, filter, tty) in streams {
            let pump = Pump {
                console: shown.then_some(stream),
                prefix: prefix.clone(),
                file,
                tail,
                filter: filter.clone(),
                activity: Some(node.deadlines.activity.clone()),
            };
            self.plumb(pump, &[stream], tty, done)?;
        }
        Ok(())
    }

    /// Makes the pipe that carries the rank's `streams` to `pump` (with `tty`, local rank
    /// `tty`'s pseudo-terminal, of the size of the launcher's terminal on `streams[0]` less the
    /// width of the pump's prefix), and starts the pump.
    fn plumb(
        &mut self,
        pump: Pump,
        streams: &[Stream],
        tty: Option<usize>,
        done: &mpsc::Sender<()>,
    ) -> Result<(), RunError> {
        let narrower = pump.prefix.as_ref().map_or(0, |p| pty::width(p.text()));
        let pty = tty.and_then(|local| pty::open(local, streams[0], narrower));
        let (read, write) = match pty {
            Some(pty) => (pty.master, pty.slave),
            None => {
                let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .map_err(|e| io_err("cannot create a pipe")(e.into()))?;
                (Arc::new(read), write)
            }
        };
        for stream in streams {
            match stream {
                Stream::Stdout => self.spec.stdout = Some(write.as_raw_fd()),
                Stream::Stderr => self.spec.stderr = Some(write.as_raw_fd()),
            }
        }
        self.write_ends.push(write);
        pump.spawn(read, done.clone())
            .map_err(io_err("cannot start an output thread"))?;
        self.pumps += 1;
        Ok(())
    }
}

/// Rank `rank`'s TORCHELASTIC_ERROR_FILE in attempt `attempt`, its directory created.
fn error_file(node: &Node, attempt: u32, rank: usize) -> Result<PathBuf, RunError> {
    let dir = node.tmp.join(format!("attempt_{attempt}/rank_{rank}"));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    Ok(dir.join("error.json"))
}

/// `dir/stdout.log` and `dir/stderr.log`, created.
fn open_logs(dir: &Path) -> Result<(Option<File>, Option<File>), RunError> {
    std::fs::create_dir_all(dir).map_err(io_err(format!("cannot create {}", dir.display())))?;
    let open = |name: &str| {
        let path = dir.join(name);
        File::create(&path).map_err(io_err(format!("cannot create {}", path.display())))
    };
    Ok((Some(open("stdout.log")?), Some(open("stderr.log")?)))
}
