//! `tether stacks PID`: asks the `tether run` whose pid is PID for every rank's stack, as
//! `kill -USR1 PID` does (the run goes on, the block shows on its stderr), and prints the
//! block it gets back on stdout ([`crate::stacks::reply`]), summary last.

use std::ffi::OsString;
use std::io::Write;
use std::time::Duration;

use tether_core::proc::{self, Of};
use tether_core::stacks;

pub mod hangs;
pub mod reply;
pub mod workers;

use reply::Got;

/// How long the asker waits for the block: the launcher's wait for its ranks, and time to
/// write it.
pub const WAIT: Duration = Duration::from_secs(crate::stacks::hangs::STACKS_TIMEOUT.as_secs() + 10);

/// The exit status when some rank did not answer.
const SILENT: i32 = 3;

const USAGE: &str = "usage: tether stacks PID  (PID: the pid of a running `tether run`)";

/// `tether stacks ARGS`: prints the stacks on stdout; 0 when every rank answered, 3 (and a
/// line on stderr naming the ranks and pids) when some did not, 1 when PID is no `tether
/// run` this user may ask or sent no stacks back in time, 2 (and the usage) for bad usage,
/// 0 for the usage that `-h` asks.
pub fn main(args: &[OsString]) -> i32 {
    let digits = match args {
        [pid] => pid
            .to_str()
            .filter(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())),
        _ => None,
    };
    let Some(digits) = digits else {
        println_flushed(USAGE);
        let help = matches!(args, [flag] if flag == "-h" || flag == "--help");
        return if help { 0 } else { 2 };
    };
    let shown = match digits.trim_start_matches('0') {
        "" => "0",
        rest => rest,
    };
    let not_a_run = || {
        crate::output::message(&format!(
            "tether stacks: pid {shown} is not a running `tether run`"
        ));
        1
    };
    let Some(pid) = digits
        .parse::<i32>()
        .ok()
        .filter(|&pid| pid > 0 && is_launcher(pid))
    else {
        return not_a_run();
    };
    match reply::ask(pid, stacks::signal(), WAIT, false) {
        Ok(Some(got)) => show(pid, got),
        Ok(None) => {
            crate::output::message(&format!(
                "tether stacks: `tether run` (pid {pid}) sent no stacks back within {} s \
                 (between attempts, it has no rank to ask)",
                WAIT.as_secs()
            ));
            1
        }
        Err(err) if err.raw_os_error() == Some(libc::EPERM) => {
            crate::output::message(&format!(
                "tether stacks: pid {pid} belongs to another user: ask as that user (or as root)"
            ));
            1
        }
        Err(err) if err.raw_os_error() == Some(libc::ESRCH) => not_a_run(),
        Err(err) => {
            crate::output::message(&format!(
                "tether stacks: cannot ask `tether run` (pid {pid}): {}",
                tether_core::strerror(&err)
            ));
            1
        }
    }
}

/// Prints what the launcher `pid` sent back; the exit status.
fn show(pid: i32, got: Got) -> i32 {
    let (block, silent) = match got {
        Got::Stacks { block, silent, .. } => (block, silent),
        Got::Error(why) => {
            crate::output::message(&format!("tether stacks: `tether run` (pid {pid}): {why}"));
            return 1;
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(&block).and_then(|()| out.flush());
    if silent.is_empty() {
        return 0;
    }
    let named: Vec<String> = silent
        .iter()
        .map(|(rank, pid)| format!("rank {rank} (pid {pid})"))
        .collect();
    crate::output::message(&format!(
        "tether stacks: {} of the ranks did not answer: {}; their lines above say why",
        silent.len(),
        named.join(", ")
    ));
    SILENT
}

fn println_flushed(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Whether `pid` is a running `tether run` (its keeper or its supervisor): such a process
/// reads the stacks signal from a signalfd, so it keeps it blocked.
pub fn is_launcher(pid: i32) -> bool {
    let (Some(status), Some(argv)) = (proc::status(Of::Pid(pid)), proc::cmdline(pid)) else {
        return false;
    };
    let program = |arg: &Vec<u8>| {
        arg.rsplit(|&b| b == b'/')
            .next()
            .is_some_and(|name| name.starts_with(b"tether"))
    };
    let named = argv.iter().any(program) && argv.iter().any(|arg| arg == b"run");
    named && status.has_signal("SigBlk", stacks::signal())
}
