//! What the watch sees of a rank: /proc's counters of its main thread, its place and what it
//! does, and one look at every rank.

use std::time::Duration;

use tether_core::stacks::Whereabouts;

/// What /proc says of a rank's main thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub state: char,
    pub cpu_ns: u64,
    /// How many times it was put on a CPU.
    pub runs: u64,
    /// The CPU time of its children.
    pub children_ns: u64,
}

/// Where a rank's main thread is: the user's innermost frame, and the call it waits in.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Place {
    pub file: String,
    pub line: String,
    pub function: String,
    pub callee: Option<String>,
}

impl Place {
    pub fn of(at: Whereabouts) -> Place {
        Place {
            file: at.file,
            line: at.line,
            function: at.function,
            callee: at.callee,
        }
    }
}

/// What a rank does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Doing {
    Collective,
    /// In torch.distributed's start (`init_process_group`): waiting for the others to start.
    Starting,
    DataLoading,
    Lock,
    Asleep,
    /// Busy at this CPU percentage.
    Busy(u32),
    Stopped,
    Waiting,
    Exited,
}

/// One look at every rank (by local rank): when it began and ended, and what it saw.
#[derive(Debug, Clone, Default)]
pub struct Look {
    pub before_at: Duration,
    pub after_at: Duration,
    /// `None`: the rank has exited.
    pub pids: Vec<Option<i32>>,
    pub before: Vec<Option<Counters>>,
    pub after: Vec<Option<Counters>>,
    /// Where it is and what it does, when it answered.
    pub places: Vec<Option<(Place, Doing)>>,
}
