//! torchrun's command line, unchanged: scripts run with python -u, modules with -m, commands
//! with --no-python; every option spelling; fixed-membership rendezvous; bad values.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{by_rank, command, run, run_env, Launcher, Scratch};

/// A script that prints, per rank, how it was started.
const SHOW: &str = r#"
import os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID", "GROUP_RANK", "CUDA_VISIBLE_DEVICES"]
print("argv=" + " ".join(sys.orig_argv[1:]))
print("name=" + __name__ + " unbuffered=" + str(sys.stdout.write_through))
print("python=" + sys.executable)
for k in keys:
    print(k + "=" + os.environ.get(k, "-"))
"#;

fn script(dir: &Scratch) -> String {
    let path = dir.path().join("show.py");
    std::fs::write(&path, SHOW).unwrap();
    path.to_str().unwrap().to_string()
}

/// `KEY=value` lines per rank.
fn vars(out: &str) -> BTreeMap<usize, BTreeMap<String, String>> {
    by_rank(out)
        .into_iter()
        .map(|(rank, lines)| {
            let kv = lines
                .iter()
                .flat_map(|l| l.split(' '))
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            (rank, kv)
        })
        .collect()
}

fn python3() -> String {
    let out = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

#[test]
fn a_script_runs_as_python_dash_u_script() {
    let dir = Scratch::new("form");
    let script = script(&dir);
    let out = run(&[
        "run",
        "--standalone",
        "--nproc_per_node=2",
        &script,
        "--epochs",
        "3",
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let vars = vars(&out.stdout);
    assert_eq!(vars.len(), 2, "{out:?}");
    for v in vars.values() {
        assert_eq!(
            out.stdout
                .matches(&format!("argv=-u {script} --epochs 3"))
                .count(),
            2
        );
        assert_eq!(v["name"], "__main__");
        assert_eq!(v["unbuffered"], "True");
        assert_eq!(v["MASTER_ADDR"], "localhost");
    }
}

#[test]
fn python_exec_chooses_the_interpreter_and_dash_dash_is_optional() {
    let dir = Scratch::new("form");
    let script = script(&dir);
    let python = python3();
    for args in [
        &["run", "-n", "1", "--", &script, "a"][..],
        &["run", "-n", "1", &script, "a"],
    ] {
        let out = run_env(args, &[("PYTHON_EXEC", &python)]);
        assert_eq!(out.code, Some(0), "{out:?}");
        assert_eq!(vars(&out.stdout)[&0]["python"], python, "{out:?}");
        assert!(
            out.stdout.contains(&format!("argv=-u {script} a\n")),
            "{out:?}"
        );
    }
}

#[test]
fn a_module_runs_with_dash_m() {
    let dir = Scratch::new("module");
    std::fs::create_dir_all(dir.path().join("pkg")).unwrap();
    std::fs::write(dir.path().join("pkg/__init__.py"), "").unwrap();
    std::fs::write(dir.path().join("pkg/show.py"), SHOW).unwrap();
    for flag in ["-m", "--module"] {
        let mut cmd = command(&[
            "run",
            "--nproc-per-node",
            "2",
            flag,
            "pkg.show",
            "--lr",
            "1",
        ]);
        cmd.current_dir(dir.path());
        let out = Launcher::spawn(cmd).finish(std::time::Duration::from_secs(60));
        assert_eq!(out.code, Some(0), "{out:?}");
        assert_eq!(
            out.stdout.matches("argv=-u -m pkg.show --lr 1\n").count(),
            2
        );
        assert_eq!(vars(&out.stdout)[&1]["name"], "__main__");
    }
}

#[test]
fn no_python_runs_the_command_as_it_is() {
    for flag in ["--no-python", "--no_python"] {
        let out = run(&["run", "-n", "2", flag, "sh", "-c", "echo sh $RANK"]);
        assert_eq!(out.code, Some(0), "{out:?}");
        assert!(out.stdout.contains("[rank 1]: sh 1\n"), "{out:?}");
    }
    let out = run(&["run", "-m", "--no-python", "x"]);
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("cannot be used together"),
        "{}",
        out.stderr
    );
}

#[test]
fn a_command_where_a_script_belongs_is_explained() {
    let out = run(&["run", "-n", "2", "python", "train.py"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(
        out.stderr.contains("cannot find the script \"python\"")
            && out.stderr.contains("--no-python"),
        "{}",
        out.stderr
    );
}

#[test]
fn rendezvous_endpoint_gives_the_master_and_node_rank_the_ranks() {
    let dir = Scratch::new("form");
    let script = script(&dir);
    let out = run(&[
        "run",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:29400",
        "--rdzv_id=101",
        "--nnodes=1",
        "--nproc_per_node=2",
        &script,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    for v in vars(&out.stdout).values() {
        assert_eq!(
            (v["MASTER_ADDR"].as_str(), v["MASTER_PORT"].as_str()),
            ("localhost", "29400")
        );
        assert_eq!(v["TORCHELASTIC_RUN_ID"], "101");
    }
    let out = run(&[
        "run",
        "--nnodes",
        "2:2",
        "--node-rank",
        "1",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        "10.1.2.3:4567",
        &script,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let vars = vars(&out.stdout);
    assert_eq!(vars.keys().copied().collect::<Vec<_>>(), [2, 3]);
    assert_eq!(vars[&3]["MASTER_ADDR"], "10.1.2.3");
    assert_eq!(vars[&3]["MASTER_PORT"], "4567");
    assert_eq!(vars[&3]["GROUP_RANK"], "1");
}

#[test]
fn every_torchrun_option_is_accepted() {
    let dir = Scratch::new("form");
    let script = script(&dir);
    let logs = dir.path().join("logs");
    let logs = logs.to_str().unwrap();
    let out = run(&[
        "run",
        "--nnodes=1:1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:0",
        "--rdzv_id=all",
        "--rdzv_conf=join_timeout=900,read_timeout=60",
        "--max_restarts=1",
        "--monitor_interval=0.5",
        "--start_method=forkserver",
        "--event_log_handler=null",
        "--role=trainer",
        "--run_path",
        "--log_dir",
        logs,
        "--redirects=0",
        "--tee=3",
        "--log_line_prefix_template=[${role_name}${local_rank}]:",
        "--local_ranks_filter=0,1",
        "--duplicate_stdout_filters=argv",
        "--duplicate_stderr_filters=x",
        "--node_rank=0",
        "--master_addr=127.0.0.1",
        "--master_port=29511",
        "--local_addr=127.0.0.1",
        "--logs_specs=custom",
        "--numa_binding=node",
        "--signals_to_handle=SIGTERM,SIGINT,SIGUSR1",
        "--shutdown_timeout=5",
        "--virtual_local_rank",
        &script,
    ]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(out.stdout.contains("[trainer1]:argv=-u "), "{out:?}");
    assert!(out.stdout.contains("[trainer0]:LOCAL_RANK=0\n"), "{out:?}");
    assert!(out.stdout.contains("[trainer1]:LOCAL_RANK=0\n"), "{out:?}");
    assert!(
        out.stdout.contains("[trainer1]:CUDA_VISIBLE_DEVICES=1\n"),
        "{out:?}"
    );
    assert!(
        out.stderr.contains("--numa-binding node is not applied"),
        "{out:?}"
    );
    assert!(
        out.stderr.contains("--logs-specs custom is not applied"),
        "{out:?}"
    );
    let filtered = Path::new(logs).join("all/attempt_0/filtered_stdout.log");
    assert_eq!(
        std::fs::read_to_string(filtered).unwrap().lines().count(),
        2
    );
}

#[test]
fn pet_variables_are_defaults_as_in_torchrun() {
    let out = run_env(
        &["run", "--no-python", "sh", "-c", "echo $RANK/$WORLD_SIZE"],
        &[("PET_NPROC_PER_NODE", "3"), ("PET_RDZV_ID", "pet")],
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(by_rank(&out.stdout).len(), 3, "{out:?}");
    let out = run_env(
        &[
            "run",
            "-n",
            "1",
            "--no-python",
            "sh",
            "-c",
            "echo $TORCHELASTIC_RUN_ID",
        ],
        &[("PET_RDZV_ID", "pet")],
    );
    assert_eq!(out.stdout, "[rank 0]: pet\n");
    // A flag's variable is a number, as torchrun reads it.
    let out = run_env(
        &["run", "-n", "1", "sh", "-c", "echo $MASTER_ADDR"],
        &[("PET_NO_PYTHON", "1"), ("PET_STANDALONE", "1")],
    );
    assert_eq!(out.stdout, "[rank 0]: localhost\n", "{out:?}");
    let out = run_env(&["run", "-n", "1", "true"], &[("PET_NO_PYTHON", "0")]);
    assert_eq!(out.code, Some(2), "{out:?}");
}

#[test]
fn elastic_ranges_need_a_dynamic_rendezvous_and_unknown_backends_are_refused() {
    let out = run(&["run", "--nnodes", "1:4", "--no-python", "true"]);
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr.contains("elastic range") && out.stderr.contains("--rdzv-backend c10d"),
        "{}",
        out.stderr
    );
    let out = run(&[
        "run",
        "--nnodes",
        "1:4",
        "--rdzv-backend",
        "c10d",
        "--no-python",
        "true",
    ]);
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("--rdzv-endpoint"), "{}", out.stderr);
    let out = run(&["run", "--rdzv-backend", "zookeeper", "--no-python", "true"]);
    assert_eq!(out.code, Some(2));
    assert!(out
        .stderr
        .contains("--rdzv-backend zookeeper is not supported"));
}

#[test]
fn bad_option_values_are_errors_that_name_the_option() {
    let dir = Scratch::new("bad");
    let marker = dir.path().join("ran");
    let marker = marker.to_str().unwrap();
    let logs = dir.path().to_str().unwrap();
    for (args, option) in [
        (&["--tee", "9", "--log-dir", logs, "--"][..], "--tee"),
        (&["-t", "4"], "--tee"),
        (&["--redirects", "x"], "--redirects"),
        (&["--nproc-per-node", "many"], "--nproc-per-node"),
        (&["--nnodes", "0"], "--nnodes"),
        (&["--node-rank", "one"], "--node-rank"),
        (&["--master-port", "70000"], "--master-port"),
        (&["--max-restarts", "-1"], "--max-restarts"),
        (&["--rdzv-endpoint", "host:port"], "--rdzv-endpoint"),
        (&["--rdzv-conf", "novalue"], "--rdzv-conf"),
        (&["--start-method", "thread"], "--start-method"),
        (&["--monitor-interval", "soon"], "--monitor-interval"),
        (&["--local-ranks-filter", "0,x"], "--local-ranks-filter"),
        (&["--signals-to-handle", "SIGNOPE"], "--signals-to-handle"),
        (&["--shutdown-timeout", "-3"], "--shutdown-timeout"),
        (&["--shutdown_timeout", "soon"], "--shutdown-timeout"),
        (&["--grace-period", "-3"], "--grace-period"),
        (&["--numa-binding", "everywhere"], "--numa-binding"),
    ] {
        let argv = [&["run"][..], args, &["--no-python", "touch", marker]].concat();
        let out = run(&argv);
        assert_eq!(out.code, Some(2), "{args:?}: {out:?}");
        assert!(out.stderr.contains(option), "{args:?}: {}", out.stderr);
        assert!(!Path::new(marker).exists(), "{args:?} ran the command");
    }
}

#[test]
fn gpu_ranks_without_a_gpu_say_that_no_gpu_was_found() {
    let out = run_env(
        &["run", "-n", "gpu", "--no-python", "true"],
        &[("CUDA_VISIBLE_DEVICES", "")],
    );
    assert_eq!(out.code, Some(2));
    assert!(
        out.stderr
            .contains("--nproc-per-node gpu: no GPU was found"),
        "{}",
        out.stderr
    );
}

#[test]
fn help_shows_torchruns_form_first_with_examples() {
    let out = run(&["run", "--help"]);
    assert_eq!(out.code, Some(0));
    let usage = out
        .stdout
        .find("Usage: tether run [OPTIONS] SCRIPT.py")
        .unwrap();
    let example = out
        .stdout
        .find("tether run --standalone --nproc-per-node 4 train.py")
        .unwrap();
    let options = out.stdout.find("--nproc-per-node <N>").unwrap();
    assert!(usage < example && example < options, "{}", out.stdout);
    for spelling in [
        "--nproc_per_node",
        "--rdzv_endpoint",
        "--no_python",
        "-m, --module",
    ] {
        assert!(out.stdout.contains(spelling), "{spelling}");
    }
}
