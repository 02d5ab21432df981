//! The summary that ends every block of stacks: the ranks grouped by where their main
//! thread is, and the ranks that are not where most others are named.
//!
//! Where a rank is, read from its Python stack (faulthandler's format, most recent call
//! first), main thread only (the thread Python's handler runs in, `Current thread`, or the
//! one faulthandler dumps, `Stack`):
//!
//! - its *place* is the innermost frame of the user's code: a frame whose file is none of
//!   the standard library's (`<frozen ...>`, a file under `lib/python3.X/` that is not in
//!   `site-packages` or `dist-packages`), no installed package's (`site-packages`,
//!   `dist-packages`), and not tether's own (its `tether` package, wherever it is). A
//!   stack with no such frame is placed at its innermost frame;
//! - the *call it waits in* is the function of the next frame inward from that one (for a
//!   collective, torch.distributed's `all_reduce`), past a decorator's wrapper of the same
//!   file set; a place with no frame inward (the user's line is in C code, as in
//!   `time.sleep`) has none.
//!
//! Ranks at the same file, line and call form a group. A group with more than half of the
//! ranks asked is where most ranks are; every other rank is named as elsewhere (or as one
//! that did not answer, or has exited). With no such group the summary says so and lists
//! every group. Files are shown by their name alone, or by their whole path where two
//! places' names are the same.

use std::collections::BTreeMap;
use std::path::Path;

use super::answer::{Answer, Reply};

/// How many places the summary lists before it counts the rest.
const MOST_PLACES: usize = 8;

/// One frame of a stack.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Frame {
    file: String,
    line: String,
    function: String,
}

/// Where a rank is.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Spot {
    /// At `frame`, waiting in the call `callee` when one is seen.
    At {
        frame: Frame,
        callee: Option<String>,
    },
    /// Its main thread shows no Python frame.
    NoFrame,
    /// It did not answer (its pid).
    Silent,
    /// It has exited.
    Exited,
}

/// The summary of `ranks` (each rank's number and its answer), as one sentence: "ranks 0-6
/// wait in all_reduce called from train.py:57; rank 7 is elsewhere: data.py:31 in
/// __getitem__". Empty when there is no rank.
pub fn summary(ranks: &[(usize, &Answer)]) -> String {
    if ranks.is_empty() {
        return String::new();
    }
    let mut groups: BTreeMap<Spot, Vec<(usize, i32)>> = BTreeMap::new();
    for (rank, answer) in ranks {
        groups
            .entry(spot(answer))
            .or_default()
            .push((*rank, answer.pid));
    }
    let mut groups: Vec<(Spot, Vec<(usize, i32)>)> = groups.into_iter().collect();
    for (_, members) in groups.iter_mut() {
        members.sort_unstable();
    }
    // The biggest first, then by their lowest rank.
    groups.sort_by_key(|(spot, members)| {
        (
            std::cmp::Reverse(members.len()),
            !matches!(spot, Spot::At { .. }),
            members[0].0,
        )
    });
    let names = Names::of(&groups);
    let total = ranks.len();
    let (head, rest) = groups.split_at(1);
    let (spot, members) = &head[0];
    let majority = matches!(spot, Spot::At { .. }) && members.len() * 2 > total;
    let mut parts = Vec::new();
    if majority {
        parts.push(names.group(spot, members));
        if rest.is_empty() {
            parts.push(match total {
                1 => "it is the only rank".to_string(),
                _ => "none is elsewhere".to_string(),
            });
        }
        for (spot, members) in rest.iter().take(MOST_PLACES) {
            parts.push(names.elsewhere(spot, members));
        }
        parts.extend(more(&rest[rest.len().min(MOST_PLACES)..]));
    } else {
        parts.push("no place holds most of the ranks".to_string());
        for (spot, members) in groups.iter().take(MOST_PLACES) {
            parts.push(names.group(spot, members));
        }
        parts.extend(more(&groups[groups.len().min(MOST_PLACES)..]));
    }
    parts.join("; ")
}

/// "ranks 12-15 are in 3 other places", for the groups past the ones listed.
fn more(groups: &[(Spot, Vec<(usize, i32)>)]) -> Option<String> {
    if groups.is_empty() {
        return None;
    }
    let mut all: Vec<usize> = groups
        .iter()
        .flat_map(|(_, m)| m.iter().map(|&(r, _)| r))
        .collect();
    all.sort_unstable();
    let verb = if all.len() == 1 { "is" } else { "are" };
    let places = match groups.len() {
        1 => "1 other place".to_string(),
        n => format!("{n} other places"),
    };
    Some(format!("{} {verb} in {places}", ranks_words(&all)))
}

/// How files are shown: by name, or by path where two places share a name.
struct Names {
    ambiguous: Vec<String>,
}

impl Names {
    fn of(groups: &[(Spot, Vec<(usize, i32)>)]) -> Names {
        let mut by_name: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (spot, _) in groups {
            if let Spot::At { frame, .. } = spot {
                let paths = by_name.entry(file_name(&frame.file)).or_default();
                if !paths.contains(&frame.file.as_str()) {
                    paths.push(&frame.file);
                }
            }
        }
        let ambiguous = by_name
            .into_iter()
            .filter(|(_, paths)| paths.len() > 1)
            .map(|(name, _)| name)
            .collect();
        Names { ambiguous }
    }

    fn file(&self, path: &str) -> String {
        let name = file_name(path);
        match self.ambiguous.contains(&name) {
            true => path.to_string(),
            false => name,
        }
    }

    /// "ranks 0-6 wait in all_reduce called from train.py:57".
    fn group(&self, spot: &Spot, members: &[(usize, i32)]) -> String {
        let ranks: Vec<usize> = members.iter().map(|&(r, _)| r).collect();
        let one = ranks.len() == 1;
        let who = ranks_words(&ranks);
        match spot {
            Spot::At {
                frame,
                callee: Some(callee),
            } => {
                let verb = if one { "waits" } else { "wait" };
                let at = format!("{}:{}", self.file(&frame.file), frame.line);
                format!("{who} {verb} in {callee} called from {at}")
            }
            Spot::At {
                frame,
                callee: None,
            } => {
                let verb = if one { "is at" } else { "are at" };
                format!("{who} {verb} {}", self.frame(frame))
            }
            other => self.absent(other, members),
        }
    }

    /// "rank 7 is elsewhere: data.py:31 in __getitem__".
    fn elsewhere(&self, spot: &Spot, members: &[(usize, i32)]) -> String {
        let ranks: Vec<usize> = members.iter().map(|&(r, _)| r).collect();
        let verb = if ranks.len() == 1 { "is" } else { "are" };
        let who = ranks_words(&ranks);
        match spot {
            Spot::At {
                frame,
                callee: Some(callee),
            } => format!(
                "{who} {verb} elsewhere: in {callee} called from {}:{}",
                self.file(&frame.file),
                frame.line
            ),
            Spot::At {
                frame,
                callee: None,
            } => format!("{who} {verb} elsewhere: {}", self.frame(frame)),
            other => self.absent(other, members),
        }
    }

    /// "rank 3 did not answer (pid 4242)", "rank 5 has exited".
    fn absent(&self, spot: &Spot, members: &[(usize, i32)]) -> String {
        let ranks: Vec<usize> = members.iter().map(|&(r, _)| r).collect();
        let one = ranks.len() == 1;
        let who = ranks_words(&ranks);
        match spot {
            Spot::Silent => {
                let pids: Vec<String> = members.iter().map(|(_, p)| p.to_string()).collect();
                let pids = match one {
                    true => format!("pid {}", pids[0]),
                    false => format!("pids {}", pids.join(", ")),
                };
                format!("{who} did not answer ({pids})")
            }
            Spot::Exited => match one {
                true => format!("{who} has exited"),
                false => format!("{who} have exited"),
            },
            _ => match one {
                true => format!("{who} shows no Python frame in its main thread"),
                false => format!("{who} show no Python frame in their main thread"),
            },
        }
    }

    /// "data.py:31 in __getitem__".
    fn frame(&self, frame: &Frame) -> String {
        format!(
            "{}:{} in {}",
            self.file(&frame.file),
            frame.line,
            frame.function
        )
    }
}

fn file_name(path: &str) -> String {
    match path.starts_with('<') {
        true => path.to_string(),
        false => path.rsplit('/').next().unwrap_or(path).to_string(),
    }
}

/// "rank 3", "ranks 0-6, 9".
pub fn ranks_words(ranks: &[usize]) -> String {
    let mut spans: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        spans.push(match j > i {
            true => format!("{}-{}", ranks[i], ranks[j]),
            false => ranks[i].to_string(),
        });
        i = j + 1;
    }
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", spans.join(", "))
}

/// Where the process that gave `answer` is, in a few words: "all_reduce called from
/// train.py:57", "data.py:31 in __getitem__", "no Python frame", "did not answer",
/// "exited".
pub fn place(answer: &Answer) -> String {
    let file = |f: &Frame| file_name(&f.file);
    match spot(answer) {
        Spot::At {
            frame,
            callee: Some(callee),
        } => format!("{callee} called from {}:{}", file(&frame), frame.line),
        Spot::At {
            frame,
            callee: None,
        } => format!("{}:{} in {}", file(&frame), frame.line, frame.function),
        Spot::NoFrame => "no Python frame".to_string(),
        Spot::Silent => "did not answer".to_string(),
        Spot::Exited => "exited".to_string(),
    }
}

/// Where the rank that gave `answer` is.
fn spot(answer: &Answer) -> Spot {
    match &answer.reply {
        Reply::Stack(text) => {
            let frames = main_thread(text);
            match innermost(&frames) {
                Some((frame, callee)) => Spot::At { frame, callee },
                None => Spot::NoFrame,
            }
        }
        Reply::Exited(_) => Spot::Exited,
        _ => Spot::Silent,
    }
}

/// Where a main thread is, read from a dump as the summary reads it: the user's innermost
/// frame, the call it waits in, and every frame of the main thread (file and function, most
/// recent call first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Whereabouts {
    pub file: String,
    pub line: String,
    pub function: String,
    pub callee: Option<String>,
    pub frames: Vec<(String, String)>,
}

/// Where the main thread of the dump `text` is; `None` when it shows no Python frame.
pub fn whereabouts(text: &str) -> Option<Whereabouts> {
    let frames = main_thread(text);
    let (frame, callee) = innermost(&frames)?;
    Some(Whereabouts {
        file: frame.file,
        line: frame.line,
        function: frame.function,
        callee,
        frames: frames.into_iter().map(|f| (f.file, f.function)).collect(),
    })
}

/// The frames of the main thread in a dump, most recent call first.
fn main_thread(text: &str) -> Vec<Frame> {
    let mut blocks: Vec<(bool, Vec<Frame>)> = Vec::new();
    for line in text.lines() {
        if let Some(frame) = line.strip_prefix("  File ").and_then(parse_frame) {
            if let Some((_, frames)) = blocks.last_mut() {
                frames.push(frame);
            }
        } else if line.starts_with("Current thread") || line.starts_with("Stack (") {
            blocks.push((true, Vec::new()));
        } else if line.starts_with("Thread ") {
            blocks.push((false, Vec::new()));
        }
    }
    let main = blocks.iter().position(|(main, _)| *main).unwrap_or(0);
    match blocks.into_iter().nth(main) {
        Some((_, frames)) => frames,
        None => Vec::new(),
    }
}

/// `"PATH", line N in NAME`.
fn parse_frame(rest: &str) -> Option<Frame> {
    let rest = rest.strip_prefix('"')?;
    let (file, rest) = rest.rsplit_once("\", line ")?;
    let (line, function) = rest.split_once(" in ")?;
    Some(Frame {
        file: file.to_string(),
        line: line.to_string(),
        function: function.trim_end().to_string(),
    })
}

/// The user's innermost frame in `frames` (most recent first), with the call it waits in;
/// the innermost frame when none is the user's.
fn innermost(frames: &[Frame]) -> Option<(Frame, Option<String>)> {
    let Some(user) = frames.iter().position(|f| is_users(&f.file)) else {
        return frames.first().map(|f| (f.clone(), None));
    };
    let mut inward = user.checked_sub(1);
    // A decorator's wrapper (torch wraps its collectives in one): the call it wraps, when
    // that is in the same package.
    while let Some(i) = inward {
        let wrapper = WRAPPERS.contains(&frames[i].function.as_str());
        let wraps = i
            .checked_sub(1)
            .filter(|&j| same_package(&frames[i], &frames[j]));
        match (wrapper, wraps) {
            (true, Some(j)) => inward = Some(j),
            _ => break,
        }
    }
    let callee = inward.map(|i| frames[i].function.clone());
    Some((frames[user].clone(), callee))
}

/// The names decorators usually give the function that wraps another.
const WRAPPERS: &[&str] = &[
    "wrapper",
    "_wrapper",
    "wrapped",
    "inner",
    "_inner",
    "_fn",
    "decorate_context",
    "wrapper_func",
];

/// Whether two frames' files are in the same installed package (or both the standard
/// library's).
fn same_package(a: &Frame, b: &Frame) -> bool {
    let top = |f: &Frame| {
        let (base, rest) = split_installed(&f.file)?;
        Some((base, rest.split('/').next().unwrap_or(rest).to_string()))
    };
    match (top(a), top(b)) {
        (Some(a), Some(b)) => a == b,
        _ => is_stdlib(&a.file) && is_stdlib(&b.file),
    }
}

/// `(the site-packages folder, the path inside it)` of an installed package's file.
fn split_installed(path: &str) -> Option<(String, &str)> {
    ["/site-packages/", "/dist-packages/"]
        .iter()
        .find_map(|dir| path.find(dir).map(|at| (at, dir.len())))
        .map(|(at, len)| (path[..at].to_string(), &path[at + len..]))
}

/// Whether a frame's file is the user's code (see the module's documentation).
fn is_users(path: &str) -> bool {
    split_installed(path).is_none() && !is_stdlib(path) && !is_tethers(path)
}

/// A file of the standard library: a frozen module, or a file under `lib/python3.X/`
/// (`lib/pypy3.X/`) outside the installed packages.
fn is_stdlib(path: &str) -> bool {
    if path.starts_with("<frozen ") {
        return true;
    }
    if split_installed(path).is_some() {
        return false;
    }
    path.split('/').collect::<Vec<_>>().windows(2).any(|w| {
        let version = w[1]
            .strip_prefix("python")
            .or_else(|| w[1].strip_prefix("pypy"));
        w[0].starts_with("lib") && version.is_some_and(is_version)
    })
}

/// `3`, `3.11`, `3.13t`.
fn is_version(v: &str) -> bool {
    let v = v.trim_end_matches('t');
    !v.is_empty() && v.starts_with('3') && v.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// A file of tether's own Python package, at any depth (`tether/pool/core.py`): under a
/// folder named `tether` that holds tether's native module.
fn is_tethers(path: &str) -> bool {
    let holds_native = |dir: &Path| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().as_encoded_bytes().starts_with(b"_native"))
        })
    };
    Path::new(path)
        .ancestors()
        .skip(1)
        .filter(|dir| dir.file_name().is_some_and(|name| name == "tether"))
        .any(holds_native)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(pid: i32, frames: &[(&str, u32, &str)]) -> Answer {
        let mut text = String::from("Current thread 0x00007f (most recent call first):\n");
        for (file, line, function) in frames {
            text.push_str(&format!("  File \"{file}\", line {line} in {function}\n"));
        }
        text.push_str("\nThread 0x00007e (most recent call first):\n");
        text.push_str("  File \"/home/u/other.py\", line 1 in elsewhere\n");
        Answer {
            pid,
            reply: Reply::Stack(text),
            native: None,
        }
    }

    const SITE: &str = "/venv/lib/python3.11/site-packages";

    fn in_all_reduce(pid: i32) -> Answer {
        stack(
            pid,
            &[
                (
                    &format!("{SITE}/torch/distributed/distributed_c10d.py"),
                    2800,
                    "all_reduce",
                ),
                (
                    &format!("{SITE}/torch/distributed/c10d_logger.py"),
                    81,
                    "wrapper",
                ),
                ("/home/u/train.py", 57, "step"),
                ("/home/u/train.py", 90, "<module>"),
                ("/usr/lib/python3.11/runpy.py", 88, "_run_code"),
            ],
        )
    }

    fn in_getitem(pid: i32) -> Answer {
        stack(
            pid,
            &[
                ("/home/u/data.py", 31, "__getitem__"),
                (&format!("{SITE}/torch/utils/data/dataset.py"), 20, "fetch"),
                ("/home/u/train.py", 50, "step"),
            ],
        )
    }

    fn summary_of(answers: &[Answer]) -> String {
        let ranks: Vec<(usize, &Answer)> = answers.iter().enumerate().collect();
        summary(&ranks)
    }

    #[test]
    fn the_rank_not_where_most_wait_is_named() {
        let mut answers: Vec<Answer> = (0..7).map(in_all_reduce).collect();
        answers.push(in_getitem(7));
        assert_eq!(
            summary_of(&answers),
            "ranks 0-6 wait in all_reduce called from train.py:57; rank 7 is elsewhere: \
             data.py:31 in __getitem__"
        );
    }

    #[test]
    fn ranks_that_did_not_answer_or_exited_are_named_with_their_pids() {
        let mut answers: Vec<Answer> = (0..6).map(in_all_reduce).collect();
        answers[1].reply = Reply::Silent { state: Some('T') };
        answers.push(Answer {
            pid: 9,
            reply: Reply::Exited(None),
            native: None,
        });
        answers.push(Answer {
            pid: 10,
            reply: Reply::NoHandler,
            native: None,
        });
        assert_eq!(
            summary_of(&answers),
            "ranks 0, 2-5 wait in all_reduce called from train.py:57; ranks 1, 7 did not \
             answer (pids 1, 10); rank 6 has exited"
        );
    }

    #[test]
    fn one_group_past_the_listed_places_is_one_other_place() {
        let mut answers: Vec<Answer> = (0..10).map(in_all_reduce).collect();
        for line in 0..9 {
            let pid = 10 + line as i32;
            answers.push(stack(pid, &[("/home/u/data.py", 31 + line, "__getitem__")]));
        }
        let said = summary_of(&answers);
        assert!(said.ends_with("; rank 18 is in 1 other place"), "{said}");
    }

    #[test]
    fn without_a_majority_it_says_so() {
        let answers = vec![in_all_reduce(0), in_getitem(1)];
        assert_eq!(
            summary_of(&answers),
            "no place holds most of the ranks; rank 0 waits in all_reduce called from \
             train.py:57; rank 1 is at data.py:31 in __getitem__"
        );
    }

    #[test]
    fn every_rank_in_one_place_and_a_lone_rank() {
        let answers: Vec<Answer> = (0..3).map(in_all_reduce).collect();
        assert_eq!(
            summary_of(&answers),
            "ranks 0-2 wait in all_reduce called from train.py:57; none is elsewhere"
        );
        assert_eq!(
            summary_of(&answers[..1]),
            "rank 0 waits in all_reduce called from train.py:57; it is the only rank"
        );
        assert_eq!(summary_of(&[]), "");
    }

    #[test]
    fn the_stdlib_and_installed_packages_are_not_the_users() {
        assert!(is_stdlib("/usr/lib/python3.11/threading.py"));
        assert!(is_stdlib("/opt/py/lib/python3.13t/queue.py"));
        assert!(is_stdlib("<frozen runpy>"));
        assert!(!is_stdlib("/usr/lib/python3/dist-packages/numpy/core.py"));
        assert!(!is_users("/usr/lib/python3/dist-packages/numpy/core.py"));
        assert!(!is_users(&format!("{SITE}/torch/nn/module.py")));
        assert!(is_users("/home/u/lib/python_tools/train.py"));
        assert!(is_users("<string>"));
        // A folder named tether without tether's native module is the user's.
        assert!(is_users("/home/u/tether/train.py"));
    }

    #[test]
    fn a_stack_of_library_frames_only_is_placed_at_its_innermost_frame() {
        let answer = stack(
            1,
            &[
                ("/usr/lib/python3.11/threading.py", 320, "wait"),
                ("/usr/lib/python3.11/queue.py", 171, "get"),
            ],
        );
        assert_eq!(
            summary_of(&[answer]),
            "rank 0 is at threading.py:320 in wait; it is the only rank"
        );
    }

    #[test]
    fn the_call_from_the_users_line_is_named_and_same_names_show_their_paths() {
        let queue = stack(
            1,
            &[
                ("/usr/lib/python3.11/threading.py", 320, "wait"),
                ("/usr/lib/python3.11/queue.py", 171, "get"),
                ("/a/train.py", 5, "loop"),
            ],
        );
        let other = stack(2, &[("/b/train.py", 9, "loop")]);
        assert_eq!(
            summary_of(&[queue, other]),
            "no place holds most of the ranks; rank 0 waits in get called from \
             /a/train.py:5; rank 1 is at /b/train.py:9 in loop"
        );
    }

    #[test]
    fn a_faulthandler_dump_of_the_main_thread_is_read() {
        let answer = Answer {
            pid: 3,
            reply: Reply::Stack(
                "Stack (most recent call first):\n  File \"/u/x.py\", line 4 in spin\n".into(),
            ),
            native: None,
        };
        assert_eq!(
            summary_of(&[answer]),
            "rank 0 is at x.py:4 in spin; it is the only rank"
        );
    }

    #[test]
    fn rank_ranges_are_compressed() {
        assert_eq!(ranks_words(&[0, 1, 2, 3, 4, 5, 6, 9]), "ranks 0-6, 9");
        assert_eq!(ranks_words(&[7]), "rank 7");
        assert_eq!(ranks_words(&[1, 3, 4]), "ranks 1, 3-4");
    }

    #[test]
    fn tethers_own_files_are_known_at_every_depth_of_its_package() {
        let root = std::env::temp_dir().join(format!("tether-summary-{}", std::process::id()));
        let package = root.join("site").join("tether");
        std::fs::create_dir_all(package.join("pool")).unwrap();
        std::fs::write(package.join("_native.abi3.so"), b"").unwrap();
        let lonely = root.join("elsewhere").join("tether");
        std::fs::create_dir_all(&lonely).unwrap();
        let path = |p: &Path| p.to_str().unwrap().to_string();
        assert!(is_tethers(&path(&package.join("spawn.py"))));
        assert!(is_tethers(&path(&package.join("pool").join("channel.py"))));
        assert!(!is_tethers(&path(&lonely.join("spawn.py"))));
        assert!(!is_users(&path(&package.join("pool").join("channel.py"))));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
