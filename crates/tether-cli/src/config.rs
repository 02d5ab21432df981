//! What `tether run`'s options mean: the checked [`Config`], and [`resolve`], which makes it
//! from the parsed options. Every invalid value is a usage error that names its option;
//! torchrun options tether cannot honour are refused with a sentence that says what it
//! supports instead, or accepted with a note. An option resolves here, into its field of
//! [`Config`], checks against other options included; the groups with a type of their own
//! resolve in the file that declares it (the nodes, the output, the program).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::args::{conflict, invalid, AcceptedArgs, RunArgs, StopArgs};
use crate::slurm::SlurmJob;

mod nodes;
mod output;
mod program;
mod rendezvous;

pub use nodes::Place;
pub use rendezvous::{nodes_spec, Backend, Rendezvous};

pub use nodes::random_id;
pub use output::{Output, Streams, DEFAULT_PREFIX};

/// Seconds between the stop signal and SIGKILL when no --grace-period is given.
const DEFAULT_GRACE_SECONDS: f64 = 30.0;

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
    /// Whether the ranks are watched for hangs and slow ranks ([`crate::watch`]): Python
    /// ranks, without `--no-watch`.
    pub watch: bool,
    /// Whether the ranks are forked from the node's warm zygote (a script or a module,
    /// without `--no-warm`).
    pub warm: bool,
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

/// Resolves the parsed options (with SLURM's environment and the host's) into a [`Config`].
pub fn resolve(args: RunArgs, ctx: &Context) -> Result<Config, clap::Error> {
    let mut notes = accepted(&args.accepted, &args.rdzv.conf)?;
    let backend = Backend::parse(args.rdzv.backend.as_deref(), args.nodes.standalone)?;
    let slurm = ctx.slurm.clone().unwrap_or_default();
    let nproc = nproc(args.nodes.nproc_per_node.as_deref(), ctx)?;
    let (place, rendezvous, run_id) = nodes::place(&args, backend, nproc, &slurm, &mut notes)?;
    let stop = &args.stopping;
    let max_restarts = max_restarts(stop.max_restarts, &place, &rendezvous)?;
    let grace = grace(stop)?;
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
        max_restarts,
        grace,
        output: Output::resolve(&args.output, &ctx.var)?,
        log_name: nodes::log_name(args.rdzv.id.as_deref(), &run_id),
        run_id,
        role: args.program.role.clone(),
        virtual_devices: virtual_devices(args.program.virtual_local_rank, nproc, ctx)?,
        stop_signals,
        signals_to_handle: stop.signals.clone(),
        timeout: limit("--timeout", stop.timeout)?,
        stall_timeout: limit("--stall-timeout", stop.stall_timeout)?,
        command: program::program(&args.program, &args.command, &ctx.python)?,
        python_ranks: !args.program.no_python || args.program.run_path,
        watch: (!args.program.no_python || args.program.run_path) && !stop.no_watch,
        warm: (!args.program.no_python || args.program.run_path) && !args.program.no_warm,
        notes,
    })
}

/// `--max-restarts`: with a fixed membership, on a single node only (nodes with fixed
/// ranks cannot restart in step).
fn max_restarts(
    restarts: u32,
    place: &Place,
    rendezvous: &Option<Rendezvous>,
) -> Result<u32, clap::Error> {
    if restarts > 0 && rendezvous.is_none() && place.nnodes > 1 {
        return Err(conflict(format!(
            "--max-restarts {restarts} with --rdzv-backend static needs a single node: nodes \
             with fixed ranks cannot restart in step (use --rdzv-backend c10d with \
             --rdzv-endpoint HOST:PORT, which restarts every node's ranks together)"
        )));
    }
    Ok(restarts)
}

/// The time between the stop signal and SIGKILL: `--grace-period`, else
/// `--shutdown-timeout`, else the default.
fn grace(stop: &StopArgs) -> Result<Duration, clap::Error> {
    let (grace, grace_option) = match (stop.grace_period, stop.shutdown_timeout) {
        (Some(seconds), _) => (seconds, "--grace-period"),
        (None, Some(seconds)) => (seconds, "--shutdown-timeout"),
        (None, None) => (DEFAULT_GRACE_SECONDS, "--grace-period"),
    };
    seconds(grace_option, grace)
}

/// A number of seconds, zero or more (one too large for a duration is refused as well).
fn seconds(option: &str, value: f64) -> Result<Duration, clap::Error> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| invalid(format!("invalid {option} {value}: expected seconds >= 0")))
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
        seconds("--monitor-interval", t)?;
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

#[cfg(test)]
mod tests {
    use super::output::filter_list;
    use super::*;
    use crate::args::parse_run;
    use clap::error::ErrorKind;
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
            (&["--grace-period", "1e300", "x"], "--grace-period"),
            (&["--shutdown-timeout", "inf", "x"], "--shutdown-timeout"),
            (&["--timeout", "1e300", "x"], "--timeout"),
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
    fn scripts_and_modules_are_warm_unless_told_otherwise() {
        assert!(args(&["-m", "pkg.train"]).unwrap().warm);
        assert!(!args(&["--no-python", "x"]).unwrap().warm);
        for flag in ["--no-warm", "--no_warm"] {
            let c = args(&[flag, "-m", "pkg.train"]).unwrap();
            assert!(!c.warm && c.python_ranks);
        }
    }

    #[test]
    fn python_ranks_are_watched_unless_told_otherwise() {
        assert!(args(&["-m", "pkg.train"]).unwrap().watch);
        assert!(!args(&["--no-python", "x"]).unwrap().watch);
        for flag in ["--no-watch", "--no_watch"] {
            let c = args(&[flag, "-m", "pkg.train"]).unwrap();
            assert!(!c.watch && c.python_ranks);
        }
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
