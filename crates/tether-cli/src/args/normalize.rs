//! torchrun's parser rules that clap does not have, applied to the words before clap reads
//! them.

use std::ffi::OsString;

/// Whether `token` is a `--tee`/`-t` value rather than the script that follows: digits,
/// colons and commas only (`3`, `0:3,1:2`; a bad one such as `9` is then refused by name).
fn looks_like_streams(token: &str) -> bool {
    !token.is_empty()
        && token
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b':' || b == b',')
}

/// The option of `run` that `--name` names: exactly, or by an unambiguous prefix.
fn long_option<'a>(run: &'a clap::Command, name: &str) -> Option<&'a clap::Arg> {
    let names = |a: &'a clap::Arg| {
        a.get_long()
            .into_iter()
            .chain(a.get_all_aliases().unwrap_or_default())
    };
    if let Some(exact) = run.get_arguments().find(|a| names(a).any(|n| n == name)) {
        return Some(exact);
    }
    let mut found = run
        .get_arguments()
        .filter(|a| names(a).any(|n| n.starts_with(name)));
    match (found.next(), found.next()) {
        (Some(only), None) => Some(only),
        _ => None,
    }
}

/// Whether `token` names an option of `run` that takes a value (`--nnodes`, `-n`).
fn takes_value(run: &clap::Command, token: &str) -> bool {
    let arg = match token.strip_prefix("--") {
        Some(long) => long_option(run, long),
        None => {
            let short = token.strip_prefix('-').and_then(|s| s.chars().next());
            run.get_arguments()
                .find(|a| token.len() == 2 && short.is_some() && a.get_short() == short)
        }
    };
    arg.is_some_and(|a| a.get_action().takes_values())
}

/// Two rules of torchrun's parser that clap does not have. `--tee` takes an optional value:
/// `--tee train.py` means `--tee=3 train.py`, while `--tee 9` is a (bad) value. A `--`
/// right after the script is dropped (`train.py -- --lr 1` gives the script `--lr 1`),
/// unless a `--` came before the script. Only the launcher's own options are looked at
/// (up to the script or `--`); `cmd` is the whole command line.
pub(super) fn normalize(argv: Vec<OsString>, cmd: &clap::Command) -> Vec<OsString> {
    let Some(run) = cmd.find_subcommand("run") else {
        return argv;
    };
    let mut out = Vec::with_capacity(argv.len());
    let mut iter = argv.into_iter().peekable();
    let mut in_run = false;
    while let Some(arg) = iter.next() {
        let text = arg.to_str().map(str::to_owned);
        out.push(arg);
        let Some(text) = text else { continue };
        if !in_run {
            in_run = text == "run";
            continue;
        }
        if text == "--" {
            break;
        }
        if !text.starts_with('-') || text == "-" {
            if iter.peek().is_some_and(|next| next == "--") {
                iter.next();
            }
            break;
        }
        if text == "--tee" || text == "-t" {
            if iter
                .peek()
                .and_then(|n| n.to_str())
                .is_some_and(looks_like_streams)
            {
                out.extend(iter.next());
            } else if let Some(last) = out.last_mut() {
                *last = "--tee=3".into();
            }
        } else if !text.contains('=') && takes_value(run, &text) {
            out.extend(iter.next());
        }
    }
    out.extend(iter);
    out
}
