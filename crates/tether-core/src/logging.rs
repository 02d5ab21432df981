//! The runtime's events (start, adopt, exit, stop, escalation to SIGKILL, the zygote's life)
//! go through the `log` crate. [`init_from_env`] installs a logger that writes them to
//! stderr, one line each, when `TETHER_LOG` asks for them (`error`, `warn`, `info`, `debug`,
//! `trace`); without it the level stays off and a log call costs one atomic load.

use std::io::Write;

use log::{LevelFilter, Log, Metadata, Record};

/// The environment variable that turns logging on.
pub const ENV: &str = "TETHER_LOG";

struct Stderr;

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // One write per line: lines from several processes and threads stay whole.
        let line = format!(
            "tether[{}] {} {}: {}\n",
            std::process::id(),
            record.level(),
            record.target(),
            record.args()
        );
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

/// The level `TETHER_LOG` asks for (off when unset or not a level).
pub fn level_from_env() -> LevelFilter {
    std::env::var(ENV)
        .ok()
        .and_then(|v| parse_level(&v))
        .unwrap_or(LevelFilter::Off)
}

/// A level name, any case: `off`, `error`, `warn` (or `warning`), `info`, `debug`, `trace`.
fn parse_level(value: &str) -> Option<LevelFilter> {
    let value = value.trim();
    if value.eq_ignore_ascii_case("warning") {
        return Some(LevelFilter::Warn);
    }
    value.parse().ok()
}

/// The warning for a `TETHER_LOG` that is set but names no level; `None` when it is unset,
/// empty or a level.
pub fn invalid_env_warning() -> Option<String> {
    let value = std::env::var_os(ENV)?;
    let text = value.to_string_lossy();
    if text.trim().is_empty() || parse_level(&text).is_some() {
        return None;
    }
    Some(format!(
        "TETHER_LOG={text:?} is not a log level (off, error, warn, info, debug, trace): \
         nothing is logged"
    ))
}

/// Installs the stderr logger at the level `TETHER_LOG` asks for (once per process; later
/// calls only change the level).
pub fn init_from_env() {
    static LOGGER: Stderr = Stderr;
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(level_from_env());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse() {
        assert_eq!(
            "debug".parse::<LevelFilter>().ok(),
            Some(LevelFilter::Debug)
        );
        assert_eq!("INFO".parse::<LevelFilter>().ok(), Some(LevelFilter::Info));
        assert!("loud".parse::<LevelFilter>().is_err());
        assert_eq!(parse_level(" Warning "), Some(LevelFilter::Warn));
        assert_eq!(parse_level("loud"), None);
    }
}
