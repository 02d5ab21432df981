//! Stacks a process answers for its own children: the workers of a `tether.Pool` it
//! started answer to it (to its pool's channel), not to whoever asked it, so its answer to a
//! request carries theirs after its own, each under a header line ([`section`]); the asker
//! takes them apart again ([`split`]) and shows them as the process's children.

use super::{Answer, Reply};

/// The start of the header line of a child's stack in its parent's answer.
const HEADER: &str = "-- a worker of this process's tether.Pool, pid ";

/// The header and text of the stack of child `pid`, as its parent's answer carries it.
pub fn section(pid: i32, text: &str) -> String {
    let mut out = format!("{HEADER}{pid}:\n{text}");
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// The pid a header line names; `None` for any other line.
fn header_pid(line: &str) -> Option<i32> {
    line.strip_prefix(HEADER)?.strip_suffix(':')?.parse().ok()
}

/// `answer` without the stacks it carries for its children, and those children's answers.
pub fn split(answer: Answer) -> (Answer, Vec<Answer>) {
    let Reply::Stack(text) = &answer.reply else {
        return (answer, Vec::new());
    };
    let mut own = String::new();
    let mut children: Vec<(i32, String)> = Vec::new();
    for line in text.split_inclusive('\n') {
        if let Some(pid) = header_pid(line.trim_end_matches('\n')) {
            children.push((pid, String::new()));
        } else if let Some((_, child)) = children.last_mut() {
            child.push_str(line);
        } else {
            own.push_str(line);
        }
    }
    let children = children
        .into_iter()
        .map(|(pid, text)| Answer {
            pid,
            reply: Reply::Stack(text),
            native: None,
        })
        .collect();
    let own = Answer {
        reply: Reply::Stack(own),
        ..answer
    };
    (own, children)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_childs_stack_travels_in_its_parents_answer_and_comes_apart_again() {
        let own = "Current thread 0x1 (most recent call first):\n  File \"t.py\", line 3 in f\n";
        let child = "Current thread 0x2 (most recent call first):\n  File \"d.py\", line 9 in g";
        let text = format!(
            "{own}{}{}",
            section(41, child),
            section(42, "(no answer)\n")
        );
        let answer = Answer {
            pid: 7,
            reply: Reply::Stack(text),
            native: None,
        };
        let (parent, children) = split(answer);
        assert_eq!(parent.reply, Reply::Stack(own.to_string()));
        assert_eq!(parent.pid, 7);
        let pids: Vec<i32> = children.iter().map(|c| c.pid).collect();
        assert_eq!(pids, [41, 42]);
        assert_eq!(children[0].reply, Reply::Stack(format!("{child}\n")));
        assert_eq!(children[1].reply, Reply::Stack("(no answer)\n".to_string()));
    }

    #[test]
    fn an_answer_without_children_is_left_as_it_is() {
        let answer = Answer {
            pid: 7,
            reply: Reply::Silent { state: Some('S') },
            native: None,
        };
        assert_eq!(split(answer.clone()), (answer, Vec::new()));
    }
}
