//! What `tether run`'s options mean: the checked [`Config`]. Every invalid value is a usage
//! error that names its option; torchrun options tether cannot honour are refused with a
//! sentence that says what it supports instead, or accepted with a note.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use clap::error::ErrorKind;

use crate::args::usage_error;
use crate::rendezvous::{Place, Rendezvous};
use crate::slurm::SlurmJob;

mod nodes;
mod output;
mod program;
mod resolve;

pub use nodes::random_id;
pub use resolve::resolve;

/// The default console prefix.
pub const DEFAULT_PREFIX: &str = "[rank ${rank}]: ";

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

#[cfg(test)]
mod tests {
    use super::output::filter_list;
    use super::resolve::{gpu_count, no_gpu_reason};
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
