//! Imports in tether-core go one way: no file of `src/` reaches itself through the paths it
//! names (`use crate::...`, `use super::...`, `crate::x::y(...)` in code, a child module's
//! items). A module declaring its child (`mod child;`) is not an import; a child reaching
//! back into the file that declares it is.
//!
//! Inside the crate an item is named by the file that defines it (`crate::zygote::wire::
//! Notice`, not `crate::zygote::Notice`): a `mod.rs` re-exports for other crates, and naming
//! it would import every child it re-exports from.
//!
//! The same holds one level up: no top-level module (a folder such as `zygote/`, a file
//! such as `group.rs`) reaches itself through another, whichever of their files name the
//! paths.
//!
//! `cargo test -p tether-core --test imports -- --nocapture` prints the graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Source text without comments, string and char literals, and inline `mod x { ... }`
/// blocks (tests, whose `super` is the file itself).
fn code_of(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &text[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            i += rest.find("*/").map_or(rest.len(), |n| n + 2);
        } else if rest.starts_with("r#\"") || rest.starts_with("r\"") {
            let hashes = rest[1..].bytes().take_while(|&b| b == b'#').count();
            let close = format!("\"{}", "#".repeat(hashes));
            let open = 2 + hashes;
            i += rest[open..]
                .find(&close)
                .map_or(rest.len(), |n| open + n + close.len());
        } else if bytes[i] == b'"' {
            let mut j = i + 1;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
        } else if bytes[i] == b'\'' && is_char_literal(rest) {
            let end = rest[1..].find('\'').map_or(rest.len(), |n| n + 2);
            i += end;
        } else {
            let c = rest.chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    without_inline_modules(&out)
}

/// `'x'`, `'\n'`, `'\''` rather than a lifetime `'a`.
fn is_char_literal(rest: &str) -> bool {
    let b = rest.as_bytes();
    (b.len() > 2 && b[1] == b'\\') || (b.len() > 2 && b[2] == b'\'')
}

fn without_inline_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = find_inline_module(rest) {
        out.push_str(&rest[..at]);
        let open = at + rest[at..].find('{').unwrap_or(0);
        let mut depth = 0;
        let mut end = rest.len();
        for (k, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Where `mod NAME {` starts in `code`.
fn find_inline_module(code: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(k) = code[from..].find("mod ") {
        let at = from + k;
        let before_ok = at == 0 || !is_ident(code.as_bytes()[at - 1]);
        let after = code[at + 4..].trim_start();
        let name_len = after.bytes().take_while(|&b| is_ident(b)).count();
        if before_ok && name_len > 0 && after[name_len..].trim_start().starts_with('{') {
            return Some(at);
        }
        from = at + 4;
    }
    None
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The module path of a file under `src/`: `zygote/wire.rs` is `[zygote, wire]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap_or(file);
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

/// The deepest file the module path `path` names (an item's module, not the item).
fn resolve(src: &Path, path: &[String]) -> PathBuf {
    let mut dir = src.to_path_buf();
    let mut file = src.join("lib.rs");
    for segment in path {
        let flat = dir.join(format!("{segment}.rs"));
        let nested = dir.join(segment).join("mod.rs");
        if flat.exists() {
            file = flat;
        } else if nested.exists() {
            file = nested;
        } else {
            break;
        }
        dir = dir.join(segment);
    }
    file
}

/// Every path the code names from this crate, as module paths from the root.
fn paths_named(code: &str, module: &[String], children: &BTreeSet<String>) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let (statements, rest) = use_statements(code);
    for statement in statements {
        for path in expand(&statement) {
            found.extend(absolute(&path, module, children));
        }
    }
    let tokens: Vec<&str> = rest
        .split(|c: char| !(is_ident(c as u8) || c == ':') || !c.is_ascii())
        .filter(|t| t.contains("::"))
        .collect();
    for token in tokens {
        let path: Vec<String> = token
            .split("::")
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        found.extend(absolute(&path, module, children));
    }
    found
}

/// `path` from the crate root, when it is one of this crate's.
fn absolute(
    path: &[String],
    module: &[String],
    children: &BTreeSet<String>,
) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => module.to_vec(),
        "super" => {
            let mut up = module.to_vec();
            let mut rest = rest;
            up.pop()?;
            while rest.first().map(String::as_str) == Some("super") {
                up.pop()?;
                rest = &rest[1..];
            }
            up.extend(rest.iter().cloned());
            return Some(up);
        }
        name if children.contains(name) => {
            let mut here = module.to_vec();
            here.push(name.to_string());
            here
        }
        _ => return None,
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The text of each `use ...;` statement, and the code without them.
fn use_statements(code: &str) -> (Vec<String>, String) {
    let mut found = Vec::new();
    let mut rest = String::new();
    let mut from = 0;
    let mut search = 0;
    while let Some(k) = code[search..].find("use ") {
        let at = search + k;
        search = at + 4;
        if at > 0 && is_ident(code.as_bytes()[at - 1]) {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        let words: Vec<&str> = code[at + 4..at + end].split_whitespace().collect();
        found.push(words.join(" "));
        rest.push_str(&code[from..at]);
        from = at + end + 1;
        search = from;
    }
    rest.push_str(&code[from..]);
    (found, rest)
}

fn segments(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
}

/// `a::{b, c::{d, e}}` as `[a::b, a::c::d, a::c::e]` (without `as` renames).
fn expand(tree: &str) -> Vec<Vec<String>> {
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
        let tree = tree.trim().trim_start_matches("::");
        match tree.find('{') {
            None => {
                let mut path = prefix.to_vec();
                let head = tree.split(" as ").next().unwrap_or(tree);
                path.extend(segments(head));
                out.push(path);
            }
            Some(open) => {
                let mut path = prefix.to_vec();
                path.extend(segments(&tree[..open]));
                let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
                let mut depth = 0;
                let mut start = 0;
                for (i, c) in inner.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            walk(&path, &inner[start..i], out);
                            start = i + 1;
                        }
                        _ => {}
                    }
                }
                if !inner[start..].trim().is_empty() {
                    walk(&path, &inner[start..], out);
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(&[], tree, &mut out);
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("src/ is readable")
        .map(|e| e.expect("a readable entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The child modules a file declares (`mod x;`, with or without visibility).
fn children_of(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in code.lines() {
        let line = line.trim();
        let line = line
            .strip_prefix("pub(crate) ")
            .or(line.strip_prefix("pub "))
            .unwrap_or(line);
        if let Some(name) = line.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            found.insert(name.trim().to_string());
        }
    }
    found
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let name = |p: &Path| p.strip_prefix(&src).unwrap_or(p).display().to_string();
    let mut edges = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable source file");
        let code = code_of(&text);
        let module = module_of(&src, file);
        let children = children_of(&code);
        let targets: BTreeSet<String> = paths_named(&code, &module, &children)
            .iter()
            .map(|path| resolve(&src, path))
            .filter(|target| target != file)
            .map(|target| name(&target))
            .collect();
        edges.insert(name(file), targets);
    }
    edges
}

/// A cycle through `start`, if there is one.
fn cycle_from(edges: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    fn dfs(
        edges: &BTreeMap<String, BTreeSet<String>>,
        start: &str,
        at: &str,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> bool {
        for next in edges.get(at).into_iter().flatten() {
            if next == start {
                path.push(next.clone());
                return true;
            }
            if seen.insert(next.clone()) {
                path.push(next.clone());
                if dfs(edges, start, next, path, seen) {
                    return true;
                }
                path.pop();
            }
        }
        false
    }
    let mut path = vec![start.to_string()];
    let mut seen = BTreeSet::new();
    dfs(edges, start, start, &mut path, &mut seen).then_some(path)
}

#[test]
fn no_file_of_tether_core_imports_itself_through_another() {
    let edges = graph();
    for (file, targets) in &edges {
        let list: Vec<&str> = targets.iter().map(String::as_str).collect();
        println!("{file} -> {}", list.join(", "));
    }
    let cycles: Vec<String> = edges
        .keys()
        .filter_map(|file| cycle_from(&edges, file))
        .map(|cycle| cycle.join(" -> "))
        .collect();
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

/// The top-level module a file of `src/` belongs to: `zygote/wire.rs` is `zygote`,
/// `group.rs` is `group`; `None` for `lib.rs`.
fn top_level(file: &str) -> Option<String> {
    let first = file.split('/').next()?;
    (first != "lib.rs").then(|| first.trim_end_matches(".rs").to_string())
}

#[test]
fn no_top_level_module_of_tether_core_imports_itself_through_another() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (file, targets) in graph() {
        let Some(from) = top_level(&file) else {
            continue;
        };
        let reached = targets.iter().filter_map(|t| top_level(t));
        let entry = edges.entry(from.clone()).or_default();
        entry.extend(reached.filter(|to| *to != from));
    }
    let cycles: Vec<String> = edges
        .keys()
        .filter_map(|top| cycle_from(&edges, top))
        .map(|cycle| cycle.join(" -> "))
        .collect();
    assert!(
        cycles.is_empty(),
        "import cycles between top-level modules:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_checker_sees_every_form_of_path() {
    let code = code_of(
        "use crate::a::{b::C, d};\nuse super::e;\n// use crate::f;\nfn g() { crate::h::i(); \
         let s = \"crate::j\"; child::k(); }\nmod tests { use super::*; use crate::l; }",
    );
    let children: BTreeSet<String> = ["child".to_string()].into();
    let module = vec!["m".to_string(), "n".to_string()];
    let named: BTreeSet<String> = paths_named(&code, &module, &children)
        .iter()
        .map(|p| p.join("::"))
        .collect();
    let expected: BTreeSet<String> = ["a::b::C", "a::d", "m::e", "h::i", "m::n::child::k"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(named, expected);
}
