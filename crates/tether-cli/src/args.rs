//! The command line: clap's definition, torchrun's spellings, and the resolved [`Config`].

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::slurm::SlurmJob;

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
    /// Run N ranks of a command with torchrun's environment, rank-prefixed output, a
    /// root-cause report on failure, restarts, and no orphans.
    #[command(
        after_help = "Each rank's output lines are printed whole, prefixed with \"[rank N]: \".\n\
                      Exit status: 0 when every rank exits 0; the first failing rank's exit code\n\
                      (128+signal when a signal killed it); 128+signal when tether itself got\n\
                      SIGINT, SIGTERM or SIGHUP; 2 for bad usage; 127/126 when the command\n\
                      cannot be started."
    )]
    Run(RunArgs),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Ranks per node: a number, or "cpu"/"auto" (one per CPU) or "gpu" (one per GPU).
    #[arg(
        short = 'n',
        long = "nproc-per-node",
        visible_alias = "nproc_per_node",
        value_name = "N"
    )]
    pub nproc_per_node: Option<String>,
    /// Number of nodes ("N" or "N:N"; static membership only). SLURM's when unset.
    #[arg(long, value_name = "N")]
    pub nnodes: Option<String>,
    /// This node's rank among the nodes. SLURM's when unset, else 0.
    #[arg(long = "node-rank", visible_alias = "node_rank", value_name = "R")]
    pub node_rank: Option<String>,
    /// Address of rank 0's node [default: 127.0.0.1, or SLURM's first host].
    #[arg(
        long = "master-addr",
        visible_alias = "master_addr",
        value_name = "HOST"
    )]
    pub master_addr: Option<String>,
    /// Port of rank 0's node [default: 29500].
    #[arg(
        long = "master-port",
        visible_alias = "master_port",
        value_name = "PORT"
    )]
    pub master_port: Option<u16>,
    /// Restart every rank up to K times after a failure (single node only).
    #[arg(
        long = "max-restarts",
        visible_alias = "max_restarts",
        value_name = "K",
        default_value_t = 0
    )]
    pub max_restarts: u32,
    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(
        long = "grace-period",
        visible_alias = "grace_period",
        value_name = "SECONDS",
        default_value_t = 30.0
    )]
    pub grace_period: f64,
    /// Write each rank's output to DIR/<run-id>/attempt_<k>/rank_<N>/{stdout,stderr}.log
    /// instead of the console.
    #[arg(long = "log-dir", visible_alias = "log_dir", value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// With --log-dir, also print to the console: 1 stdout, 2 stderr, 3 both (the default),
    /// 0 none, or per local rank as "0:3,1:2".
    #[arg(long, value_name = "STREAMS", num_args = 0..=1, default_missing_value = "3")]
    pub tee: Option<String>,
    /// Print rank output without the "[rank N]: " prefix.
    #[arg(long = "no-prefix", visible_alias = "no_prefix")]
    pub no_prefix: bool,
    /// Only these local ranks reach the console, e.g. "0,3" (log files get every rank).
    #[arg(
        long = "ranks-filter",
        visible_aliases = ["local-ranks-filter", "local_ranks_filter", "ranks_filter"],
        value_name = "RANKS"
    )]
    pub ranks_filter: Option<String>,
    /// One node, master 127.0.0.1 on a free port.
    #[arg(long)]
    pub standalone: bool,
    /// The run id (TORCHELASTIC_RUN_ID) [default: generated, or SLURM's job id].
    #[arg(long = "run-id", visible_aliases = ["rdzv-id", "rdzv_id", "run_id"], value_name = "ID")]
    pub run_id: Option<String>,
    /// Rendezvous backend: only "static" is supported.
    #[arg(
        long = "rdzv-backend",
        visible_alias = "rdzv_backend",
        value_name = "NAME"
    )]
    pub rdzv_backend: Option<String>,
    /// HOST:PORT of rank 0's node, another way to give --master-addr and --master-port.
    #[arg(
        long = "rdzv-endpoint",
        visible_alias = "rdzv_endpoint",
        value_name = "HOST:PORT"
    )]
    pub rdzv_endpoint: Option<String>,
    /// The role name (ROLE_NAME).
    #[arg(long, value_name = "NAME", default_value = "default")]
    pub role: String,
    /// Accepted for torchrun compatibility: tether always runs the command as given.
    #[arg(long = "no-python", visible_alias = "no_python")]
    pub no_python: bool,
    /// The command every rank runs, with its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

/// Which of a rank's streams reach the console when they also go to log files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    pub const BOTH: Streams = Streams {
        stdout: true,
        stderr: true,
    };

    fn from_code(code: &str) -> Option<Streams> {
        match code.trim() {
            "0" => Some(Streams {
                stdout: false,
                stderr: false,
            }),
            "1" => Some(Streams {
                stdout: true,
                stderr: false,
            }),
            "2" => Some(Streams {
                stdout: false,
                stderr: true,
            }),
            "3" => Some(Streams::BOTH),
            _ => None,
        }
    }
}

/// torchrun's `--tee`: one code for every rank, or `local_rank:code,...` (ranks not named
/// get none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tee {
    All(Streams),
    PerRank(Vec<(usize, Streams)>),
}

impl Tee {
    pub fn parse(spec: &str) -> Option<Tee> {
        if let Some(s) = Streams::from_code(spec) {
            return Some(Tee::All(s));
        }
        let mut per = Vec::new();
        for part in spec.split(',') {
            let (rank, code) = part.split_once(':')?;
            per.push((rank.trim().parse().ok()?, Streams::from_code(code)?));
        }
        Some(Tee::PerRank(per))
    }

    pub fn for_rank(&self, local_rank: usize) -> Streams {
        match self {
            Tee::All(s) => *s,
            Tee::PerRank(per) => per
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map(|(_, s)| *s)
                .unwrap_or(Streams {
                    stdout: false,
                    stderr: false,
                }),
        }
    }
}

/// Everything `tether run` needs, checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub nproc: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub max_restarts: u32,
    pub grace: Duration,
    pub log_dir: Option<PathBuf>,
    /// With `log_dir`: which streams also reach the console (`None`: none).
    pub tee: Option<Tee>,
    pub prefix: bool,
    /// Local ranks whose output reaches the console (`None`: all).
    pub ranks_filter: Option<Vec<usize>>,
    pub run_id: String,
    pub role: String,
    pub command: Vec<OsString>,
}

impl Config {
    pub fn world_size(&self) -> usize {
        self.nproc * self.nnodes
    }

    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.node_rank * self.nproc + local_rank
    }

    /// Which streams of `local_rank` reach the console.
    pub fn console_streams(&self, local_rank: usize) -> Streams {
        let shown = self
            .ranks_filter
            .as_ref()
            .map_or(true, |ranks| ranks.contains(&local_rank));
        let streams = match (&self.log_dir, &self.tee) {
            (None, _) => Streams::BOTH,
            (Some(_), None) => Streams {
                stdout: false,
                stderr: false,
            },
            (Some(_), Some(tee)) => tee.for_rank(local_rank),
        };
        Streams {
            stdout: shown && streams.stdout,
            stderr: shown && streams.stderr,
        }
    }
}

/// Parses the process's command line; bad usage exits with clap's message, the usage line
/// and status 2.
pub fn parse() -> Cli {
    let argv = normalize_tee(std::env::args_os().collect());
    Cli::parse_from(argv)
}

/// A usage error of `tether run`: message, usage line, exit status 2.
pub fn usage_error(kind: ErrorKind, message: impl std::fmt::Display) -> clap::Error {
    let mut cmd = Cli::command();
    cmd.build();
    match cmd.find_subcommand_mut("run") {
        Some(run) => run.error(kind, message),
        None => cmd.error(kind, message),
    }
}

/// `--tee` takes an optional value; `--tee train.py` means `--tee=3 train.py`. Only the
/// launcher's own options are looked at (up to the command or `--`).
fn normalize_tee(argv: Vec<OsString>) -> Vec<OsString> {
    let cmd = Cli::command();
    let Some(run) = cmd.find_subcommand("run") else {
        return argv;
    };
    let takes_value = |token: &str| -> bool {
        let (long, short) = match token.strip_prefix("--") {
            Some(long) => (Some(long), None),
            None => (None, token.strip_prefix('-').and_then(|s| s.chars().next())),
        };
        run.get_arguments().any(|a| {
            let named = match (long, short) {
                (Some(l), _) => {
                    a.get_long() == Some(l) || a.get_all_aliases().is_some_and(|al| al.contains(&l))
                }
                (None, Some(s)) => token.len() == 2 && a.get_short() == Some(s),
                _ => false,
            };
            named && a.get_action().takes_values() && a.get_id() != "tee"
        })
    };
    let mut out = Vec::with_capacity(argv.len());
    let mut iter = argv.into_iter().peekable();
    let mut in_run = false;
    while let Some(arg) = iter.next() {
        let text = arg.to_str().map(str::to_owned);
        out.push(arg);
        let Some(text) = text else { continue };
        if !in_run {
            in_run = text == "run";
            if in_run {
                continue;
            }
            continue;
        }
        if text == "--" || !text.starts_with('-') || text == "-" {
            break;
        }
        if text == "--tee" {
            let next_is_spec = iter
                .peek()
                .and_then(|n| n.to_str())
                .is_some_and(|n| Tee::parse(n).is_some());
            if !next_is_spec {
                if let Some(last) = out.last_mut() {
                    *last = "--tee=3".into();
                }
            } else if let Some(value) = iter.next() {
                out.push(value);
            }
        } else if !text.contains('=') && takes_value(&text) {
            if let Some(value) = iter.next() {
                out.push(value);
            }
        }
    }
    out.extend(iter);
    out
}

/// Resolves the parsed flags (with SLURM's environment, `slurm`) into a [`Config`].
pub fn resolve(args: RunArgs, slurm: Option<SlurmJob>) -> Result<Config, clap::Error> {
    let invalid = |msg: String| usage_error(ErrorKind::ValueValidation, msg);
    if let Some(backend) = &args.rdzv_backend {
        if backend != "static" {
            return Err(invalid(format!(
                "--rdzv-backend {backend:?} is not supported: tether run uses static membership \
                 (give every node --nnodes, --node-rank and --master-addr)"
            )));
        }
    }
    let nproc = match args.nproc_per_node.as_deref() {
        None => 1,
        Some(spec) => parse_nproc(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --nproc-per-node {spec:?}: expected a number of at least 1, \"cpu\", \
                 \"auto\" or \"gpu\""
            ))
        })?,
    };
    let slurm = slurm.unwrap_or_default();
    let standalone = args.standalone;
    let nnodes_spec = args.nnodes.clone().or(slurm.nnodes.clone());
    let nnodes = match nnodes_spec.as_deref() {
        None => 1,
        Some(spec) => parse_nnodes(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --nnodes {spec:?}: expected a number of at least 1 (or \"N:N\"; \
                 elastic ranges are not supported)"
            ))
        })?,
    };
    if standalone && nnodes != 1 {
        return Err(usage_error(
            ErrorKind::ArgumentConflict,
            "--standalone runs a single node; it cannot be used with --nnodes > 1",
        ));
    }
    let node_rank_spec = args.node_rank.clone().or(slurm.node_rank.clone());
    let node_rank = match node_rank_spec.as_deref() {
        None => 0,
        Some(spec) => spec
            .trim()
            .parse::<usize>()
            .map_err(|_| invalid(format!("invalid --node-rank {spec:?}: expected a number")))?,
    };
    if node_rank >= nnodes {
        return Err(invalid(format!(
            "--node-rank {node_rank} is out of range for --nnodes {nnodes} (expected 0..{})",
            nnodes - 1
        )));
    }
    if args.max_restarts > 0 && nnodes > 1 {
        return Err(usage_error(
            ErrorKind::ArgumentConflict,
            format!(
                "--max-restarts {} needs a single node: static multi-node runs cannot restart \
                 in step (use --max-restarts 0 with --nnodes {nnodes})",
                args.max_restarts
            ),
        ));
    }
    if !(args.grace_period.is_finite() && args.grace_period >= 0.0) {
        return Err(invalid(format!(
            "invalid --grace-period {}: expected seconds >= 0",
            args.grace_period
        )));
    }
    let (endpoint_addr, endpoint_port) = match &args.rdzv_endpoint {
        None => (None, None),
        Some(ep) => {
            let (host, port) = match ep.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (ep.as_str(), None),
            };
            let port = match port {
                None => None,
                Some(p) => Some(p.parse::<u16>().map_err(|_| {
                    invalid(format!(
                        "invalid --rdzv-endpoint {ep:?}: expected HOST:PORT"
                    ))
                })?),
            };
            let host = host.trim_start_matches('[').trim_end_matches(']');
            ((!host.is_empty()).then(|| host.to_string()), port)
        }
    };
    let (master_addr, master_port) = if standalone {
        let port = match args.master_port {
            Some(p) => p,
            None => free_port().map_err(|e| {
                usage_error(ErrorKind::Io, format!("--standalone: no free port: {e}"))
            })?,
        };
        ("127.0.0.1".to_string(), port)
    } else {
        (
            args.master_addr
                .or(endpoint_addr)
                .or(slurm.first_host.clone())
                .unwrap_or_else(|| "127.0.0.1".to_string()),
            args.master_port.or(endpoint_port).unwrap_or(29500),
        )
    };
    let tee = match args.tee.as_deref() {
        None => None,
        Some(spec) => Some(Tee::parse(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --tee {spec:?}: expected 0, 1, 2, 3 or \"local_rank:code,...\""
            ))
        })?),
    };
    let ranks_filter = match args.ranks_filter.as_deref() {
        None => None,
        Some(spec) => Some(parse_rank_list(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --ranks-filter {spec:?}: expected local ranks like \"0,3\""
            ))
        })?),
    };
    let run_id = match args.run_id {
        Some(id) if !id.is_empty() => id,
        _ if !slurm.job_id.is_empty() => format!("slurm-{}", slurm.job_id),
        _ => generate_run_id(),
    };
    if run_id.contains('/') || run_id == "." || run_id == ".." {
        return Err(invalid(format!(
            "invalid --run-id {run_id:?}: it names a directory under --log-dir"
        )));
    }
    Ok(Config {
        nproc,
        nnodes,
        node_rank,
        master_addr,
        master_port,
        max_restarts: args.max_restarts,
        grace: Duration::from_secs_f64(args.grace_period),
        log_dir: args.log_dir,
        tee,
        prefix: !args.no_prefix,
        ranks_filter,
        run_id,
        role: args.role,
        command: args.command,
    })
}

fn parse_nproc(spec: &str) -> Option<usize> {
    let n = match spec.trim() {
        "cpu" | "auto" => std::thread::available_parallelism().map_or(1, |n| n.get()),
        "gpu" => count_gpus(),
        n => n.parse().ok()?,
    };
    (n >= 1).then_some(n)
}

fn count_gpus() -> usize {
    std::fs::read_dir("/dev")
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia")
                        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                })
                .count()
        })
        .unwrap_or(0)
}

fn parse_nnodes(spec: &str) -> Option<usize> {
    let n = match spec.split_once(':') {
        Some((lo, hi)) => {
            let (lo, hi): (usize, usize) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
            (lo == hi).then_some(lo)?
        }
        None => spec.trim().parse().ok()?,
    };
    (n >= 1).then_some(n)
}

fn parse_rank_list(spec: &str) -> Option<Vec<usize>> {
    spec.split(',')
        .map(|r| r.trim().parse().ok())
        .collect::<Option<Vec<usize>>>()
        .filter(|v| !v.is_empty())
}

fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

/// A short random id (16 hex digits), for TORCHELASTIC_RUN_ID and the log directory.
fn generate_run_id() -> String {
    let mut bytes = [0u8; 8];
    // SAFETY: getrandom writes at most `bytes.len()` bytes into `bytes`.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if n != bytes.len() as isize {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        bytes = (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_ne_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<Config, clap::Error> {
        let mut argv = vec!["tether", "run"];
        argv.extend_from_slice(list);
        let cli = Cli::try_parse_from(normalize_tee(argv.iter().map(OsString::from).collect()))?;
        let Command::Run(run) = cli.command;
        resolve(run, None)
    }

    #[test]
    fn torchrun_spellings() {
        let c = args(&["--nproc_per_node", "3", "--master_port", "1234", "--", "x"]).unwrap();
        assert_eq!((c.nproc, c.master_port), (3, 1234));
        let c = args(&[
            "--nproc-per-node=2",
            "--nnodes",
            "2:2",
            "--node_rank",
            "1",
            "x",
        ])
        .unwrap();
        assert_eq!((c.nproc, c.nnodes, c.node_rank), (2, 2, 1));
        assert_eq!(c.global_rank(1), 3);
        assert_eq!(c.master_addr, "127.0.0.1");
        let c = args(&["--rdzv-endpoint", "h:9", "x"]).unwrap();
        assert_eq!((c.master_addr.as_str(), c.master_port), ("h", 9));
    }

    #[test]
    fn tee_takes_an_optional_value() {
        let c = args(&["--log-dir", "d", "--tee", "python", "-c", "--tee"]).unwrap();
        assert_eq!(c.tee, Some(Tee::All(Streams::BOTH)));
        assert_eq!(c.command, ["python", "-c", "--tee"]);
        let c = args(&["--log-dir", "d", "--tee", "1", "x"]).unwrap();
        assert_eq!(
            c.tee,
            Some(Tee::All(Streams {
                stdout: true,
                stderr: false
            }))
        );
        let c = args(&["--log-dir", "d", "--tee", "0:2,1:3", "x"]).unwrap();
        assert!(c.console_streams(0).stderr && !c.console_streams(0).stdout);
        assert!(!c.console_streams(2).stderr);
        let c = args(&["-n", "2", "x", "--tee"]).unwrap();
        assert_eq!(c.command, ["x", "--tee"]);
    }

    #[test]
    fn bad_usage() {
        for bad in [
            &["-n", "0", "x"][..],
            &["x", "y"][..0],
            &["--nnodes", "2", "--node-rank", "2", "x"],
            &["--nnodes", "2", "--max-restarts", "1", "x"],
            &["--nnodes", "1:4", "x"],
            &["--standalone", "--nnodes", "2", "x"],
            &["--bogus", "x"],
            &["--rdzv-backend", "c10d", "x"],
        ] {
            let err = args(bad).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{bad:?}");
        }
    }

    #[test]
    fn slurm_fills_the_gaps() {
        let job = SlurmJob {
            nnodes: Some("3".into()),
            node_rank: Some("2".into()),
            first_host: Some("gpu03".into()),
            job_id: "42".into(),
        };
        let cli = Cli::try_parse_from(["tether", "run", "-n", "2", "x"]).unwrap();
        let Command::Run(run) = cli.command;
        let c = resolve(run, Some(job.clone())).unwrap();
        assert_eq!(
            (c.nnodes, c.node_rank, c.master_addr.as_str()),
            (3, 2, "gpu03")
        );
        assert_eq!(c.run_id, "slurm-42");
        let cli = Cli::try_parse_from(["tether", "run", "--master-addr", "h", "x"]).unwrap();
        let Command::Run(run) = cli.command;
        assert_eq!(resolve(run, Some(job)).unwrap().master_addr, "h");
    }

    #[test]
    fn filter_and_log_dir_choose_the_console() {
        let c = args(&["-n", "4", "--ranks-filter", "0,3", "x"]).unwrap();
        assert!(c.console_streams(3).stdout && !c.console_streams(1).stdout);
        let c = args(&["-n", "4", "--log-dir", "d", "x"]).unwrap();
        assert!(!c.console_streams(0).stdout && !c.console_streams(0).stderr);
    }
}
