//! The vault of a job's shared copies: what lives as long as the job, not as long as its
//! ranks. `tether run`'s supervisor and `tether.spawn`'s caller start one for each job
//! (at [`vault_name`] of the job's id); the rank that built a key hands it the key's
//! listening socket and memfd ([`Meeting::hand_over`]), and the vault answers at that
//! meeting point as any holder does. So a rank that asks after every other rank has
//! exited still maps the copy, and does not build it again. When the vault is dropped
//! (the job ends), its copies go once the ranks that hold them are gone.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
use rustix::io::Errno;
use rustix::net::{
    accept_with, bind, listen, socket_with, AddressFamily, SocketAddrUnix, SocketFlags, SocketType,
};

use crate::channel::{Endpoint, Recv};
use crate::codec::Reader;
use crate::share::meet::{close_listener, same_user, vault_name, Meeting, Who, HOLD};

/// How long the vault waits for a holder's message once it connected.
const RECV_LIMIT: Duration = Duration::from_secs(5);

#[derive(Debug)]
struct Inner {
    /// The listening socket; -1 once closed.
    listener: AtomicI32,
    /// The names a meeting point of this job starts with.
    prefix: Vec<u8>,
    /// Meeting point name -> what the vault holds there.
    held: Mutex<HashMap<Vec<u8>, Meeting>>,
}

/// A job's vault, answering from a thread of its own until it is dropped.
#[derive(Debug)]
pub struct Vault {
    inner: Arc<Inner>,
    wake: OwnedFd,
    thread: Option<JoinHandle<()>>,
    owner: u32,
}

impl Vault {
    /// Starts the vault of the job `job`.
    pub fn start(job: &str) -> io::Result<Vault> {
        let name = vault_name(job);
        let addr = SocketAddrUnix::new_abstract_name(&name)?;
        let flags = SocketFlags::CLOEXEC | SocketFlags::NONBLOCK;
        let sock = socket_with(AddressFamily::UNIX, SocketType::SEQPACKET, flags, None)?;
        bind(&sock, &addr)?;
        listen(&sock, 64)?;
        let mut prefix = name;
        prefix.truncate(prefix.len() - "vault".len());
        let inner = Arc::new(Inner {
            listener: AtomicI32::new(sock.as_raw_fd()),
            prefix,
            held: Mutex::new(HashMap::new()),
        });
        std::mem::forget(sock); // owned by `inner.listener` from here
        let wake = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let (served, stop) = (inner.clone(), wake.try_clone()?);
        let thread = std::thread::Builder::new()
            .name("tether-vault".into())
            .spawn(move || serve(&served, &stop))?;
        Ok(Vault {
            inner,
            wake,
            thread: Some(thread),
            owner: std::process::id(),
        })
    }

    /// How many meeting points the vault holds.
    pub fn held(&self) -> usize {
        self.inner.held.lock().map_or(0, |held| held.len())
    }

    /// In a child forked from the vault's process: closes the child's copies of the
    /// vault's sockets and memfds (the job's memory must not live on in it). Takes a lock
    /// only if nobody holds it (another thread of the parent may have held it at the fork).
    pub fn close_after_fork(&self) {
        close_listener(&self.inner.listener);
        if let Ok(mut held) = self.inner.held.try_lock() {
            for meeting in held.values() {
                meeting.close_after_fork();
            }
            held.clear();
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        close_listener(&self.listener);
    }
}

impl Drop for Vault {
    fn drop(&mut self) {
        if std::process::id() != self.owner {
            // A forked child: the thread and the wake-up are the parent's.
            std::mem::forget(self.thread.take());
            self.close_after_fork();
            return;
        }
        let _ = rustix::io::write(&self.wake, &1u64.to_ne_bytes());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        close_listener(&self.inner.listener);
    }
}

/// The vault's thread: takes every meeting point a holder hands over, until `stop`.
fn serve(inner: &Inner, stop: &OwnedFd) {
    loop {
        let raw = inner.listener.load(Ordering::Acquire);
        if raw < 0 {
            return;
        }
        // SAFETY: open until this thread has stopped (closed only after the join).
        let listener = unsafe { BorrowedFd::borrow_raw(raw) };
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(stop, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) | Err(Errno::INTR) => {}
            Err(_) => return,
        }
        if !fds[1].revents().is_empty() {
            return;
        }
        if fds[0].revents().is_empty() {
            continue;
        }
        match accept_with(listener, SocketFlags::CLOEXEC) {
            Ok(conn) => {
                if let Err(err) = take(inner, conn) {
                    log::debug!(target: "tether::share", "a hand-over failed: {err}");
                }
            }
            Err(Errno::AGAIN | Errno::INTR | Errno::CONNABORTED) => {}
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Takes what a holder hands over on `conn`: a meeting point of this job to hold.
fn take(inner: &Inner, conn: OwnedFd) -> io::Result<()> {
    same_user(conn.as_fd())?;
    let Recv::Message(mut msg) = Endpoint::from_fd(conn).recv(Some(RECV_LIMIT))? else {
        return Ok(());
    };
    let mut r = Reader::new(&msg.data, "vault message");
    let (kind, name) = (r.u8()?, r.bytes()?.to_vec());
    let memfd = msg.fds.pop();
    let listener = msg.fds.pop();
    let (HOLD, true, Some(listener), Some(memfd)) =
        (kind, name.starts_with(&inner.prefix), listener, memfd)
    else {
        return Err(crate::codec::malformed("vault message"));
    };
    let me = Who {
        rank: -1,
        pid: std::process::id(),
    };
    let meeting = Meeting::hold(&name, listener, memfd, me)?;
    let mut held = inner.held.lock().unwrap_or_else(|e| e.into_inner());
    held.insert(name, meeting);
    Ok(())
}
