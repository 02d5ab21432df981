//! `tether run`: the attempt loop. Each attempt launches every local rank, pumps their
//! output, waits for exits and signals, stops the rest on the first failure, and cleans up
//! whatever the ranks left behind; a failure with restarts left starts the next attempt.

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec};
use tether_core::{signal_name, Group, LaunchSpec, WaitFor};

use crate::args::Config;
use crate::env::rank_env;
use crate::output::{self, Pump, SharedTail, Stream, Tail};
use crate::reaper::{self, Watchdog};
use crate::report::{oom_kills, ErrorFile, Failure, RankEnd};
use crate::signals::SignalFd;

/// How long the launcher waits for output pipes to drain, and for leftovers to die, once
/// every rank has exited.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cannot start {program:?}: {source}")]
    Start { program: String, source: io::Error },
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error(transparent)]
    Core(#[from] tether_core::Error),
}

impl RunError {
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

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> RunError {
    let what = what.into();
    move |source| RunError::Io { what, source }
}

/// A private directory (mode 0700) removed with everything in it on drop.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new(prefix: &str) -> io::Result<TempDir> {
        let template = std::env::temp_dir().join(format!("{prefix}XXXXXX"));
        let template = CString::new(template.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let mut bytes = template.into_bytes_with_nul();
        // SAFETY: `bytes` is a NUL-terminated template that mkdtemp rewrites in place.
        let rc = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
        if rc.is_null() {
            return Err(io::Error::last_os_error());
        }
        bytes.pop();
        let path =
            PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes));
        Ok(TempDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// How an attempt ended.
enum AttemptEnd {
    Success,
    Failed(Box<Failure>),
    /// The launcher got this signal and stopped the ranks.
    Interrupted(i32),
}

pub struct Launcher {
    cfg: Config,
    signals: SignalFd,
    watchdog: Option<Watchdog>,
    tmp: TempDir,
    omp_unset: bool,
}

fn monotonic() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Launcher {
    /// `tmp` holds the ranks' error files; it is removed by [`Launcher::finish`].
    pub fn new(
        cfg: Config,
        signals: SignalFd,
        watchdog: Option<Watchdog>,
        tmp: TempDir,
    ) -> Launcher {
        Launcher {
            omp_unset: std::env::var_os("OMP_NUM_THREADS").is_none(),
            cfg,
            signals,
            watchdog,
            tmp,
        }
    }

    /// Runs every attempt; returns the launcher's exit status.
    pub fn run(&mut self) -> i32 {
        let max = self.cfg.max_restarts;
        for attempt in 0..=max {
            if let Some(sig) = self.pending_stop_signal() {
                output::message(&format!("tether: got {}; not restarting", signal_name(sig)));
                return 128 + sig;
            }
            match self.attempt(attempt) {
                Ok(AttemptEnd::Success) => return 0,
                Ok(AttemptEnd::Interrupted(sig)) => return 128 + sig,
                Ok(AttemptEnd::Failed(failure)) if attempt < max => {
                    output::message(&format!(
                        "tether: attempt {attempt} failed: rank {} (pid {}) ended with {}; \
                         restarting all {} ranks (restart {} of {max})",
                        failure.root.rank,
                        failure.root.pid,
                        failure.root.status,
                        self.cfg.nproc,
                        attempt + 1,
                    ));
                }
                Ok(AttemptEnd::Failed(failure)) => {
                    output::message(&failure.render());
                    return failure.root.status.as_shell_code();
                }
                Err(err) => {
                    output::message(&format!("tether: {err}"));
                    return err.exit_code();
                }
            }
        }
        1
    }

    /// A SIGINT, SIGTERM or SIGHUP that arrived while no rank ran (between attempts);
    /// SIGCHLDs on the way reap orphans.
    fn pending_stop_signal(&self) -> Option<i32> {
        let spare = self.watchdog.as_ref().map(Watchdog::pid);
        while let Some(sig) = self.signals.next() {
            if sig == libc::SIGCHLD {
                reaper::reap_orphans(&HashSet::new(), spare);
            } else {
                return Some(sig);
            }
        }
        None
    }

    /// The pids of running ranks, which only tether-core may reap.
    fn live_pids(group: &Group) -> HashSet<i32> {
        (0..group.len())
            .filter(|&i| group.exit(i).is_none())
            .filter_map(|i| group.pid(i))
            .collect()
    }

    fn attempt(&mut self, attempt: u32) -> Result<AttemptEnd, RunError> {
        let cfg = &self.cfg;
        let n = cfg.nproc;
        let err_root = self.tmp.path().join(format!("attempt_{attempt}"));
        let log_root = cfg
            .log_dir
            .as_ref()
            .map(|d| d.join(&cfg.run_id).join(format!("attempt_{attempt}")));
        let (done_tx, done_rx) = mpsc::channel();
        let mut pumps = 0usize;
        let mut specs = Vec::with_capacity(n);
        let mut write_ends: Vec<OwnedFd> = Vec::with_capacity(2 * n);
        let mut tails: Vec<SharedTail> = Vec::with_capacity(n);
        let mut error_files = Vec::with_capacity(n);
        for local in 0..n {
            let rank = cfg.global_rank(local);
            let err_dir = err_root.join(format!("rank_{rank}"));
            std::fs::create_dir_all(&err_dir)
                .map_err(io_err(format!("cannot create {}", err_dir.display())))?;
            let error_file = err_dir.join("error.json");
            let (out_file, err_file) = match &log_root {
                Some(root) => {
                    let dir = root.join(format!("rank_{rank}"));
                    std::fs::create_dir_all(&dir)
                        .map_err(io_err(format!("cannot create {}", dir.display())))?;
                    let open = |name: &str| {
                        let path = dir.join(name);
                        File::create(&path)
                            .map_err(io_err(format!("cannot create {}", path.display())))
                    };
                    (Some(open("stdout.log")?), Some(open("stderr.log")?))
                }
                None => (None, None),
            };
            let streams = cfg.console_streams(local);
            let prefix = if cfg.prefix {
                format!("[rank {rank}]: ").into_bytes()
            } else {
                Vec::new()
            };
            let tail: SharedTail = Arc::new(Mutex::new(Tail::default()));
            let pipe = || {
                rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                    .map_err(|e| io_err("cannot create a pipe")(e.into()))
            };
            let (out_r, out_w) = pipe()?;
            let (err_r, err_w) = pipe()?;
            let mut spec = LaunchSpec::new(cfg.command.clone());
            spec.env = rank_env(cfg, local, attempt, &error_file, self.omp_unset);
            spec.stdout = Some(out_w.as_raw_fd());
            spec.stderr = Some(err_w.as_raw_fd());
            specs.push(spec);
            write_ends.push(out_w);
            write_ends.push(err_w);
            Pump {
                stream: Stream::Stdout,
                prefix: prefix.clone(),
                console: streams.stdout,
                file: out_file,
                tail: None,
            }
            .spawn(out_r, done_tx.clone())
            .map_err(io_err("cannot start an output thread"))?;
            pumps += 1;
            Pump {
                stream: Stream::Stderr,
                prefix,
                console: streams.stderr,
                file: err_file,
                tail: Some(tail.clone()),
            }
            .spawn(err_r, done_tx.clone())
            .map_err(io_err("cannot start an output thread"))?;
            pumps += 1;
            tails.push(tail);
            error_files.push(error_file);
        }
        drop(done_tx);
        let oom_before = oom_kills();
        let group = Group::new();
        let launched = group.launch(specs);
        // The ranks hold their own copies now; the pumps see EOF once the ranks (and what
        // they started) are gone.
        drop(write_ends);
        if let Err(err) = launched {
            group.signal_all(libc::SIGKILL);
            group.wait(None, WaitFor::AllExited, Some(DRAIN_LIMIT));
            self.cleanup(&group, &done_rx, pumps);
            return Err(match err {
                tether_core::Error::Launch { program, source } => {
                    RunError::Start { program, source }
                }
                other => RunError::Core(other),
            });
        }
        if let Some(w) = &self.watchdog {
            for i in 0..n {
                if let Some(pid) = group.pid(i) {
                    w.add(pid);
                }
            }
        }

        let supervised = self.supervise(&group);
        if supervised.is_err() {
            group.signal_all(libc::SIGKILL);
            group.wait(None, WaitFor::AllExited, Some(DRAIN_LIMIT));
        }
        let oom_after = oom_kills();
        self.cleanup(&group, &done_rx, pumps);
        let (stop_mono, interrupted) = supervised?;

        if let Some(sig) = interrupted {
            return Ok(AttemptEnd::Interrupted(sig));
        }
        let ends: Vec<(RankEnd, Duration)> = (0..n)
            .filter_map(|i| {
                let exit = group.exit(i)?;
                let stopped = stop_mono.is_some_and(|t| exit.at > t);
                Some((
                    RankEnd {
                        rank: self.cfg.global_rank(i),
                        local_rank: i,
                        pid: group.pid(i).unwrap_or(0),
                        status: exit.status,
                        stopped,
                    },
                    exit.at,
                ))
            })
            .collect();
        let root = ends
            .iter()
            .filter(|(e, _)| !e.status.success())
            .min_by_key(|(_, at)| *at)
            .map(|(e, _)| e.clone());
        let Some(root) = root else {
            return Ok(AttemptEnd::Success);
        };
        let local = root.local_rank;
        Ok(AttemptEnd::Failed(Box::new(Failure {
            node_rank: self.cfg.node_rank,
            attempt,
            error: error_files.get(local).and_then(|p| ErrorFile::read(p)),
            stderr_tail: tails
                .get(local)
                .map(|t| t.lock().unwrap_or_else(|e| e.into_inner()).lines())
                .unwrap_or_default(),
            oom: oom_before.zip(oom_after),
            others: ends
                .into_iter()
                .map(|(e, _)| e)
                .filter(|e| e.local_rank != local)
                .collect(),
            log_dir: log_root.map(|p| p.display().to_string()),
            root,
        })))
    }

    /// Waits until every rank has exited. On the first failure, or on a signal to the
    /// launcher, stops the others (the signal, the grace period, SIGKILL). Returns when the
    /// stopping began (monotonic clock) and the signal that interrupted the run, if any.
    fn supervise(&mut self, group: &Group) -> Result<(Option<Duration>, Option<i32>), RunError> {
        let n = group.len();
        let grace = self.cfg.grace;
        let spare = self.watchdog.as_ref().map(Watchdog::pid);
        let mut stop_mono: Option<Duration> = None;
        let mut kill_at: Option<Instant> = None;
        let mut interrupted: Option<i32> = None;
        loop {
            let exits: Vec<_> = (0..n).map(|i| group.exit(i)).collect();
            if stop_mono.is_none() && exits.iter().flatten().any(|e| !e.status.success()) {
                stop_mono = Some(monotonic());
                group.signal_all(libc::SIGTERM);
                kill_at = Some(Instant::now() + grace);
            }
            let live: Vec<usize> = (0..n).filter(|&i| exits[i].is_none()).collect();
            if live.is_empty() {
                return Ok((stop_mono, interrupted));
            }
            if kill_at.is_some_and(|t| Instant::now() >= t) {
                group.signal_all(libc::SIGKILL);
                kill_at = None;
            }
            let sentinels: Vec<(usize, i32)> = live
                .iter()
                .filter_map(|&i| group.with_member(i, |m| (i, m.sentinel())))
                .collect();
            let ready = {
                let mut fds = Vec::with_capacity(sentinels.len() + 1);
                fds.push(PollFd::new(&self.signals, PollFlags::IN));
                for &(_, raw) in &sentinels {
                    // SAFETY: the pidfd belongs to a member of `group`, which outlives
                    // this poll.
                    let fd = unsafe { BorrowedFd::borrow_raw(raw) };
                    fds.push(PollFd::from_borrowed_fd(fd, PollFlags::IN));
                }
                let timeout = kill_at.map(|t| {
                    let left = t.saturating_duration_since(Instant::now());
                    Timespec {
                        tv_sec: left.as_secs() as _,
                        tv_nsec: left.subsec_nanos() as _,
                    }
                });
                match rustix::event::poll(&mut fds, timeout.as_ref()) {
                    Ok(_) | Err(rustix::io::Errno::INTR) => {}
                    Err(e) => return Err(io_err("poll")(e.into())),
                }
                fds.iter()
                    .skip(1)
                    .zip(&sentinels)
                    .filter(|(fd, _)| !fd.revents().is_empty())
                    .map(|(_, &(i, _))| i)
                    .collect::<Vec<usize>>()
            };
            while let Some(sig) = self.signals.next() {
                if sig == libc::SIGCHLD {
                    reaper::reap_orphans(&Self::live_pids(group), spare);
                    continue;
                }
                if stop_mono.is_none() {
                    interrupted = Some(sig);
                    stop_mono = Some(monotonic());
                    output::message(&format!(
                        "tether: got {}; forwarding it to {} rank(s), SIGKILL after {:?}",
                        signal_name(sig),
                        live.len(),
                        grace
                    ));
                    group.signal_all(sig);
                    kill_at = Some(Instant::now() + grace);
                } else if sig == libc::SIGINT {
                    output::message("tether: SIGINT while stopping: killing every rank now");
                    group.signal_all(libc::SIGKILL);
                    kill_at = None;
                }
            }
            if !ready.is_empty() {
                // The pidfd is readable once the rank exited; the supervisor thread records
                // the exit right after.
                group.wait(
                    Some(&ready),
                    WaitFor::AllExited,
                    Some(Duration::from_secs(1)),
                );
            }
        }
    }

    /// After every rank has exited: kill and reap what they left behind, tell the watchdog,
    /// and let the output pumps finish.
    fn cleanup(&self, group: &Group, done: &mpsc::Receiver<()>, pumps: usize) {
        let spare = self.watchdog.as_ref().map(Watchdog::pid);
        let live = Self::live_pids(group);
        reaper::kill_orphans(&live, spare, DRAIN_LIMIT);
        if let Some(w) = &self.watchdog {
            for i in 0..group.len() {
                if let Some(pid) = group.pid(i) {
                    w.remove(pid);
                }
            }
        }
        let deadline = Instant::now() + DRAIN_LIMIT;
        for _ in 0..pumps {
            let left = deadline.saturating_duration_since(Instant::now());
            if done.recv_timeout(left).is_err() {
                break;
            }
        }
        reaper::reap_orphans(&live, spare);
    }

    /// Ends the watchdog and removes the temporary directory.
    pub fn finish(self) {
        if let Some(w) = self.watchdog {
            w.finish();
        }
        drop(self.tmp);
    }
}
