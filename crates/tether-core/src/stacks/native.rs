//! Native frames through `py-spy dump --native`, when it is installed: one run per process,
//! all at once, each bounded by the request's timeout. py-spy reads the process's memory
//! with ptrace rights; where it has none, its error is the answer, never a failure.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::io::Errno;

/// Most bytes kept of one run's output.
const OUTPUT_LIMIT: usize = 4 << 20;

/// One run of py-spy: its output so far, and the pipe while it is open.
struct Run {
    pid: i32,
    child: Option<(Child, Option<OwnedFd>)>,
    pipe: Option<OwnedFd>,
    output: Vec<u8>,
    error: Option<Failure>,
}

/// Why a run gave no native stack.
enum Failure {
    /// The program could not be started at all (the text says why).
    Start(String),
    /// It ran and failed with this status.
    Exit(String),
}

impl Run {
    fn start(py_spy: &Path, pid: i32) -> Run {
        let mut run = Run {
            pid,
            child: None,
            pipe: None,
            output: Vec::new(),
            error: None,
        };
        match spawn(py_spy, pid) {
            Ok((child, pidfd, pipe)) => {
                run.child = Some((child, pidfd));
                run.pipe = Some(pipe);
            }
            Err(err) => run.error = Some(Failure::Start(cannot_run(py_spy, &err))),
        }
        run
    }

    /// Reads what the pipe holds; closes it at its end.
    fn read(&mut self) {
        let Some(pipe) = &self.pipe else { return };
        let mut buf = [0u8; 1 << 16];
        loop {
            match rustix::io::read(pipe, &mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if self.output.len() < OUTPUT_LIMIT {
                        self.output.extend_from_slice(&buf[..n]);
                    }
                }
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => return,
                Err(_) => break,
            }
        }
        self.pipe = None;
    }

    /// Ends the run (SIGKILL when it is still going, through its pidfd) and reaps it; the
    /// text of its answer.
    fn finish(mut self, py_spy: &Path, timeout: Duration) -> String {
        let timed_out = self.pipe.is_some();
        if let Some((mut child, pidfd)) = self.child.take() {
            if timed_out {
                if let Some(fd) = &pidfd {
                    let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
                }
            }
            // Its status may have been taken by a launcher's reaper: the output tells.
            let status = child.wait().ok();
            if let Some(status) = status.filter(|s| !s.success() && !timed_out) {
                self.error = Some(Failure::Exit(status.to_string()));
            }
        }
        let output = String::from_utf8_lossy(&self.output).trim_end().to_string();
        let name = py_spy.display();
        match (timed_out, self.error) {
            (true, _) => format!(
                "(py-spy did not finish within {:.1} s for pid {}){}",
                timeout.as_secs_f64(),
                self.pid,
                with_output(&output)
            ),
            (false, Some(Failure::Start(why))) => {
                format!("(no native stack of pid {}: {why})", self.pid)
            }
            // py-spy's own words for a process it may not trace.
            (false, Some(Failure::Exit(status)))
                if ["ermission", "not permitted", "ptrace"]
                    .iter()
                    .any(|w| output.contains(w)) =>
            {
                format!(
                    "(no native stack of pid {}: py-spy failed ({status}); {name} needs ptrace \
                     rights over it){}",
                    self.pid,
                    with_output(&output)
                )
            }
            (false, Some(Failure::Exit(status))) => format!(
                "(no native stack of pid {}: {name} failed ({status}) without giving one: is \
                 it py-spy?){}",
                self.pid,
                with_output(&output)
            ),
            (false, None) => output,
        }
    }
}

/// Why `py_spy` could not be started, in words.
fn cannot_run(py_spy: &Path, err: &std::io::Error) -> String {
    let name = py_spy.display();
    if py_spy.is_dir() {
        return format!("{name} is a directory, not py-spy");
    }
    match err.kind() {
        std::io::ErrorKind::NotFound => format!("{name} does not exist"),
        std::io::ErrorKind::PermissionDenied => {
            format!("{name} cannot be run (permission denied: not executable by this user?)")
        }
        _ => format!("cannot run {name}: {}", crate::error::strerror(err)),
    }
}

fn with_output(output: &str) -> String {
    match output.is_empty() {
        true => String::new(),
        false => format!("\n{output}"),
    }
}

/// Starts `py-spy dump --native --pid PID`, its stdout and stderr on one non-blocking
/// pipe; also returns its pidfd (to kill it without a race with its reaping).
fn spawn(py_spy: &Path, pid: i32) -> std::io::Result<(Child, Option<OwnedFd>, OwnedFd)> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    rustix::io::ioctl_fionbio(&read, true)?;
    let child = Command::new(py_spy)
        .args(["dump", "--native", "--pid", &pid.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::from(write.try_clone()?))
        .stderr(Stdio::from(write))
        .spawn()?;
    let pidfd = rustix::process::Pid::from_raw(child.id() as i32)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok());
    Ok((child, pidfd, read))
}

/// The native view of each of `pids` (in order), from `py_spy`, within `timeout`.
pub(crate) fn dump(py_spy: &Path, pids: &[i32], timeout: Duration) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    let mut runs: Vec<Run> = pids.iter().map(|&pid| Run::start(py_spy, pid)).collect();
    loop {
        let open: Vec<usize> = (0..runs.len())
            .filter(|&i| runs[i].pipe.is_some())
            .collect();
        let left = deadline.saturating_duration_since(Instant::now());
        if open.is_empty() || left.is_zero() {
            break;
        }
        let mut fds: Vec<PollFd<'_>> = open
            .iter()
            .filter_map(|&i| runs[i].pipe.as_ref())
            .map(|pipe| PollFd::from_borrowed_fd(pipe.as_fd(), PollFlags::IN))
            .collect();
        let wait = Timespec {
            tv_sec: left.as_secs() as i64,
            tv_nsec: left.subsec_nanos() as i64,
        };
        let _ = poll(&mut fds, Some(&wait));
        let ready: Vec<bool> = fds.iter().map(|fd| !fd.revents().is_empty()).collect();
        drop(fds);
        for (&i, ready) in open.iter().zip(ready) {
            if ready {
                runs[i].read();
            }
        }
    }
    runs.into_iter()
        .map(|run| run.finish(py_spy, timeout))
        .collect()
}
