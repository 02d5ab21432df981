//! Memfds, the memory tether-core shares between processes: a sealed memfd that carries a
//! large message or a payload, or a shared dataset's items ([`sealed_memfd`], read through a
//! [`ReadOnlyMap`]), and a shared mapping of one ([`SharedPages`]: a flag's page, a worker's
//! gate). Nothing here lives in `/dev/shm`: every segment is freed with its last fd or
//! mapping.

use std::io;
use std::os::fd::OwnedFd;

use rustix::fs::{fstat, ftruncate, memfd_create, FallocateFlags, MemfdFlags, SealFlags};
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

/// A memfd named `name` holding `parts` one after the other, sealed against any change
/// (write, shrink, grow, and further seals). Its pages are allocated before anything is
/// written, so that running out of memory is an error here (ENOMEM, ENOSPC), never a SIGBUS
/// when a page is first read.
pub(crate) fn sealed_memfd(name: &str, parts: &[&[u8]]) -> io::Result<OwnedFd> {
    let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
    if total > 0 {
        rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, total)?;
    }
    let mut at = 0u64;
    for part in parts {
        let mut done = 0;
        while done < part.len() {
            match rustix::io::pwrite(&fd, &part[done..], at + done as u64) {
                Ok(n) => done += n,
                Err(Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        at += part.len() as u64;
    }
    let seals = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    rustix::fs::fcntl_add_seals(&fd, seals)?;
    Ok(fd)
}

/// A read-only shared mapping of a whole memfd sealed by [`sealed_memfd`] (in any process):
/// its bytes never change and never shrink away while mapped, so they are a plain `&[u8]`.
#[derive(Debug)]
pub(crate) struct ReadOnlyMap {
    base: *const u8,
    len: usize,
}

// SAFETY: the mapping is read-only and its file sealed against writes: shared immutable bytes,
// valid until `drop` unmaps them.
unsafe impl Send for ReadOnlyMap {}
// SAFETY: as above.
unsafe impl Sync for ReadOnlyMap {}

impl ReadOnlyMap {
    /// Maps `fd`, which must be sealed against writes and shrinking (anything else could
    /// change or vanish under a reader: refused as `InvalidData`).
    pub(crate) fn of_sealed(fd: &OwnedFd) -> io::Result<ReadOnlyMap> {
        let needed = SealFlags::WRITE | SealFlags::SHRINK;
        let seals = rustix::fs::fcntl_get_seals(fd).map_err(|_| not_sealed())?;
        if !seals.contains(needed) {
            return Err(not_sealed());
        }
        let len = usize::try_from(fstat(fd)?.st_size).map_err(|_| not_sealed())?;
        if len == 0 {
            return Ok(ReadOnlyMap {
                base: std::ptr::NonNull::<u8>::dangling().as_ptr(),
                len,
            });
        }
        // SAFETY: a fresh read-only shared mapping of `len` bytes of a file that is at least
        // that long and sealed against shrinking; nothing else refers to the address.
        let base = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ,
                MapFlags::SHARED,
                fd,
                0,
            )?
        };
        Ok(ReadOnlyMap {
            base: base.cast::<u8>().cast_const(),
            len,
        })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `len` readable bytes at `base` (or none), mapped until `self` drops, and
        // never written (the file is sealed against writes).
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }
}

fn not_sealed() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        "not a sealed memfd of tether's shared items",
    )
}

impl Drop for ReadOnlyMap {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `of_sealed`, unmapped once; no slice outlives
            // `self` (`bytes` borrows it).
            let _ = unsafe { munmap(self.base.cast_mut().cast::<std::ffi::c_void>(), self.len) };
        }
    }
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
