//! `tether ps`: the processes tether started for this user on this machine, as a tree under
//! the process that started each, from the names they carry (`tether zygote ...`,
//! `tether rank 3: train ...`); a `tether run` job whole, its keeper, supervisor and every
//! rank (with its rank number) and what the ranks started. The process that asks is left
//! out.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::io::Write;

use tether_core::proc::{self, Of};

/// The name a `tether run` supervisor has in /proc/PID/comm (the first 15 bytes of the name
/// it gives itself, in [`crate::run`]).
const SUPERVISOR_COMM: &str = "tether-supervis";

const USAGE: &str = "usage: tether ps";

/// What `/proc` says of one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    pub ppid: i32,
    pub comm: String,
    /// Its command line on one line, control characters escaped.
    pub args: String,
}

/// `tether ps ARGS`: prints the tree on stdout; the usage for `-h`/`--help` (status 0) and
/// for any other argument (status 2).
pub fn main(args: &[OsString]) -> i32 {
    let help = matches!(args, [flag] if flag == "-h" || flag == "--help");
    let text = if args.is_empty() {
        let me = rustix::process::getpid().as_raw_nonzero().get();
        let mut table = processes(rustix::process::getuid().as_raw());
        table.remove(&me);
        tree(&table, rank_of).join("\n")
    } else {
        USAGE.to_string()
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
    if args.is_empty() || help {
        0
    } else {
        2
    }
}

/// Every process of `uid`, by pid.
fn processes(uid: u32) -> BTreeMap<i32, Process> {
    let read = |pid: i32| {
        if proc::owner(pid)? != uid {
            return None;
        }
        let stat = proc::stat(Of::Pid(pid))?;
        let args = proc::cmdline(pid)?.join(&b' ');
        Some(Process {
            ppid: stat.field(4)?.parse().ok()?,
            comm: stat.command()?.to_string(),
            args: one_line(&args),
        })
    };
    let found = proc::pids()
        .into_iter()
        .filter_map(|pid| Some((pid, read(pid)?)));
    found.collect()
}

/// A command line as it shows on one line: trimmed, with its control characters escaped
/// (a `python -c` program has newlines).
fn one_line(raw: &[u8]) -> String {
    let text = String::from_utf8_lossy(raw);
    let blank = |c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c);
    let mut line = String::with_capacity(text.len());
    for c in text.trim_matches(blank).chars() {
        match c {
            '\n' => line.push_str("\\n"),
            '\t' => line.push_str("\\t"),
            c if (c as u32) < 32 => line.push_str(&format!("\\x{:02x}", c as u32)),
            c => line.push(c),
        }
    }
    line
}

/// Whether a process is one tether started or runs (from its name), or a launcher.
fn is_tethers(process: &Process) -> bool {
    if process.comm.starts_with("tether") || process.args.starts_with("tether ") {
        return true;
    }
    let mut words = process.args.split_whitespace();
    let program = words.next().and_then(|w| w.rsplit('/').next());
    program == Some("tether") && words.next() == Some("run")
}

/// Whether a child of a supervisor is one of its helpers rather than a rank: the node's
/// zygote of warm ranks, the rendezvous helper (forked from the zygote, or a new
/// interpreter).
fn is_helper(process: &Process) -> bool {
    process.comm.starts_with("tether") || process.args.contains(" -m tether.run.rendezvous ")
}

/// `rank N (local L)` from a rank's environment, as `tether run` set it.
fn rank_of(pid: i32) -> String {
    let Some(env) = proc::environ(pid) else {
        return "rank ?".to_string();
    };
    let var = |name: &[u8]| {
        let value = env.iter().rev().find(|(k, _)| k == name)?;
        Some(String::from_utf8_lossy(&value.1).into_owned())
    };
    let rank = var(b"RANK").unwrap_or_else(|| "?".to_string());
    match var(b"LOCAL_RANK").filter(|l| !l.is_empty()) {
        Some(local) => format!("rank {rank} (local {local})"),
        None => format!("rank {rank}"),
    }
}

/// Every process started from one of `roots`, and from those, ...
fn descendants(roots: &BTreeSet<i32>, children: &BTreeMap<i32, Vec<i32>>) -> BTreeSet<i32> {
    let mut started = roots.clone();
    let mut todo: Vec<i32> = roots.iter().copied().collect();
    while let Some(pid) = todo.pop() {
        for &kid in children.get(&pid).into_iter().flatten() {
            if started.insert(kid) {
                todo.push(kid);
            }
        }
    }
    started
}

/// The lines of `tether ps` for the processes of `table`; `rank_of` labels a rank.
pub fn tree(table: &BTreeMap<i32, Process>, rank_of: impl Fn(i32) -> String) -> Vec<String> {
    let mut children: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for (&pid, process) in table {
        children.entry(process.ppid).or_default().push(pid);
    }
    let supervisors: BTreeSet<i32> = table
        .iter()
        .filter(|(_, p)| p.comm == SUPERVISOR_COMM)
        .map(|(&pid, _)| pid)
        .collect();
    let keepers: BTreeSet<i32> = supervisors.iter().map(|pid| table[pid].ppid).collect();
    let ranks: BTreeSet<i32> = supervisors
        .iter()
        .flat_map(|pid| children.get(pid).into_iter().flatten().copied())
        .filter(|pid| !is_helper(&table[pid]))
        .collect();
    let mut ours = descendants(&ranks, &children);
    ours.extend(
        table
            .iter()
            .filter(|(_, p)| is_tethers(p))
            .map(|(&pid, _)| pid),
    );
    ours.extend(&keepers);
    if ours.is_empty() {
        return vec!["no process started by tether runs for this user".to_string()];
    }
    let mut labels: BTreeMap<i32, String> = ranks
        .iter()
        .map(|&pid| (pid, format!("{}: ", rank_of(pid))))
        .collect();
    labels.extend(
        keepers
            .iter()
            .map(|&pid| (pid, "tether run keeper: ".to_string())),
    );
    for kids in children.values_mut() {
        kids.retain(|kid| ours.contains(kid));
    }
    let parents = ours.iter().filter_map(|pid| Some(table.get(pid)?.ppid));
    let roots: BTreeSet<i32> = parents.filter(|pid| !ours.contains(pid)).collect();
    let mut lines = vec![format!("{:>7}  WHAT", "PID")];
    let shape = Shape {
        children: &children,
        table,
        labels: &labels,
    };
    for root in roots {
        let args = match table.get(&root) {
            Some(process) => shape.what(process),
            None => "?".to_string(),
        };
        lines.push(format!("{root:>7}  {args}"));
        shape.branch(root, "", &mut lines);
    }
    lines
}

/// What the branches of the tree are drawn from.
struct Shape<'a> {
    children: &'a BTreeMap<i32, Vec<i32>>,
    table: &'a BTreeMap<i32, Process>,
    labels: &'a BTreeMap<i32, String>,
}

impl Shape<'_> {
    /// A process's command line, or `[comm]` when it has none (a kernel thread, a zombie).
    fn what(&self, process: &Process) -> String {
        if process.args.is_empty() {
            format!("[{}]", process.comm)
        } else {
            process.args.clone()
        }
    }

    /// The lines of the processes under `pid`, each indented by `indent` and its branch.
    fn branch(&self, pid: i32, indent: &str, lines: &mut Vec<String>) {
        let kids = self.children.get(&pid).map_or(&[][..], Vec::as_slice);
        for (n, &kid) in kids.iter().enumerate() {
            let last = n + 1 == kids.len();
            let label = self.labels.get(&kid).map_or("", String::as_str);
            let what = self.what(&self.table[&kid]);
            let arm = if last { "└─ " } else { "├─ " };
            lines.push(format!("{kid:>7}  {indent}{arm}{label}{what}"));
            let deeper = format!("{indent}{}", if last { "   " } else { "│  " });
            self.branch(kid, &deeper, lines);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn process(ppid: i32, comm: &str, args: &str) -> Process {
        Process {
            ppid,
            comm: comm.into(),
            args: args.into(),
        }
    }

    #[test]
    fn a_job_shows_whole_under_the_shell_that_started_it() {
        let table = BTreeMap::from([
            (10, process(1, "bash", "bash")),
            (
                20,
                process(10, "tether", "/venv/bin/tether run -n 2 train.py"),
            ),
            (
                21,
                process(20, SUPERVISOR_COMM, "tether supervisor of run x"),
            ),
            (
                22,
                process(21, "tether-zygote", "tether zygote of pid 21 (warm ranks)"),
            ),
            (
                23,
                process(21, "tether-rdzv", "tether rendezvous helper of pid 21"),
            ),
            (30, process(21, "python", "python -u train.py")),
            (31, process(21, "python", "python -u train.py")),
            (40, process(31, "sh", "")),
            (50, process(10, "vim", "vim notes")),
        ]);
        let lines = tree(&table, |pid| format!("rank {}", pid - 30));
        assert_eq!(
            lines,
            [
                "    PID  WHAT",
                "     10  bash",
                "     20  └─ tether run keeper: /venv/bin/tether run -n 2 train.py",
                "     21     └─ tether supervisor of run x",
                "     22        ├─ tether zygote of pid 21 (warm ranks)",
                "     23        ├─ tether rendezvous helper of pid 21",
                "     30        ├─ rank 0: python -u train.py",
                "     31        └─ rank 1: python -u train.py",
                "     40           └─ [sh]",
            ]
        );
    }

    #[test]
    fn nothing_of_tethers_is_said_in_one_line() {
        let table = BTreeMap::from([(10, process(1, "bash", "bash"))]);
        assert_eq!(
            tree(&table, |_| unreachable!()),
            ["no process started by tether runs for this user"]
        );
    }

    #[test]
    fn a_parent_that_is_not_listed_is_a_question_mark() {
        let table = BTreeMap::from([(7, process(3, "tether-zygote", "tether zygote of pid 3"))]);
        assert_eq!(
            tree(&table, |_| unreachable!()),
            [
                "    PID  WHAT",
                "      3  ?",
                "      7  └─ tether zygote of pid 3"
            ]
        );
    }

    #[test]
    fn a_command_line_is_one_line() {
        assert_eq!(
            one_line(b" python -c a\n\tb\x01 \n"),
            "python -c a\\n\\tb\\x01"
        );
        assert_eq!(one_line("é\u{1f}".as_bytes()), "é");
    }
}
