//! Where this node stands in the job: the node count, its rank, the master address, the
//! run id, and the dynamic rendezvous when there is one.

use clap::error::ErrorKind;

use super::rendezvous::{parse_endpoint, Backend, Rendezvous};
use crate::args::{conflict, invalid, usage_error, NodeArgs, RunArgs};
use crate::slurm::SlurmJob;

/// torchrun's default port for a c10d endpoint given without one.
const C10D_PORT: u16 = 29400;
/// torchrun's default MASTER_PORT for several nodes.
const MASTER_PORT: u16 = 29500;
/// MASTER_ADDR on one node when none is given, as torchrun gives it.
const LOCAL_MASTER: &str = "localhost";
/// torchrun's `--rdzv-id` when none is given.
const DEFAULT_RUN_ID: &str = "none";

/// This node's place in the job for one attempt: what its ranks' environment says (read
/// from the rendezvous helper's `round` message as it writes it, torch's names).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct Place {
    #[serde(rename = "group_rank")]
    pub node_rank: usize,
    #[serde(rename = "group_world_size")]
    pub nnodes: usize,
    /// The global rank of local rank 0.
    pub rank_base: usize,
    pub world_size: usize,
    pub role_rank_base: usize,
    pub role_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Whether the ranks join the launcher's store (`TORCHELASTIC_USE_AGENT_STORE`).
    pub agent_store: bool,
}

impl Place {
    /// A fixed place: `nnodes` nodes of `nproc` ranks each.
    pub fn fixed(node_rank: usize, nnodes: usize, nproc: usize, addr: String, port: u16) -> Place {
        Place {
            node_rank,
            nnodes,
            rank_base: node_rank * nproc,
            world_size: nnodes * nproc,
            role_rank_base: node_rank * nproc,
            role_world_size: nnodes * nproc,
            master_addr: addr,
            master_port: port,
            agent_store: false,
        }
    }

    /// The place before the first round of a dynamic rendezvous.
    pub fn unknown(nproc: usize) -> Place {
        Place::fixed(0, 1, nproc, String::new(), 0)
    }
}

/// This node's place in the job, the dynamic rendezvous that gives it when there is one,
/// and the run id; `notes` gets what the rendezvous ignores.
pub(super) fn place(
    args: &RunArgs,
    backend: Backend,
    nproc: usize,
    slurm: &SlurmJob,
    notes: &mut Vec<String>,
) -> Result<(Place, Option<Rendezvous>, String), clap::Error> {
    let c10d = backend != Backend::Static;
    let (min_nodes, max_nodes) = node_counts(&args.nodes, slurm)?;
    let run_id = run_id(args.rdzv.id.as_deref(), args.nodes.standalone, slurm)?;
    let dynamic = c10d && !args.nodes.standalone && (max_nodes > 1 || min_nodes != max_nodes);
    if !c10d && min_nodes != max_nodes {
        return Err(conflict(format!(
            "--nnodes {min_nodes}:{max_nodes} asks for an elastic range of nodes, which needs a \
             dynamic rendezvous: add --rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        )));
    }
    if dynamic {
        let rdzv = Rendezvous::resolve(args, backend, (min_nodes, max_nodes), nproc, &run_id)?;
        if let Some(rank) = args.nodes.node_rank {
            notes.push(format!(
                "tether: --node-rank {rank} is ignored with --rdzv-backend {}: the rendezvous \
                 gives every node its rank, as torchrun does",
                backend.name()
            ));
        }
        return Ok((Place::unknown(nproc), Some(rdzv), run_id));
    }
    let nnodes = max_nodes;
    let node_rank = node_rank(&args.nodes, slurm, nnodes)?;
    let (master_addr, master_port) = master(args, nnodes, slurm, c10d)?;
    let place = Place::fixed(node_rank, nnodes, nproc, master_addr, master_port);
    Ok((place, None, run_id))
}

/// The name of the run's directory under `--log-dir`: the run id when one was given, else
/// a random one.
pub(super) fn log_name(id: Option<&str>, run_id: &str) -> String {
    match id {
        None | Some("") if run_id == DEFAULT_RUN_ID => random_id(),
        _ => run_id.to_string(),
    }
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

fn free_port() -> std::io::Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
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
