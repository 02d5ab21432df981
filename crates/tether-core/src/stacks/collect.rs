//! The parent's side: the stacks channel (one per process), drained by the warden
//! thread, and the dumps that requests wait for.

use std::collections::HashMap;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    recvmsg, socketpair, AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags,
    SocketFlags, SocketType,
};

use super::handler::Marker;

/// Most bytes kept of one dump (faulthandler shows at most 100 threads of 100 frames).
const DUMP_LIMIT: usize = 8 << 20;

/// One dump a request waits for.
#[derive(Debug, Default)]
pub(crate) struct Dump {
    pub(crate) text: Vec<u8>,
    /// Its start marker arrived.
    pub(crate) started: bool,
    /// Its end marker arrived: the dump is whole.
    pub(crate) done: bool,
}

/// The dumps wanted from one process.
#[derive(Debug, Default)]
struct Wanted {
    /// The request whose dump is arriving now (between its markers).
    current: Option<u64>,
    dumps: HashMap<u64, Dump>,
}

/// One `SOCK_DGRAM` socket pair per process: the warden drains the receiving end,
/// every child holds the sending end. The kernel tags each datagram with its sender's pid.
#[derive(Debug)]
pub(crate) struct Channel {
    receiver: OwnedFd,
    sender: OwnedFd,
    /// The sending end's inode: what a child must still hold to be asked.
    inode: u64,
    wanted: Mutex<HashMap<i32, Wanted>>,
    /// The processes that installed their own handler for tether's signals, by pid, with
    /// their start time (a pid used again by a new process is asked again).
    withdrawn: Mutex<HashMap<i32, Option<u64>>>,
    /// The processes seen waiting for tether's request signal in a `sigwait` of their
    /// own, likewise: they are never sent it again.
    sigwaiting: Mutex<HashMap<i32, Option<u64>>>,
    arrived: Condvar,
}

/// Whether `pid` is in `noted` as the same process (its start time unchanged).
fn same_process(noted: &Mutex<HashMap<i32, Option<u64>>>, pid: i32) -> bool {
    let noted = noted.lock().unwrap_or_else(|e| e.into_inner());
    noted
        .get(&pid)
        .is_some_and(|&since| since == crate::proc::process_start_time(pid))
}

static CURRENT: AtomicPtr<(u32, Channel)> = AtomicPtr::new(std::ptr::null_mut());

/// This process's stacks channel, made on first use. It records the pid that made it, so
/// that a process forked from this one makes its own (its children answer there).
pub(crate) fn this_process() -> io::Result<&'static Channel> {
    let pid = std::process::id();
    let current = CURRENT.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in CURRENT comes from `Box::into_raw` and is never freed.
    if let Some((owner, channel)) = unsafe { current.as_ref() } {
        if *owner == pid {
            return Ok(channel);
        }
    }
    let fresh = Box::into_raw(Box::new((pid, Channel::new()?)));
    match CURRENT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        // SAFETY: `fresh` was just leaked into CURRENT and lives for ever.
        Ok(_) => Ok(unsafe { &(*fresh).1 }),
        Err(_) => {
            // Another thread made one first: use it.
            // SAFETY: `fresh` was never shared; reclaim it.
            drop(unsafe { Box::from_raw(fresh) });
            this_process()
        }
    }
}

impl Channel {
    pub(crate) fn new() -> io::Result<Channel> {
        let (receiver, sender) = socketpair(
            AddressFamily::UNIX,
            SocketType::DGRAM,
            SocketFlags::CLOEXEC,
            None,
        )?;
        rustix::net::sockopt::set_socket_passcred(&receiver, true)?;
        rustix::io::ioctl_fionbio(&receiver, true)?;
        let inode = rustix::fs::fstat(&sender)?.st_ino;
        Ok(Channel {
            receiver,
            sender,
            inode,
            wanted: Mutex::new(HashMap::new()),
            withdrawn: Mutex::new(HashMap::new()),
            sigwaiting: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        })
    }

    pub(crate) fn receiver(&self) -> BorrowedFd<'_> {
        self.receiver.as_fd()
    }

    /// The sending end that children inherit (blocking: a dump waits for room rather than
    /// losing lines).
    pub(crate) fn sender(&self) -> BorrowedFd<'_> {
        self.sender.as_fd()
    }

    /// The sending end's inode.
    pub(crate) fn inode(&self) -> u64 {
        self.inode
    }

    /// Whether `pid` said it installed its own handler for tether's signals.
    pub(crate) fn withdrawn(&self, pid: i32) -> bool {
        same_process(&self.withdrawn, pid)
    }

    /// Whether `pid` was seen waiting for tether's request signal in a `sigwait`.
    pub(crate) fn sigwaiting(&self, pid: i32) -> bool {
        same_process(&self.sigwaiting, pid)
    }

    /// Notes that `pid` waits for tether's request signal in a `sigwait` of its own.
    pub(crate) fn saw_sigwait(&self, pid: i32) {
        let mut seen = self.sigwaiting.lock().unwrap_or_else(|e| e.into_inner());
        seen.insert(pid, crate::proc::process_start_time(pid));
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<i32, Wanted>> {
        self.wanted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads every datagram waiting (on the warden thread).
    pub(crate) fn drain(&self) {
        let mut buf = vec![0u8; 1 << 16];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmCredentials(1))];
        loop {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut buf)];
            let got = recvmsg(&self.receiver, &mut iov, &mut control, RecvFlags::DONTWAIT);
            let bytes = match got {
                Ok(msg) => msg.bytes.min(buf.len()),
                Err(Errno::INTR) => continue,
                Err(_) => return,
            };
            let pid = control.drain().find_map(|cmsg| match cmsg {
                RecvAncillaryMessage::ScmCredentials(cred) => Some(cred.pid.as_raw_pid()),
                _ => None,
            });
            if let Some(pid) = pid {
                self.take(pid, &buf[..bytes]);
            }
        }
    }

    /// Files a datagram from `pid` under the request it answers; anything else is dropped.
    fn take(&self, pid: i32, datagram: &[u8]) {
        if Marker::decode(datagram) == Some(Marker::Withdraw) {
            let mut withdrawn = self.withdrawn.lock().unwrap_or_else(|e| e.into_inner());
            withdrawn.insert(pid, crate::proc::process_start_time(pid));
            return;
        }
        let mut wanted = self.lock();
        let Some(from) = wanted.get_mut(&pid) else {
            return;
        };
        match Marker::decode(datagram) {
            Some(Marker::Start(id)) => {
                from.current = Some(id);
                if let Some(dump) = from.dumps.get_mut(&id) {
                    *dump = Dump {
                        started: true,
                        ..Dump::default()
                    };
                    self.arrived.notify_all();
                }
            }
            Some(Marker::End(id)) => {
                from.current = None;
                if let Some(dump) = from.dumps.get_mut(&id) {
                    dump.done = true;
                    self.arrived.notify_all();
                }
            }
            Some(Marker::Withdraw) => {}
            None => {
                let dump = from.current.and_then(|id| from.dumps.get_mut(&id));
                if let Some(dump) = dump.filter(|d| d.text.len() < DUMP_LIMIT) {
                    dump.text.extend_from_slice(datagram);
                }
            }
        }
    }

    /// Announces that request `id` expects a dump from `pid`.
    pub(crate) fn expect(&self, pid: i32, id: u64) {
        let mut wanted = self.lock();
        wanted
            .entry(pid)
            .or_default()
            .dumps
            .insert(id, Dump::default());
    }

    /// Withdraws request `id`'s wish for a dump from `pid` (the request could not be sent).
    pub(crate) fn forget(&self, pid: i32, id: u64) {
        let mut wanted = self.lock();
        if let Some(from) = wanted.get_mut(&pid) {
            from.dumps.remove(&id);
            if from.dumps.is_empty() {
                wanted.remove(&pid);
            }
        }
    }

    /// Waits until every dump of request `id` from `pids` has begun (or `until`); returns
    /// the pids whose dump has not.
    pub(crate) fn wait_started(&self, id: u64, pids: &[i32], until: Instant) -> Vec<i32> {
        let mut wanted = self.lock();
        loop {
            let silent: Vec<i32> = pids
                .iter()
                .copied()
                .filter(|pid| {
                    wanted
                        .get(pid)
                        .and_then(|w| w.dumps.get(&id))
                        .is_some_and(|d| !d.started && !d.done)
                })
                .collect();
            let now = Instant::now();
            if silent.is_empty() || now >= until {
                return silent;
            }
            wanted = self
                .arrived
                .wait_timeout(wanted, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits until every dump of request `id` from `pids` is whole, until `deadline`, or
    /// until `gone` says a process exited (checked every `slice`); then takes what arrived.
    pub(crate) fn collect(
        &self,
        id: u64,
        pids: &[i32],
        deadline: Instant,
        gone: &mut dyn FnMut(i32) -> bool,
    ) -> HashMap<i32, Dump> {
        const SLICE: Duration = Duration::from_millis(50);
        let mut wanted = self.lock();
        loop {
            let waiting = pids.iter().any(|pid| {
                let done = wanted
                    .get(pid)
                    .and_then(|w| w.dumps.get(&id))
                    .map_or(true, |d| d.done);
                !done && !gone(*pid)
            });
            let now = Instant::now();
            if !waiting || now >= deadline {
                break;
            }
            let wait = deadline.saturating_duration_since(now).min(SLICE);
            wanted = self
                .arrived
                .wait_timeout(wanted, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut taken = HashMap::new();
        for &pid in pids {
            let Some(from) = wanted.get_mut(&pid) else {
                continue;
            };
            if let Some(dump) = from.dumps.remove(&id) {
                taken.insert(pid, dump);
            }
            if from.dumps.is_empty() {
                wanted.remove(&pid);
            }
        }
        taken
    }
}
