//! The output options resolved: where each rank's streams go, their prefix and filters.

use std::path::PathBuf;

use crate::args::{invalid, OutputArgs};

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
    /// Streams that reach a terminal get a pseudo-terminal (off with `--no-tty`).
    pub tty: bool,
}

impl Output {
    /// Resolves the output options; `var` reads the environment (torchelastic's
    /// TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE).
    pub(super) fn resolve(
        args: &OutputArgs,
        var: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Output, clap::Error> {
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
                .or_else(|| var("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"))
                .filter(|t| !t.is_empty())
                .unwrap_or_else(|| DEFAULT_PREFIX.to_string())
        });
        let stdout_filters = filter_list(args.stdout_filters.as_deref());
        let stderr_filters = filter_list(args.stderr_filters.as_deref());
        let wants_files = redirects.any()
            || tee.any()
            || !stdout_filters.is_empty()
            || !stderr_filters.is_empty();
        Ok(Output {
            auto_log_dir: args.log_dir.is_none() && wants_files,
            log_dir: args.log_dir.clone(),
            redirects,
            tee,
            ranks_filter,
            prefix,
            stdout_filters,
            stderr_filters,
            tty: !args.no_tty,
        })
    }

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

    /// Which streams of `local_rank` are a pseudo-terminal when the launcher's stream is a
    /// terminal: those that reach the console and are neither redirected nor teed (a
    /// torchrun rank writes those to a log file), unless `--no-tty`.
    pub fn tty(&self, local_rank: usize) -> Streams {
        let console = self.console(local_rank);
        let redirected = self.redirects.for_rank(local_rank);
        let teed = self.tee.for_rank(local_rank);
        Streams {
            stdout: self.tty && console.stdout && !redirected.stdout && !teed.stdout,
            stderr: self.tty && console.stderr && !redirected.stderr && !teed.stderr,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_run;

    fn output(list: &[&str]) -> Output {
        let mut argv = list.to_vec();
        argv.push("x.py");
        Output::resolve(&parse_run(&argv).unwrap().output, &|_| None).unwrap()
    }

    #[test]
    fn only_streams_that_reach_the_console_and_no_log_file_may_be_a_terminal() {
        let stdout = Streams {
            stdout: true,
            stderr: false,
        };
        let stderr = Streams {
            stdout: false,
            stderr: true,
        };
        assert_eq!(output(&[]).tty(0), Streams::BOTH);
        assert_eq!(output(&["--log-dir", "/l"]).tty(0), Streams::BOTH);
        assert_eq!(
            output(&["--duplicate-stdout-filters", "a"]).tty(0),
            Streams::BOTH
        );
        assert_eq!(output(&["--no-tty"]).tty(0), Streams::NONE);
        assert_eq!(output(&["--redirects", "1"]).tty(0), stderr);
        assert_eq!(output(&["--tee", "2"]).tty(0), stdout);
        let per_rank = output(&["--tee", "0:3"]);
        assert_eq!(
            (per_rank.tty(0), per_rank.tty(1)),
            (Streams::NONE, Streams::BOTH)
        );
        let filtered = output(&["--local-ranks-filter", "1"]);
        assert_eq!(
            (filtered.tty(0), filtered.tty(1)),
            (Streams::NONE, Streams::BOTH)
        );
    }
}
