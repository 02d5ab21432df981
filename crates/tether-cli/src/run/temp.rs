//! The temporary directory, chosen as Python's `tempfile` chooses it, and the directories the
//! run makes in it.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The temporary directory, chosen once as Python's `tempfile` chooses it (torchrun's
/// choice): the first of `$TMPDIR`, `$TEMP`, `$TMP`, `/tmp`, `/var/tmp`, `/usr/tmp` and the
/// working directory in which a file can be created, so that a `TMPDIR` that is missing, a
/// file or unwritable falls back instead of stopping the run.
pub fn temp_dir() -> io::Result<PathBuf> {
    static CHOSEN: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    CHOSEN
        .get_or_init(choose_temp_dir)
        .clone()
        .map_err(|tried| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no usable temporary directory found in {tried}"),
            )
        })
}

fn choose_temp_dir() -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = ["TMPDIR", "TEMP", "TMP"]
        .into_iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .collect();
    candidates.extend(["/tmp", "/var/tmp", "/usr/tmp"].map(PathBuf::from));
    candidates.extend(std::env::current_dir().ok());
    for dir in &candidates {
        if can_create_in(dir) {
            return Ok(dir.clone());
        }
    }
    Err(format!("{candidates:?}"))
}

/// Whether a file can be created (and written) in `dir`: an unnamed file (O_TMPFILE), which
/// leaves nothing behind even if the launcher is killed at that moment; where the file
/// system has no unnamed files, a named one, removed again.
fn can_create_in(dir: &Path) -> bool {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let unnamed = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o600)
        .open(dir);
    match unnamed {
        Ok(mut file) => return file.write_all(b"tether").is_ok(),
        Err(err) if !matches!(err.raw_os_error(), Some(libc::EOPNOTSUPP | libc::EISDIR)) => {
            return false
        }
        Err(_) => {}
    }
    let probe = dir.join(format!(".tether-probe-{}", crate::config::random_id()));
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&probe);
    match made {
        Ok(mut file) => {
            let written = file.write_all(b"tether").is_ok();
            let _ = std::fs::remove_file(&probe);
            written
        }
        Err(_) => false,
    }
}

/// A new directory (mode 0700) under the temporary directory, `prefix` then six random
/// characters.
pub fn make_temp_dir(prefix: &str) -> io::Result<PathBuf> {
    let template = temp_dir()?.join(format!("{prefix}XXXXXX"));
    let template = CString::new(template.as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    let mut bytes = template.into_bytes_with_nul();
    // SAFETY: `bytes` is a NUL-terminated template that mkdtemp rewrites in place.
    if unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) }.is_null() {
        return Err(io::Error::last_os_error());
    }
    bytes.pop();
    Ok(PathBuf::from(
        <std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes),
    ))
}

/// The supervisor's private directory (error files): named by the keeper, created by the
/// supervisor, and removed with everything in it on drop (by the keeper once the supervisor
/// has ended, or by a supervisor whose keeper died). Naming it before the fork and making it
/// after leaves no moment at which a SIGKILL of either process would leave it behind.
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// A new name under the temporary directory ([`temp_dir`]); nothing is created yet.
    pub fn name(prefix: &str) -> io::Result<TempDir> {
        let name = format!("{prefix}{}", crate::config::random_id());
        Ok(TempDir {
            path: temp_dir()?.join(name),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
