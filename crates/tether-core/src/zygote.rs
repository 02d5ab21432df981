//! The zygote: a warm process that forks children on request, so that a new process costs a
//! fork instead of an interpreter start and the heavy imports. Both sides live here: the
//! [`Zygote`] client in the parent, and [`serve`], the zygote's loop.
//!
//! The zygote forks with `clone(CLONE_PARENT)` (the embedding supplies the fork, see
//! [`serve`]): every child is a child of the *parent*, which watches it through a pidfd like
//! any other. Between requests the zygote keeps "blank" children forked ahead, each waiting
//! on a private channel for its part of a request, so that a start costs no fork at all.
//!
//! Protocol, on [`crate::channel`] endpoints (`SOCK_SEQPACKET`, messages of any size and
//! any number of fds). The parent and the zygote alternate strictly: each parent message
//! gets one reply.
//! - `Start` (parent): request id, ranks, the [`Common`] part (fd targets, the caller's
//!   [`Attributes`], a label) as raw bytes, and the first batch of ranks; fds: the payload (a
//!   sealed memfd, the prepared and pickled work, opaque here), the shared fds, one report
//!   pipe per rank of the batch.
//! - `Batch` (parent): the next batch of ranks; fds: their report pipes.
//! - `Started` / `Failed` (zygote): per batch, the children made (rank, pid, whether it was a
//!   blank), or an errno and a message with those made before the error.
//! - `Ready` (zygote, once): the embedding's bytes (what the preload did).
//! - On the notice channel (zygote to parent's supervisor): `Blank(pid)` for each blank
//!   forked, before it can be handed out; `Retired(pid)` for a blank found dead.
//! - To a blank: `Job` with its rank and the raw [`Common`] part; fds: payload, shared fds,
//!   its report pipe. A blank receives only its own part.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::time::Duration;

use rustix::event::{poll, PollFd, PollFlags, Timespec};

use crate::attrs::{Attributes, ThreadAttributes};
use crate::channel::{self, Endpoint, Recv};
use crate::group::{signal_tree, Exit, Group, WaitFor};
use crate::launch::{self, LaunchSpec};
use crate::status::{describe_state, process_state};
use crate::supervisor::{Adoption, Reserve};
use crate::error::Error;

/// Most blank children a zygote keeps ready.
pub const MAX_BLANKS: usize = 64;
/// How long the zygote waits, idle, before it forks blanks to replace those used.
const REPLENISH_DELAY: Duration = Duration::from_millis(50);
/// Ranks per message: the zygote holds at most this many report pipes at once.
const BATCH: usize = 32;
/// How long a reply may keep the parent waiting before the zygote counts as not answering.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a stopped zygote (SIGSTOP, a debugger) is given before the start fails.
const STOPPED_PATIENCE: Duration = Duration::from_secs(1);
/// How often a waiting parent checks on the zygote.
const CHECK_EVERY: Duration = Duration::from_millis(250);
/// The environment variable that names the zygote's two fds ("request,notices").
pub const FDS_ENV: &str = "TETHER_ZYGOTE_FDS";

const START: u8 = 1;
const BATCH_MSG: u8 = 2;
const STARTED: u8 = 3;
const FAILED: u8 = 4;
const READY: u8 = 5;
const JOB: u8 = 6;
const BLANK: u8 = 7;
const RETIRED: u8 = 8;

// Wire format --------------------------------------------------------------------------

/// Little-endian fields, byte strings with a u64 length.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn i32(self, v: i32) -> Self {
        self.u32(v as u32)
    }
    fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(self, v: &[u8]) -> Self {
        let mut w = self.u64(v.len() as u64);
        w.0.extend_from_slice(v);
        w
    }
    fn list<T>(self, items: &[T], mut each: impl FnMut(Self, &T) -> Self) -> Self {
        let mut w = self.u32(items.len() as u32);
        for item in items {
            w = each(w, item);
        }
        w
    }
}

struct Reader<'a> {
    data: &'a [u8],
}

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed zygote message")
}

impl<'a> Reader<'a> {
    fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }
    fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.data.len() < n {
            return Err(malformed());
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| malformed())?,
        ))
    }
    fn i32(&mut self) -> io::Result<i32> {
        Ok(self.u32()? as i32)
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| malformed())?,
        ))
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = usize::try_from(self.u64()?).map_err(|_| malformed())?;
        Ok(self.take(n)?.to_vec())
    }
    fn list<T>(&mut self, mut each: impl FnMut(&mut Self) -> io::Result<T>) -> io::Result<Vec<T>> {
        let n = self.u32()? as usize;
        if n > self.data.len() {
            return Err(malformed());
        }
        (0..n).map(|_| each(self)).collect()
    }
}

/// What every child of a request shares: where the shared fds go, the caller's attributes
/// and a label (what the children run, for their process title).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Common {
    pub targets: Vec<i32>,
    pub attrs: Attributes,
    pub label: Vec<u8>,
}

impl Common {
    fn encode(&self) -> Vec<u8> {
        let a = &self.attrs;
        Writer::default()
            .list(&self.targets, |w, &t| w.i32(t))
            .u32(a.umask)
            .list(&a.rlimits, |w, &(r, soft, hard)| {
                w.u32(r).u64(soft).u64(hard)
            })
            .bytes(&a.thread.affinity)
            .i32(a.thread.nice)
            .bytes(&a.cwd)
            .list(&a.env, |w, (k, v)| w.bytes(k).bytes(v))
            .bytes(&self.label)
            .0
    }

    fn decode(data: &[u8]) -> io::Result<Common> {
        let mut r = Reader::new(data);
        let targets = r.list(|r| r.i32())?;
        let umask = r.u32()?;
        let rlimits = r.list(|r| Ok((r.u32()?, r.u64()?, r.u64()?)))?;
        let affinity = r.bytes()?;
        let nice = r.i32()?;
        let cwd = r.bytes()?;
        let env = r.list(|r| Ok((r.bytes()?, r.bytes()?)))?;
        let label = r.bytes()?;
        Ok(Common {
            targets,
            attrs: Attributes {
                umask,
                rlimits,
                thread: ThreadAttributes { affinity, nice },
                cwd,
                env,
            },
            label,
        })
    }
}

/// One child the zygote made for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Made {
    pub rank: u32,
    pub pid: i32,
    /// A blank forked ahead (watched by the parent's reserve until now).
    pub blank: bool,
}

/// A message from the zygote to the parent.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Ready(Vec<u8>),
    Started(Vec<Made>),
    Failed {
        errno: i32,
        message: String,
        made: Vec<Made>,
    },
}

impl Reply {
    fn encode(&self) -> Vec<u8> {
        let made = |w: Writer, m: &Made| w.u32(m.rank).i32(m.pid).u8(m.blank as u8);
        match self {
            Reply::Ready(body) => Writer::default().u8(READY).bytes(body).0,
            Reply::Started(list) => Writer::default().u8(STARTED).list(list, made).0,
            Reply::Failed {
                errno,
                message,
                made: list,
            } => {
                let w = Writer::default().u8(FAILED).i32(*errno);
                w.bytes(message.as_bytes()).list(list, made).0
            }
        }
    }

    fn decode(data: &[u8]) -> io::Result<Reply> {
        let mut r = Reader::new(data);
        let made = |r: &mut Reader<'_>| {
            Ok(Made {
                rank: r.u32()?,
                pid: r.i32()?,
                blank: r.u8()? != 0,
            })
        };
        match r.u8()? {
            READY => Ok(Reply::Ready(r.bytes()?)),
            STARTED => Ok(Reply::Started(r.list(made)?)),
            FAILED => Ok(Reply::Failed {
                errno: r.i32()?,
                message: String::from_utf8_lossy(&r.bytes()?).into_owned(),
                made: r.list(made)?,
            }),
            _ => Err(malformed()),
        }
    }
}

/// A message from the parent to the zygote.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Order {
    /// `batch` ranks from the start have report pipes in this message, after the payload
    /// and `shared` shared fds.
    Start {
        ranks: Vec<u32>,
        shared: u32,
        common: Vec<u8>,
        batch: u32,
    },
    /// The next `batch` ranks' report pipes.
    Batch { batch: u32 },
}

impl Order {
    fn encode(&self) -> Vec<u8> {
        match self {
            Order::Start {
                ranks,
                shared,
                common,
                batch,
            } => {
                let w = Writer::default().u8(START).list(ranks, |w, &r| w.u32(r));
                w.u32(*shared).bytes(common).u32(*batch).0
            }
            Order::Batch { batch } => Writer::default().u8(BATCH_MSG).u32(*batch).0,
        }
    }

    fn decode(data: &[u8]) -> io::Result<Order> {
        let mut r = Reader::new(data);
        match r.u8()? {
            START => Ok(Order::Start {
                ranks: r.list(|r| r.u32())?,
                shared: r.u32()?,
                common: r.bytes()?,
                batch: r.u32()?,
            }),
            BATCH_MSG => Ok(Order::Batch { batch: r.u32()? }),
            _ => Err(malformed()),
        }
    }
}

/// A notice from the zygote to the parent's supervisor about its blank children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// A blank was forked: watch it.
    Blank(i32),
    /// A blank was found dead and will never be handed out.
    Retired(i32),
}

impl Notice {
    pub fn encode(self) -> Vec<u8> {
        match self {
            Notice::Blank(pid) => Writer::default().u8(BLANK).i32(pid).0,
            Notice::Retired(pid) => Writer::default().u8(RETIRED).i32(pid).0,
        }
    }

    pub fn decode(data: &[u8]) -> Option<Notice> {
        let mut r = Reader::new(data);
        match (r.u8().ok()?, r.i32().ok()?) {
            (BLANK, pid) => Some(Notice::Blank(pid)),
            (RETIRED, pid) => Some(Notice::Retired(pid)),
            _ => None,
        }
    }
}

fn job_message(rank: u32, common: &[u8]) -> Vec<u8> {
    Writer::default().u8(JOB).u32(rank).bytes(common).0
}

// The child's side -----------------------------------------------------------------------

/// What a child of the zygote runs: handed to the embedding, in the child, by [`serve`].
#[derive(Debug)]
pub struct Job {
    pub rank: u32,
    /// The caller's environment, for the embedding to install.
    pub env: Vec<(Vec<u8>, Vec<u8>)>,
    pub label: Vec<u8>,
    /// The request's payload (a sealed memfd).
    pub payload: OwnedFd,
    /// The write end of this child's report pipe (close-on-exec).
    pub report: OwnedFd,
    /// Why the caller's attributes could not all be applied (the child reports it).
    pub error: Option<io::Error>,
}

impl Job {
    /// The whole payload.
    pub fn read_payload(&self) -> io::Result<Vec<u8>> {
        read_payload(&self.payload)
    }
}

/// The whole of a payload memfd.
pub fn read_payload(fd: &OwnedFd) -> io::Result<Vec<u8>> {
    let size = rustix::fs::fstat(fd)?.st_size as usize;
    channel::read_memfd(fd, size)
}

/// The fds a new child takes: the shared ones go to their target numbers, the payload and
/// report to free numbers; every other fd of the zygote is closed. Works on raw numbers: the
/// zygote's own fd owners have been forgotten in the child.
struct Parts {
    rank: u32,
    common: Common,
    payload: RawFd,
    shared: Vec<RawFd>,
    report: RawFd,
}

impl Parts {
    /// Takes the fds and attributes of the request. Every fd of the zygote but these is
    /// closed; the report pipe moves first, so that a later failure can be reported on it.
    fn become_child(self) -> Served {
        let mut all = vec![self.report, self.payload];
        all.extend(&self.shared);
        if close_all_but(&all).is_err() {
            return Served::Exit(SETUP_FAILED);
        }
        let Ok(report) = move_avoiding(self.report, &self.common.targets) else {
            return Served::Exit(SETUP_FAILED);
        };
        // SAFETY: `move_avoiding` made this fd for us alone.
        let report = unsafe { OwnedFd::from_raw_fd(report) };
        match self.into_job(report.as_raw_fd()) {
            Ok(job) => {
                std::mem::forget(report); // now owned by the job
                Served::Child(job)
            }
            Err(err) => {
                let text = format!("tether could not set up this process: {err}\n");
                let frame = crate::report::encode("OSError", text.as_bytes(), &[]);
                let _ = rustix::io::write(&report, &frame);
                Served::Exit(SETUP_FAILED)
            }
        }
    }

    /// Moves the payload to a free number and the shared fds to their targets, and applies
    /// the caller's attributes (a failure there is the job's to report).
    fn into_job(self, report: RawFd) -> io::Result<Job> {
        let Parts {
            rank,
            common,
            payload,
            shared,
            ..
        } = self;
        if shared.len() != common.targets.len() {
            return Err(malformed());
        }
        let payload = move_avoiding(payload, &common.targets)?;
        // SAFETY: `move_avoiding` made this fd for us alone.
        let payload = unsafe { OwnedFd::from_raw_fd(payload) };
        let moved = shared
            .iter()
            .map(|&fd| move_avoiding(fd, &common.targets))
            .collect::<io::Result<Vec<RawFd>>>()?;
        for (&fd, &target) in moved.iter().zip(&common.targets) {
            // SAFETY: dup2 onto a number this child chose; clears close-on-exec on the target.
            if unsafe { libc::dup2(fd, target) } < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `fd` is our temporary copy.
            unsafe { libc::close(fd) };
        }
        let error = common.attrs.apply().err();
        Ok(Job {
            rank,
            env: common.attrs.env,
            label: common.label,
            payload,
            // SAFETY: the caller hands over `report`, a fd of ours alone.
            report: unsafe { OwnedFd::from_raw_fd(report) },
            error,
        })
    }
}

/// Moves `fd` to the lowest free number outside `avoid` (close-on-exec), closing `fd`.
fn move_avoiding(fd: RawFd, avoid: &[i32]) -> io::Result<RawFd> {
    let new = dup_avoiding(fd, avoid)?;
    // SAFETY: the original is ours alone and has just been copied.
    unsafe { libc::close(fd) };
    Ok(new)
}

/// A close-on-exec copy of `fd` at the lowest free number that is not in `avoid`.
fn dup_avoiding(fd: RawFd, avoid: &[i32]) -> io::Result<RawFd> {
    let mut rejected = Vec::new();
    let found = loop {
        // SAFETY: F_DUPFD_CLOEXEC on an fd this process holds.
        let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if new < 0 {
            break Err(io::Error::last_os_error());
        }
        if !avoid.contains(&new) {
            break Ok(new);
        }
        rejected.push(new);
    };
    for fd in rejected {
        // SAFETY: copies made above, ours alone.
        unsafe { libc::close(fd) };
    }
    found
}

/// Closes every fd above 2 except `keep`.
fn close_all_but(keep: &[RawFd]) -> io::Result<()> {
    let mut keep = keep.to_vec();
    keep.sort_unstable();
    let mut low = 3u32;
    for fd in keep.into_iter().map(|fd| fd as u32).chain([u32::MAX]) {
        if fd > low {
            // SAFETY: close_range closes fds this process holds; nothing refers to them now.
            let rc = unsafe { libc::syscall(libc::SYS_close_range, low, fd - 1, 0u32) };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        low = low.max(fd.saturating_add(1));
    }
    Ok(())
}

/// A blank child: watched until a request takes it, it waits for its job on `channel`, and
/// exits quietly when the zygote goes away first.
fn blank_main(channel: Endpoint, parent: i32, zygote: u32) -> Served {
    if launch::setup_forked_child(parent, true).is_err() {
        return Served::Exit(SETUP_FAILED);
    }
    let raw = channel.as_fd().as_raw_fd();
    if close_all_but(&[raw]).is_err() {
        return Served::Exit(SETUP_FAILED);
    }
    let title = format!("tether blank of zygote {zygote} (ready to run a rank of pid {parent})");
    let _ = crate::title::set(&title, "tether-blank");
    let message = match channel.recv(None) {
        Ok(Recv::Message(m)) => m,
        _ => return Served::Exit(0),
    };
    let _ = channel.into_fd().into_raw_fd(); // closed by the fd placement
    let mut fds: Vec<RawFd> = message
        .fds
        .into_iter()
        .map(IntoRawFd::into_raw_fd)
        .collect();
    let mut r = Reader::new(&message.data);
    let job = (r.u8(), r.u32(), r.bytes());
    let (Ok(JOB), Ok(rank), Ok(common), true) = (job.0, job.1, job.2, fds.len() >= 2) else {
        return Served::Exit(SETUP_FAILED);
    };
    let Ok(common) = Common::decode(&common) else {
        return Served::Exit(SETUP_FAILED);
    };
    let report = fds.pop().unwrap_or(-1);
    let payload = fds.remove(0);
    let parts = Parts {
        rank,
        common,
        payload,
        shared: fds,
        report,
    };
    parts.become_child()
}

// The zygote's side ----------------------------------------------------------------------

/// What [`serve`] returns: only ever in a child, or when the zygote should exit.
#[derive(Debug)]
pub enum Served {
    /// In a new child: run this.
    Child(Job),
    /// Exit with this code: 0 when the parent closed the request channel (or a blank's
    /// zygote went away), non-zero in a child that could not be set up (its report says
    /// why when it could be written).
    Exit(i32),
}

/// The exit code of a child that could not be set up.
pub const SETUP_FAILED: i32 = 111;

/// The fork the embedding supplies: 0 in the child, the child's pid in the zygote. For a
/// Python zygote, [`clone_parent`] wrapped in `PyOS_BeforeFork`/`PyOS_AfterFork_*`.
pub type Fork<'a> = &'a mut dyn FnMut() -> io::Result<i32>;

/// A fork whose child is a child of this process's parent (`clone(CLONE_PARENT | SIGCHLD)`
/// with no new stack: the child goes on from a copy of this one). Returns 0 in the child and
/// the child's pid here.
///
/// # Safety
/// As for `fork`: the process must have a single thread (the zygote has), and the caller
/// does what its runtime needs around a fork.
pub unsafe fn clone_parent() -> io::Result<i32> {
    // SAFETY: the caller's promise above; a null stack makes clone behave like fork.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_PARENT | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(pid as i32)
}

struct Pending {
    ranks: Vec<u32>,
    common_raw: Vec<u8>,
    common: Common,
    payload: OwnedFd,
    shared: Vec<OwnedFd>,
    next: usize,
}

struct Server<'a> {
    request: Endpoint,
    notices: Endpoint,
    fork: Fork<'a>,
    target: usize,
    blanks: VecDeque<(i32, Endpoint)>,
    pending: Option<Pending>,
    /// Its memory still to collapse into huge pages, slice by slice while it is idle.
    collapser: Option<Collapser>,
    /// Set when a fork of the current request met the process limit: how many processes
    /// this zygote held idle then (itself and its blanks, which it dropped before trying
    /// once more).
    held_at_limit: Option<usize>,
}

enum Step {
    Continue,
    Exit,
    Blank(Endpoint),
    Rank(Parts),
}

const HUGE_PAGE: usize = 2 << 20;

/// Makes the zygote cheap to fork: its private anonymous memory (the heap and the arenas the
/// imports filled: hundreds of MiB with torch) is collapsed into 2 MiB pages, so that a
/// fork copies one page-table entry where it copied 512, and a child's exit frees as many
/// fewer (a fork of a zygote with torch drops from about 10 ms to about 2 ms). Future
/// allocations stay on small pages, so a child copies only the 4 KiB pages it writes. The
/// work is done in slices while the zygote is idle: a request never waits for more than one.
/// A kernel without `MADV_COLLAPSE` collapses nothing.
struct Collapser {
    /// Huge-page-aligned ranges still to collapse, last first.
    ranges: Vec<(usize, usize)>,
    collapsed: usize,
}

/// How much one slice collapses (tens of milliseconds of copying).
const COLLAPSE_SLICE: usize = 32 << 20;

impl Collapser {
    fn new() -> Collapser {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let mut ranges: Vec<(usize, usize)> = maps
            .lines()
            .filter_map(private_anonymous)
            .map(|(start, end)| {
                (
                    start.next_multiple_of(HUGE_PAGE),
                    end / HUGE_PAGE * HUGE_PAGE,
                )
            })
            .filter(|(from, to)| from < to)
            .collect();
        ranges.reverse();
        Collapser {
            ranges,
            collapsed: 0,
        }
    }

    /// Collapses up to one slice; returns whether anything is left.
    fn slice(&mut self) -> bool {
        let Some((from, to)) = self.ranges.pop() else {
            return false;
        };
        let end = to.min(from + COLLAPSE_SLICE);
        if end < to {
            self.ranges.push((end, to));
        }
        let (addr, len) = (from as *mut libc::c_void, end - from);
        // SAFETY: advice on whole huge pages inside one of this process's own private
        // anonymous mappings; collapsing keeps their contents, and no other thread runs.
        unsafe {
            libc::madvise(addr, len, libc::MADV_HUGEPAGE);
            if libc::madvise(addr, len, MADV_COLLAPSE) == 0 {
                self.collapsed += len;
            }
            libc::madvise(addr, len, libc::MADV_NOHUGEPAGE);
        }
        if self.ranges.is_empty() {
            let mib = self.collapsed >> 20;
            log::debug!(target: "tether::zygote", "collapsed {mib} MiB into huge pages");
        }
        !self.ranges.is_empty()
    }
}

/// `MADV_COLLAPSE` (Linux 6.1), which the libc crate may not name.
const MADV_COLLAPSE: libc::c_int = 25;

/// The range of a line of /proc/self/maps that is private, anonymous and writable (the
/// heap included, the stack not).
fn private_anonymous(line: &str) -> Option<(usize, usize)> {
    let mut fields = line.split_whitespace();
    let (range, perms, offset, device, inode) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    let name = fields.next().unwrap_or("");
    let anonymous = offset.trim_start_matches('0').is_empty() && device == "00:00" && inode == "0";
    if !(anonymous && perms == "rw-p" && (name.is_empty() || name == "[heap]")) {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    Some((
        usize::from_str_radix(start, 16).ok()?,
        usize::from_str_radix(end, 16).ok()?,
    ))
}

/// The zygote's loop: tells the parent `ready`, then serves requests from `request` and
/// keeps `blanks` children forked ahead (more when a request was larger, up to
/// [`MAX_BLANKS`]). Returns in each child it makes, and when the parent goes away.
pub fn serve(
    request: OwnedFd,
    notices: OwnedFd,
    parent: i32,
    ready: &[u8],
    blanks: usize,
    fork: Fork<'_>,
) -> io::Result<Served> {
    let zygote = std::process::id();
    let mut server = Server {
        request: Endpoint::from_fd(request),
        notices: Endpoint::from_fd(notices),
        fork,
        target: blanks.min(MAX_BLANKS),
        blanks: VecDeque::new(),
        pending: None,
        collapser: Some(Collapser::new()),
        held_at_limit: None,
    };
    server.reply(&Reply::Ready(ready.to_vec()))?;
    loop {
        match server.step()? {
            Step::Continue => {}
            Step::Exit => return Ok(Served::Exit(0)),
            Step::Blank(channel) => {
                // In the new blank: the zygote's fds are closed by number, never dropped.
                std::mem::forget(server);
                return Ok(blank_main(channel, parent, zygote));
            }
            Step::Rank(parts) => {
                std::mem::forget(server);
                if launch::setup_forked_child(parent, true).is_err() {
                    return Ok(Served::Exit(SETUP_FAILED));
                }
                return Ok(parts.become_child());
            }
        }
    }
}

impl Server<'_> {
    fn reply(&self, reply: &Reply) -> io::Result<()> {
        self.request.send(&reply.encode(), &[], None).map(drop)
    }

    fn step(&mut self) -> io::Result<Step> {
        let idle_work = self.collapser.is_some() || self.blanks.len() < self.target;
        if idle_work && !readable(&self.request, REPLENISH_DELAY)? {
            if let Some(collapser) = self.collapser.as_mut() {
                while collapser.slice() {
                    if readable(&self.request, Duration::ZERO)? {
                        return Ok(Step::Continue);
                    }
                }
                self.collapser = None;
            }
            if let Some(step) = self.replenish()? {
                return Ok(step);
            }
            return Ok(Step::Continue);
        }
        let message = match self.request.recv(None) {
            Ok(Recv::Message(m)) => m,
            Ok(Recv::Timeout) => return Ok(Step::Continue),
            Ok(Recv::Closed) => return Ok(Step::Exit),
            Err(err) => {
                // The message is lost (its fds did not fit): the parent waits for a reply.
                self.pending = None;
                self.fail(&err, "cannot receive a request", Vec::new())?;
                return Ok(Step::Continue);
            }
        };
        let mut fds = message.fds;
        match Order::decode(&message.data) {
            Ok(Order::Start {
                ranks,
                shared,
                common,
                batch,
            }) => self.start(ranks, shared, common, batch, &mut fds),
            Ok(Order::Batch { batch }) => self.batch(batch, &mut fds),
            Err(err) => {
                self.fail(&err, "cannot read a request", Vec::new())?;
                Ok(Step::Continue)
            }
        }
    }

    fn start(
        &mut self,
        ranks: Vec<u32>,
        shared: u32,
        common_raw: Vec<u8>,
        batch: u32,
        fds: &mut Vec<OwnedFd>,
    ) -> io::Result<Step> {
        self.pending = None;
        self.held_at_limit = None;
        let expected = 1 + shared as usize + batch as usize;
        let common = match Common::decode(&common_raw) {
            Ok(common) if fds.len() == expected => common,
            Ok(_) => {
                self.fail(
                    &malformed(),
                    "a request whose fds do not match it",
                    Vec::new(),
                )?;
                return Ok(Step::Continue);
            }
            Err(err) => {
                self.fail(&err, "cannot read a request", Vec::new())?;
                return Ok(Step::Continue);
            }
        };
        self.target = self.target.max(ranks.len()).min(MAX_BLANKS);
        let reports = fds.split_off(1 + shared as usize);
        let shared_fds = fds.split_off(1);
        let payload = fds.remove(0);
        self.pending = Some(Pending {
            ranks,
            common_raw,
            common,
            payload,
            shared: shared_fds,
            next: 0,
        });
        self.run_batch(reports)
    }

    fn batch(&mut self, batch: u32, fds: &mut Vec<OwnedFd>) -> io::Result<Step> {
        if self.pending.is_none() || fds.len() != batch as usize {
            self.pending = None;
            self.fail(&malformed(), "a batch without its request", Vec::new())?;
            return Ok(Step::Continue);
        }
        self.run_batch(std::mem::take(fds))
    }

    /// Starts one child per report pipe, for the next ranks of the pending request.
    fn run_batch(&mut self, reports: Vec<OwnedFd>) -> io::Result<Step> {
        let mut made = Vec::with_capacity(reports.len());
        let mut reports = reports.into_iter();
        while let Some(report) = reports.next() {
            let Some(pending) = self.pending.as_mut() else {
                break;
            };
            let Some(&rank) = pending.ranks.get(pending.next) else {
                self.pending = None;
                self.fail(&malformed(), "more ranks than asked for", made)?;
                return Ok(Step::Continue);
            };
            pending.next += 1;
            match self.make(rank, report) {
                Ok(Ok(child)) => made.push(child),
                Ok(Err(parts)) => {
                    // In the new child: forget the rest of this batch's pipes (closed by
                    // number when its fds are placed).
                    reports.for_each(std::mem::forget);
                    return Ok(Step::Rank(parts));
                }
                Err(err) => {
                    self.pending = None;
                    let what = match self.held_at_limit.take() {
                        Some(1) => format!(
                            "cannot fork rank {rank}, nor on a second try; tether's idle \
                             processes held 1 process of the limit (this zygote, which had no \
                             blank left and keeps none ready until the next start)"
                        ),
                        Some(held) => format!(
                            "cannot fork rank {rank}, nor on a second try once it had given \
                             back the {} blank(s) it kept ready; tether's idle processes held \
                             {held} processes of the limit (this zygote and those blanks; it \
                             keeps none ready until the next start)",
                            held - 1
                        ),
                        None => format!("cannot fork rank {rank}"),
                    };
                    self.fail(&err, &what, made)?;
                    return Ok(Step::Continue);
                }
            }
        }
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.next == p.ranks.len())
        {
            self.pending = None;
        }
        self.reply(&Reply::Started(made))?;
        Ok(Step::Continue)
    }

    /// Starts the child for `rank`: a blank takes it, or a fork. `Ok(Err(parts))` in the
    /// forked child itself.
    fn make(&mut self, rank: u32, report: OwnedFd) -> io::Result<Result<Made, Parts>> {
        if self.pending.is_none() {
            return Err(malformed());
        }
        if let Some(pid) = self.activate(rank, &report)? {
            return Ok(Ok(Made {
                rank,
                pid,
                blank: true,
            }));
        }
        let pid = match (self.fork)() {
            Err(err) if err.raw_os_error() == Some(libc::EAGAIN) => {
                // The process limit: give back what is held idle, then once more.
                self.held_at_limit = Some(1 + self.blanks.len());
                self.drop_blanks()?;
                (self.fork)()?
            }
            made => made?,
        };
        if pid != 0 {
            return Ok(Ok(Made {
                rank,
                pid,
                blank: false,
            }));
        }
        let Some(pending) = self.pending.as_ref() else {
            return Err(malformed());
        };
        Ok(Err(Parts {
            rank,
            common: pending.common.clone(),
            payload: pending.payload.as_raw_fd(),
            shared: pending.shared.iter().map(|fd| fd.as_raw_fd()).collect(),
            report: report.into_raw_fd(),
        }))
    }

    /// Hands `rank` to a waiting blank; `None` when none is left alive.
    fn activate(&mut self, rank: u32, report: &OwnedFd) -> io::Result<Option<i32>> {
        let Some(pending) = self.pending.as_ref() else {
            return Ok(None);
        };
        let message = job_message(rank, &pending.common_raw);
        let mut fds: Vec<BorrowedFd<'_>> = vec![pending.payload.as_fd()];
        fds.extend(pending.shared.iter().map(|fd| fd.as_fd()));
        fds.push(report.as_fd());
        while let Some((pid, channel)) = self.blanks.pop_front() {
            match channel.send(&message, &fds, Some(Duration::from_secs(1))) {
                Ok(true) => return Ok(Some(pid)),
                Ok(false) | Err(_) => {
                    // Dead (or stuck): never handed out; the parent's supervisor reaps it.
                    signal_tree(pid, libc::SIGKILL);
                    self.notify(Notice::Retired(pid))?;
                }
            }
        }
        Ok(None)
    }

    /// Kills every blank kept ready (the parent's supervisor reaps them) and keeps none
    /// until the next request; returns once they are gone (reaped), or after a second.
    fn drop_blanks(&mut self) -> io::Result<()> {
        self.target = 0;
        let dropped: Vec<i32> = self.blanks.drain(..).map(|(pid, _)| pid).collect();
        for &pid in &dropped {
            signal_tree(pid, libc::SIGKILL);
            self.notify(Notice::Retired(pid))?;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while std::time::Instant::now() < deadline
            && dropped
                .iter()
                .any(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// Forks blanks up to the target, stopping when a request is waiting, and never more
    /// than half of what the process limits leave (see [`crate::limits`]), so that blanks
    /// kept idle never take the processes and threads the user's program needs. Running out
    /// of processes or fds here only stops the replenishing: the target drops to what
    /// exists.
    fn replenish(&mut self) -> io::Result<Option<Step>> {
        if let Some(room) = crate::limits::process_room() {
            self.target = self.target.min(self.blanks.len() + room / 2);
        }
        while self.blanks.len() < self.target && !readable(&self.request, Duration::ZERO)? {
            let made = Endpoint::pair().and_then(|pair| Ok(((self.fork)()?, pair)));
            let Ok((pid, (ours, theirs))) = made else {
                self.target = self.blanks.len();
                return Ok(None);
            };
            if pid == 0 {
                drop(ours);
                return Ok(Some(Step::Blank(theirs)));
            }
            drop(theirs);
            log::debug!(target: "tether::zygote", "forked blank pid {pid}");
            self.notify(Notice::Blank(pid))?;
            self.blanks.push_back((pid, ours));
        }
        Ok(None)
    }

    fn notify(&self, notice: Notice) -> io::Result<()> {
        self.notices.send(&notice.encode(), &[], None).map(drop)
    }

    /// Replies that the request failed: `what` failed with `err` (an errno, or a message
    /// when there is none).
    fn fail(&self, err: &io::Error, what: &str, made: Vec<Made>) -> io::Result<()> {
        let (errno, message) = match err.raw_os_error() {
            Some(errno) => (errno, what.to_string()),
            None => (0, format!("{what}: {err}")),
        };
        self.reply(&Reply::Failed {
            errno,
            message,
            made,
        })
    }
}

fn readable(endpoint: &Endpoint, wait: Duration) -> io::Result<bool> {
    let timeout = Timespec {
        tv_sec: wait.as_secs() as i64,
        tv_nsec: wait.subsec_nanos() as i64,
    };
    let mut fds = [PollFd::new(endpoint, PollFlags::IN)];
    loop {
        match poll(&mut fds, Some(&timeout)) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

// The parent's side ----------------------------------------------------------------------

/// What a start asks of the zygote.
#[derive(Debug)]
pub struct ForkRequest<'a> {
    pub ranks: &'a [u32],
    /// Fds every child inherits, and the number each gets in the child.
    pub shared: &'a [(BorrowedFd<'a>, i32)],
    /// The prepared work, opaque here (read by the child with [`Job::read_payload`]).
    pub payload: &'a [u8],
    /// The caller's attributes, read when the request is made.
    pub attrs: Attributes,
    pub label: Vec<u8>,
}

/// The parent's handle on a running zygote.
#[derive(Debug)]
pub struct Zygote {
    process: Group,
    request: Endpoint,
    reserve: Reserve,
    /// The attributes the zygote was started with (its resource limits bound its children's).
    started_with: Attributes,
    ready: Option<Vec<u8>>,
    broken: Option<String>,
    vanished: bool,
}

impl Zygote {
    /// Starts the zygote process from `spec` (its program calls [`serve`] with the fds named
    /// by [`FDS_ENV`]). Returns at once: the zygote gets ready in the background.
    pub fn start(mut spec: LaunchSpec) -> Result<Zygote, Error> {
        let started_with = Attributes::of_caller()?;
        let (request, theirs) = Endpoint::pair()?;
        let (notices, their_notices) = Endpoint::pair()?;
        let fds = [
            theirs.as_fd().as_raw_fd(),
            their_notices.as_fd().as_raw_fd(),
        ];
        spec.env.push((
            FDS_ENV.into(),
            OsString::from(format!("{},{}", fds[0], fds[1])),
        ));
        spec.keep_fds.extend(fds);
        spec.report = true;
        let process = Group::new();
        process.launch(vec![spec])?;
        drop((theirs, their_notices));
        let reserve = Reserve::new();
        log::info!(target: "tether::zygote", "started the zygote: pid {}", process.pid(0).unwrap_or(0));
        let zygote = Zygote {
            process,
            request,
            reserve,
            started_with,
            ready: None,
            broken: None,
            vanished: false,
        };
        zygote.reserve.watch(notices)?;
        Ok(zygote)
    }

    pub fn pid(&self) -> i32 {
        self.process.pid(0).unwrap_or(0)
    }

    /// The zygote's exit, once it has exited.
    pub fn exit(&self) -> Option<Exit> {
        self.process.exit(0)
    }

    /// The pids of the blank children waiting.
    pub fn blanks(&self) -> Vec<i32> {
        self.reserve.pids()
    }

    /// Whether it can serve a request from a caller with `attrs`: running, answering, and
    /// started with resource limits no lower than the caller's.
    pub fn usable(&self, attrs: &Attributes) -> bool {
        self.broken.is_none() && self.exit().is_none() && self.started_with.limits_allow(attrs)
    }

    /// Why it is unusable, if it failed.
    pub fn broken(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// Waits until the zygote is ready (its imports done); returns what it said then.
    pub fn wait_ready(&mut self) -> Result<&[u8], Error> {
        if self.ready.is_none() {
            match self.reply(None)? {
                Reply::Ready(body) => {
                    log::info!(target: "tether::zygote", "zygote pid {} is ready", self.pid());
                    self.ready = Some(body)
                }
                _ => return Err(self.fail("sent an unexpected message")),
            }
        }
        Ok(self.ready.as_deref().unwrap_or_default())
    }

    /// Starts one child per rank in `group` (member n runs `ranks[n]`). On an error, every
    /// child of the call is stopped and reaped, every fd made for it closed.
    pub fn fork(&mut self, request: &ForkRequest<'_>, group: &Group) -> Result<Vec<usize>, Error> {
        let first = group.len();
        let result = self.fork_batches(request, group);
        if result.is_err() {
            let started: Vec<usize> = (first..group.len()).collect();
            for &i in &started {
                let _ = group.signal(i, libc::SIGKILL);
            }
            group.wait(Some(&started), WaitFor::AllExited, None);
        }
        result
    }

    fn fork_batches(
        &mut self,
        request: &ForkRequest<'_>,
        group: &Group,
    ) -> Result<Vec<usize>, Error> {
        self.wait_ready()?;
        let payload = channel::payload_memfd(request.payload)
            .map_err(|e| Error::resource("cannot hold the payload for the zygote", e))?;
        let common = Common {
            targets: request.shared.iter().map(|&(_, t)| t).collect(),
            attrs: request.attrs.clone(),
            label: request.label.clone(),
        }
        .encode();
        let mut indices = Vec::with_capacity(request.ranks.len());
        for (n, ranks) in request.ranks.chunks(BATCH).enumerate() {
            let pipes = report_pipes(ranks)?;
            let order = match n {
                0 => Order::Start {
                    ranks: request.ranks.to_vec(),
                    shared: request.shared.len() as u32,
                    common: common.clone(),
                    batch: ranks.len() as u32,
                },
                _ => Order::Batch {
                    batch: ranks.len() as u32,
                },
            };
            let mut fds: Vec<BorrowedFd<'_>> = Vec::new();
            if n == 0 {
                fds.push(payload.as_fd());
                fds.extend(request.shared.iter().map(|&(fd, _)| fd));
            }
            fds.extend(pipes.iter().map(|(_, w)| w.as_fd()));
            self.send(&order.encode(), &fds)?;
            drop(fds);
            let reads = pipes.into_iter().map(|(r, _)| r).collect();
            indices.extend(self.take_batch(ranks, reads, group)?);
        }
        Ok(indices)
    }

    /// Reads the zygote's answer for a batch and adopts the children it made.
    fn take_batch(
        &mut self,
        ranks: &[u32],
        reads: Vec<OwnedFd>,
        group: &Group,
    ) -> Result<Vec<usize>, Error> {
        let reply = self.reply(Some(ANSWER_TIMEOUT))?;
        let (made, error) = match reply {
            Reply::Started(made) => (made, None),
            Reply::Failed {
                errno,
                message,
                made,
            } => {
                let source = io::Error::from_raw_os_error(errno);
                let what = format!("the tether zygote (pid {}): {message}", self.pid());
                let err = match errno {
                    0 => Error::Zygote(what),
                    _ => Error::Resource { what, source },
                };
                (made, Some(err))
            }
            Reply::Ready(_) => return Err(self.fail("sent an unexpected message")),
        };
        let mut reads: Vec<Option<OwnedFd>> = reads.into_iter().map(Some).collect();
        let children = made
            .iter()
            .map(|m| Adoption {
                pid: m.pid,
                report: ranks
                    .iter()
                    .position(|&r| r == m.rank)
                    .and_then(|i| reads[i].take()),
                reserve: m.blank.then(|| self.reserve.clone()),
            })
            .collect();
        let indices = group.adopt_all(children)?;
        match error {
            None => Ok(indices),
            Some(err) => Err(err),
        }
    }

    fn send(&mut self, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), Error> {
        let mut silent = Duration::ZERO;
        loop {
            match self.request.send(data, fds, Some(CHECK_EVERY)) {
                Ok(true) => return Ok(()),
                Ok(false) => self.check(&mut silent, Some(ANSWER_TIMEOUT))?,
                Err(err) if matches!(err.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)) => {
                    return Err(self.fail("went away"))
                }
                Err(err) => {
                    return Err(Error::resource("cannot send a request to the zygote", err))
                }
            }
        }
    }

    /// The next reply, waiting while the zygote lives and answers within `patience` (for
    /// ever while it runs when `None`).
    fn reply(&mut self, patience: Option<Duration>) -> Result<Reply, Error> {
        let mut silent = Duration::ZERO;
        loop {
            match self.request.recv(Some(CHECK_EVERY)) {
                Ok(Recv::Message(m)) => {
                    return Reply::decode(&m.data).map_err(|_| self.fail("sent a malformed reply"))
                }
                Ok(Recv::Timeout) => self.check(&mut silent, patience)?,
                Ok(Recv::Closed) => return Err(self.fail("went away")),
                // A zygote that died with a message of ours unread resets the channel.
                Err(err) if err.raw_os_error() == Some(libc::ECONNRESET) => {
                    return Err(self.fail("went away"))
                }
                Err(err) => return Err(Error::resource("cannot read the zygote's reply", err)),
            }
        }
    }

    /// After a silent slice: fails when the zygote died, is stopped, or was silent too long.
    fn check(&mut self, silent: &mut Duration, patience: Option<Duration>) -> Result<(), Error> {
        *silent += CHECK_EVERY;
        if self.exit().is_some() {
            return Err(self.fail("went away"));
        }
        let state = process_state(self.pid());
        if matches!(state, Some('T') | Some('t')) && *silent >= STOPPED_PATIENCE {
            return Err(self.fail(&format!("is stopped (state {})", describe_state(state))));
        }
        if patience.is_some_and(|p| *silent >= p) {
            let what = format!(
                "has not answered for {} s (state {})",
                silent.as_secs(),
                describe_state(state)
            );
            return Err(self.fail(&what));
        }
        Ok(())
    }

    /// Marks the zygote broken and stops it (its blanks exit with it); the error says why.
    /// `why` is "went away" when its end of the channel closed: it died on its own, and the
    /// error shows what it reported.
    fn fail(&mut self, why: &str) -> Error {
        let pid = self.pid();
        let one_second = Some(Duration::from_secs(1));
        self.vanished =
            why == "went away" && self.process.wait(None, WaitFor::AllExited, one_second);
        self.process.terminate(libc::SIGKILL, Duration::ZERO);
        // Its blanks would only exit once they noticed: nothing of it is left running.
        self.reserve.stop_all(Duration::from_secs(1));
        let mut message = format!("the tether zygote (pid {pid}) {why}");
        if let (true, Some(exit)) = (self.vanished, self.exit()) {
            message = format!("the tether zygote (pid {pid}) died with {}", exit.status);
            let report = self
                .process
                .with_member(0, |m| crate::report::decode(m.report()));
            if let Some(Some(report)) = report {
                message += &format!(":\n{}", String::from_utf8_lossy(&report.text));
            }
        }
        self.broken = Some(message.clone());
        Error::Zygote(message)
    }

    /// Whether it died on its own (rather than being stopped for not answering).
    pub fn vanished(&self) -> bool {
        self.vanished
    }

    /// Stops the zygote: it exits at the end of its request channel, and its blanks at the
    /// end of theirs; after `grace`, SIGKILL.
    pub fn close(&mut self, grace: Duration) {
        log::info!(target: "tether::zygote", "closing zygote pid {}", self.pid());
        let _ = rustix::net::shutdown(&self.request, rustix::net::Shutdown::Write);
        if !self.process.wait(None, WaitFor::AllExited, Some(grace)) {
            self.process.terminate(libc::SIGKILL, Duration::ZERO);
        }
        // Idle, they exit at the end of their channels; none is left once this returns.
        self.reserve.stop_all(grace.max(Duration::from_secs(1)));
        self.broken
            .get_or_insert_with(|| "the tether zygote was closed".into());
    }
}

fn report_pipes(ranks: &[u32]) -> Result<Vec<(OwnedFd, OwnedFd)>, Error> {
    ranks
        .iter()
        .map(|rank| {
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| {
                Error::resource(format!("cannot make the report pipe of rank {rank}"), e)
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_parts_survive_the_wire() {
        let common = Common {
            targets: vec![0, 1, 2, 17],
            attrs: Attributes {
                umask: 0o077,
                rlimits: vec![(7, 64, 1024), (4, 0, u64::MAX)],
                thread: ThreadAttributes {
                    affinity: vec![1, 0, 0, 0],
                    nice: 5,
                },
                cwd: b"/tmp/x".to_vec(),
                env: vec![(b"A".to_vec(), b"1".to_vec()), (b"B".to_vec(), Vec::new())],
            },
            label: b"train".to_vec(),
        };
        assert_eq!(Common::decode(&common.encode()).unwrap(), common);
    }

    #[test]
    fn orders_and_replies_survive_the_wire() {
        let start = Order::Start {
            ranks: (0..1000).collect(),
            shared: 5,
            common: vec![9; 300],
            batch: 32,
        };
        assert_eq!(Order::decode(&start.encode()).unwrap(), start);
        let batch = Order::Batch { batch: 7 };
        assert_eq!(Order::decode(&batch.encode()).unwrap(), batch);
        let made = vec![
            Made {
                rank: 3,
                pid: 1234,
                blank: true,
            },
            Made {
                rank: 4,
                pid: 1235,
                blank: false,
            },
        ];
        for reply in [
            Reply::Ready(b"ok".to_vec()),
            Reply::Started(made.clone()),
            Reply::Failed {
                errno: libc::EAGAIN,
                message: "cannot fork rank 5".into(),
                made,
            },
        ] {
            assert_eq!(Reply::decode(&reply.encode()).unwrap(), reply);
        }
        for notice in [Notice::Blank(42), Notice::Retired(43)] {
            assert_eq!(Notice::decode(&notice.encode()), Some(notice));
        }
    }

    #[test]
    fn truncated_or_unknown_messages_are_errors() {
        let start = Order::Start {
            ranks: vec![1, 2],
            shared: 1,
            common: vec![1, 2, 3],
            batch: 2,
        }
        .encode();
        for cut in 0..start.len() {
            assert!(Order::decode(&start[..cut]).is_err(), "cut at {cut}");
        }
        assert!(Order::decode(&[99]).is_err());
        assert!(Reply::decode(&[]).is_err());
        // A list length beyond the message is refused before anything is allocated.
        let huge = Writer::default().u8(START).u32(u32::MAX).0;
        assert!(Order::decode(&huge).is_err());
        assert_eq!(Notice::decode(&[BLANK]), None);
    }

    #[test]
    fn private_anonymous_mappings_are_found() {
        let heap = "55d0-56d0 rw-p 00000000 00:00 0                          [heap]";
        assert_eq!(private_anonymous(heap), Some((0x55d0, 0x56d0)));
        assert_eq!(
            private_anonymous("10-20 rw-p 00000000 00:00 0 "),
            Some((0x10, 0x20))
        );
        for other in [
            "10-20 r--p 00000000 00:00 0",
            "10-20 rw-s 00000000 00:00 0",
            "10-20 rw-p 00001000 08:01 1234 /usr/lib/libc.so",
            "10-20 rw-p 00000000 00:00 0 [stack]",
        ] {
            assert_eq!(private_anonymous(other), None, "{other}");
        }
    }

    #[test]
    fn states_are_described() {
        assert_eq!(describe_state(Some('T')), "T: stopped");
        assert!(matches!(
            process_state(std::process::id() as i32),
            Some('R') | Some('S')
        ));
    }
}
