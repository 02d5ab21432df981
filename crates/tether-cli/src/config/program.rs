//! The program every rank runs.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use clap::error::ErrorKind;

use crate::args::{conflict, invalid, usage_error, ProgramArgs};

/// The argv of every rank: `PYTHON -u SCRIPT ARGS`, `PYTHON -u -m MODULE ARGS`, or the
/// command as it is with `--no-python`.
pub(super) fn program(
    args: &ProgramArgs,
    command: &[OsString],
    python: &OsStr,
) -> Result<Vec<OsString>, clap::Error> {
    let Some((target, rest)) = command.split_first() else {
        return Err(usage_error(
            ErrorKind::MissingRequiredArgument,
            "the script to run is missing",
        ));
    };
    if args.no_python && !args.run_path {
        if args.module {
            return Err(conflict(
                "-m/--module and --no-python cannot be used together: -m runs a Python \
                 module, --no-python runs a command as it is",
            ));
        }
        return Ok(command.to_vec());
    }
    let mut argv: Vec<OsString> = vec![python.to_owned(), "-u".into()];
    if args.module && !args.run_path {
        argv.push("-m".into());
    } else if !target.to_string_lossy().starts_with('-') && !Path::new(target).exists() {
        // (A target such as `-m` after `--` goes to python as it is, as with torchrun.)
        return Err(invalid(format!(
            "cannot find the script {target:?}: tether run runs SCRIPT with `{} -u SCRIPT`, as \
             torchrun does; to run a command as it is, put --no-python before it (tether run \
             [OPTIONS] --no-python {} ...)",
            python.to_string_lossy(),
            target.to_string_lossy(),
        )));
    }
    argv.push(target.clone());
    argv.extend(rest.iter().cloned());
    Ok(argv)
}
