//! Warm ranks from the binary's side: a Python without tether's start-up hook cannot host a
//! zygote, and the run goes on with cold ranks after one warning; `--no-warm` and
//! `PET_NO_WARM` start no zygote. (The warm ranks themselves are tested from Python, where
//! tether is installed: tests/test_warm_ranks.py.)

mod common;

use std::os::unix::fs::PermissionsExt;

use common::{command, Launcher, Scratch};

const SCRIPT: &str = "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n";

/// A `python3` that skips `site` (and with it every `.pth` file, tether's hook included).
fn python_without_hook(dir: &Scratch) -> String {
    let path = dir.path().join("python-without-site");
    std::fs::write(&path, "#!/bin/sh\nexec python3 -S \"$@\"\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_str().unwrap().to_string()
}

fn run(dir: &Scratch, extra: &[&str], env: &[(&str, &str)]) -> common::Output {
    let script = dir.path().join("show.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let mut args = vec!["run", "-n", "2"];
    args.extend_from_slice(extra);
    args.extend([script.to_str().unwrap(), "a"]);
    let mut cmd = command(&args);
    cmd.env_remove("PET_NO_WARM")
        .env("PYTHON_EXEC", python_without_hook(dir));
    for (k, v) in env {
        cmd.env(k, v);
    }
    Launcher::spawn(cmd).finish(std::time::Duration::from_secs(60))
}

#[test]
fn a_python_without_the_hook_runs_cold_ranks_after_one_warning() {
    let dir = Scratch::new("warm");
    let out = run(&dir, &[], &[]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let mut lines: Vec<&str> = out.stdout.lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["[rank 0]: rank 0 ['a']", "[rank 1]: rank 1 ['a']"]);
    let warnings: Vec<&str> = out.stderr.lines().collect();
    assert_eq!(warnings.len(), 1, "{}", out.stderr);
    assert!(
        warnings[0].starts_with("tether: warning: warm ranks are off for this run: ")
            && warnings[0].contains("has no tether start-up hook")
            && warnings[0].ends_with("(as with --no-warm)"),
        "{}",
        warnings[0]
    );
}

#[test]
fn no_warm_and_pet_no_warm_start_no_zygote() {
    let dir = Scratch::new("warm");
    for (extra, env) in [
        (&["--no-warm"][..], &[][..]),
        (&["--no_warm"][..], &[][..]),
        (&[][..], &[("PET_NO_WARM", "1")][..]),
    ] {
        let mut env = env.to_vec();
        env.push(("TETHER_LOG", "info"));
        let out = run(&dir, extra, &env);
        assert_eq!(out.code, Some(0), "{out:?}");
        assert!(!out.stderr.contains("zygote"), "{}", out.stderr);
        assert!(!out.stderr.contains("warning"), "{}", out.stderr);
    }
}
