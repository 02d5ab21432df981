//! The resolution of the whole command line into a [`Config`]: the ranks, their limits and
//! signals, and the pieces resolved on their own (the nodes, the output, the program).

use std::path::Path;
use std::time::Duration;

use super::{invalid, nodes, output, program, Config, Context, VirtualDevices};
use crate::args::{AcceptedArgs, RunArgs, StopArgs};
use crate::rendezvous::Backend;

/// Seconds between the stop signal and SIGKILL when no --grace-period is given.
const DEFAULT_GRACE_SECONDS: f64 = 30.0;

/// Resolves the parsed options (with SLURM's environment and the host's) into a [`Config`].
pub fn resolve(args: RunArgs, ctx: &Context) -> Result<Config, clap::Error> {
    let mut notes = accepted(&args.accepted, &args.rdzv.conf)?;
    let backend = Backend::parse(args.rdzv.backend.as_deref(), args.nodes.standalone)?;
    let slurm = ctx.slurm.clone().unwrap_or_default();
    let nproc = nproc(args.nodes.nproc_per_node.as_deref(), ctx)?;
    let (place, rendezvous, run_id) = nodes::place(&args, backend, nproc, &slurm, &mut notes)?;
    let stop = &args.stopping;
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
        max_restarts: stop.max_restarts,
        grace,
        output: output::output(&args.output, ctx)?,
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
        notes,
    })
}

/// The time between the stop signal and SIGKILL: `--grace-period`, else
/// `--shutdown-timeout`, else the default.
fn grace(stop: &StopArgs) -> Result<Duration, clap::Error> {
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
    Ok(Duration::from_secs_f64(grace))
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

pub(super) fn no_gpu_reason(dev: &Path, visible: Option<&str>) -> String {
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
