//! What a process tether started says it is: its title in `ps -o args`
//! (`/proc/PID/cmdline`) and its name in `/proc/PID/comm`.
//!
//! The title is written over the process's own argument strings, as `setproctitle` does.
//! When it is longer than they are, the environment strings that follow them are taken
//! too, after the `environ` entries that pointed into them have been moved to the heap.
//! Call it while the process has a single thread (a child, before it runs user code).

use std::ffi::{c_char, CString};
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::proc::{self, Of};

extern "C" {
    static mut environ: *mut *mut c_char;
}

/// Whether this process's environment strings were moved to the heap already.
static ENVIRON_MOVED: AtomicBool = AtomicBool::new(false);

/// Sets `/proc/self/comm` (cut at 15 bytes) and the title shown by `ps -o args` (cut to the
/// room the argument and environment strings leave).
pub fn set(title: &str, comm: &str) -> io::Result<()> {
    set_comm(comm)?;
    let area = Area::of_self()?;
    let mut end = area.arg_end;
    if title.len() >= area.arg_end - area.arg_start && area.env_start == area.arg_end {
        move_environ(&area);
        end = area.env_end;
    }
    let room = end - area.arg_start;
    let text = &title.as_bytes()[..title.len().min(room.saturating_sub(1))];
    // SAFETY: [arg_start, end) is this process's argument (and, once moved away, environment)
    // string area: writable memory that nothing else refers to any more (Python and libc
    // keep copies of the arguments; `environ` no longer points into the environment part).
    unsafe {
        let base = area.arg_start as *mut u8;
        std::ptr::copy_nonoverlapping(text.as_ptr(), base, text.len());
        std::ptr::write_bytes(base.add(text.len()), 0, room - text.len());
    }
    Ok(())
}

/// The bytes of this process's argument strings as they are now: what `/proc/self/cmdline`
/// shows (each argument followed by a NUL) while no title was set.
pub fn arguments() -> io::Result<Vec<u8>> {
    let area = Area::of_self()?;
    let mut bytes = vec![0u8; area.arg_end - area.arg_start];
    // SAFETY: [arg_start, arg_end) is this process's argument string area, mapped and
    // readable for the life of the process; `bytes` has exactly its length.
    unsafe {
        std::ptr::copy_nonoverlapping(area.arg_start as *const u8, bytes.as_mut_ptr(), bytes.len());
    }
    Ok(bytes)
}

/// Makes this process show `arguments` as its command line (`/proc/self/cmdline`, NUL after
/// each argument, as [`arguments`] returns them), `environment` as its environment
/// (`/proc/self/environ`: `KEY=VALUE` entries, each followed by a NUL) and `comm` as its
/// name: what a forked child of a process that set a title shows to look like the program
/// it runs. The argument area keeps its size (what does not fit is cut, the rest is NULs);
/// the environment entries that fit in the environment area are written whole, the rest of
/// it NULs. `environ` is moved to the heap first, so nothing points into the area any more.
pub fn show(arguments: &[u8], environment: &[(Vec<u8>, Vec<u8>)], comm: &str) -> io::Result<()> {
    set_comm(comm)?;
    let area = Area::of_self()?;
    move_environ(&area);
    // SAFETY: both ranges are this process's argument and environment string areas:
    // writable memory that nothing refers to any more (Python and libc keep copies of the
    // arguments; `environ` no longer points into the environment area).
    unsafe {
        fill(area.arg_start, area.arg_end, arguments);
        if area.env_start >= area.arg_end && area.env_start < area.env_end {
            let room = area.env_end - area.env_start;
            let mut block = Vec::with_capacity(room);
            for (key, value) in environment {
                let entry = key.len() + value.len() + 2;
                if block.len() + entry > room {
                    break;
                }
                block.extend_from_slice(key);
                block.push(b'=');
                block.extend_from_slice(value);
                block.push(0);
            }
            fill(area.env_start, area.env_end, &block);
        }
    }
    Ok(())
}

/// Writes `bytes` (cut to the room) at [start, end) and NULs after them.
///
/// # Safety
/// [start, end) must be writable memory of this process that nothing else uses.
unsafe fn fill(start: usize, end: usize, bytes: &[u8]) {
    let room = end - start;
    let n = bytes.len().min(room);
    let base = start as *mut u8;
    // SAFETY: the caller's promise; `n` and `room - n` stay within [start, end).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), base, n);
        std::ptr::write_bytes(base.add(n), 0, room - n);
    }
}

/// Sets `/proc/self/comm` (the kernel keeps 15 bytes).
pub fn set_comm(comm: &str) -> io::Result<()> {
    let cut: String = comm.chars().filter(|&c| c != '\0').take(15).collect();
    let name = CString::new(cut).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    rustix::thread::set_name(&name)?;
    Ok(())
}

/// Where the argument and environment strings of this process lie.
struct Area {
    arg_start: usize,
    arg_end: usize,
    env_start: usize,
    env_end: usize,
}

impl Area {
    fn of_self() -> io::Result<Area> {
        let bad = || io::Error::new(io::ErrorKind::InvalidData, "unexpected /proc/self/stat");
        let stat = proc::stat(Of::This).ok_or_else(bad)?;
        // Fields 48 to 51 of proc(5).
        let fields: Vec<usize> = (48..=51)
            .map(|n| stat.number(n).map(|v| v as usize).ok_or_else(bad))
            .collect::<io::Result<_>>()?;
        match fields[..] {
            [arg_start, arg_end, env_start, env_end] if arg_start < arg_end => Ok(Area {
                arg_start,
                arg_end,
                env_start,
                env_end,
            }),
            _ => Err(bad()),
        }
    }
}

/// Points every `environ` entry that lies in the environment string area at a heap copy
/// (kept for the life of the process), so that the area can hold a long title.
fn move_environ(area: &Area) {
    if ENVIRON_MOVED.swap(true, Ordering::AcqRel) {
        return;
    }
    // SAFETY: single-threaded use (see the module's documentation); `environ` is a
    // NULL-terminated array of C strings, and each entry replaced points at a copy that is
    // never freed.
    unsafe {
        let mut entry = environ;
        while !entry.is_null() && !(*entry).is_null() {
            let at = *entry as usize;
            if at >= area.env_start && at < area.env_end {
                let copy = libc::strdup(*entry);
                if !copy.is_null() {
                    *entry = copy;
                }
            }
            entry = entry.add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_area_is_found() {
        let area = Area::of_self().unwrap();
        assert!(area.arg_start < area.arg_end);
        assert!(area.env_start <= area.env_end);
    }

    #[test]
    fn the_arguments_are_what_proc_shows() {
        let shown = std::fs::read("/proc/self/cmdline").unwrap();
        assert_eq!(arguments().unwrap(), shown);
    }
}
