//! Which of many files changed since their signatures were taken (`record.signature` in
//! Python: modification time in nanoseconds, size and inode, or none for a file that does
//! not exist). A warm rank checks the thousands of files that its zygote's compiled imports
//! read before it runs its script; here it costs a `stat` each and no Python object, so the
//! rank writes none of the pages it shares with the zygote (each such write is a copy).

use std::ffi::CStr;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The bytes of one packed signature: present (0 or 1), then the modification time in
/// nanoseconds (i64), the size and the inode (u64), little-endian.
pub const PACKED: usize = 25;

/// The index of the first of `paths` (each one followed by a NUL byte) whose signature is
/// not its entry of `known` (`PACKED` bytes each, in the same order); None when none
/// changed.
#[pyfunction]
fn first_changed(paths: &[u8], known: &[u8]) -> PyResult<Option<usize>> {
    let names = paths
        .split_inclusive(|&b| b == 0)
        .map(CStr::from_bytes_with_nul)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| PyValueError::new_err("the paths do not end with a NUL byte"))?;
    if known.len() != names.len() * PACKED {
        return Err(PyValueError::new_err(format!(
            "{} signature bytes for {} paths",
            known.len(),
            names.len()
        )));
    }
    for (index, (name, want)) in names.iter().zip(known.chunks_exact(PACKED)).enumerate() {
        if signature(name) != want {
            return Ok(Some(index));
        }
    }
    Ok(None)
}

/// The packed signature of `path` now (`stat(2)`, following symbolic links).
fn signature(path: &CStr) -> [u8; PACKED] {
    let mut out = [0u8; PACKED];
    // SAFETY: stat is plain data; all zeros is a valid value for stat(2) to fill.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `st` is a live stat buffer.
    if unsafe { libc::stat(path.as_ptr(), &mut st) } != 0 {
        return out;
    }
    let mtime_ns = (st.st_mtime as i64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(st.st_mtime_nsec as i64);
    out[0] = 1;
    out[1..9].copy_from_slice(&mtime_ns.to_le_bytes());
    out[9..17].copy_from_slice(&(st.st_size as u64).to_le_bytes());
    out[17..25].copy_from_slice(&(st.st_ino as u64).to_le_bytes());
    out
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(first_changed, m)?)?;
    m.add("SIGNATURE_BYTES", PACKED)?;
    Ok(())
}
