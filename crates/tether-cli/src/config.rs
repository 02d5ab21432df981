//! What `tether run`'s options mean: the checked [`Config`]. Every invalid value is a usage
//! error that names its option; torchrun options tether cannot honour are refused with a
//! sentence that says what it supports instead, or accepted with a note.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::error::ErrorKind;

use crate::args::{usage_error, AcceptedArgs, NodeArgs, OutputArgs, ProgramArgs, RunArgs};
use crate::rendezvous::{Backend, Place, Rendezvous};
use crate::slurm::SlurmJob;

/// The default console prefix.
pub const DEFAULT_PREFIX: &str = "[rank ${rank}]: ";
/// torchrun's default port for a c10d endpoint given without one.
const C10D_PORT: u16 = 29400;
/// torchrun's default MASTER_PORT for several nodes.
const MASTER_PORT: u16 = 29500;
/// MASTER_ADDR on one node when none is given, as torchrun gives it.
const LOCAL_MASTER: &str = "localhost";
/// torchrun's `--rdzv-id` when none is given.
const DEFAULT_RUN_ID: &str = "none";
/// Seconds between the stop signal and SIGKILL when no --grace-period is given.
const DEFAULT_GRACE_SECONDS: f64 = 30.0;

/// Which of a rank's two streams something applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Streams {
    pub stdout: bool,
    pub stderr: bool,
}

impl Streams {
    pub const NONE: Streams = Streams {
        stdout: false,
        stderr: false,
    };
    pub const BOTH: Streams = Streams {
        stdout: true,
        stderr: true,
    };

    fn from_code(code: &str) -> Option<Streams> {
        let code: u8 = code.trim().parse().ok().filter(|&c| c <= 3)?;
        Some(Streams {
            stdout: code & 1 != 0,
            stderr: code & 2 != 0,
        })
    }
}

/// torchrun's `--redirects`/`--tee` value: one code for every local rank, or
/// `local_rank:code,...` (ranks not named get none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamSpec {
    All(Streams),
    PerRank(Vec<(usize, Streams)>),
}

impl Default for StreamSpec {
    fn default() -> StreamSpec {
        StreamSpec::All(Streams::NONE)
    }
}

impl StreamSpec {
    pub fn parse(spec: &str) -> Option<StreamSpec> {
        if let Some(s) = Streams::from_code(spec) {
            return Some(StreamSpec::All(s));
        }
        let mut per = Vec::new();
        for part in spec.split(',') {
            let (rank, code) = part.split_once(':')?;
            per.push((rank.trim().parse().ok()?, Streams::from_code(code)?));
        }
        Some(StreamSpec::PerRank(per))
    }

    pub fn for_rank(&self, local_rank: usize) -> Streams {
        match self {
            StreamSpec::All(s) => *s,
            StreamSpec::PerRank(per) => per
                .iter()
                .find(|(r, _)| *r == local_rank)
                .map_or(Streams::NONE, |(_, s)| *s),
        }
    }

    fn any(&self) -> bool {
        match self {
            StreamSpec::All(s) => *s != Streams::NONE,
            StreamSpec::PerRank(per) => per.iter().any(|(_, s)| *s != Streams::NONE),
        }
    }
}

/// Where rank output goes.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// The base log directory; `auto_log_dir` when tether makes one under the temporary
    /// directory (torchrun's way when streams are redirected without `--log-dir`).
    pub log_dir: Option<PathBuf>,
    pub auto_log_dir: bool,
    pub redirects: StreamSpec,
    pub tee: StreamSpec,
    /// Local ranks whose output reaches the console (`None`: all).
    pub ranks_filter: Option<Vec<usize>>,
    /// The prefix template (`None`: `--no-prefix`).
    pub prefix: Option<String>,
    pub stdout_filters: Vec<String>,
    pub stderr_filters: Vec<String>,
}

impl Output {
    /// Which streams of `local_rank` reach the console: those not redirected, and those
    /// teed, of the ranks the filter lets through.
    pub fn console(&self, local_rank: usize) -> Streams {
        let shown = self
            .ranks_filter
            .as_ref()
            .map_or(true, |ranks| ranks.contains(&local_rank));
        let redirected = self.redirects.for_rank(local_rank);
        let teed = self.tee.for_rank(local_rank);
        Streams {
            stdout: shown && (teed.stdout || !redirected.stdout),
            stderr: shown && (teed.stderr || !redirected.stderr),
        }
    }
}

/// Everything `tether run` needs, checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub nproc: usize,
    /// This node's place in the job: fixed for the static and one-node forms, else given by
    /// each round of the rendezvous.
    pub place: Place,
    /// The dynamic rendezvous (torch's handler, in a helper process), for torchrun's c10d
    /// and etcd forms on several nodes or an elastic node count.
    pub rendezvous: Option<Rendezvous>,
    /// The interpreter that runs the rendezvous helper (the one that runs scripts).
    pub rendezvous_python: OsString,
    pub max_restarts: u32,
    pub grace: Duration,
    pub output: Output,
    pub run_id: String,
    /// The name of the run's directory under `--log-dir`: the run id when one was given,
    /// else a random one (the default id, `none`, is every run's).
    pub log_name: String,
    pub role: String,
    /// With `--virtual-local-rank`: each local rank's GPU.
    pub virtual_devices: Option<VirtualDevices>,
    /// Signals that stop the run (forwarded to the ranks).
    pub stop_signals: Vec<i32>,
    /// `--signals-to-handle` as given (the ranks' TORCHELASTIC_SIGNALS_TO_HANDLE).
    pub signals_to_handle: String,
    /// `--timeout`: the run's time limit.
    pub timeout: Option<Duration>,
    /// `--stall-timeout`: the longest time without output from any rank.
    pub stall_timeout: Option<Duration>,
    /// The argv every rank runs.
    pub command: Vec<OsString>,
    /// Whether the ranks run tether's Python (a script or a module), which answers requests
    /// for its stacks; false with `--no-python`.
    pub python_ranks: bool,
    /// Warnings about options accepted but not applied, printed at start.
    pub notes: Vec<String>,
}

impl Config {
    pub fn world_size(&self) -> usize {
        self.place.world_size
    }

    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.place.rank_base + local_rank
    }
}

/// `--virtual-local-rank`: every rank sees only its own GPU, as device 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtualDevices {
    /// The GPU of each local rank (the parent's visible devices, in order, else 0..N).
    pub devices: Vec<String>,
    /// Whether HIP_VISIBLE_DEVICES (ROCm) is set too.
    pub hip: bool,
}

/// Reads an environment variable.
pub type VarFn = Box<dyn Fn(&str) -> Option<String>>;

/// What the resolution reads from outside the command line.
pub struct Context {
    pub slurm: Option<SlurmJob>,
    /// The interpreter that runs scripts (`$PYTHON_EXEC`, else the one tether was installed
    /// with, else `python3`).
    pub python: OsString,
    /// Environment variables (the process's own in `main`).
    pub var: VarFn,
    /// Where GPU device nodes are looked for (`/dev`).
    pub dev: PathBuf,
}

fn invalid(message: impl std::fmt::Display) -> clap::Error {
    usage_error(ErrorKind::ValueValidation, message)
}

fn conflict(message: impl std::fmt::Display) -> clap::Error {
    usage_error(ErrorKind::ArgumentConflict, message)
}

/// Resolves the parsed options (with SLURM's environment and the host's) into a [`Config`].
pub fn resolve(args: RunArgs, ctx: &Context) -> Result<Config, clap::Error> {
    let mut notes = accepted(&args.accepted, &args.rdzv.conf)?;
    let backend = Backend::parse(args.rdzv.backend.as_deref(), args.nodes.standalone)?;
    let c10d = backend != Backend::Static;
    let slurm = ctx.slurm.clone().unwrap_or_default();
    let nproc = nproc(args.nodes.nproc_per_node.as_deref(), ctx)?;
    let (min_nodes, max_nodes) = node_counts(&args.nodes, &slurm)?;
    let run_id = run_id(args.rdzv.id.as_deref(), args.nodes.standalone, &slurm)?;
    let stop = &args.stopping;
    let dynamic = c10d && !args.nodes.standalone && (max_nodes > 1 || min_nodes != max_nodes);
    if !c10d && min_nodes != max_nodes {
        return Err(conflict(format!(
            "--nnodes {min_nodes}:{max_nodes} asks for an elastic range of nodes, which needs a \
             dynamic rendezvous: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        )));
    }
    let (place, rendezvous) = if dynamic {
        let rdzv = Rendezvous::resolve(&args, backend, (min_nodes, max_nodes), nproc, &run_id)?;
        if let Some(rank) = args.nodes.node_rank {
            notes.push(format!(
                "tether: --node-rank {rank} is ignored with --rdzv-backend {}: the rendezvous \
                 gives every node its rank, as torchrun does",
                backend.name()
            ));
        }
        (Place::unknown(nproc), Some(rdzv))
    } else {
        let nnodes = max_nodes;
        let node_rank = node_rank(&args.nodes, &slurm, nnodes)?;
        let (master_addr, master_port) = master(&args, nnodes, &slurm, c10d)?;
        if stop.max_restarts > 0 && nnodes > 1 {
            return Err(conflict(format!(
                "--max-restarts {} with --rdzv-backend static needs a single node: nodes with \
                 fixed ranks cannot restart in step (use --rdzv-backend c10d with \
                 --rdzv-endpoint HOST:PORT, which restarts every node's ranks together)",
                stop.max_restarts
            )));
        }
        let place = Place::fixed(node_rank, nnodes, nproc, master_addr, master_port);
        (place, None)
    };
    let (grace, grace_option) = match (stop.grace_period, stop.shutdown_timeout) {
        (Some(seconds), _) => (seconds, "--grace-period"),
        (None, Some(seconds)) => (seconds, "--shutdown-timeout"),
        (None, None) => (DEFAULT_GRACE_SECONDS, "--grace-period"),
    };
    if !(grace.is_finite() && grace >= 0.0) {
        return Err(invalid(format!(
            "invalid {grace_option} {grace}: expected seconds >= 0"
        )));
    }
    let stop_signals = stop_signals(&stop.signals)?;
    if stop_signals.contains(&libc::SIGUSR1) {
        notes.push(
            "tether: SIGUSR1 stops this run (--signals-to-handle); `tether stacks PID` still \
             prints the ranks' stacks"
                .into(),
        );
    }
    Ok(Config {
        nproc,
        place,
        rendezvous,
        rendezvous_python: ctx.python.clone(),
        max_restarts: stop.max_restarts,
        grace: Duration::from_secs_f64(grace),
        output: output(&args.output, ctx)?,
        log_name: match args.rdzv.id.as_deref() {
            None | Some("") if run_id == DEFAULT_RUN_ID => random_id(),
            _ => run_id.clone(),
        },
        run_id,
        role: args.program.role.clone(),
        virtual_devices: virtual_devices(args.program.virtual_local_rank, nproc, ctx)?,
        stop_signals,
        signals_to_handle: stop.signals.clone(),
        timeout: limit("--timeout", stop.timeout)?,
        stall_timeout: limit("--stall-timeout", stop.stall_timeout)?,
        command: program(&args.program, &args.command, &ctx.python)?,
        python_ranks: !args.program.no_python || args.program.run_path,
        notes,
    })
}

/// torchrun options that tether checks and accepts without applying them; returns the
/// warnings to print.
fn accepted(args: &AcceptedArgs, rdzv_conf: &Option<String>) -> Result<Vec<String>, clap::Error> {
    if let Some(shell) = &args.print_completion {
        return Err(invalid(format!(
            "--print-completion {shell}: tether prints no shell completion script"
        )));
    }
    if let Some(t) = args.monitor_interval {
        if !(t.is_finite() && t >= 0.0) {
            return Err(invalid(format!(
                "invalid --monitor-interval {t}: expected seconds >= 0"
            )));
        }
    }
    if let Some(conf) = rdzv_conf {
        let pair_ok = |p: &str| p.split_once('=').is_some_and(|(k, _)| !k.trim().is_empty());
        if !conf.trim().is_empty() && !conf.split(',').all(pair_ok) {
            return Err(invalid(format!(
                "invalid --rdzv-conf {conf:?}: expected KEY=VALUE pairs separated by commas"
            )));
        }
    }
    let mut notes = Vec::new();
    if let Some(mode) = &args.numa_binding {
        notes.push(format!(
            "tether: --numa-binding {mode} is not applied: ranks keep the launcher's CPU affinity"
        ));
    }
    if let Some(name) = &args.logs_specs {
        notes.push(format!(
            "tether: --logs-specs {name} is not applied: tether loads no torchrun logging \
             plugin; use --log-dir, --redirects and --tee"
        ));
    }
    Ok(notes)
}

fn nproc(spec: Option<&str>, ctx: &Context) -> Result<usize, clap::Error> {
    let Some(spec) = spec else { return Ok(1) };
    let cpus = || std::thread::available_parallelism().map_or(1, |n| n.get());
    let visible = (ctx.var)("CUDA_VISIBLE_DEVICES");
    match spec.trim() {
        "cpu" => Ok(cpus()),
        "auto" => Ok(Some(gpu_count(&ctx.dev, visible.as_deref()))
            .filter(|&n| n > 0)
            .unwrap_or_else(cpus)),
        "gpu" => match gpu_count(&ctx.dev, visible.as_deref()) {
            0 => Err(invalid(format!(
                "--nproc-per-node gpu: no GPU was found ({})",
                no_gpu_reason(&ctx.dev, visible.as_deref())
            ))),
            n => Ok(n),
        },
        n => n.parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
            invalid(format!(
                "invalid --nproc-per-node {spec:?}: expected a number of ranks (at least 1), \
                 \"gpu\", \"cpu\" or \"auto\""
            ))
        }),
    }
}

/// The NVIDIA device nodes under `dev` (`nvidia0`, `nvidia1`, ...).
fn gpu_devices(dev: &Path) -> usize {
    let Ok(dir) = std::fs::read_dir(dev) else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.strip_prefix("nvidia")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
        .count()
}

/// GPUs a rank can use: the device nodes, limited by `CUDA_VISIBLE_DEVICES` as CUDA reads
/// it (entries up to the first invalid one).
pub fn gpu_count(dev: &Path, visible: Option<&str>) -> usize {
    let devices = gpu_devices(dev);
    let Some(visible) = visible else {
        return devices;
    };
    let valid = |e: &&str| {
        let e = e.trim();
        e.starts_with("GPU-")
            || e.starts_with("MIG-")
            || (!e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()))
    };
    devices.min(visible.split(',').take_while(valid).count())
}

fn no_gpu_reason(dev: &Path, visible: Option<&str>) -> String {
    match visible {
        Some(v) if gpu_devices(dev) > 0 => format!("CUDA_VISIBLE_DEVICES={v:?} hides every GPU"),
        _ => format!("no NVIDIA device under {}", dev.display()),
    }
}

/// `--virtual-local-rank`'s device for each local rank: the parent's HIP_VISIBLE_DEVICES or
/// CUDA_VISIBLE_DEVICES, in order, else the local rank's number.
fn virtual_devices(
    on: bool,
    nproc: usize,
    ctx: &Context,
) -> Result<Option<VirtualDevices>, clap::Error> {
    if !on {
        return Ok(None);
    }
    let hip = (ctx.var)("HIP_VISIBLE_DEVICES").filter(|v| !v.is_empty());
    let (name, parent) = match hip.clone() {
        Some(v) => ("HIP_VISIBLE_DEVICES", Some(v)),
        None => ("CUDA_VISIBLE_DEVICES", (ctx.var)("CUDA_VISIBLE_DEVICES")),
    };
    let devices: Vec<String> = match parent {
        Some(list) => list.split(',').map(|d| d.trim().to_string()).collect(),
        None => (0..nproc).map(|i| i.to_string()).collect(),
    };
    if devices.len() < nproc {
        return Err(invalid(format!(
            "--virtual-local-rank: {nproc} ranks per node but {name} names {} device(s)",
            devices.len()
        )));
    }
    Ok(Some(VirtualDevices {
        devices,
        hip: hip.is_some(),
    }))
}

/// `--nnodes` as MIN and MAX. The command line wins over SLURM's environment:
/// `--standalone` and `--nnodes 1` are one node on its own, whatever the allocation.
fn node_counts(args: &NodeArgs, slurm: &SlurmJob) -> Result<(usize, usize), clap::Error> {
    let spec = match (&args.nnodes, args.standalone) {
        (Some(spec), _) => Some(spec.clone()),
        (None, true) => None,
        (None, false) => slurm.nnodes.clone(),
    };
    let (min, max) = match spec.as_deref() {
        None => (1, 1),
        Some(spec) => parse_nnodes(spec)?,
    };
    if args.standalone && max != 1 {
        return Err(conflict(
            "--standalone runs a single node; it cannot be used with --nnodes > 1",
        ));
    }
    Ok((min, max))
}

/// This node's rank with a fixed number of nodes: `--node-rank`, else SLURM's.
fn node_rank(args: &NodeArgs, slurm: &SlurmJob, nnodes: usize) -> Result<usize, clap::Error> {
    let node_rank = match (args.node_rank, &slurm.node_rank) {
        (Some(r), _) => r,
        (None, Some(r)) if nnodes > 1 => r
            .trim()
            .parse()
            .map_err(|_| invalid(format!("invalid SLURM_NODEID {r:?}: expected a node rank")))?,
        (None, _) => 0,
    };
    if node_rank >= nnodes {
        return Err(invalid(format!(
            "--node-rank {node_rank} is out of range for --nnodes {nnodes} (expected 0..{})",
            nnodes - 1
        )));
    }
    Ok(node_rank)
}

/// `N`, or an elastic `MIN:MAX`.
fn parse_nnodes(spec: &str) -> Result<(usize, usize), clap::Error> {
    let bad = || {
        invalid(format!(
            "invalid --nnodes {spec:?}: expected a number of nodes, at least 1, or MIN:MAX \
             with 1 <= MIN <= MAX"
        ))
    };
    let number = |s: &str| s.trim().parse::<usize>().ok().filter(|&n| n >= 1);
    match spec.split_once(':') {
        None => number(spec).map(|n| (n, n)).ok_or_else(bad),
        Some((lo, hi)) => match (number(lo), number(hi)) {
            (Some(lo), Some(hi)) if lo <= hi => Ok((lo, hi)),
            _ => Err(bad()),
        },
    }
}

/// MASTER_ADDR and MASTER_PORT: `--standalone`'s free port, the rendezvous endpoint, or
/// `--master-addr`/`--master-port` (SLURM's first host, and a free port on one node, when
/// unset).
fn master(
    args: &RunArgs,
    nnodes: usize,
    slurm: &SlurmJob,
    c10d: bool,
) -> Result<(String, u16), clap::Error> {
    let port_or_free = |port: Option<u16>, what: &str| match port {
        Some(0) | None if nnodes == 1 => free_port().map_err(|e| {
            usage_error(
                ErrorKind::Io,
                format!("{what}: cannot find a free port: {e}"),
            )
        }),
        Some(0) => Err(invalid(format!(
            "{what}: port 0 (any free port) only works on one node; give node rank 0's port"
        ))),
        Some(p) => Ok(p),
        None => Ok(MASTER_PORT),
    };
    let nodes = &args.nodes;
    if nodes.standalone {
        return Ok((
            LOCAL_MASTER.into(),
            port_or_free(nodes.master_port, "--standalone")?,
        ));
    }
    if let Some(endpoint) = &args.rdzv.endpoint {
        let (host, port) = parse_endpoint(endpoint)?;
        let port = match port {
            None if c10d => C10D_PORT,
            None => port_or_free(nodes.master_port, "--master-port")?,
            Some(p) => port_or_free(Some(p), "--rdzv-endpoint")?,
        };
        return Ok((host, port));
    }
    let addr = nodes
        .master_addr
        .clone()
        .or(slurm.first_host.clone().filter(|_| nnodes > 1))
        .unwrap_or_else(|| match nnodes {
            1 => LOCAL_MASTER.into(),
            _ => "127.0.0.1".into(),
        });
    Ok((addr, port_or_free(nodes.master_port, "--master-port")?))
}

/// `HOST[:PORT]`, `[IPV6]:PORT` or `[IPV6]`, as torch reads a rendezvous endpoint.
pub fn parse_endpoint(endpoint: &str) -> Result<(String, Option<u16>), clap::Error> {
    let bad = |why: &str| invalid(format!("invalid --rdzv-endpoint {endpoint:?}: {why}"));
    let ep = endpoint.trim();
    let (host, port) = if ep.starts_with('[') && ep.ends_with(']') {
        (ep, None)
    } else {
        match ep.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (ep, None),
        }
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let port = match port {
        None => None,
        Some(p) if (1..=5).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_digit()) => Some(
            p.parse::<u16>()
                .map_err(|_| bad("the port must be below 65536"))?,
        ),
        Some(_) => return Err(bad("expected HOST:PORT with a numeric port")),
    };
    let host_ok = |c: char| c.is_alphanumeric() || matches!(c, '_' | '.' | ':' | '-');
    if host.is_empty() || !host.chars().all(host_ok) {
        return Err(bad(
            "expected a host name, an IPv4 address or an [IPv6] address",
        ));
    }
    Ok((host.to_string(), port))
}

fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}

/// `--redirects` or `--tee` (`name`).
fn stream_spec(name: &str, spec: &Option<String>) -> Result<StreamSpec, clap::Error> {
    let Some(spec) = spec else {
        return Ok(StreamSpec::default());
    };
    StreamSpec::parse(spec).ok_or_else(|| {
        invalid(format!(
            "invalid {name} {spec:?}: expected 0 (no stream), 1 (stdout), 2 (stderr), \
             3 (both), or local_rank:code pairs such as \"0:3,1:2\""
        ))
    })
}

fn output(args: &OutputArgs, ctx: &Context) -> Result<Output, clap::Error> {
    let redirects = stream_spec("--redirects", &args.redirects)?;
    let tee = stream_spec("--tee", &args.tee)?;
    let ranks_filter = match args.ranks_filter.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(spec) => Some(parse_rank_list(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --local-ranks-filter {spec:?}: expected local ranks such as \"0,3\""
            ))
        })?),
    };
    let prefix = (!args.no_prefix).then(|| {
        args.prefix_template
            .clone()
            .or_else(|| (ctx.var)("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_PREFIX.to_string())
    });
    let stdout_filters = filter_list(args.stdout_filters.as_deref());
    let stderr_filters = filter_list(args.stderr_filters.as_deref());
    let wants_files =
        redirects.any() || tee.any() || !stdout_filters.is_empty() || !stderr_filters.is_empty();
    Ok(Output {
        auto_log_dir: args.log_dir.is_none() && wants_files,
        log_dir: args.log_dir.clone(),
        redirects,
        tee,
        ranks_filter,
        prefix,
        stdout_filters,
        stderr_filters,
    })
}

fn parse_rank_list(spec: &str) -> Option<Vec<usize>> {
    spec.split(',')
        .map(|r| r.trim().parse().ok())
        .collect::<Option<Vec<usize>>>()
        .filter(|v| !v.is_empty())
}

/// torchrun's filter list: comma-separated, `,,` for a comma inside a filter.
fn filter_list(spec: Option<&str>) -> Vec<String> {
    let Some(spec) = spec.filter(|s| !s.is_empty()) else {
        return Vec::new();
    };
    let mut items = Vec::new();
    let mut item = String::new();
    let mut chars = spec.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ',' if chars.peek() == Some(&',') => {
                chars.next();
                item.push(',');
            }
            ',' => items.push(std::mem::take(&mut item)),
            c => item.push(c),
        }
    }
    items.push(item);
    items
}

/// TORCHELASTIC_RUN_ID, the same on every node as torchrun gives it: `--rdzv-id`, else
/// SLURM's job id, else `none` (a random one with `--standalone`, whose node is alone).
fn run_id(id: Option<&str>, standalone: bool, slurm: &SlurmJob) -> Result<String, clap::Error> {
    let run_id = match id {
        Some(id) if !id.is_empty() => id.to_string(),
        _ if standalone => random_id(),
        _ if !slurm.job_id.is_empty() => format!("slurm-{}", slurm.job_id),
        _ => DEFAULT_RUN_ID.to_string(),
    };
    if run_id.contains('/') || run_id == "." || run_id == ".." {
        return Err(invalid(format!(
            "invalid --rdzv-id {run_id:?}: it names a directory under --log-dir"
        )));
    }
    Ok(run_id)
}

/// A short random id (16 hex digits), for TORCHELASTIC_RUN_ID and directory names.
pub fn random_id() -> String {
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

/// A time limit in seconds: positive and finite.
fn limit(option: &str, seconds: Option<f64>) -> Result<Option<Duration>, clap::Error> {
    let Some(seconds) = seconds else {
        return Ok(None);
    };
    match Duration::try_from_secs_f64(seconds) {
        Ok(limit) if !limit.is_zero() => Ok(Some(limit)),
        _ => Err(invalid(format!(
            "invalid {option} {seconds}: expected a number of seconds > 0"
        ))),
    }
}

/// The signals that stop the run: SIGINT, SIGTERM and SIGHUP, and those listed.
fn stop_signals(list: &str) -> Result<Vec<i32>, clap::Error> {
    let mut signals = vec![libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
    for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        let sig = tether_core::status::signal_from_name(name).ok_or_else(|| {
            invalid(format!(
                "invalid --signals-to-handle {list:?}: {name} is not a signal"
            ))
        })?;
        if [libc::SIGKILL, libc::SIGSTOP, libc::SIGCHLD].contains(&sig) {
            return Err(invalid(format!(
                "invalid --signals-to-handle {list:?}: {name} cannot be handled"
            )));
        }
        if !signals.contains(&sig) {
            signals.push(sig);
        }
    }
    Ok(signals)
}

/// The argv of every rank: `PYTHON -u SCRIPT ARGS`, `PYTHON -u -m MODULE ARGS`, or the
/// command as it is with `--no-python`.
fn program(
    args: &ProgramArgs,
    command: &[OsString],
    python: &OsStr,
) -> Result<Vec<OsString>, clap::Error> {
    let Some((target, rest)) = command.split_first() else {
        return Err(usage_error(
            ErrorKind::MissingRequiredArgument,
            "the script to run is missing",
        ));
    };
    if args.no_python && !args.run_path {
        if args.module {
            return Err(conflict(
                "-m/--module and --no-python cannot be used together: -m runs a Python \
                 module, --no-python runs a command as it is",
            ));
        }
        return Ok(command.to_vec());
    }
    let mut argv: Vec<OsString> = vec![python.to_owned(), "-u".into()];
    if args.module && !args.run_path {
        argv.push("-m".into());
    } else if !target.to_string_lossy().starts_with('-') && !Path::new(target).exists() {
        // (A target such as `-m` after `--` goes to python as it is, as with torchrun.)
        return Err(invalid(format!(
            "cannot find the script {target:?}: tether run runs SCRIPT with `{} -u SCRIPT`, as \
             torchrun does; to run a command as it is, put --no-python before it (tether run \
             [OPTIONS] --no-python {} ...)",
            python.to_string_lossy(),
            target.to_string_lossy(),
        )));
    }
    argv.push(target.clone());
    argv.extend(rest.iter().cloned());
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_run;
    use std::collections::HashMap;

    fn ctx_with(slurm: Option<SlurmJob>, vars: &'static [(&'static str, &'static str)]) -> Context {
        Context {
            slurm,
            python: "/py/bin/python".into(),
            var: Box::new(move |k| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }),
            dev: PathBuf::from("/nonexistent-dev"),
        }
    }

    fn args(list: &[&str]) -> Result<Config, clap::Error> {
        resolve(parse_run(list)?, &ctx_with(None, &[]))
    }

    #[test]
    fn script_module_and_command() {
        let c = args(&["-n", "2", "--no-python", "sh", "-c", "x"]).unwrap();
        assert_eq!(c.command, ["sh", "-c", "x"]);
        let c = args(&["-m", "pkg.train", "--lr", "1"]).unwrap();
        assert_eq!(
            c.command,
            ["/py/bin/python", "-u", "-m", "pkg.train", "--lr", "1"]
        );
        let c = args(&["/", "a"]).unwrap();
        assert_eq!(c.command, ["/py/bin/python", "-u", "/", "a"]);
        let c = args(&["--run-path", "--no-python", "/", "a"]).unwrap();
        assert_eq!(c.command, ["/py/bin/python", "-u", "/", "a"]);
        let err = args(&["python", "train.py"]).unwrap_err().to_string();
        assert!(
            err.contains("--no-python") && err.contains("\"python\""),
            "{err}"
        );
        assert_eq!(
            args(&["-m", "--no-python", "x"]).unwrap_err().exit_code(),
            2
        );
    }

    #[test]
    fn torchrun_spellings_and_master() {
        let c = args(&[
            "--nproc_per_node",
            "3",
            "--master_port",
            "1234",
            "--no-python",
            "x",
        ])
        .unwrap();
        assert_eq!((c.nproc, c.place.master_port), (3, 1234));
        let c = args(&[
            "--nproc-per-node=2",
            "--nnodes",
            "2:2",
            "--node_rank",
            "1",
            "--no-python",
            "x",
        ])
        .unwrap();
        assert_eq!(
            (c.nproc, c.place.nnodes, c.place.node_rank, c.global_rank(1)),
            (2, 2, 1, 3)
        );
        assert_eq!(
            (c.place.master_addr.as_str(), c.place.master_port),
            ("127.0.0.1", 29500)
        );
        let c = args(&[
            "--rdzv-endpoint",
            "h:9",
            "--master-addr",
            "m",
            "--no-python",
            "x",
        ])
        .unwrap();
        assert_eq!(
            (c.place.master_addr.as_str(), c.place.master_port),
            ("h", 9)
        );
        let c = args(&[
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=[::1]",
            "--no-python",
            "x",
        ])
        .unwrap();
        assert_eq!(
            (c.place.master_addr.as_str(), c.place.master_port),
            ("::1", 29400)
        );
        // One node with no address given: torchrun's "localhost".
        for form in [
            &["--no-python", "x"][..],
            &["--standalone", "--no-python", "x"],
        ] {
            let one = args(form).unwrap();
            assert!(one.place.master_port != 0 && one.place.master_addr == "localhost");
        }
        let err = args(&["--shutdown-timeout=-1", "--no-python", "x"]).unwrap_err();
        assert!(err.to_string().contains("--shutdown-timeout"), "{err}");
    }

    #[test]
    fn c10d_on_several_nodes_is_torchs_rendezvous_and_ignores_node_ranks() {
        let base = ["--nnodes", "2", "--rdzv-backend", "c10d"];
        let err = args(&[&base[..], &["--no-python", "x"]].concat()).unwrap_err();
        assert!(err.to_string().contains("--rdzv-endpoint"), "{err}");
        let endpoint = ["--rdzv-endpoint", "h:5", "--rdzv-conf", "join_timeout=5"];
        let c = args(&[&base[..], &endpoint, &["--no-python", "x"]].concat()).unwrap();
        let rdzv = c.rendezvous.expect("a dynamic rendezvous");
        assert_eq!(
            (
                rdzv.endpoint.as_str(),
                rdzv.min_nodes,
                rdzv.max_nodes,
                rdzv.conf.as_str()
            ),
            ("h:5", 2, 2, "join_timeout=5")
        );
        assert!(c.notes.is_empty(), "{:?}", c.notes);
        let ranked = [
            &base[..],
            &endpoint,
            &["--node-rank", "1", "--no-python", "x"],
        ]
        .concat();
        let c = args(&ranked).unwrap();
        assert!(c.rendezvous.is_some());
        assert!(
            c.notes
                .iter()
                .any(|n| n.contains("--node-rank 1 is ignored")),
            "{:?}",
            c.notes
        );
        let elastic = [
            "--nnodes",
            "1:3",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "h",
        ];
        let c =
            args(&[&elastic[..], &["--max-restarts", "2", "--no-python", "x"]].concat()).unwrap();
        let rdzv = c.rendezvous.expect("an elastic rendezvous");
        assert_eq!((rdzv.min_nodes, rdzv.max_nodes, c.max_restarts), (1, 3, 2));
        // One node, and --standalone, stay tether's own.
        let one = [
            "--nnodes",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "h:5",
        ];
        assert!(args(&[&one[..], &["--no-python", "x"]].concat())
            .unwrap()
            .rendezvous
            .is_none());
        assert!(args(&["--standalone", "--no-python", "x"])
            .unwrap()
            .rendezvous
            .is_none());
    }

    #[test]
    fn bad_values_name_their_option() {
        for (bad, option) in [
            (&["-n", "0", "x"][..], "--nproc-per-node"),
            (&["-n", "xpu", "x"], "--nproc-per-node"),
            (&["--nnodes", "2", "--node-rank", "2", "x"], "--node-rank"),
            (
                &["--nnodes", "2", "--max-restarts", "1", "x"],
                "--max-restarts",
            ),
            (&["--nnodes", "1:4", "x"], "--rdzv-backend c10d"),
            (&["--nnodes", "4:1", "x"], "--nnodes"),
            (&["--standalone", "--nnodes", "2", "x"], "--standalone"),
            (
                &["--rdzv-backend", "zookeeper", "x"],
                "--rdzv-backend zookeeper is not supported",
            ),
            (&["--rdzv-endpoint", "h:x", "x"], "--rdzv-endpoint"),
            (
                &[
                    "--nnodes",
                    "2",
                    "--node-rank",
                    "0",
                    "--rdzv-endpoint",
                    "h:0",
                    "x",
                ],
                "port 0",
            ),
            (&["--rdzv-conf", "timeout", "x"], "--rdzv-conf"),
            (&["--tee", "9", "--", "true"], "--tee"),
            (&["--redirects", "4", "x"], "--redirects"),
            (&["--local-ranks-filter", "a", "x"], "--local-ranks-filter"),
            (
                &["--signals-to-handle", "SIGFOO", "x"],
                "--signals-to-handle",
            ),
            (
                &["--signals-to-handle", "SIGKILL", "x"],
                "--signals-to-handle",
            ),
            (&["--grace-period", "-1", "x"], "--grace-period"),
            (&["--monitor-interval", "-1", "x"], "--monitor-interval"),
            (&["--rdzv-id", "a/b", "x"], "--rdzv-id"),
            (&["--print-completion", "bash"], "--print-completion"),
        ] {
            let err = args(bad).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{bad:?}");
            assert!(err.to_string().contains(option), "{bad:?}: {err}");
        }
    }

    #[test]
    fn gpus_counted_from_devices_and_cuda_visible_devices() {
        let dev = std::env::temp_dir().join(format!("tether-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dev).unwrap();
        for name in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
            std::fs::write(dev.join(name), b"").unwrap();
        }
        assert_eq!(gpu_count(&dev, None), 2);
        assert_eq!(gpu_count(&dev, Some("1")), 1);
        assert_eq!(gpu_count(&dev, Some("")), 0);
        assert_eq!(gpu_count(&dev, Some("0,-1,1")), 1);
        assert_eq!(gpu_count(&dev, Some("GPU-abc,GPU-def,GPU-x")), 2);
        assert!(no_gpu_reason(&dev, Some("")).contains("CUDA_VISIBLE_DEVICES"));
        std::fs::remove_dir_all(&dev).unwrap();
        let err = resolve(
            parse_run(&["-n", "gpu", "x"]).unwrap(),
            &ctx_with(None, &[]),
        )
        .unwrap_err();
        assert!(err.to_string().contains("no GPU was found"), "{err}");
    }

    #[test]
    fn slurm_fills_the_gaps() {
        let job = SlurmJob {
            nnodes: Some("3".into()),
            node_rank: Some("2".into()),
            first_host: Some("gpu03".into()),
            job_id: "42".into(),
        };
        let c = resolve(
            parse_run(&["-n", "2", "--no-python", "x"]).unwrap(),
            &ctx_with(Some(job.clone()), &[]),
        )
        .unwrap();
        assert_eq!(
            (
                c.place.nnodes,
                c.place.node_rank,
                c.place.master_addr.as_str()
            ),
            (3, 2, "gpu03")
        );
        assert_eq!(c.run_id, "slurm-42");
        let run = parse_run(&["--master-addr", "h", "--no-python", "x"]).unwrap();
        assert_eq!(
            resolve(run, &ctx_with(Some(job), &[]))
                .unwrap()
                .place
                .master_addr,
            "h"
        );
    }

    #[test]
    fn the_command_line_wins_over_slurm_and_one_node_is_local() {
        let job = SlurmJob {
            nnodes: Some("2".into()),
            node_rank: Some("1".into()),
            first_host: Some("gpu03".into()),
            job_id: "42".into(),
        };
        for form in [
            &["--standalone", "-n", "2", "--no-python", "x"][..],
            &["--nnodes", "1", "-n", "2", "--no-python", "x"][..],
            &[
                "--nnodes",
                "1",
                "--node-rank",
                "0",
                "-n",
                "2",
                "--no-python",
                "x",
            ][..],
        ] {
            let c = resolve(parse_run(form).unwrap(), &ctx_with(Some(job.clone()), &[]))
                .unwrap_or_else(|e| panic!("{form:?}: {e}"));
            assert_eq!(
                (
                    c.place.nnodes,
                    c.place.node_rank,
                    c.place.master_addr.as_str()
                ),
                (1, 0, "localhost"),
                "{form:?}"
            );
        }
        // Given on the command line, a node count still takes SLURM's node rank and host.
        let c = resolve(
            parse_run(&["--nnodes", "2", "--no-python", "x"]).unwrap(),
            &ctx_with(Some(job), &[]),
        )
        .unwrap();
        assert_eq!(
            (
                c.place.nnodes,
                c.place.node_rank,
                c.place.master_addr.as_str()
            ),
            (2, 1, "gpu03")
        );
    }

    #[test]
    fn a_slurm_steps_nodes_win_over_the_jobs() {
        let env: HashMap<&str, &str> = [
            ("SLURM_JOB_ID", "7"),
            ("SLURM_JOB_NUM_NODES", "4"),
            ("SLURM_JOB_NODELIST", "n[1-4]"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_STEP_NODELIST", "n[3-4]"),
        ]
        .into_iter()
        .collect();
        let job = SlurmJob::from_env(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(
            (job.nnodes.as_deref(), job.first_host.as_deref()),
            (Some("2"), Some("n3"))
        );
    }

    #[test]
    fn every_node_gets_the_rdzv_id_as_run_id() {
        let static_form = ["--nnodes", "2", "--node-rank", "1", "--no-python", "x"];
        let c = resolve(parse_run(&static_form).unwrap(), &ctx_with(None, &[])).unwrap();
        assert_eq!(c.run_id, "none");
        assert_ne!(c.log_name, "none", "a run's log directory is its own");
        let given = [&["--rdzv-id", "job1"][..], &static_form[..]].concat();
        let c = resolve(parse_run(&given).unwrap(), &ctx_with(None, &[])).unwrap();
        assert_eq!((c.run_id.as_str(), c.log_name.as_str()), ("job1", "job1"));
        let c = resolve(
            parse_run(&["--standalone", "--no-python", "x"]).unwrap(),
            &ctx_with(None, &[]),
        )
        .unwrap();
        assert!(c.run_id != "none" && c.run_id.len() == 16, "{}", c.run_id);
    }

    #[test]
    fn console_follows_redirects_tee_and_filter() {
        let c = args(&["-n", "4", "--local-ranks-filter", "0,3", "--no-python", "x"]).unwrap();
        assert!(c.output.console(3).stdout && !c.output.console(1).stdout);
        let c = args(&["-n", "2", "--log-dir", "d", "--no-python", "x"]).unwrap();
        assert_eq!(c.output.console(0), Streams::BOTH);
        assert!(!c.output.auto_log_dir);
        let c = args(&["-n", "2", "-r", "3", "-t", "0:2", "--no-python", "x"]).unwrap();
        assert_eq!(
            c.output.console(0),
            Streams {
                stdout: false,
                stderr: true
            }
        );
        assert_eq!(c.output.console(1), Streams::NONE);
        assert!(c.output.auto_log_dir);
    }

    #[test]
    fn prefix_templates_and_filters() {
        let c = args(&["--no-python", "x"]).unwrap();
        assert_eq!(c.output.prefix.as_deref(), Some(DEFAULT_PREFIX));
        let c = args(&["--no-prefix", "--no-python", "x"]).unwrap();
        assert_eq!(c.output.prefix, None);
        let ctx = ctx_with(
            None,
            &[("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${rank}> ")],
        );
        let c = resolve(parse_run(&["--no-python", "x"]).unwrap(), &ctx).unwrap();
        assert_eq!(c.output.prefix.as_deref(), Some("${rank}> "));
        assert_eq!(filter_list(Some("a,b,,c")), ["a", "b,c"]);
        assert!(filter_list(Some("")).is_empty());
    }

    #[test]
    fn time_limits_are_positive_seconds_and_python_ranks_answer_for_stacks() {
        let c = args(&["--timeout", "1.5", "--stall-timeout=60", "x.py"]);
        let err = c.unwrap_err().to_string();
        assert!(err.contains("cannot find the script"), "{err}");
        let c = args(&["--timeout", "1.5", "--stall_timeout=60", "--no-python", "x"]).unwrap();
        assert_eq!(c.timeout, Some(Duration::from_millis(1500)));
        assert_eq!(c.stall_timeout, Some(Duration::from_secs(60)));
        assert!(!c.python_ranks);
        let c = args(&["-m", "pkg.train"]).unwrap();
        assert_eq!(
            (c.timeout, c.stall_timeout, c.python_ranks),
            (None, None, true)
        );
        for (option, value) in [
            ("--timeout", "0"),
            ("--stall-timeout", "-1"),
            ("--timeout", "inf"),
        ] {
            let err = args(&[option, value, "--no-python", "x"]).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::ValueValidation);
            assert!(
                err.to_string()
                    .contains(&format!("invalid {option} {}", value)),
                "{err}"
            );
        }
        assert!(args(&["--timeout", "soon", "--no-python", "x"]).is_err());
    }

    #[test]
    fn sigusr1_asks_for_stacks_unless_it_is_made_a_stop_signal() {
        let c = args(&["--no-python", "x"]).unwrap();
        assert!(!c.stop_signals.contains(&libc::SIGUSR1));
        assert!(c.notes.is_empty());
        let c = args(&["--signals-to-handle", "SIGUSR1", "--no-python", "x"]).unwrap();
        assert!(
            c.notes.iter().any(|n| n.contains("SIGUSR1 stops this run")),
            "{:?}",
            c.notes
        );
    }

    #[test]
    fn stop_signals_always_include_the_usual_three() {
        let c = args(&[
            "--signals-to-handle",
            "SIGUSR1, SIGTERM",
            "--no-python",
            "x",
        ])
        .unwrap();
        assert_eq!(
            c.stop_signals,
            [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1]
        );
        let c = args(&["--no-python", "x"]).unwrap();
        assert!(c.stop_signals.contains(&libc::SIGQUIT));
    }
}
