//! The layout of a shared list or dict: one sealed memfd of serialized items with an offset
//! index, and for a dict a hash table over its keys' canonical bytes. Every process that
//! maps it reads the same pages, and reading never writes them.
//!
//! ```text
//! header   72 bytes: magic, kind, count, index offset, table offset, table slots,
//!          data offset, data length, index width (u64, little-endian)
//! index    (count x pieces + 1) offsets into data, u32 (data under 4 GiB) or u64:
//!          piece i is data[o[i]..o[i+1]]
//! table    (dict) slots u64, a power of two: (hash >> 32) << 32 | (entry + 1), 0 empty
//! data     the pieces, one after the other
//! ```
//!
//! A list's entry is one piece (the item); a dict's is three: the key's canonical bytes
//! (what lookups compare and hash, see [`key_hash`]), the key as it is loaded, the value.
//! What the bytes mean is the caller's business; the table only keeps them apart.

use std::io;
use std::os::fd::OwnedFd;

use crate::memfd::{sealed_memfd, ReadOnlyMap};

const MAGIC: &[u8; 8] = b"TETHSHR\x01";
const HEADER: usize = 72;

/// What a table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A list: one piece an entry, its item.
    List,
    /// A dict: three pieces an entry (canonical key, key, value) and a hash table.
    Dict,
}

impl Kind {
    fn code(self) -> u64 {
        match self {
            Kind::List => 1,
            Kind::Dict => 2,
        }
    }

    fn pieces(self) -> usize {
        match self {
            Kind::List => 1,
            Kind::Dict => 3,
        }
    }
}

/// The hash of a key's canonical bytes: the same in every process and every run (FNV-1a,
/// then a finalizer that spreads it over all 64 bits), unlike Python's seeded `hash()`.
pub fn key_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The most entries a dict's table can index (an entry is 32 bits of a slot).
pub const MAX_DICT_ENTRIES: usize = u32::MAX as usize - 1;

fn corrupt(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("tether shared items: {what}"),
    )
}

/// Writes a table, piece by piece, then into its memfd.
#[derive(Debug)]
pub struct TableBuilder {
    kind: Kind,
    /// Where each piece ends, after a first 0.
    offsets: Vec<u64>,
    data: Vec<u8>,
}

impl TableBuilder {
    /// A builder for about `entries` entries.
    pub fn new(kind: Kind, entries: usize) -> TableBuilder {
        let mut offsets = Vec::with_capacity(entries * kind.pieces() + 1);
        offsets.push(0);
        TableBuilder {
            kind,
            offsets,
            data: Vec::new(),
        }
    }

    /// Adds one piece: the concatenation of `parts`.
    pub fn piece(&mut self, parts: &[&[u8]]) {
        for part in parts {
            self.data.extend_from_slice(part);
        }
        self.offsets.push(self.data.len() as u64);
    }

    /// The bytes of the pieces so far.
    pub fn data_len(&self) -> usize {
        self.data.len()
    }

    /// The table in a new sealed memfd named `name`.
    pub fn finish(self, name: &str) -> io::Result<OwnedFd> {
        let per = self.kind.pieces();
        let pieces = self.offsets.len() - 1;
        if pieces % per != 0 {
            return Err(corrupt("an entry is missing pieces"));
        }
        let count = pieces / per;
        let table = match self.kind {
            Kind::List => Vec::new(),
            Kind::Dict => self.hash_table(count)?,
        };
        let width = if u32::try_from(self.data.len()).is_ok() {
            4
        } else {
            8
        };
        let index: Vec<u8> = match width {
            4 => self
                .offsets
                .iter()
                .flat_map(|&o| (o as u32).to_le_bytes())
                .collect(),
            _ => self.offsets.iter().flat_map(|o| o.to_le_bytes()).collect(),
        };
        let index_off = HEADER;
        let table_off = index_off + index.len();
        let data_off = table_off + table.len();
        let header = [
            u64::from_le_bytes(*MAGIC),
            self.kind.code(),
            count as u64,
            index_off as u64,
            table_off as u64,
            (table.len() / 8) as u64,
            data_off as u64,
            self.data.len() as u64,
            width,
        ];
        let header: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
        sealed_memfd(name, &[&header, &index, &table, &self.data])
    }

    fn offset(&self, piece: usize) -> usize {
        self.offsets.get(piece).map_or(0, |&o| o as usize)
    }

    /// The slots of a dict's hash table (open addressing, linear probing, at most half full).
    fn hash_table(&self, count: usize) -> io::Result<Vec<u8>> {
        if count > MAX_DICT_ENTRIES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a shared dict holds at most {MAX_DICT_ENTRIES} entries"),
            ));
        }
        let slots = (2 * count).max(8).next_power_of_two();
        let mask = slots - 1;
        let mut table = vec![0u64; slots];
        for entry in 0..count {
            let key = &self.data[self.offset(3 * entry)..self.offset(3 * entry + 1)];
            let hash = key_hash(key);
            let mut at = hash as usize & mask;
            while table[at] != 0 {
                at = (at + 1) & mask;
            }
            table[at] = (hash >> 32) << 32 | (entry as u64 + 1);
        }
        Ok(table.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    let field = bytes.get(at..at.checked_add(8)?)?;
    Some(u64::from_le_bytes(field.try_into().ok()?))
}

/// What the table in `fd` holds, read from its header without mapping it.
pub fn kind_of(fd: &OwnedFd) -> io::Result<Kind> {
    let mut head = [0u8; 16];
    let n = rustix::io::pread(fd, &mut head, 0)?;
    match (&head[..8] == MAGIC, n, read_u64(&head, 8)) {
        (true, 16, Some(1)) => Ok(Kind::List),
        (true, 16, Some(2)) => Ok(Kind::Dict),
        _ => Err(corrupt("not a table of shared items")),
    }
}

/// A table mapped read-only from its memfd (made by [`TableBuilder::finish`], in any
/// process). Every read is bounds-checked: a damaged table is an error, never a bad read.
#[derive(Debug)]
pub struct Table {
    map: ReadOnlyMap,
    kind: Kind,
    count: usize,
    index: (usize, usize),
    /// The bytes of an offset in the index: 4 or 8.
    width: usize,
    table: (usize, usize),
    data: (usize, usize),
}

impl Table {
    /// Maps the table in `fd` (sealed, so that it can neither change nor shrink).
    pub fn open(fd: &OwnedFd) -> io::Result<Table> {
        let map = ReadOnlyMap::of_sealed(fd)?;
        let bytes = map.bytes();
        let field = |n: usize| read_u64(bytes, 8 * n).ok_or_else(|| corrupt("no header"));
        if bytes.get(..8) != Some(&MAGIC[..]) {
            return Err(corrupt("not a table of shared items"));
        }
        let kind = match field(1)? {
            1 => Kind::List,
            2 => Kind::Dict,
            _ => return Err(corrupt("unknown kind")),
        };
        let count = usize::try_from(field(2)?).map_err(|_| corrupt("bad count"))?;
        let pieces = count
            .checked_mul(kind.pieces())
            .and_then(|p| p.checked_add(1))
            .ok_or_else(|| corrupt("bad count"))?;
        let region = |off: u64, len: Option<u64>| -> io::Result<(usize, usize)> {
            let off = usize::try_from(off).map_err(|_| corrupt("bad region"))?;
            let len = len
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| corrupt("bad region"))?;
            match off.checked_add(len) {
                Some(end) if end <= bytes.len() => Ok((off, len)),
                _ => Err(corrupt("a region runs past the end")),
            }
        };
        let width = match field(8)? {
            4 => 4,
            8 => 8,
            _ => return Err(corrupt("bad index width")),
        };
        let index = region(field(3)?, (pieces as u64).checked_mul(width))?;
        let table = region(field(4)?, field(5)?.checked_mul(8))?;
        let data = region(field(6)?, Some(field(7)?))?;
        let slots = table.1 / 8;
        if kind == Kind::Dict && (!slots.is_power_of_two() || slots < count) {
            return Err(corrupt("bad hash table"));
        }
        let opened = Table {
            map,
            kind,
            count,
            index,
            width: width as usize,
            table,
            data,
        };
        if opened.offset(pieces - 1)? != data.1 as u64 {
            return Err(corrupt("the index does not end with the data"));
        }
        Ok(opened)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The number of entries (items of a list, pairs of a dict).
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The size of the memfd, in bytes.
    pub fn size(&self) -> usize {
        self.map.bytes().len()
    }

    fn offset(&self, piece: usize) -> io::Result<u64> {
        let bytes = &self.map.bytes()[self.index.0..self.index.0 + self.index.1];
        let at = piece.checked_mul(self.width);
        let field = at.and_then(|at| bytes.get(at..at + self.width));
        match field {
            Some(&[a, b, c, d]) => Ok(u64::from(u32::from_le_bytes([a, b, c, d]))),
            Some(f) => f
                .try_into()
                .map(u64::from_le_bytes)
                .map_err(|_| corrupt("index out of range")),
            None => Err(corrupt("index out of range")),
        }
    }

    /// Piece `n` (of all entries' pieces, in order).
    fn piece(&self, n: usize) -> io::Result<&[u8]> {
        let (start, end) = (self.offset(n)?, self.offset(n + 1)?);
        let data = &self.map.bytes()[self.data.0..self.data.0 + self.data.1];
        usize::try_from(start)
            .ok()
            .zip(usize::try_from(end).ok())
            .and_then(|(s, e)| data.get(s..e))
            .ok_or_else(|| corrupt("a piece runs past the data"))
    }

    /// Item `i` of a list (the first piece of entry `i` of any table).
    pub fn item(&self, i: usize) -> io::Result<&[u8]> {
        if i >= self.count {
            return Err(corrupt("item out of range"));
        }
        self.piece(i * self.kind.pieces())
    }

    /// Entry `i` of a dict: its canonical key, key and value.
    pub fn entry(&self, i: usize) -> io::Result<(&[u8], &[u8], &[u8])> {
        if i >= self.count || self.kind != Kind::Dict {
            return Err(corrupt("entry out of range"));
        }
        Ok((
            self.piece(3 * i)?,
            self.piece(3 * i + 1)?,
            self.piece(3 * i + 2)?,
        ))
    }

    /// The entry of a dict whose canonical key is `key`, if any.
    pub fn find(&self, key: &[u8]) -> io::Result<Option<usize>> {
        if self.kind != Kind::Dict {
            return Ok(None);
        }
        let slots = self.table.1 / 8;
        let table = &self.map.bytes()[self.table.0..self.table.0 + self.table.1];
        let hash = key_hash(key);
        let mask = slots - 1;
        let mut at = hash as usize & mask;
        for _ in 0..slots {
            let slot = read_u64(table, 8 * at).ok_or_else(|| corrupt("bad hash table"))?;
            if slot == 0 {
                return Ok(None);
            }
            let entry = (slot & 0xffff_ffff) as usize;
            if slot >> 32 == hash >> 32 && entry >= 1 && self.piece(3 * (entry - 1))? == key {
                return Ok(Some(entry - 1));
            }
            at = (at + 1) & mask;
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(items: &[&[u8]]) -> io::Result<Table> {
        let mut b = TableBuilder::new(Kind::List, items.len());
        for item in items {
            b.piece(&[item]);
        }
        Table::open(&b.finish("test")?)
    }

    #[test]
    fn a_list_reads_back_its_items() -> io::Result<()> {
        let t = list(&[b"a", b"", b"ccc"])?;
        assert_eq!((t.kind(), t.len()), (Kind::List, 3));
        assert_eq!(t.item(0)?, b"a");
        assert_eq!(t.item(1)?, b"");
        assert_eq!(t.item(2)?, b"ccc");
        assert!(t.item(3).is_err());
        assert!(list(&[])?.is_empty());
        Ok(())
    }

    #[test]
    fn a_piece_may_be_written_in_parts() -> io::Result<()> {
        let mut b = TableBuilder::new(Kind::List, 1);
        b.piece(&[b"ab", b"cd"]);
        assert_eq!(b.data_len(), 4);
        assert_eq!(Table::open(&b.finish("test")?)?.item(0)?, b"abcd");
        Ok(())
    }

    #[test]
    fn a_dict_finds_every_key_and_no_other() -> io::Result<()> {
        let keys: Vec<Vec<u8>> = (0..1000).map(|i| format!("key{i}").into_bytes()).collect();
        let mut b = TableBuilder::new(Kind::Dict, keys.len());
        for (i, key) in keys.iter().enumerate() {
            b.piece(&[key]);
            b.piece(&[b"k"]);
            b.piece(&[format!("v{i}").as_bytes()]);
        }
        let t = Table::open(&b.finish("test")?)?;
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(t.find(key)?, Some(i));
            assert_eq!(t.entry(i)?.2, format!("v{i}").as_bytes());
        }
        assert_eq!(t.find(b"key1000")?, None);
        assert_eq!(t.find(b"")?, None);
        Ok(())
    }

    #[test]
    fn the_key_hash_is_fixed() {
        // The same in every process and run: a table built by one is read by the others.
        assert_eq!(key_hash(b""), key_hash(b""));
        assert_ne!(key_hash(b"a"), key_hash(b"b"));
        // FNV-1a then murmur3's fmix64, computed independently.
        assert_eq!(key_hash(b"imagenet"), 0xf75e_f8d3_2d72_000b);
    }

    #[test]
    fn an_unsealed_or_foreign_memfd_is_refused() -> io::Result<()> {
        let fd = rustix::fs::memfd_create("plain", rustix::fs::MemfdFlags::CLOEXEC)?;
        assert!(Table::open(&fd).is_err());
        let junk = sealed_memfd("junk", &[b"not a table at all"])?;
        assert_eq!(
            Table::open(&junk).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        Ok(())
    }

    #[test]
    fn a_damaged_index_is_an_error_not_a_bad_read() -> io::Result<()> {
        let table = |last: u64| -> Vec<u8> {
            let fields = [
                u64::from_le_bytes(*MAGIC),
                1,
                1,
                72,
                88,
                0,
                88,
                2,
                8,
                0,
                last,
            ];
            fields.iter().flat_map(|v| v.to_le_bytes()).collect()
        };
        assert_eq!(
            Table::open(&sealed_memfd("ok", &[&table(2), b"ok"])?)?.item(0)?,
            b"ok"
        );
        assert!(Table::open(&sealed_memfd("bad", &[&table(9), b"ok"])?).is_err());
        Ok(())
    }
}
