//! The environment of each rank: torchrun's variables and the job's id on this machine;
//! and what of it a node's zygote (warm ranks) gets: the variables every rank of every
//! attempt shares, never those that differ between ranks or attempts.

use std::ffi::OsString;
use std::path::Path;
use std::sync::OnceLock;

use crate::config::{Config, VirtualDevices};

/// `--virtual-local-rank`: the rank's own GPU, as the only one it sees.
fn virtual_devices(virt: &VirtualDevices, local_rank: usize) -> Vec<(&'static str, String)> {
    let device = virt.devices.get(local_rank).cloned().unwrap_or_default();
    let mut vars = vec![("CUDA_VISIBLE_DEVICES", device.clone())];
    if virt.hip {
        vars.push(("HIP_VISIBLE_DEVICES", device));
    }
    vars
}

/// The id of this job on this machine (`TETHER_JOB_ID`), the same for every rank of every
/// attempt: `tether.share`'s key form meets the other ranks of the job under it, and ranks
/// of other jobs never. The launcher's pid makes it unique among the jobs running here, and
/// a random part among all.
pub fn job_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| format!("{}-{}", std::process::id(), crate::config::random_id()))
}

/// The variables set for `local_rank` in restart `restart`. `omp_unset` says whether the
/// launcher's own environment lacks OMP_NUM_THREADS.
pub fn rank_env(
    cfg: &Config,
    local_rank: usize,
    restart: u32,
    error_file: &Path,
    omp_unset: bool,
) -> Vec<(OsString, OsString)> {
    let place = &cfg.place;
    let rank = cfg.global_rank(local_rank);
    let world = cfg.world_size();
    let mut vars = vec![
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", cfg.nproc.to_string()),
        ("GROUP_RANK", place.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", place.nnodes.to_string()),
        ("ROLE_RANK", (place.role_rank_base + local_rank).to_string()),
        ("ROLE_WORLD_SIZE", place.role_world_size.to_string()),
        ("ROLE_NAME", cfg.role.clone()),
        ("MASTER_ADDR", place.master_addr.clone()),
        ("MASTER_PORT", place.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", cfg.run_id.clone()),
        (
            "TORCHELASTIC_SIGNALS_TO_HANDLE",
            cfg.signals_to_handle.clone(),
        ),
        // Rank 0 hosts the store, unless the rendezvous shares its own (torch's default
        // in the first round of a c10d rendezvous).
        (
            "TORCHELASTIC_USE_AGENT_STORE",
            if place.agent_store { "True" } else { "False" }.to_string(),
        ),
    ];
    if std::env::var_os("TORCH_NCCL_ASYNC_ERROR_HANDLING").is_none() {
        vars.push(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1".to_string()));
    }
    if let Some(virt) = &cfg.virtual_devices {
        vars[1].1 = "0".to_string();
        vars.extend(virtual_devices(virt, local_rank));
    }
    if omp_unset && cfg.nproc > 1 {
        vars.push(("OMP_NUM_THREADS", "1".to_string()));
    }
    let mut env: Vec<(OsString, OsString)> = vars
        .into_iter()
        .map(|(k, v)| (OsString::from(k), OsString::from(v)))
        .collect();
    env.push((
        "TORCHELASTIC_ERROR_FILE".into(),
        error_file.as_os_str().to_owned(),
    ));
    env.push((tether_core::share::JOB_ENV.into(), job_id().into()));
    env
}

/// The variables whose values differ between the ranks of a node or between attempts (a
/// round of an elastic rendezvous may change the world too): a node's zygote never has them,
/// so a package that reads one while the zygote imports it is noticed (and left to the
/// ranks).
pub fn varying(cfg: &Config) -> Vec<&'static str> {
    let mut keys = vec![
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    ];
    if cfg.virtual_devices.is_some() {
        keys.extend(["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]);
    }
    keys
}

/// The variables every rank of every attempt gets with the same value (`OMP_NUM_THREADS`,
/// `LOCAL_WORLD_SIZE`, `TORCHELASTIC_RUN_ID`, ...): the zygote's own, on top of the
/// launcher's environment.
pub fn common(cfg: &Config, omp_unset: bool) -> Vec<(OsString, OsString)> {
    let varying = varying(cfg);
    rank_env(cfg, 0, 0, Path::new(""), omp_unset)
        .into_iter()
        .filter(|(key, _)| !varying.iter().any(|v| key == v))
        .collect()
}
