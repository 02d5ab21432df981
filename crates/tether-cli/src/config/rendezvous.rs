//! The dynamic rendezvous as the command line asks for it (`--rdzv-backend`, `--rdzv-endpoint`,
//! `--rdzv-conf`, an elastic `--nnodes`): the options torch's handler is built from, which the
//! run's membership ([`crate::run`]) hands to its rendezvous helper.

use clap::error::ErrorKind;
use serde_json::{json, Value};

use crate::args::{usage_error, RunArgs};

/// The rendezvous backend named by `--rdzv-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Node ranks from `--node-rank`: tether's own, pure Rust.
    Static,
    C10d,
    Etcd,
    EtcdV2,
}

impl Backend {
    /// `--standalone` is c10d on one node (run locally, without torch's handler).
    pub fn parse(backend: Option<&str>, standalone: bool) -> Result<Backend, clap::Error> {
        if standalone {
            return Ok(Backend::C10d);
        }
        match backend.map(str::trim) {
            None | Some("static") => Ok(Backend::Static),
            Some("c10d") => Ok(Backend::C10d),
            Some("etcd") => Ok(Backend::Etcd),
            Some("etcd-v2") => Ok(Backend::EtcdV2),
            Some(other) => Err(usage_error(
                ErrorKind::ValueValidation,
                format!(
                    "--rdzv-backend {other} is not supported: use static (with each node's \
                     --node-rank), c10d (torch's rendezvous over a TCPStore at \
                     --rdzv-endpoint), or etcd / etcd-v2 where python-etcd is installed"
                ),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Static => "static",
            Backend::C10d => "c10d",
            Backend::Etcd => "etcd",
            Backend::EtcdV2 => "etcd-v2",
        }
    }
}

/// The options torch's handler is built from, as torchrun builds it.
#[derive(Debug, Clone)]
pub struct Rendezvous {
    pub backend: Backend,
    pub endpoint: String,
    pub run_id: String,
    pub min_nodes: usize,
    pub max_nodes: usize,
    pub conf: String,
    pub local_addr: Option<String>,
    pub role: String,
    pub nproc: usize,
}

impl Rendezvous {
    pub fn resolve(
        args: &RunArgs,
        backend: Backend,
        (min_nodes, max_nodes): (usize, usize),
        nproc: usize,
        run_id: &str,
    ) -> Result<Rendezvous, clap::Error> {
        let Some(endpoint) = args.rdzv.endpoint.clone().filter(|e| !e.trim().is_empty()) else {
            return Err(usage_error(
                ErrorKind::MissingRequiredArgument,
                format!(
                    "--rdzv-backend {} with --nnodes {} needs --rdzv-endpoint HOST[:PORT]: the \
                     address where the nodes meet (the node at that address hosts the store)",
                    backend.name(),
                    nodes_spec(min_nodes, max_nodes)
                ),
            ));
        };
        parse_endpoint(&endpoint)?;
        Ok(Rendezvous {
            backend,
            endpoint: endpoint.trim().to_string(),
            run_id: run_id.to_string(),
            min_nodes,
            max_nodes,
            conf: args.rdzv.conf.clone().unwrap_or_default(),
            local_addr: args.accepted.local_addr.clone(),
            role: args.program.role.clone(),
            nproc,
        })
    }

    /// The helper's argument: the options as JSON.
    pub fn options(&self) -> Value {
        json!({
            "backend": self.backend.name(),
            "endpoint": self.endpoint,
            "run_id": self.run_id,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "conf": self.conf,
            "local_addr": self.local_addr,
            "role": self.role,
            "nproc": self.nproc,
        })
    }
}

/// `N` or `MIN:MAX`.
pub fn nodes_spec(min: usize, max: usize) -> String {
    if min == max {
        min.to_string()
    } else {
        format!("{min}:{max}")
    }
}

/// `HOST[:PORT]`, `[IPV6]:PORT` or `[IPV6]`, as torch reads a rendezvous endpoint.
pub fn parse_endpoint(endpoint: &str) -> Result<(String, Option<u16>), clap::Error> {
    let bad = |why: &str| {
        usage_error(
            ErrorKind::ValueValidation,
            format!("invalid --rdzv-endpoint {endpoint:?}: {why}"),
        )
    };
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
