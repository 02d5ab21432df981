//! A rank's console prefix, rendered from its template, and the rule that leaves it off
//! lines that carry it already.

/// A rank's console prefix, and the rule that leaves it off lines that carry it already.
#[derive(Debug, Clone)]
pub struct Prefix {
    text: Vec<u8>,
    pub rank: usize,
}

/// What a prefix template's macros stand for.
pub struct RankNames<'a> {
    pub rank: usize,
    pub local_rank: usize,
    pub role: &'a str,
    pub hostname: &'a str,
}

impl Prefix {
    /// Renders `template` (`${rank}`, `${local_rank}`, `${role_name}`, `${hostname}`).
    pub fn render(template: &str, names: &RankNames<'_>) -> Prefix {
        let text = template
            .replace("${rank}", &names.rank.to_string())
            .replace("${local_rank}", &names.local_rank.to_string())
            .replace("${role_name}", names.role)
            .replace("${hostname}", names.hostname);
        Prefix {
            text: text.into_bytes(),
            rank: names.rank,
        }
    }

    /// The rendered prefix.
    pub fn text(&self) -> &[u8] {
        &self.text
    }

    /// Whether `line` starts with this rank's own prefix: the rendered prefix (without its
    /// trailing blanks), `[rank N]` or `[rankN]`.
    pub fn is_own(&self, line: &[u8]) -> bool {
        let end = self.text.iter().rposition(|b| !b.is_ascii_whitespace());
        let rendered = &self.text[..end.map_or(0, |e| e + 1)];
        if !rendered.is_empty() && line.starts_with(rendered) {
            return true;
        }
        let Some(rest) = line.strip_prefix(b"[rank") else {
            return false;
        };
        let rest = rest.strip_prefix(b" ").unwrap_or(rest);
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        digits > 0
            && rest.get(digits) == Some(&b']')
            && std::str::from_utf8(&rest[..digits])
                .ok()
                .and_then(|d| d.parse::<usize>().ok())
                == Some(self.rank)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::output) fn prefix(template: &str, rank: usize) -> Prefix {
        let names = RankNames {
            rank,
            local_rank: rank % 2,
            role: "trainer",
            hostname: "h1",
        };
        Prefix::render(template, &names)
    }

    #[test]
    fn own_prefixes_are_not_doubled() {
        let p = prefix(crate::config::DEFAULT_PREFIX, 1);
        assert_eq!(p.text, b"[rank 1]: ");
        for own in [
            "[rank1]: Traceback",
            "[rank 1]: x",
            "[rank1]:x",
            "[rank1] x",
            "[rank 1]",
        ] {
            assert!(p.is_own(own.as_bytes()), "{own}");
        }
        for other in [
            "[rank10]: x",
            "[rank0]: x",
            "[rank 2]: x",
            "rank1: x",
            "[rank]: x",
            "x",
        ] {
            assert!(!p.is_own(other.as_bytes()), "{other}");
        }
    }

    #[test]
    fn templates_render_their_macros() {
        let p = prefix("${hostname}:${role_name}${local_rank}/${rank}> ", 3);
        assert_eq!(p.text, b"h1:trainer1/3> ");
        assert!(p.is_own(b"h1:trainer1/3> already"));
        assert!(p.is_own(b"[rank3]: from torch"));
        assert!(!p.is_own(b"h1:trainer1/2> another"));
    }
}
