//! The notices a zygote sends its parent's warden about its blanks, on their own channel
//! (see [`crate::blanks`]), written with [`crate::codec`].

use crate::codec::{Reader, Writer};

/// What the errors of this format call a message.
const WHAT: &str = "blank notice";

const BLANK: u8 = 7;
const RETIRED: u8 = 8;

/// A notice from the zygote to the parent's warden about its blank children.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Notice {
    /// A blank was forked: follow it.
    Blank(i32),
    /// A blank is given back, or was found dead: it will never be handed out.
    Retired(i32),
}

impl Notice {
    pub fn encode(self) -> Vec<u8> {
        match self {
            Notice::Blank(pid) => Writer::new().u8(BLANK).i32(pid).finish(),
            Notice::Retired(pid) => Writer::new().u8(RETIRED).i32(pid).finish(),
        }
    }

    pub fn decode(data: &[u8]) -> Option<Notice> {
        let mut r = Reader::new(data, WHAT);
        match (r.u8().ok()?, r.i32().ok()?) {
            (BLANK, pid) => Some(Notice::Blank(pid)),
            (RETIRED, pid) => Some(Notice::Retired(pid)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_survive_the_wire_and_a_cut_one_is_none() {
        for notice in [Notice::Blank(42), Notice::Retired(43)] {
            assert_eq!(Notice::decode(&notice.encode()), Some(notice));
        }
        assert_eq!(Notice::decode(&[BLANK]), None);
        assert_eq!(Notice::decode(&[99, 0, 0, 0, 1]), None);
    }
}
