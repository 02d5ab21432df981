//! Channels between a process and its pool workers, usable by processes that are already
//! running (their fds travel with `SCM_RIGHTS`):
//!
//! - [`Endpoint`]: one end of a `SOCK_SEQPACKET` socket pair. A message is sent and received
//!   whole by one `sendmsg` / `recvmsg`, so any number of processes and threads may send on
//!   one end and receive on the other (a multi-producer, multi-consumer queue), and each
//!   message carries its own file descriptors. Messages above [`INLINE_MAX`] travel in a
//!   sealed memfd; more fds than fit one control message travel through a private bundle
//!   socket. A pair is also a duplex link (a worker's control socket).
//! - [`SharedFlag`]: a flag in a shared memfd page with futex waits (an `Event`).
//! - [`Poller`]: epoll over many fds, with a wake-up (the warden thread, a worker set).
//!
//! Nothing here lives in `/dev/shm`: every segment is a memfd (see `memfd.rs`), freed
//! with its last fd or mapping.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rustix::event::{epoll, eventfd, poll, EventfdFlags, PollFd, PollFlags, Timespec};
use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage,
    RecvFlags, ReturnFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags,
    SocketType,
};

use crate::codec::{Fixed, Reader, Writer};
use crate::memfd::{payload_memfd, read_memfd, SharedPages};

/// Messages up to this size (header included) travel inline; larger ones in a memfd.
pub const INLINE_MAX: usize = 64 * 1024;
/// The most fds one message carries in its own control data; more go through a bundle.
pub const FDS_PER_MESSAGE: usize = 250;
/// The send buffer asked for each socket (the kernel caps it at `net.core.wmem_max`): it
/// bounds how much may wait unread before a `send` blocks.
const SEND_BUFFER: usize = 4 << 20;

const FLAG_MEMFD: u8 = 1;
const FLAG_BUNDLE: u8 = 2;
/// Header: flags (1 byte), then for a memfd payload its length (8 bytes).
const HEADER: usize = 1;
const MEMFD_HEADER: usize = 9;

/// Per-thread receive buffers (a frame and its control data), reused by every `recv`.
struct Scratch {
    buf: Vec<u8>,
    space: Vec<MaybeUninit<u8>>,
}

thread_local! {
    static RECV_SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch {
        buf: vec![0u8; INLINE_MAX],
        space: vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_MESSAGE + 2))],
    });
}

/// A received message: its bytes and the fds that came with it (owned by the receiver).
#[derive(Debug, Default)]
pub struct Message {
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// What [`Endpoint::recv`] found.
#[derive(Debug)]
pub enum Recv {
    Message(Message),
    /// Nothing arrived before the timeout.
    Timeout,
    /// Every peer end is closed and nothing is left to read.
    Closed,
}

/// One end of a `SOCK_SEQPACKET` socket pair.
#[derive(Debug)]
pub struct Endpoint {
    fd: OwnedFd,
}

fn deadline_of(timeout: Option<Duration>) -> Option<Instant> {
    timeout.map(|t| Instant::now() + t)
}

/// Waits until `fd` is ready for `flags` or `deadline` passes; false on timeout.
fn wait_ready(fd: BorrowedFd<'_>, flags: PollFlags, deadline: Option<Instant>) -> io::Result<bool> {
    loop {
        let timeout = match deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                Some(Timespec {
                    tv_sec: left.as_secs() as i64,
                    tv_nsec: left.subsec_nanos() as i64,
                })
            }
        };
        let mut fds = [PollFd::new(&fd, flags)];
        match poll(&mut fds, timeout.as_ref()) {
            Ok(0) => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Ok(false);
                }
            }
            Ok(_) => return Ok(true),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

impl Endpoint {
    /// A connected pair: what is sent on one end is received on the other.
    pub fn pair() -> io::Result<(Endpoint, Endpoint)> {
        let (a, b) = socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        for fd in [&a, &b] {
            // Best effort: a smaller buffer only means an earlier blocking send.
            let _ = rustix::net::sockopt::set_socket_send_buffer_size(fd, SEND_BUFFER);
        }
        Ok((Endpoint { fd: a }, Endpoint { fd: b }))
    }

    /// Takes ownership of an fd that is one end of a `SOCK_SEQPACKET` pair.
    pub fn from_fd(fd: OwnedFd) -> Endpoint {
        Endpoint { fd }
    }

    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// Sends `data` with `fds` as one message. Blocks while the socket's buffer is full, up
    /// to `timeout`; returns false if the timeout passed with nothing sent.
    pub fn send(
        &self,
        data: &[u8],
        fds: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> io::Result<bool> {
        let bundle = if fds.len() > FDS_PER_MESSAGE {
            Some(bundle_fds(fds)?)
        } else {
            None
        };
        let mut flags = 0u8;
        let memfd;
        let mut all: Vec<BorrowedFd<'_>> = Vec::with_capacity(fds.len().min(FDS_PER_MESSAGE) + 2);
        let body: &[u8] = if data.len() + HEADER > INLINE_MAX {
            flags |= FLAG_MEMFD;
            memfd = Some(payload_memfd(data)?);
            if let Some(fd) = &memfd {
                all.push(fd.as_fd());
            }
            &[]
        } else {
            data
        };
        match &bundle {
            Some(fd) => {
                flags |= FLAG_BUNDLE;
                all.push(fd.as_fd());
            }
            None => all.extend_from_slice(fds),
        }
        let header: Writer<Fixed<MEMFD_HEADER>> = Writer::fixed().u8(flags);
        let (header, head_len) = match flags & FLAG_MEMFD {
            0 => (header.array(), HEADER),
            _ => (header.u64(data.len() as u64).array(), MEMFD_HEADER),
        };
        let iov = [IoSlice::new(&header[..head_len]), IoSlice::new(body)];
        self.send_frame(&iov, &all, deadline_of(timeout))
    }

    /// Sends one frame (its header and body) with its fds, waiting for room until
    /// `deadline`; false when it passed with nothing sent.
    fn send_frame(
        &self,
        iov: &[IoSlice<'_>],
        all: &[BorrowedFd<'_>],
        deadline: Option<Instant>,
    ) -> io::Result<bool> {
        loop {
            let mut space =
                vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(all.len().max(1)))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !all.is_empty() && !control.push(SendAncillaryMessage::ScmRights(all)) {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "too many fds"));
            }
            match sendmsg(
                &self.fd,
                iov,
                &mut control,
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            ) {
                Ok(_) => return Ok(true),
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    if !wait_ready(self.fd.as_fd(), PollFlags::OUT, deadline)? {
                        return Ok(false);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Receives one message, waiting up to `timeout` (for ever when `None`).
    pub fn recv(&self, timeout: Option<Duration>) -> io::Result<Recv> {
        let deadline = deadline_of(timeout);
        loop {
            let got = RECV_SCRATCH.with(|scratch| {
                let mut scratch = scratch.borrow_mut();
                let Scratch { buf, space } = &mut *scratch;
                let mut control = RecvAncillaryBuffer::new(space);
                let mut iov = [IoSliceMut::new(buf)];
                let msg = recvmsg(
                    &self.fd,
                    &mut iov,
                    &mut control,
                    RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
                )?;
                let mut fds: Vec<OwnedFd> = Vec::new();
                for cmsg in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(received) = cmsg {
                        fds.extend(received);
                    }
                }
                let frame = buf[..msg.bytes.min(INLINE_MAX)].to_vec();
                Ok::<_, Errno>((msg.bytes, msg.flags, frame, fds))
            });
            match got {
                Ok((bytes, flags, frame, fds)) => {
                    if bytes == 0 {
                        return Ok(Recv::Closed);
                    }
                    if flags.contains(ReturnFlags::CTRUNC) {
                        // The kernel could not give us every fd of the message: out of fds.
                        return Err(io::Error::from_raw_os_error(libc::EMFILE));
                    }
                    if flags.contains(ReturnFlags::TRUNC) {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "a channel message was truncated",
                        ));
                    }
                    return decode(frame, fds).map(Recv::Message);
                }
                Err(Errno::INTR) => {}
                Err(Errno::AGAIN) => {
                    if !wait_ready(self.fd.as_fd(), PollFlags::IN, deadline)? {
                        return Ok(Recv::Timeout);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// True when a message (or the end of the stream) is waiting to be received.
    pub fn readable(&self) -> io::Result<bool> {
        wait_ready(self.fd.as_fd(), PollFlags::IN, Some(Instant::now()))
    }

    /// Waits up to `timeout` until a message (or the end of the stream) is waiting; returns
    /// whether one is.
    pub fn readable_within(&self, timeout: Duration) -> io::Result<bool> {
        wait_ready(self.fd.as_fd(), PollFlags::IN, deadline_of(Some(timeout)))
    }

    /// Waits up to `timeout` (for ever when `None`) until this endpoint or one of `sentinels`
    /// is readable; returns the index in `sentinels` of a readable fd, or `None` (the endpoint
    /// is readable, or the timeout passed).
    pub fn wait_or_sentinel(
        &self,
        sentinels: &[BorrowedFd<'_>],
        timeout: Option<Duration>,
    ) -> io::Result<Option<usize>> {
        let mut fds = Vec::with_capacity(sentinels.len() + 1);
        fds.push(PollFd::new(&self.fd, PollFlags::IN));
        fds.extend(sentinels.iter().map(|fd| PollFd::new(fd, PollFlags::IN)));
        let timeout = timeout.map(|t| Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        match poll(&mut fds, timeout.as_ref()) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        Ok(fds[1..].iter().position(|fd| !fd.revents().is_empty()))
    }
}

impl AsFd for Endpoint {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Rebuilds a message from its frame.
fn decode(mut frame: Vec<u8>, mut fds: Vec<OwnedFd>) -> io::Result<Message> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let mut header = Reader::new(&frame, "channel frame");
    let flags = header.u8().map_err(|_| bad("empty channel frame"))?;
    let data = if flags & FLAG_MEMFD != 0 {
        let len = header.u64().map_err(|_| bad("bad memfd channel frame"))?;
        if fds.is_empty() {
            return Err(bad("bad memfd channel frame"));
        }
        let memfd = fds.remove(0);
        read_memfd(&memfd, len as usize)?
    } else {
        frame.drain(..HEADER);
        frame
    };
    if flags & FLAG_BUNDLE != 0 {
        if fds.len() != 1 {
            return Err(bad("bad fd bundle in channel frame"));
        }
        let bundle = Endpoint::from_fd(fds.remove(0));
        while let Recv::Message(mut part) = bundle.recv(Some(Duration::ZERO))? {
            fds.append(&mut part.fds);
        }
    }
    Ok(Message { data, fds })
}

/// Sends `fds` over a fresh private pair in parts, and returns its receiving end (to travel
/// as the only fd of the real message). The parts are all queued before this returns.
fn bundle_fds(fds: &[BorrowedFd<'_>]) -> io::Result<OwnedFd> {
    let (tx, rx) = Endpoint::pair()?;
    for part in fds.chunks(FDS_PER_MESSAGE) {
        if !tx.send(&[], part, Some(Duration::from_secs(5)))? {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "fd bundle is full"));
        }
    }
    Ok(rx.into_fd())
}

/// A flag in a shared memory page (a memfd), set and waited for by any process that maps it:
/// `is_set` is a plain load, `wait` a futex wait, `set` a futex wake.
#[derive(Debug)]
pub struct SharedFlag {
    fd: OwnedFd,
    page: SharedPages,
}

const FLAG_PAGE: usize = 4096;

impl SharedFlag {
    pub fn new() -> io::Result<SharedFlag> {
        let (fd, page) = SharedPages::create("tether-event", FLAG_PAGE)?;
        Ok(SharedFlag { fd, page })
    }

    /// Maps the flag held by `fd` (an fd made by [`SharedFlag::new`] in some process).
    pub fn from_fd(fd: OwnedFd) -> io::Result<SharedFlag> {
        let page = SharedPages::map(&fd, FLAG_PAGE, "tether flag")?;
        Ok(SharedFlag { fd, page })
    }

    fn word(&self) -> &AtomicU32 {
        // SAFETY: offset 0 of a page is aligned for and holds an AtomicU32.
        unsafe { self.page.at(0) }
    }

    pub fn is_set(&self) -> bool {
        self.word().load(Ordering::Acquire) != 0
    }

    pub fn set(&self) {
        if self.word().swap(1, Ordering::AcqRel) == 0 {
            // Shared (not private) futex: the waiters may be in other processes.
            let _ = rustix::thread::futex::wake(
                self.word(),
                rustix::thread::futex::Flags::empty(),
                i32::MAX as u32,
            );
        }
    }

    pub fn clear(&self) {
        self.word().store(0, Ordering::Release);
    }

    /// Waits until the flag is set or `timeout` passes; returns whether it is set.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = deadline_of(timeout);
        loop {
            if self.is_set() {
                return true;
            }
            let left = match deadline {
                None => None,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return false;
                    }
                    Some(Timespec {
                        tv_sec: left.as_secs() as i64,
                        tv_nsec: left.subsec_nanos() as i64,
                    })
                }
            };
            // EAGAIN (the flag changed meanwhile), EINTR and ETIMEDOUT all lead back to the
            // checks above.
            let _ = rustix::thread::futex::wait(
                self.word(),
                rustix::thread::futex::Flags::empty(),
                0,
                left.as_ref(),
            );
        }
    }
}

impl AsFd for SharedFlag {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Epoll over many fds (each with a `u64` token) and a wake-up eventfd: the one poller of
/// tether-core (the warden thread's, a worker set's).
#[derive(Debug)]
pub struct Poller {
    epoll: OwnedFd,
    wake: OwnedFd,
}

/// The token of the wake-up; no fd may be added under it.
pub const WAKE_TOKEN: u64 = u64::MAX;

impl Poller {
    pub fn new() -> io::Result<Poller> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        epoll::add(
            &epoll,
            &wake,
            epoll::EventData::new_u64(WAKE_TOKEN),
            epoll::EventFlags::IN,
        )?;
        Ok(Poller { epoll, wake })
    }

    fn add_for(&self, token: u64, fd: BorrowedFd<'_>, flags: epoll::EventFlags) -> io::Result<()> {
        debug_assert_ne!(token, WAKE_TOKEN);
        epoll::add(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?;
        Ok(())
    }

    /// Watches `fd` for readability (or hang-up) under `token` (not [`WAKE_TOKEN`]).
    pub fn add(&self, token: u64, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.add_for(token, fd, epoll::EventFlags::IN)
    }

    /// Watches `fd` for room to write (or an error) under `token`.
    pub fn add_writable(&self, token: u64, fd: BorrowedFd<'_>) -> io::Result<()> {
        self.add_for(token, fd, epoll::EventFlags::OUT)
    }

    /// Pauses (`readable` false) or resumes the watch of `fd` for readability, under `token`.
    pub fn set_readable(&self, token: u64, fd: BorrowedFd<'_>, readable: bool) -> io::Result<()> {
        let flags = match readable {
            true => epoll::EventFlags::IN,
            false => epoll::EventFlags::empty(),
        };
        epoll::modify(&self.epoll, fd, epoll::EventData::new_u64(token), flags)?;
        Ok(())
    }

    pub fn remove(&self, fd: BorrowedFd<'_>) -> io::Result<()> {
        epoll::delete(&self.epoll, fd)?;
        Ok(())
    }

    /// Makes a current or the next `wait` return at once.
    pub fn wake(&self) -> io::Result<()> {
        rustix::io::write(&self.wake, &1u64.to_ne_bytes())?;
        Ok(())
    }

    /// The tokens of the fds that are ready, and whether a `wake` came, waiting up to
    /// `timeout` for either (for ever when `None`; an interrupted wait returns nothing).
    pub fn wait(&self, timeout: Option<Duration>) -> io::Result<(Vec<u64>, bool)> {
        let timeout = timeout.map(|t| Timespec {
            tv_sec: t.as_secs() as i64,
            tv_nsec: t.subsec_nanos() as i64,
        });
        let mut events = Vec::with_capacity(64);
        match epoll::wait(
            &self.epoll,
            rustix::buffer::spare_capacity(&mut events),
            timeout.as_ref(),
        ) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
        let mut ready = Vec::with_capacity(events.len());
        let mut woken = false;
        for event in events {
            let token = event.data.u64();
            if token == WAKE_TOKEN {
                let mut buf = [0u8; 8];
                let _ = rustix::io::read(&self.wake, &mut buf);
                woken = true;
            } else {
                ready.push(token);
            }
        }
        Ok((ready, woken))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_messages_with_fds() -> io::Result<()> {
        let (a, b) = Endpoint::pair()?;
        let flag = SharedFlag::new()?;
        a.send(b"hello", &[flag.as_fd()], None)?;
        let big = vec![7u8; INLINE_MAX * 3];
        a.send(&big, &[], None)?;
        let Recv::Message(first) = b.recv(Some(Duration::from_secs(1)))? else {
            panic!("no message");
        };
        assert_eq!(first.data, b"hello");
        assert_eq!(first.fds.len(), 1);
        let again = SharedFlag::from_fd(first.fds.into_iter().next().ok_or(Errno::BADF)?)?;
        flag.set();
        assert!(again.is_set());
        let Recv::Message(second) = b.recv(None)? else {
            panic!("no message");
        };
        assert_eq!(second.data, big);
        assert!(matches!(
            b.recv(Some(Duration::from_millis(10)))?,
            Recv::Timeout
        ));
        drop(a);
        assert!(matches!(b.recv(None)?, Recv::Closed));
        Ok(())
    }

    #[test]
    fn many_fds_travel_in_a_bundle() -> io::Result<()> {
        let (a, b) = Endpoint::pair()?;
        let flags: Vec<SharedFlag> = (0..600)
            .map(|_| SharedFlag::new())
            .collect::<Result<_, _>>()?;
        let fds: Vec<BorrowedFd<'_>> = flags.iter().map(|f| f.as_fd()).collect();
        a.send(b"x", &fds, None)?;
        let Recv::Message(msg) = b.recv(None)? else {
            panic!("no message");
        };
        assert_eq!(msg.fds.len(), 600);
        Ok(())
    }

    #[test]
    fn a_wait_heeds_sentinels_too() -> io::Result<()> {
        let (a, b) = Endpoint::pair()?;
        let (c, d) = Endpoint::pair()?;
        let sentinels = [d.as_fd()];
        assert_eq!(
            b.wait_or_sentinel(&sentinels, Some(Duration::from_millis(5)))?,
            None
        );
        c.send(b"x", &[], None)?;
        assert_eq!(
            b.wait_or_sentinel(&sentinels, Some(Duration::from_secs(1)))?,
            Some(0)
        );
        a.send(b"y", &[], None)?;
        let _ = d.recv(None)?;
        assert_eq!(b.wait_or_sentinel(&sentinels, None)?, None);
        Ok(())
    }

    #[test]
    fn flag_wait_times_out_and_wakes() -> io::Result<()> {
        let flag = std::sync::Arc::new(SharedFlag::new()?);
        assert!(!flag.wait(Some(Duration::from_millis(5))));
        let setter = flag.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            setter.set();
        });
        assert!(flag.wait(Some(Duration::from_secs(5))));
        let _ = t.join();
        flag.clear();
        assert!(!flag.is_set());
        Ok(())
    }

    #[test]
    fn poller_reports_ready_endpoints() -> io::Result<()> {
        let poller = Poller::new()?;
        let (a, b) = Endpoint::pair()?;
        poller.add(7, b.as_fd())?;
        assert_eq!(
            poller.wait(Some(Duration::from_millis(1)))?,
            (vec![], false)
        );
        a.send(b"x", &[], None)?;
        assert_eq!(poller.wait(Some(Duration::from_secs(1)))?, (vec![7], false));
        poller.wake()?;
        let _ = b.recv(None)?;
        assert_eq!(poller.wait(Some(Duration::from_secs(1)))?, (vec![], true));
        Ok(())
    }
}
