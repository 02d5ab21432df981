//! The one reader of `/proc` in tether-core: every file of proc(5) that tether reads is
//! opened and parsed here, so that a reader finds each format in one place.
//!
//! Everything returns `None` (or nothing) when the file cannot be read or does not parse:
//! the process is gone, or `/proc` says less than expected.

use std::ffi::OsString;
use std::path::PathBuf;

/// Which process a file is read for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Of {
    /// This process (`/proc/self`).
    This,
    Pid(i32),
}

fn path(of: Of, file: &str) -> PathBuf {
    match of {
        Of::This => PathBuf::from(format!("/proc/self/{file}")),
        Of::Pid(pid) => PathBuf::from(format!("/proc/{pid}/{file}")),
    }
}

fn read(of: Of, file: &str) -> Option<String> {
    std::fs::read_to_string(path(of, file)).ok()
}

/// `/proc/PID/status`: one `Name:\tvalue` line a field.
#[derive(Debug, Clone)]
pub struct Status(String);

pub fn status(of: Of) -> Option<Status> {
    read(of, "status").map(Status)
}

impl Status {
    /// The value of the field `name` (without its colon), trimmed.
    pub fn field(&self, name: &str) -> Option<&str> {
        self.0.lines().find_map(|line| {
            let value = line.strip_prefix(name)?.strip_prefix(':')?;
            Some(value.trim())
        })
    }

    /// The first number of a decimal field (`Uid`, `Threads`).
    pub fn number(&self, name: &str) -> Option<u64> {
        self.field(name)?.split_whitespace().next()?.parse().ok()
    }

    /// A field in base `radix`: a signal mask (16), the umask (8).
    pub fn radix(&self, name: &str, radix: u32) -> Option<u64> {
        u64::from_str_radix(self.field(name)?, radix).ok()
    }

    /// Whether `signal` is in the hexadecimal signal mask `name` (`SigCgt`, `SigBlk`).
    pub fn has_signal(&self, name: &str, signal: i32) -> bool {
        let mask = self.radix(name, 16);
        mask.is_some_and(|m| (1..=64).contains(&signal) && m & (1u64 << (signal - 1)) != 0)
    }
}

/// `/proc/PID/stat`: space-separated fields, the second (the command) in parentheses.
#[derive(Debug, Clone)]
pub struct Stat(String);

pub fn stat(of: Of) -> Option<Stat> {
    read(of, "stat").map(Stat)
}

impl Stat {
    /// Field `n` of proc(5), counted from 1; the command (field 2) excepted, since it may
    /// hold spaces and parentheses.
    pub fn field(&self, n: usize) -> Option<&str> {
        let after = &self.0[self.0.rfind(')')? + 1..];
        after.split_whitespace().nth(n.checked_sub(3)?)
    }

    pub fn number(&self, n: usize) -> Option<u64> {
        self.field(n)?.parse().ok()
    }

    /// The command (field 2, `comm`), without its parentheses.
    pub fn command(&self) -> Option<&str> {
        self.0.get(self.0.find('(')? + 1..self.0.rfind(')')?)
    }
}

fn read_bytes(of: Of, file: &str) -> Option<Vec<u8>> {
    std::fs::read(path(of, file)).ok()
}

/// `/proc/PID/cmdline`: the arguments of a process, as raw bytes each (what a process that
/// set its title wrote there, split at its NULs).
pub fn cmdline(pid: i32) -> Option<Vec<Vec<u8>>> {
    let raw = read_bytes(Of::Pid(pid), "cmdline")?;
    Some(nul_separated(&raw))
}

/// `/proc/PID/environ`: the environment a process started with, `(name, value)`.
pub fn environ(pid: i32) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    let raw = read_bytes(Of::Pid(pid), "environ")?;
    let pairs = nul_separated(&raw).into_iter().filter_map(|entry| {
        let at = entry.iter().position(|&b| b == b'=')?;
        Some((entry[..at].to_vec(), entry[at + 1..].to_vec()))
    });
    Some(pairs.collect())
}

fn nul_separated(raw: &[u8]) -> Vec<Vec<u8>> {
    let raw = raw.strip_suffix(b"\0").unwrap_or(raw);
    if raw.is_empty() {
        return Vec::new();
    }
    raw.split(|&b| b == 0).map(<[u8]>::to_vec).collect()
}

/// The user who owns a process (the owner of `/proc/PID`).
pub fn owner(pid: i32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    Some(std::fs::metadata(path(Of::Pid(pid), "")).ok()?.uid())
}

/// The state letter of a process (R, S, D, T, t, Z, ...).
pub fn process_state(pid: i32) -> Option<char> {
    stat(Of::Pid(pid))?.field(3)?.chars().next()
}

/// When a process started (field 22 of /proc/PID/stat, in clock ticks since boot): with its
/// pid, it names one process for good.
pub fn process_start_time(pid: i32) -> Option<u64> {
    stat(Of::Pid(pid))?.number(22)
}

/// A state letter in words: "T: stopped".
pub fn describe_state(state: Option<char>) -> String {
    let name = match state {
        Some('R') => "running",
        Some('S') => "sleeping",
        Some('D') => "in uninterruptible sleep",
        Some('T') => "stopped",
        Some('t') => "stopped by a debugger",
        Some('Z') => "zombie",
        _ => "unknown",
    };
    match state {
        Some(c) => format!("{c}: {name}"),
        None => name.to_string(),
    }
}

/// The soft value of the limit named `name` in `/proc/PID/limits` (`Max processes`):
/// `Some(None)` when it is unlimited, `None` when it cannot be read.
pub fn soft_limit(pid: i32, name: &str) -> Option<Option<u64>> {
    let text = read(Of::Pid(pid), "limits")?;
    let line = text.lines().find(|l| l.starts_with(name))?;
    match line[name.len()..].split_whitespace().next()? {
        "unlimited" => Some(None),
        soft => soft.parse().ok().map(Some),
    }
}

/// How many tasks (threads) the whole system runs now: the fourth field of
/// `/proc/loadavg` (`running/total`), which a pid namespace does not narrow.
pub fn system_tasks() -> Option<usize> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    text.split_whitespace()
        .nth(3)?
        .split('/')
        .nth(1)?
        .parse()
        .ok()
}

/// Whether `/proc/PID` exists: the process (or its zombie) is there.
pub fn exists(pid: i32) -> bool {
    path(Of::Pid(pid), "").exists()
}

/// The pid of every process in `/proc`.
pub fn pids() -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let names = entries.filter_map(Result::ok).map(|e| e.file_name());
    names.filter_map(|n| n.to_str()?.parse().ok()).collect()
}

/// The threads of this process (`/proc/self/task`); 1 when it cannot be read.
pub fn threads() -> usize {
    std::fs::read_dir(path(Of::This, "task")).map_or(1, Iterator::count)
}

/// The pids of this process's children (every thread's), from
/// `/proc/self/task/*/children`, or from every process's parent (field 4 of its stat)
/// where the kernel has no such file.
pub fn children() -> Vec<i32> {
    let tasks = std::fs::read_dir(path(Of::This, "task"));
    let lists: Vec<String> = tasks
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .collect();
    if lists.is_empty() {
        return children_by_parent();
    }
    let each = lists.iter().flat_map(|list| list.split_whitespace());
    each.filter_map(|pid| pid.parse().ok()).collect()
}

/// The pids of this process's children, from every process's parent (field 4 of its
/// stat): slower than [`children`], and exact for a child that `children` files miss.
pub fn children_by_parent() -> Vec<i32> {
    let me = u64::from(std::process::id());
    let mine = |pid: &i32| stat(Of::Pid(*pid)).and_then(|s| s.number(4)) == Some(me);
    pids().into_iter().filter(mine).collect()
}

/// What each fd of a process points at (`socket:[INODE]`, a path, ...); `None` when its
/// fd directory cannot be read.
pub fn fd_targets(pid: i32) -> Option<Vec<OsString>> {
    let entries = std::fs::read_dir(path(Of::Pid(pid), "fd")).ok()?;
    let links = entries
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok());
    Some(links.map(PathBuf::into_os_string).collect())
}

/// The system call the main thread of `pid` is blocked in (`/proc/PID/syscall`): its
/// number and its first three arguments.
pub fn syscall(pid: i32) -> Option<(i64, Vec<u64>)> {
    let text = read(Of::Pid(pid), "syscall")?;
    let mut fields = text.split_whitespace();
    let number: i64 = fields.next()?.parse().ok()?;
    let args: Vec<u64> = fields
        .take(3)
        .filter_map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
        .collect();
    Some((number, args))
}

/// Eight bytes of the memory of `pid` at `address` (`/proc/PID/mem`).
pub fn read_u64(pid: i32, address: u64) -> Option<u64> {
    use std::os::unix::fs::FileExt;
    let mem = std::fs::File::open(path(Of::Pid(pid), "mem")).ok()?;
    let mut bytes = [0u8; 8];
    mem.read_exact_at(&mut bytes, address).ok()?;
    Some(u64::from_ne_bytes(bytes))
}

/// One line of `/proc/self/cgroup`: hierarchy id, controllers, path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cgroup {
    pub id: String,
    pub controllers: String,
    pub path: String,
}

/// The cgroups of this process.
pub fn cgroups() -> Vec<Cgroup> {
    let text = read(Of::This, "cgroup").unwrap_or_default();
    let parse = |line: &str| {
        let mut parts = line.splitn(3, ':');
        Some(Cgroup {
            id: parts.next()?.into(),
            controllers: parts.next()?.into(),
            path: parts.next()?.into(),
        })
    };
    text.lines().filter_map(parse).collect()
}

/// The private, anonymous, writable mappings of this process (`/proc/self/maps`: the heap
/// included, the stack not), as `(start, end)` addresses.
pub fn private_anonymous_mappings() -> Vec<(usize, usize)> {
    let maps = read(Of::This, "maps").unwrap_or_default();
    maps.lines().filter_map(private_anonymous).collect()
}

/// The range of a line of /proc/self/maps, when it is private, anonymous and writable.
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

/// Whether a TCP socket of this network namespace listens on `port`, on any address
/// (`/proc/self/net/tcp` and `tcp6`: state `0A` is LISTEN, the local port is in hex).
pub fn tcp_listening(port: u16) -> bool {
    ["net/tcp", "net/tcp6"].iter().any(|file| {
        let table = read(Of::This, file).unwrap_or_default();
        table.lines().skip(1).any(|line| listens_on(line, port))
    })
}

/// Whether a line of `/proc/net/tcp` is a socket listening on `port`.
fn listens_on(line: &str, port: u16) -> bool {
    let mut fields = line.split_whitespace().skip(1);
    let (Some(local), Some(state)) = (fields.next(), fields.nth(1)) else {
        return false;
    };
    let local_port = local
        .rsplit_once(':')
        .map(|(_, p)| u16::from_str_radix(p, 16));
    state == "0A" && local_port == Some(Ok(port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields_are_read() {
        let fields = Status("Name:\tx\nUid:\t1000\t1000\t1000\t1000\nThreads:\t7\n".into());
        assert_eq!(fields.number("Uid"), Some(1000));
        assert_eq!(fields.number("Threads"), Some(7));
        assert_eq!(fields.number("Gid"), None);
        let masks = Status("SigBlk:\t0000000000000002\nUmask:\t0022\n".into());
        assert!(masks.has_signal("SigBlk", 2));
        assert!(!masks.has_signal("SigBlk", 1));
        assert_eq!(masks.radix("Umask", 8), Some(0o22));
        let this = status(Of::This).unwrap();
        assert_eq!(this.number("Pid"), Some(std::process::id() as u64));
    }

    #[test]
    fn stat_fields_count_from_one_past_the_command() {
        let stat = Stat("42 (a (b) c) S 1 42 42 0".into());
        assert_eq!(stat.field(3), Some("S"));
        assert_eq!(stat.number(5), Some(42));
        assert_eq!(stat.field(2), None);
        assert_eq!(stat.command(), Some("a (b) c"));
        assert!(process_start_time(std::process::id() as i32).is_some());
    }

    #[test]
    fn a_listening_socket_is_seen_until_it_closes() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(tcp_listening(port));
        drop(listener);
        assert!(!tcp_listening(port));
        let line =
            "   3: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000";
        assert!(listens_on(line, 8080));
        assert!(!listens_on(line, 8081));
        assert!(!listens_on(&line.replace(" 0A ", " 01 "), 8080));
    }

    #[test]
    fn states_are_described() {
        assert_eq!(describe_state(Some('T')), "T: stopped");
        assert!(matches!(
            process_state(std::process::id() as i32),
            Some('R') | Some('S')
        ));
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
        assert!(!private_anonymous_mappings().is_empty());
    }

    #[test]
    fn this_process_is_found_with_its_fds() {
        let me = std::process::id() as i32;
        assert!(exists(me));
        assert!(pids().contains(&me));
        assert!(fd_targets(me).is_some_and(|fds| !fds.is_empty()));
        assert_eq!(owner(me), Some(rustix::process::getuid().as_raw()));
        assert!(cmdline(me).is_some_and(|args| !args.is_empty()));
        let path = std::env::var_os("PATH").map(std::os::unix::ffi::OsStringExt::into_vec);
        let env = environ(me).unwrap();
        assert_eq!(
            env.into_iter().find(|(k, _)| k == b"PATH").map(|(_, v)| v),
            path
        );
    }

    #[test]
    fn nul_separated_fields_keep_empty_ones_but_the_last() {
        assert_eq!(
            nul_separated(b"a\0\0b\0"),
            vec![b"a".to_vec(), vec![], b"b".to_vec()]
        );
        assert_eq!(nul_separated(b"a b"), vec![b"a b".to_vec()]);
        assert!(nul_separated(b"").is_empty());
    }
}
