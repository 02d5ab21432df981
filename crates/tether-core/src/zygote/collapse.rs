//! Memory collapse: the zygote's memory moved into huge pages while it is idle, so that a
//! fork of it is cheap.

const HUGE_PAGE: usize = 2 << 20;

/// Makes the zygote cheap to fork: its private anonymous memory (the heap and the arenas the
/// imports filled: hundreds of MiB with torch) is collapsed into 2 MiB pages, so that a
/// fork copies one page-table entry where it copied 512, and a child's exit frees as many
/// fewer (a fork of a zygote with torch drops from about 10 ms to about 2 ms). Future
/// allocations stay on small pages, so a child copies only the 4 KiB pages it writes. The
/// work is done in slices while the zygote is idle: a request never waits for more than one.
/// A kernel without `MADV_COLLAPSE` collapses nothing.
pub(super) struct Collapser {
    /// Huge-page-aligned ranges still to collapse, last first.
    ranges: Vec<(usize, usize)>,
    collapsed: usize,
}

/// How much one slice collapses (tens of milliseconds of copying).
const COLLAPSE_SLICE: usize = 32 << 20;

impl Collapser {
    pub(super) fn new() -> Collapser {
        let mut ranges: Vec<(usize, usize)> = crate::proc::private_anonymous_mappings()
            .into_iter()
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
    pub(super) fn slice(&mut self) -> bool {
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
