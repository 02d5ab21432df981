//! The one byte-level codec of tether-core: every message and frame it writes by hand (the
//! zygote's protocol, a child's failure report, a channel message's header, a stacks
//! marker) is little-endian fixed-size integers and byte strings with a `u64` length,
//! written by a [`Writer`] and read back by a [`Reader`].
//!
//! A [`Writer`] fills a `Vec` or, where nothing may allocate (a signal handler), a
//! [`Fixed`] array. A [`Reader`] refuses a field that runs past the end of its data, and a
//! list longer than the bytes left before it allocates anything.

use std::io;

/// Where a [`Writer`] puts its bytes.
pub(crate) trait Buffer {
    fn put(&mut self, bytes: &[u8]);
}

impl Buffer for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// `N` bytes on the stack, for a writer that must not allocate. Bytes beyond `N` are
/// dropped (a fixed layout is sized to fit; a test holds each one).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fixed<const N: usize> {
    data: [u8; N],
    len: usize,
}

impl<const N: usize> Buffer for Fixed<N> {
    fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(N - self.len);
        self.data[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }
}

/// Writes little-endian fields, one call a field: `Writer::new().u8(1).bytes(b"x").finish()`.
#[derive(Debug, Default)]
pub(crate) struct Writer<B: Buffer = Vec<u8>>(B);

impl Writer {
    pub(crate) fn new() -> Writer {
        Writer(Vec::new())
    }

    pub(crate) fn with_capacity(capacity: usize) -> Writer {
        Writer(Vec::with_capacity(capacity))
    }
}

impl<const N: usize> Writer<Fixed<N>> {
    /// A writer into `N` zeroed bytes on the stack.
    pub(crate) const fn fixed() -> Writer<Fixed<N>> {
        Writer(Fixed {
            data: [0; N],
            len: 0,
        })
    }

    /// The `N` bytes (zeros after the last field written).
    pub(crate) fn array(self) -> [u8; N] {
        self.0.data
    }
}

impl<B: Buffer> Writer<B> {
    pub(crate) fn u8(mut self, v: u8) -> Self {
        self.0.put(&[v]);
        self
    }

    pub(crate) fn u32(mut self, v: u32) -> Self {
        self.0.put(&v.to_le_bytes());
        self
    }

    pub(crate) fn i32(self, v: i32) -> Self {
        self.u32(v as u32)
    }

    pub(crate) fn u64(mut self, v: u64) -> Self {
        self.0.put(&v.to_le_bytes());
        self
    }

    /// A byte string: its length (u64), then its bytes.
    pub(crate) fn bytes(self, v: &[u8]) -> Self {
        self.u64(v.len() as u64).raw(v)
    }

    /// Bytes as they are, with no length (the rest of a frame, or a length given before).
    pub(crate) fn raw(mut self, v: &[u8]) -> Self {
        self.0.put(v);
        self
    }

    /// A list: its length (u32), then each item as `each` writes it.
    pub(crate) fn list<T>(self, items: &[T], mut each: impl FnMut(Self, &T) -> Self) -> Self {
        let mut w = self.u32(items.len() as u32);
        for item in items {
            w = each(w, item);
        }
        w
    }

    pub(crate) fn finish(self) -> B {
        self.0
    }
}

/// The error of a [`Reader`]: the data does not hold what was asked for.
pub(crate) fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("malformed {what}"))
}

/// Reads back what a [`Writer`] wrote; each field read moves past it. `what` names the
/// message in errors ("zygote message").
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    data: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(data: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { data, what }
    }

    fn malformed(&self) -> io::Error {
        malformed(self.what)
    }

    /// The next `n` bytes.
    pub(crate) fn take(&mut self, n: usize) -> io::Result<&'a [u8]> {
        if self.data.len() < n {
            return Err(self.malformed());
        }
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }

    /// The next `n` bytes, or fewer when the data ends first (a frame cut short).
    pub(crate) fn take_up_to(&mut self, n: u64) -> &'a [u8] {
        let n = usize::try_from(n).map_or(self.data.len(), |n| n.min(self.data.len()));
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head
    }

    /// Everything not read yet.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }

    fn array<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let bytes = self.take(N)?;
        bytes.try_into().map_err(|_| self.malformed())
    }

    pub(crate) fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take(1)?[0])
    }

    pub(crate) fn u32(&mut self) -> io::Result<u32> {
        self.array().map(u32::from_le_bytes)
    }

    pub(crate) fn i32(&mut self) -> io::Result<i32> {
        Ok(self.u32()? as i32)
    }

    pub(crate) fn u64(&mut self) -> io::Result<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A byte string written by [`Writer::bytes`].
    pub(crate) fn bytes(&mut self) -> io::Result<&'a [u8]> {
        let n = usize::try_from(self.u64()?).map_err(|_| self.malformed())?;
        self.take(n)
    }

    /// A list written by [`Writer::list`], each item read by `each`.
    pub(crate) fn list<T>(
        &mut self,
        mut each: impl FnMut(&mut Self) -> io::Result<T>,
    ) -> io::Result<Vec<T>> {
        let n = self.u32()? as usize;
        // Every item takes a byte at least: a longer list is refused before allocating.
        if n > self.data.len() {
            return Err(self.malformed());
        }
        (0..n).map(|_| each(self)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_read_back_as_written() -> io::Result<()> {
        let data = Writer::new()
            .u8(7)
            .u32(70_000)
            .i32(-5)
            .u64(u64::MAX)
            .bytes(b"name")
            .list(&[1u32, 2, 3], |w, &v| w.u32(v))
            .raw(b"tail")
            .finish();
        let mut r = Reader::new(&data, "test message");
        assert_eq!(r.u8()?, 7);
        assert_eq!(r.u32()?, 70_000);
        assert_eq!(r.i32()?, -5);
        assert_eq!(r.u64()?, u64::MAX);
        assert_eq!(r.bytes()?, b"name");
        assert_eq!(r.list(|r| r.u32())?, vec![1, 2, 3]);
        assert_eq!(r.rest(), b"tail");
        assert!(r.u8().is_err());
        Ok(())
    }

    #[test]
    fn a_field_past_the_end_is_malformed() {
        let data = Writer::new().bytes(b"abc").finish();
        for cut in 0..data.len() {
            let err = Reader::new(&data[..cut], "zygote message")
                .bytes()
                .unwrap_err();
            assert_eq!(err.to_string(), "malformed zygote message");
        }
        let huge = Writer::new().u32(u32::MAX).finish();
        assert!(Reader::new(&huge, "list").list(|r| r.u8()).is_err());
        let mut r = Reader::new(b"abc", "frame");
        assert_eq!(r.take_up_to(10), b"abc");
        assert_eq!(r.take_up_to(1), b"");
    }

    #[test]
    fn a_fixed_writer_fills_its_array_and_no_more() {
        let bytes: [u8; 6] = Writer::fixed().u8(1).u32(2).array();
        assert_eq!(bytes, [1, 2, 0, 0, 0, 0]);
        let cut: [u8; 3] = Writer::fixed().u64(u64::MAX).array();
        assert_eq!(cut, [0xff; 3]);
    }
}
