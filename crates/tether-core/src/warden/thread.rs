//! The warden of this process: made on first use (anew in a forked child, whose copy of
//! its parent's has no thread), it starts the thread that runs the event loop, and hands
//! that thread each request, waiting for the reply. Launching and adopting members of a
//! [`Group`] go through here.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::mpsc;

use crate::blanks::reserve::Reserve;
use crate::channel::Endpoint;
use crate::error::Error;
use crate::group::{Group, WaitFor};
use crate::launch::LaunchSpec;
use crate::stacks;
use crate::warden::events::{Loop, STACKS};
use crate::warden::request::{Added, Adoption, Inbox, Request};

/// The per-process warden. It records the pid that made it, so that a process forked
/// from this one (whose copy of the warden has no thread) makes its own.
struct Warden {
    pid: u32,
    inbox: Inbox,
    /// Set when its thread could not be started: requests are refused (their callers get
    /// `WardenGone`) and the next call makes a new warden.
    failed: AtomicBool,
}

static CURRENT: AtomicPtr<Warden> = AtomicPtr::new(std::ptr::null_mut());

fn warden() -> Result<&'static Warden, Error> {
    let pid = std::process::id();
    let current = CURRENT.load(Ordering::Acquire);
    // SAFETY: a non-null pointer in CURRENT comes from `Box::into_raw` and is never freed.
    if let Some(sup) = unsafe { current.as_ref() } {
        if sup.pid == pid && !sup.failed.load(Ordering::Acquire) {
            return Ok(sup);
        }
    }
    let fresh = Box::into_raw(Box::new(Warden {
        pid,
        inbox: Inbox::new()?,
        failed: AtomicBool::new(false),
    }));
    match CURRENT.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            // SAFETY: `fresh` was just leaked into CURRENT and lives for ever.
            let sup: &'static Warden = unsafe { &*fresh };
            match sup.start_thread() {
                Ok(()) => Ok(sup),
                Err(err) => {
                    sup.failed.store(true, Ordering::Release);
                    sup.refuse_queued();
                    Err(err)
                }
            }
        }
        Err(_) => {
            // Another thread made one first: use it.
            // SAFETY: `fresh` was never shared; reclaim it.
            drop(unsafe { Box::from_raw(fresh) });
            warden()
        }
    }
}

impl Warden {
    fn start_thread(&'static self) -> Result<(), Error> {
        let stacks = stacks::channel()?;
        self.inbox.poller.add(STACKS, stacks.receiver())?;
        let inbox = &self.inbox;
        std::thread::Builder::new()
            .name("tether-warden".into())
            .spawn(move || Loop::new(inbox, stacks).run())?;
        Ok(())
    }

    /// Drops the queued requests: their callers' replies fail with `WardenGone`.
    fn refuse_queued(&self) {
        drop(self.inbox.take());
    }

    fn send(&self, request: Request) -> Result<(), Error> {
        self.inbox.queue().push(request);
        if self.failed.load(Ordering::Acquire) {
            self.refuse_queued();
            return Err(Error::WardenGone);
        }
        self.inbox.poller.wake()?;
        Ok(())
    }
}

/// Sends a request to the warden thread and waits for its reply.
fn call<T>(
    request: impl FnOnce(mpsc::SyncSender<Result<T, Error>>) -> Request,
) -> Result<T, Error> {
    let (reply, rx) = mpsc::sync_channel(1);
    warden()?.send(request(reply))?;
    rx.recv().map_err(|_| Error::WardenGone)?
}

/// On a failed launch or adoption, waits until the children of the call that did start
/// (already sent SIGKILL by the warden) are reaped.
fn settle(group: &Group, result: Result<Added, Error>) -> Result<Vec<usize>, Error> {
    let added = result?;
    match added.error {
        None => Ok(added.indices),
        Some(err) => {
            group.wait(Some(&added.indices), WaitFor::AllExited, None);
            Err(err)
        }
    }
}

/// Starting members: the warden thread does it, for the parent-death signal's sake
/// (see [`crate::warden`]).
impl Group {
    /// Starts one child per spec, all from the warden thread, and returns their indices
    /// in this group. On an error, the children of this call that did start are killed and
    /// reaped before this returns.
    pub fn launch(&self, specs: Vec<LaunchSpec>) -> Result<Vec<usize>, Error> {
        let group = self.inner.clone();
        let result = call(|reply| Request::Launch {
            group,
            specs,
            reply,
        });
        settle(self, result)
    }

    /// Takes on children of this process started some other way (a fork, the zygote), with
    /// the read ends of their report pipes, in one call to the warden. On an error,
    /// every child of the call is killed and reaped before this returns.
    pub fn adopt_all(&self, children: Vec<Adoption>) -> Result<Vec<usize>, Error> {
        let group = self.inner.clone();
        let result = call(|reply| Request::Adopt {
            group,
            children,
            reply,
        });
        settle(self, result)
    }

    /// Takes on one child this process forked itself; see [`Group::adopt_all`].
    pub fn adopt(&self, pid: i32, report: Option<std::os::fd::OwnedFd>) -> Result<usize, Error> {
        let indices = self.adopt_all(vec![Adoption::forked(pid, report)])?;
        Ok(indices[0])
    }
}

/// Has the warden read `notices` (a zygote's announcements of its blank children) as
/// they arrive, keeping what it learns in `reserve`.
pub(crate) fn follow_blanks(reserve: &Reserve, notices: Endpoint) -> Result<(), Error> {
    let reserve = reserve.clone();
    call(|reply| Request::Follow {
        reserve,
        notices,
        reply,
    })
}
