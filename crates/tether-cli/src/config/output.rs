//! The output options: where each rank's streams go, their prefix and filters.

use super::{invalid, Context, Output, StreamSpec, DEFAULT_PREFIX};
use crate::args::OutputArgs;

/// `--redirects` or `--tee` (`name`).
fn stream_spec(name: &str, spec: &Option<String>) -> Result<StreamSpec, clap::Error> {
    let Some(spec) = spec else {
        return Ok(StreamSpec::default());
    };
    StreamSpec::parse(spec).ok_or_else(|| {
        invalid(format!(
            "invalid {name} {spec:?}: expected 0 (no stream), 1 (stdout), 2 (stderr), \
             3 (both), or local_rank:code pairs such as \"0:3,1:2\""
        ))
    })
}

pub(super) fn output(args: &OutputArgs, ctx: &Context) -> Result<Output, clap::Error> {
    let redirects = stream_spec("--redirects", &args.redirects)?;
    let tee = stream_spec("--tee", &args.tee)?;
    let ranks_filter = match args.ranks_filter.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(spec) => Some(parse_rank_list(spec).ok_or_else(|| {
            invalid(format!(
                "invalid --local-ranks-filter {spec:?}: expected local ranks such as \"0,3\""
            ))
        })?),
    };
    let prefix = (!args.no_prefix).then(|| {
        args.prefix_template
            .clone()
            .or_else(|| (ctx.var)("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| DEFAULT_PREFIX.to_string())
    });
    let stdout_filters = filter_list(args.stdout_filters.as_deref());
    let stderr_filters = filter_list(args.stderr_filters.as_deref());
    let wants_files =
        redirects.any() || tee.any() || !stdout_filters.is_empty() || !stderr_filters.is_empty();
    Ok(Output {
        auto_log_dir: args.log_dir.is_none() && wants_files,
        log_dir: args.log_dir.clone(),
        redirects,
        tee,
        ranks_filter,
        prefix,
        stdout_filters,
        stderr_filters,
    })
}

fn parse_rank_list(spec: &str) -> Option<Vec<usize>> {
    spec.split(',')
        .map(|r| r.trim().parse().ok())
        .collect::<Option<Vec<usize>>>()
        .filter(|v| !v.is_empty())
}

/// torchrun's filter list: comma-separated, `,,` for a comma inside a filter.
pub(super) fn filter_list(spec: Option<&str>) -> Vec<String> {
    let Some(spec) = spec.filter(|s| !s.is_empty()) else {
        return Vec::new();
    };
    let mut items = Vec::new();
    let mut item = String::new();
    let mut chars = spec.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            ',' if chars.peek() == Some(&',') => {
                chars.next();
                item.push(',');
            }
            ',' => items.push(std::mem::take(&mut item)),
            c => item.push(c),
        }
    }
    items.push(item);
    items
}
