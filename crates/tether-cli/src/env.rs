//! The environment of each rank: torchrun's variables.

use std::ffi::OsString;
use std::path::Path;

use crate::args::Config;

/// The variables set for `local_rank` in restart `restart`. `omp_unset` says whether the
/// launcher's own environment lacks OMP_NUM_THREADS.
pub fn rank_env(
    cfg: &Config,
    local_rank: usize,
    restart: u32,
    error_file: &Path,
    omp_unset: bool,
) -> Vec<(OsString, OsString)> {
    let rank = cfg.global_rank(local_rank);
    let world = cfg.world_size();
    let mut env: Vec<(OsString, OsString)> = [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", local_rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", cfg.nproc.to_string()),
        ("GROUP_RANK", cfg.node_rank.to_string()),
        ("GROUP_WORLD_SIZE", cfg.nnodes.to_string()),
        ("ROLE_RANK", rank.to_string()),
        ("ROLE_WORLD_SIZE", world.to_string()),
        ("ROLE_NAME", cfg.role.clone()),
        ("MASTER_ADDR", cfg.master_addr.clone()),
        ("MASTER_PORT", cfg.master_port.to_string()),
        ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
        ("TORCHELASTIC_MAX_RESTARTS", cfg.max_restarts.to_string()),
        ("TORCHELASTIC_RUN_ID", cfg.run_id.clone()),
    ]
    .into_iter()
    .map(|(k, v)| (OsString::from(k), OsString::from(v)))
    .collect();
    env.push((
        "TORCHELASTIC_ERROR_FILE".into(),
        error_file.as_os_str().to_owned(),
    ));
    if omp_unset && cfg.nproc > 1 {
        env.push(("OMP_NUM_THREADS".into(), "1".into()));
    }
    env
}
