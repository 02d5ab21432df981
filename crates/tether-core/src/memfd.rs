//! Memfds, the memory tether-core shares between processes: a sealed memfd that carries a
//! large message or a payload, and a shared mapping of one ([`SharedPages`]: a flag's page,
//! a worker's gate). Nothing here lives in `/dev/shm`: every segment is freed with its last
//! fd or mapping.

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// A sealed memfd holding `data`.
pub(crate) fn payload_memfd(data: &[u8]) -> io::Result<OwnedFd> {
    let fd = memfd_create(
        "tether-message",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    let mut written = 0;
    while written < data.len() {
        match rustix::io::write(&fd, &data[written..]) {
            Ok(n) => written += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    rustix::fs::fcntl_add_seals(&fd, SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW)?;
    Ok(fd)
}

pub(crate) fn read_memfd(fd: &OwnedFd, len: usize) -> io::Result<Vec<u8>> {
    if (fstat(fd)?.st_size as u64) < len as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "short memfd payload",
        ));
    }
    let mut data = vec![0u8; len];
    let mut read = 0;
    while read < len {
        match rustix::io::pread(fd, &mut data[read..], read as u64) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short memfd")),
            Ok(n) => read += n,
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(data)
}

/// A shared mapping of a memfd, unmapped when dropped: the memory behind a [`SharedFlag`] and
/// behind a pool worker's gate page. Its users reach it only through atomics.
#[derive(Debug)]
pub(crate) struct SharedPages {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is only accessed through atomics, which are safe to share between
// threads; the pointer stays valid until `drop` unmaps it.
unsafe impl Send for SharedPages {}
// SAFETY: as above.
unsafe impl Sync for SharedPages {}

impl SharedPages {
    /// A fresh memfd of `len` zeroed bytes, named `name`, and its mapping.
    pub(crate) fn create(name: &str, len: usize) -> io::Result<(OwnedFd, SharedPages)> {
        let fd = memfd_create(name, MemfdFlags::CLOEXEC)?;
        ftruncate(&fd, len as u64)?;
        let pages = SharedPages::map(&fd, len, name)?;
        Ok((fd, pages))
    }

    /// Maps the first `len` bytes of `fd` (made by [`SharedPages::create`] in some process);
    /// an fd shorter than that is not a `what`.
    pub(crate) fn map(fd: &OwnedFd, len: usize, what: &str) -> io::Result<SharedPages> {
        if (fstat(fd)?.st_size as u64) < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a {what}"),
            ));
        }
        // SAFETY: a fresh shared mapping of a file at least `len` bytes long; nothing else in
        // this process refers to the address it returns.
        let base = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                fd,
                0,
            )?
        };
        Ok(SharedPages {
            base: base.cast::<u8>(),
            len,
        })
    }

    /// The atomic `T` at byte `offset`.
    ///
    /// # Safety
    /// `offset` is aligned for `T` and `offset + size_of::<T>() <= len`.
    pub(crate) unsafe fn at<T>(&self, offset: usize) -> &T {
        // SAFETY: in bounds and aligned (the caller's promise), in a live page-aligned
        // mapping that outlives the returned reference (it is tied to `self`).
        unsafe { &*self.base.add(offset).cast::<T>() }
    }
}

impl Drop for SharedPages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no reference outlives `self`.
        let _ = unsafe { munmap(self.base.cast::<std::ffi::c_void>(), self.len) };
    }
}
