//! SLURM's view of a job: node count, node rank and the first host of the node list.
//!
//! A node list is a comma-separated list of host names, each of which may carry bracketed
//! ranges: `gpu[03-05,07],cpu1` is gpu03, gpu04, gpu05, gpu07, cpu1 (zero padding kept),
//! and `rack[1-2]-n[1-2]` expands every bracket in turn. Only the first host is needed.

/// What SLURM says about this job step, each field only when SLURM set it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SlurmJob {
    pub nnodes: Option<String>,
    pub node_rank: Option<String>,
    pub first_host: Option<String>,
    pub job_id: String,
}

impl SlurmJob {
    /// Reads the job from `get` (the environment); `None` outside a SLURM job. A job
    /// step's values (`srun` on part of the allocation) win over the job's.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Option<SlurmJob> {
        let job_id = get("SLURM_JOB_ID")?;
        let first = |names: &[&str]| names.iter().find_map(|name| get(name));
        let nodelist = first(&[
            "SLURM_STEP_NODELIST",
            "SLURM_JOB_NODELIST",
            "SLURM_NODELIST",
        ]);
        Some(SlurmJob {
            nnodes: first(&[
                "SLURM_STEP_NUM_NODES",
                "SLURM_JOB_NUM_NODES",
                "SLURM_NNODES",
            ]),
            node_rank: get("SLURM_NODEID"),
            first_host: nodelist.and_then(|list| first_host(&list)),
            job_id,
        })
    }
}

/// The first host of a SLURM node list.
pub fn first_host(nodelist: &str) -> Option<String> {
    let item = split_top_level(nodelist).into_iter().next()?;
    let mut host = String::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']')? + open;
        let first_range = rest[open + 1..close].split(',').next()?;
        let start = first_range.split('-').next()?.trim();
        if start.is_empty() {
            return None;
        }
        host.push_str(start);
        rest = &rest[close + 1..];
    }
    host.push_str(rest);
    let host = host.trim().to_string();
    (!host.is_empty()).then_some(host)
}

/// Splits on the commas that are not inside brackets.
fn split_top_level(list: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&list[start..]);
    items
        .into_iter()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_host_of_ranges() {
        assert_eq!(first_host("gpu[03-05,07],cpu1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("node1").as_deref(), Some("node1"));
        assert_eq!(first_host("node7,node2").as_deref(), Some("node7"));
        assert_eq!(first_host("n[0009-0012]").as_deref(), Some("n0009"));
        assert_eq!(first_host("a[2,1]").as_deref(), Some("a2"));
        assert_eq!(
            first_host("rack[1-2]-n[04-05]").as_deref(),
            Some("rack1-n04")
        );
        assert_eq!(first_host("x[5]-ib").as_deref(), Some("x5-ib"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("bad[3"), None);
    }

    #[test]
    fn job_from_env() {
        let env = |k: &str| match k {
            "SLURM_JOB_ID" => Some("77".to_string()),
            "SLURM_NNODES" => Some("4".to_string()),
            "SLURM_NODEID" => Some("2".to_string()),
            "SLURM_NODELIST" => Some("gpu[03-05,07]".to_string()),
            _ => None,
        };
        let job = SlurmJob::from_env(env).unwrap();
        assert_eq!(job.nnodes.as_deref(), Some("4"));
        assert_eq!(job.node_rank.as_deref(), Some("2"));
        assert_eq!(job.first_host.as_deref(), Some("gpu03"));
        assert_eq!(SlurmJob::from_env(|_| None), None);
    }
}
