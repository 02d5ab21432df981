//! The command line as clap sees it: `tether run` takes torchrun's options, every one in its
//! dash and underscore spelling, with torchrun's `PET_<NAME>` environment defaults (a flag's
//! is a number, as torchrun reads it: `PET_STANDALONE=1`; `true`, `yes`, `off`, ... too). What
//! the values mean is decided in [`crate::config`].
//!
//! Each option is written once, below, with what is its own (its help, value name, short
//! form); the spellings torchrun gives every option (the underscore alias, the `PET_`
//! variable) are added by one rule ([`torchrun_spellings`]) from the table of exceptions
//! ([`NO_ENV`], [`MORE_NAMES`]).

use std::ffi::OsString;
use std::path::PathBuf;

use clap::builder::BoolishValueParser;
use clap::error::ErrorKind;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

mod normalize;

const NODES: &str = "Ranks and nodes";
const RDZV: &str = "Rendezvous (fixed membership)";
const PROGRAM: &str = "What each rank runs";
const OUTPUT: &str = "Output and logs";
const STOPPING: &str = "Failures and signals";
const ACCEPTED: &str = "Accepted for torchrun compatibility";

const RUN_USAGE: &str = "tether run [OPTIONS] SCRIPT.py [SCRIPT ARGS]...\n       \
     tether run [OPTIONS] -m MODULE [MODULE ARGS]...\n       \
     tether run [OPTIONS] --no-python COMMAND [ARGS]...";

const RUN_EXAMPLES: &str =
    "torchrun's command line, unchanged: `torchrun ARGS` and `tether run ARGS` \
     start the same ranks.\n\n\
     Examples:\n  \
     tether run --standalone --nproc-per-node 4 train.py --epochs 3\n  \
     tether run --nproc_per_node=2 -m mypackage.train --lr 0.1\n  \
     tether run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\\n      \
     --rdzv-endpoint node0:29400 --rdzv-id job42 train.py       (on every node)\n  \
     tether run --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \\\n      \
     --rdzv-endpoint node0:29400 --rdzv-id job42 train.py       (elastic: 1 to 4 nodes)\n  \
     tether run --nnodes 2 --node-rank 1 --master-addr node0 --nproc-per-node 8 train.py\n  \
     tether run -n 4 --no-python -- ./bench --size 1024\n\n\
     Under a scheduler:\n  \
     srun --nodes 2 --ntasks-per-node 1 tether run --nproc-per-node 8 train.py\n      \
     (SLURM: the node count, node rank and first host come from the allocation)\n  \
     tether run --nproc-per-node 8 train.py\n      \
     (Kubernetes' PyTorchJob, elastic policy: the operator sets\n      \
     PET_NNODES=MIN:MAX, PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT, PET_RDZV_ID)";

const RUN_TEMPLATE: &str =
    "{about-with-newline}\n{usage-heading} {usage}\n\n{before-help}{all-args}{after-help}";

const RUN_AFTER: &str =
    "SCRIPT runs as `PYTHON -u SCRIPT ARGS...`, as torchrun runs it: PYTHON is the \
     interpreter\ntether was installed with, or $PYTHON_EXEC. Options not given are read from \
     PET_<NAME>\n(PET_NPROC_PER_NODE, PET_NNODES, ...), as torchrun reads them.\n\n\
     Output: each line of a rank is printed whole, after \"[rank N]: \" unless it starts with \
     the\nrank's own prefix already (\"[rank N]\", or \"[rankN]\" as torch prints). When \
     tether's stdout\nand stderr are one file (a terminal, `2>&1`), a rank's two streams share \
     one pipe and\nkeep the order it wrote them in. A rank's stream that reaches a terminal \
     is a\npseudo-terminal of its size (resizes follow), as a torchrun rank sees the\n\
     terminal itself; --no-tty (PET_NO_TTY=1) gives every rank pipes.\n\n\
     Stacks: `kill -USR1 PID` (or `tether stacks PID`) prints every rank's Python stack, \
     rank\nby rank, to tether's stderr, and the run goes on; PID is tether's own.\n\n\
     Watch: a hang (a rank that has not moved for max(2 s, 3 steps)) and a slow rank are \
     named\non tether's stderr as they happen (`tether: hang: ...`, `tether: slow: ...`), and \
     the run\ngoes on; --no-watch (PET_NO_WATCH=1) turns it off.\n\n\
     Exit status: 0 when every rank exits 0; the first failing rank's exit code (128+signal\n\
     when a signal killed it); 128+signal when tether got a stop signal; 124 past \
     --timeout or\n--stall-timeout; 2 for bad usage; 127/126 when the command cannot be \
     started.";

#[derive(Debug, Parser)]
#[command(
    name = "tether",
    version,
    about = "Start, watch and stop groups of processes without hangs or orphans",
    propagate_version = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run N ranks of a script with torchrun's command line: prefixed output, the root cause
    /// of a failure, restarts, no orphans.
    #[command(
        override_usage = RUN_USAGE,
        before_help = RUN_EXAMPLES,
        after_help = RUN_AFTER,
        help_template = RUN_TEMPLATE,
        next_line_help = true,
        // As torchrun's argparse: an unambiguous prefix names an option (`--nproc_per`),
        // and an option given twice takes its last value.
        infer_long_args = true,
        args_override_self = true
    )]
    Run(Box<RunArgs>),
    /// List the processes tether started for this user, as a tree
    #[command(disable_help_flag = true, disable_version_flag = true)]
    Ps(OwnArgs),
    /// Print every rank's stack in a running `tether run` (its PID)
    #[command(disable_help_flag = true, disable_version_flag = true)]
    Stacks(OwnArgs),
    /// Show the ranks of a running `tether run` (its PID) live: state, CPU, memory, place
    #[command(disable_help_flag = true, disable_version_flag = true)]
    Top(OwnArgs),
}

/// The arguments of a subcommand that reads them itself (`ps`, `stacks`).
#[derive(Debug, Args)]
pub struct OwnArgs {
    #[arg(num_args = 0.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub args: Vec<OsString>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub nodes: NodeArgs,
    #[command(flatten)]
    pub rdzv: RdzvArgs,
    #[command(flatten)]
    pub program: ProgramArgs,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub stopping: StopArgs,
    #[command(flatten)]
    pub accepted: AcceptedArgs,
    /// The script every rank runs (or the module with -m, the command with --no-python),
    /// then its arguments.
    #[arg(
        required_unless_present = "print_completion",
        trailing_var_arg = true,
        value_name = "SCRIPT",
        help_heading = "Arguments"
    )]
    pub command: Vec<OsString>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = NODES)]
pub struct NodeArgs {
    /// Ranks per node: a number, "gpu" (one per GPU), "cpu" (one per CPU) or "auto" (one per
    /// GPU, else one per CPU).
    #[arg(short = 'n', long, allow_negative_numbers = true, value_name = "N")]
    pub nproc_per_node: Option<String>,
    /// Number of nodes: N, or an elastic range MIN:MAX (with a dynamic --rdzv-backend: the
    /// job starts with MIN to MAX nodes and takes in or loses nodes in new rounds). SLURM's
    /// when unset; Kubernetes' PyTorchJob sets PET_NNODES=MIN:MAX.
    #[arg(long, allow_negative_numbers = true, value_name = "N")]
    pub nnodes: Option<String>,
    /// This node's rank among the nodes, with --rdzv-backend static. SLURM's when unset, else
    /// 0. Ignored (with a note) under c10d, whose rendezvous ranks the nodes.
    #[arg(long, allow_negative_numbers = true, value_name = "R")]
    pub node_rank: Option<usize>,
    /// Address of node rank 0 (MASTER_ADDR) [default: localhost on one node, else 127.0.0.1;
    /// under SLURM its first host].
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// Port on node rank 0 (MASTER_PORT) [default: a free port on one node, else 29500].
    #[arg(long, allow_negative_numbers = true, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// One node, master localhost on a free port.
    #[arg(long)]
    pub standalone: bool,
}

#[derive(Debug, Args)]
#[command(next_help_heading = RDZV)]
pub struct RdzvArgs {
    /// "static" (ranks by --node-rank, a fixed number of nodes), or a dynamic rendezvous:
    /// "c10d" (torch's, over a TCPStore at --rdzv-endpoint), "etcd" or "etcd-v2" (where
    /// python-etcd is installed). On several nodes, the dynamic forms run torch's own
    /// rendezvous handler in a helper process, so tether and torchrun nodes can form one job.
    #[arg(long = "rdzv-backend", value_name = "NAME")]
    pub backend: Option<String>,
    /// HOST[:PORT] where the nodes meet (port 29400 for c10d when omitted): the node at that
    /// address hosts the rendezvous's store. With --rdzv-backend static, node rank 0's
    /// address (the ranks' MASTER_ADDR and MASTER_PORT).
    #[arg(long = "rdzv-endpoint", value_name = "HOST:PORT")]
    pub endpoint: Option<String>,
    /// The run id (TORCHELASTIC_RUN_ID, and the log directory's name) [default: generated,
    /// or SLURM's job id].
    #[arg(long = "rdzv-id", value_name = "ID")]
    pub id: Option<String>,
    /// KEY=VALUE,...: torch's rendezvous settings, as torchrun passes them (join_timeout,
    /// last_call_timeout, read_timeout, is_host, keep_alive_interval, ...).
    #[arg(long = "rdzv-conf", value_name = "CONF")]
    pub conf: Option<String>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = PROGRAM)]
pub struct ProgramArgs {
    /// Run SCRIPT as a module, as `python -u -m MODULE`.
    #[arg(short = 'm', long)]
    pub module: bool,
    /// Run the command as it is, without python in front.
    #[arg(long)]
    pub no_python: bool,
    /// Start every rank as a new interpreter (`PYTHON -u SCRIPT`), as torchrun does. By
    /// default a script's or module's ranks are forked from this node's warm zygote, which
    /// has imported the installed packages the script imports (torch, ...) once for every
    /// rank and restart.
    #[arg(long)]
    pub no_warm: bool,
    /// Accepted: each rank runs SCRIPT in a new interpreter, as without it (torchrun would
    /// run it inside its agent process).
    #[arg(long)]
    pub run_path: bool,
    /// The role name (ROLE_NAME).
    #[arg(long, value_name = "NAME", default_value = "default")]
    pub role: String,
    /// LOCAL_RANK=0 in every rank, and CUDA_VISIBLE_DEVICES set to the rank's own GPU.
    #[arg(long)]
    pub virtual_local_rank: bool,
}

#[derive(Debug, Args)]
#[command(next_help_heading = OUTPUT)]
pub struct OutputArgs {
    /// Write each rank's stdout and stderr to DIR/<run-id>/attempt_<k>/rank_<N>/{stdout,stderr}.log
    /// (the run's directory is printed at start).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Streams kept off the console (log files only): 0 none, 1 stdout, 2 stderr, 3 both, or
    /// per local rank as "0:3,1:2".
    #[arg(short = 'r', long, value_name = "STREAMS")]
    pub redirects: Option<String>,
    /// Streams written to log files and to the console (--redirects' format; alone: 3).
    #[arg(short = 't', long, value_name = "STREAMS", num_args = 0..=1, default_missing_value = "3")]
    pub tee: Option<String>,
    /// The console prefix, with ${rank}, ${local_rank}, ${role_name} and ${hostname}
    /// [default: "[rank ${rank}]: "].
    #[arg(long = "log-line-prefix-template", value_name = "TEMPLATE")]
    pub prefix_template: Option<String>,
    /// Print rank output without a prefix.
    #[arg(long)]
    pub no_prefix: bool,
    /// Give every rank pipes. By default a rank's stream that reaches tether's terminal is a
    /// pseudo-terminal of its size (resizes follow), as a torchrun rank sees the terminal:
    /// isatty() is true, colours and progress bars behave.
    #[arg(long)]
    pub no_tty: bool,
    /// Only these local ranks reach the console, e.g. "0,3" (log files get every rank).
    #[arg(long = "local-ranks-filter", value_name = "RANKS")]
    pub ranks_filter: Option<String>,
    /// Also copy the stdout lines that contain any of these comma-separated strings (",,"
    /// for a comma) to <attempt>/filtered_stdout.log.
    #[arg(long = "duplicate-stdout-filters", value_name = "FILTERS")]
    pub stdout_filters: Option<String>,
    /// The same for stderr, to <attempt>/filtered_stderr.log.
    #[arg(long = "duplicate-stderr-filters", value_name = "FILTERS")]
    pub stderr_filters: Option<String>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = STOPPING)]
pub struct StopArgs {
    /// Restart every rank up to K times after a failure of this node's ranks; on several
    /// nodes (c10d), every node restarts its ranks in a new round, and a restart for a node
    /// that joined or left does not count.
    #[arg(
        long,
        allow_negative_numbers = true,
        value_name = "K",
        default_value_t = 0
    )]
    pub max_restarts: u32,
    /// Seconds between the stop signal and SIGKILL when stopping ranks (default 30).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub grace_period: Option<f64>,
    /// torchrun's name of --grace-period.
    #[arg(
        long,
        value_name = "SECONDS",
        allow_negative_numbers = true,
        conflicts_with = "grace_period"
    )]
    pub shutdown_timeout: Option<f64>,
    /// Signals that stop the run, forwarded to every rank; SIGINT, SIGTERM and SIGHUP always
    /// are.
    #[arg(
        long = "signals-to-handle",
        value_name = "SIGNALS",
        default_value = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    )]
    pub signals: String,
    /// End the run after SECONDS: print every rank's stack (with py-spy's native frames
    /// when py-spy is installed), then stop the ranks (SIGTERM, the grace period, SIGKILL);
    /// exit status 124, as timeout(1).
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub timeout: Option<f64>,
    /// End the run the same way when no rank has printed anything for SECONDS.
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub stall_timeout: Option<f64>,
    /// Do not watch the ranks. By default tether samples where each rank's main thread is,
    /// and its CPU time, a few times a second: a hang (no rank moving for max(2 s, 3 steps))
    /// and a slow rank are named on stderr, and the run goes on.
    #[arg(long)]
    pub no_watch: bool,
}

#[derive(Debug, Args)]
#[command(next_help_heading = ACCEPTED)]
pub struct AcceptedArgs {
    /// Checked and accepted: tether sees every exit the moment it happens.
    #[arg(long, value_name = "SECONDS", allow_negative_numbers = true)]
    pub monitor_interval: Option<f64>,
    /// Checked and accepted: every rank is a new process running the command.
    #[arg(long, value_name = "METHOD", value_parser = ["spawn", "fork", "forkserver"])]
    pub start_method: Option<String>,
    /// Accepted: tether records no torchelastic events.
    #[arg(long, value_name = "NAME")]
    pub event_log_handler: Option<String>,
    /// This node's address in a dynamic rendezvous (MASTER_ADDR when it is node rank 0)
    /// [default: its fully qualified host name].
    #[arg(long, value_name = "HOST")]
    pub local_addr: Option<String>,
    /// Accepted with a warning: tether loads no torchrun logging plugin (see --log-dir).
    #[arg(long, value_name = "NAME")]
    pub logs_specs: Option<String>,
    /// Accepted with a warning: ranks keep the launcher's CPU affinity.
    #[arg(long, value_name = "MODE", value_parser = ["node", "socket", "exclusive", "core-complex"])]
    pub numa_binding: Option<String>,
    /// Refused: tether prints no completion script.
    #[arg(long, value_name = "SHELL")]
    pub print_completion: Option<String>,
}

/// The options that no `PET_` variable sets: tether's own, and those torchrun reads from the
/// command line only.
const NO_ENV: [&str; 7] = [
    "grace-period",
    "timeout",
    "stall-timeout",
    "no-prefix",
    "logs-specs",
    "numa-binding",
    "print-completion",
];

/// The options' other names, after their underscore spelling.
const MORE_NAMES: [(&str, &[&str]); 2] = [
    ("rdzv-id", &["run-id", "run_id"]),
    ("local-ranks-filter", &["ranks-filter", "ranks_filter"]),
];

/// The spellings torchrun gives an option of `tether run`: `--a_b` beside `--a-b` (and the
/// names of [`MORE_NAMES`]), and its default from `PET_A_B` unless [`NO_ENV`] lists it (a
/// flag's read as torchrun reads it: `1`, `true`, `yes`, `off`, ...).
fn torchrun_spellings(arg: clap::Arg) -> clap::Arg {
    let Some(long) = arg.get_long().map(str::to_owned) else {
        return arg;
    };
    let underscored = long.replace('-', "_");
    let mut arg = arg;
    if underscored != long {
        arg = arg.visible_alias(underscored.clone());
    }
    if let Some((_, more)) = MORE_NAMES.iter().find(|(name, _)| *name == long) {
        arg = arg.visible_aliases(more.iter().copied());
    }
    if NO_ENV.contains(&long.as_str()) {
        return arg;
    }
    if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
        arg = arg.value_parser(BoolishValueParser::new());
    }
    arg.env(format!("PET_{}", underscored.to_uppercase()))
        .hide_env(true)
}

/// The whole command line: the derived one, `run`'s options with their torchrun spellings.
fn cli() -> clap::Command {
    Cli::command().mut_subcommand("run", |run| run.mut_args(torchrun_spellings))
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed {
    Run(Box<RunArgs>),
    Ps(Vec<OsString>),
    Stacks(Vec<OsString>),
    Top(Vec<OsString>),
    /// A subcommand that the host (the Python package) implements; `main` never sees it
    /// when the host dispatched it first.
    Hosted(String),
}

/// The clap command, with the host's own subcommands (`(name, summary)`) listed in the help.
fn command(hosted: &[(String, String)]) -> clap::Command {
    let mut cmd = cli();
    for (name, about) in hosted {
        cmd = cmd.subcommand(
            clap::Command::new(name.clone())
                .about(about.clone())
                .disable_help_flag(true)
                .arg(
                    clap::Arg::new("args")
                        .num_args(0..)
                        .trailing_var_arg(true)
                        .allow_hyphen_values(true),
                ),
        );
    }
    cmd
}

/// Parses `argv` (with the program name first). Help, version and bad usage come back as
/// clap errors, to be printed and exited with.
pub fn parse(argv: Vec<OsString>, hosted: &[(String, String)]) -> Result<Parsed, clap::Error> {
    let mut cmd = command(hosted);
    let mut argv = normalize::normalize(argv, &cmd);
    // `tether help -h` asks for help as much as `tether -h` does (clap refuses it).
    if argv.get(1).is_some_and(|a| a == "help")
        && argv[2..].iter().all(|a| a == "-h" || a == "--help")
    {
        argv.truncate(2);
    }
    let matches = cmd.try_get_matches_from_mut(argv)?;
    if let Some((name, _)) = matches.subcommand() {
        if hosted.iter().any(|(n, _)| n == name) {
            return Ok(Parsed::Hosted(name.to_string()));
        }
    }
    let cli = Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))?;
    Ok(match cli.command {
        Command::Run(run) => Parsed::Run(run),
        Command::Ps(own) => Parsed::Ps(own.args),
        Command::Stacks(own) => Parsed::Stacks(own.args),
        Command::Top(own) => Parsed::Top(own.args),
    })
}

/// A usage error of `tether run`: message, usage line, exit status 2.
pub fn usage_error(kind: ErrorKind, message: impl std::fmt::Display) -> clap::Error {
    let mut cmd = cli();
    cmd.build();
    match cmd.find_subcommand_mut("run") {
        Some(run) => run.error(kind, message),
        None => cmd.error(kind, message),
    }
}

/// A usage error for a value that an option cannot take.
pub fn invalid(message: impl std::fmt::Display) -> clap::Error {
    usage_error(ErrorKind::ValueValidation, message)
}

/// A usage error for options that cannot be used together.
pub fn conflict(message: impl std::fmt::Display) -> clap::Error {
    usage_error(ErrorKind::ArgumentConflict, message)
}

#[cfg(test)]
pub fn parse_run(list: &[&str]) -> Result<RunArgs, clap::Error> {
    let mut argv = vec!["tether", "run"];
    argv.extend_from_slice(list);
    match parse(argv.iter().map(OsString::from).collect(), &[])? {
        Parsed::Run(run) => Ok(*run),
        other => panic!("not `run`: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_spelling_of_a_value() {
        for argv in [
            &["--nproc-per-node", "3", "x"][..],
            &["--nproc_per_node", "3", "x"],
            &["--nproc-per-node=3", "x"],
            &["--nproc_per_node=3", "x"],
            &["-n", "3", "x"],
            &["-n3", "x"],
        ] {
            let run = parse_run(argv).unwrap();
            assert_eq!(run.nodes.nproc_per_node.as_deref(), Some("3"), "{argv:?}");
            assert_eq!(run.command, ["x"]);
        }
    }

    #[test]
    fn tee_takes_an_optional_value() {
        let run = parse_run(&["--tee", "train.py", "--tee"]).unwrap();
        assert_eq!(run.output.tee.as_deref(), Some("3"));
        assert_eq!(run.command, ["train.py", "--tee"]);
        let run = parse_run(&["-t", "0:2,1:3", "x"]).unwrap();
        assert_eq!(run.output.tee.as_deref(), Some("0:2,1:3"));
        let run = parse_run(&["--tee", "9", "--", "true"]).unwrap();
        assert_eq!(run.output.tee.as_deref(), Some("9"));
        assert_eq!(run.command, ["true"]);
        let run = parse_run(&["--tee", "-m", "pkg"]).unwrap();
        assert!(run.program.module && run.output.tee.as_deref() == Some("3"));
        let run = parse_run(&["x", "--tee", "1"]).unwrap();
        assert_eq!(run.command, ["x", "--tee", "1"]);
    }

    #[test]
    fn options_by_unambiguous_prefix_and_the_last_value_wins() {
        let run = parse_run(&["--standal", "--nproc_per=2", "--max_restart", "1", "x"]).unwrap();
        assert!(run.nodes.standalone);
        assert_eq!(run.nodes.nproc_per_node.as_deref(), Some("2"));
        assert_eq!(run.stopping.max_restarts, 1);
        let run = parse_run(&["--nproc-per-node=1", "--nproc_per_node=2", "x"]).unwrap();
        assert_eq!(run.nodes.nproc_per_node.as_deref(), Some("2"));
        assert!(parse_run(&["--rdzv", "c10d", "x"]).is_err(), "ambiguous");
        // The tee rule sees through a prefix too: `--nproc_per 2` takes its value.
        let run = parse_run(&["--nproc_per", "2", "--tee", "x"]).unwrap();
        assert_eq!(run.output.tee.as_deref(), Some("3"));
        assert_eq!(run.command, ["x"]);
    }

    #[test]
    fn a_double_dash_right_after_the_script_is_dropped() {
        let run = parse_run(&["x.py", "--", "--help", "-h"]).unwrap();
        assert_eq!(run.command, ["x.py", "--help", "-h"]);
        let run = parse_run(&["x.py", "a", "--", "b"]).unwrap();
        assert_eq!(run.command, ["x.py", "a", "--", "b"]);
        let run = parse_run(&["--", "x.py", "--", "b"]).unwrap();
        assert_eq!(run.command, ["x.py", "--", "b"]);
        let run = parse_run(&["-n", "1", "--", "-m", "pkg", "a"]).unwrap();
        assert_eq!(run.command, ["-m", "pkg", "a"]);
    }

    #[test]
    fn script_arguments_are_the_scripts() {
        let run = parse_run(&["-m", "pkg.train", "--nnodes", "4", "-n", "2"]).unwrap();
        assert!(run.program.module);
        assert_eq!(run.command, ["pkg.train", "--nnodes", "4", "-n", "2"]);
        assert_eq!(run.nodes.nnodes, None);
    }

    /// Every option of torchrun's parser (torch 2.15), and its short forms.
    const TORCHRUN_OPTIONS: [&str; 32] = [
        "nnodes",
        "nproc-per-node",
        "rdzv-backend",
        "rdzv-endpoint",
        "rdzv-id",
        "rdzv-conf",
        "standalone",
        "max-restarts",
        "monitor-interval",
        "start-method",
        "event-log-handler",
        "role",
        "module",
        "no-python",
        "run-path",
        "log-dir",
        "redirects",
        "tee",
        "log-line-prefix-template",
        "local-ranks-filter",
        "duplicate-stdout-filters",
        "duplicate-stderr-filters",
        "node-rank",
        "master-addr",
        "master-port",
        "local-addr",
        "logs-specs",
        "numa-binding",
        "signals-to-handle",
        "shutdown-timeout",
        "virtual-local-rank",
        "print-completion",
    ];

    #[test]
    fn every_torchrun_option_in_both_spellings() {
        let cmd = cli();
        let run = cmd.find_subcommand("run").unwrap();
        let known = |name: &str| {
            run.get_arguments().any(|a| {
                a.get_long() == Some(name)
                    || a.get_all_aliases().is_some_and(|al| al.contains(&name))
            })
        };
        for name in TORCHRUN_OPTIONS {
            assert!(known(name), "--{name}");
            assert!(
                known(&name.replace('-', "_")),
                "--{}",
                name.replace('-', "_")
            );
        }
        for short in ['m', 'r', 't', 'n'] {
            assert!(
                run.get_arguments().any(|a| a.get_short() == Some(short)),
                "-{short}"
            );
        }
    }

    #[test]
    fn ps_and_stacks_take_their_arguments_as_they_come() {
        let parsed = |words: &[&str]| parse(words.iter().map(OsString::from).collect(), &[]);
        assert!(matches!(parsed(&["tether", "ps"]), Ok(Parsed::Ps(a)) if a.is_empty()));
        assert!(matches!(parsed(&["tether", "ps", "-a"]), Ok(Parsed::Ps(a)) if a == ["-a"]));
        let help = parsed(&["tether", "stacks", "--help"]);
        assert!(matches!(help, Ok(Parsed::Stacks(a)) if a == ["--help"]));
        let version = parsed(&["tether", "stacks", "--version"]);
        assert!(matches!(version, Ok(Parsed::Stacks(a)) if a == ["--version"]));
    }

    #[test]
    fn hosted_subcommands_are_listed() {
        let hosted = [("runs".to_string(), "List the runs".to_string())];
        let argv = ["tether", "runs", "-a"].map(OsString::from).to_vec();
        assert!(matches!(parse(argv, &hosted), Ok(Parsed::Hosted(name)) if name == "runs"));
        let help = command(&hosted).render_help().to_string();
        assert!(
            help.contains("runs") && help.contains("List the runs"),
            "{help}"
        );
    }
}
