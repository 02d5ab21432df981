//! `tether stacks PID`: asks the `tether run` whose pid is PID to print every rank's stack
//! on its stderr, as `kill -USR1 PID` does; the run goes on.

use std::ffi::OsString;
use std::io::Write;

use tether_core::proc::{self, Of};
use tether_core::stacks;

const USAGE: &str = "usage: tether stacks PID  (PID: the pid of a running `tether run`)";

/// `tether stacks ARGS`: 0 when the run was asked, 1 when PID is no `tether run` this user
/// may ask, 2 (and the usage) for bad usage, 0 for the usage that `-h` asks.
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
    // SAFETY: kill(2) with a pid and a signal number has no memory-safety requirement;
    // rustix has no safe constructor of a real-time signal such as this one.
    if unsafe { libc::kill(pid, stacks::signal()) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EPERM) {
            return not_a_run();
        }
        crate::output::message(&format!(
            "tether stacks: pid {pid} belongs to another user: ask as that user (or as root)"
        ));
        return 1;
    }
    println_flushed(&format!(
        "tether stacks: asked `tether run` (pid {pid}); the stacks appear on its stderr"
    ));
    0
}

fn println_flushed(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Whether `pid` is a running `tether run` (its keeper or its supervisor): such a process
/// reads the stacks signal from a signalfd, so it keeps it blocked.
fn is_launcher(pid: i32) -> bool {
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
