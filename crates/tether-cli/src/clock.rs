//! Times as people read them: local ISO-8601 with milliseconds and the UTC offset
//! (`2025-11-30T10:18:05.811+01:00`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Reads the time zone (`TZ`, else /etc/localtime) once, while the process has one thread.
pub fn init() {
    extern "C" {
        fn tzset();
    }
    // SAFETY: tzset only reads the environment and the zone file into libc's state; it is
    // called before any other thread exists.
    unsafe { tzset() };
}

/// `t` in local time, ISO-8601 with milliseconds.
pub fn local_iso(t: SystemTime) -> String {
    let (secs, millis) = match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_millis()),
        Err(before) => {
            let d = before.duration();
            let whole = d.as_secs() as i64 + i64::from(d.subsec_millis() > 0);
            (-whole, (1000 - d.subsec_millis()) % 1000)
        }
    };
    let time = secs as libc::time_t;
    // SAFETY: tm is plain data; zeroed is a valid value for localtime_r to overwrite.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: localtime_r reads `time` and writes only into `tm`; it is thread-safe.
    if unsafe { libc::localtime_r(&time, &mut tm) }.is_null() {
        return format!("@{secs}.{millis:03}");
    }
    let offset = tm.tm_gmtoff;
    let sign = if offset < 0 { '-' } else { '+' };
    let offset = offset.unsigned_abs();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{millis:03}{sign}{:02}:{:02}",
        i64::from(tm.tm_year) + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        offset / 3600,
        offset % 3600 / 60,
    )
}

/// A time given as Unix seconds (as torch's error files write it), in local ISO-8601; the
/// text as it is when it is not a number.
pub fn local_iso_from_unix(text: &str) -> String {
    match text.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => {
            local_iso(UNIX_EPOCH + Duration::from_secs_f64(secs))
        }
        _ => text.to_string(),
    }
}

/// The current `CLOCK_MONOTONIC` time (what tether-core stamps exits with).
pub fn monotonic() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The wall-clock time of the monotonic instant `at`.
pub fn wall_time_of(at: Duration) -> SystemTime {
    let ago = monotonic().saturating_sub(at);
    SystemTime::now().checked_sub(ago).unwrap_or(UNIX_EPOCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_with_milliseconds_and_offset() {
        // The test process's zone is whatever TZ says; only the shape is fixed here (the
        // end-to-end test sets TZ and checks the digits).
        let text = local_iso(UNIX_EPOCH + Duration::from_millis(1_700_000_000_123));
        assert_eq!(text.len(), "2023-11-14T22:13:20.123+00:00".len(), "{text}");
        assert_eq!(&text[19..23], ".123", "{text}");
        assert!(matches!(&text[23..24], "+" | "-"), "{text}");
        assert_eq!(local_iso_from_unix("not a time"), "not a time");
        assert_eq!(local_iso_from_unix("1700000000").len(), text.len());
    }
}
