//! How a shared item is written: the plain values of most datasets (None, bool, int, float,
//! str, bytes, and tuples and lists of them: an ImageFolder's `(path, class)`) in a compact
//! form of tether's own that reads back without an unpickler, anything else as a pickle
//! (protocol 5). A pickle starts with its PROTO opcode (0x80), which no tag here is, so an
//! item says which it is by its first byte; inside a tuple or list, a value that is no plain
//! value is a pickle of its own ([`PICKLED`]).
//!
//! Only exact types are plain (a str subclass, a namedtuple, a bool-like int subclass are
//! pickled, and come back as themselves). A list met twice in one item (`[x, x]`) makes the
//! whole item a pickle, which keeps the two one list, as it was.

use std::os::raw::c_char;

use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyFloat, PyInt, PyList, PyString, PyTuple};

const NONE: u8 = 1;
const FALSE: u8 = 2;
const TRUE: u8 = 3;
const INT8: u8 = 4;
const INT16: u8 = 5;
const INT32: u8 = 6;
const INT64: u8 = 7;
const FLOAT: u8 = 8;
const STR8: u8 = 9;
const STR32: u8 = 10;
const BYTES8: u8 = 11;
const BYTES32: u8 = 12;
const TUPLE8: u8 = 13;
const TUPLE32: u8 = 14;
const LIST8: u8 = 15;
const LIST32: u8 = 16;
const PICKLED: u8 = 17;
/// A pickle's first byte (its PROTO opcode): the whole item is a pickle.
pub const PICKLE: u8 = 0x80;

/// How deep plain containers nest before the rest is pickled.
const MAX_DEPTH: usize = 32;

/// Appends `obj` to `out`, written as plain values where it is made of them; false (and
/// `out` as it was) when it is not, and the caller pickles it.
pub fn encode(obj: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<bool> {
    let start = out.len();
    let mut lists = Vec::new();
    let plain = encode_value(obj, out, 0, &mut lists)?;
    if !plain {
        out.truncate(start);
    }
    Ok(plain)
}

/// One value; `lists` are the lists met so far in this item (a second meeting is false).
fn encode_value(
    obj: &Bound<'_, PyAny>,
    out: &mut Vec<u8>,
    depth: usize,
    lists: &mut Vec<usize>,
) -> PyResult<bool> {
    if obj.is_none() {
        out.push(NONE);
    } else if obj.is_exact_instance_of::<PyBool>() {
        out.push(if obj.is_truthy()? { TRUE } else { FALSE });
    } else if obj.is_exact_instance_of::<PyInt>() {
        let Ok(v) = obj.extract::<i64>() else {
            return nested_pickle(obj, out, depth);
        };
        integer(v, out);
    } else if obj.is_exact_instance_of::<PyFloat>() {
        out.push(FLOAT);
        out.extend_from_slice(&obj.extract::<f64>()?.to_le_bytes());
    } else if let Ok(s) = obj.downcast_exact::<PyString>() {
        // Lone surrogates have no UTF-8: pickled (as "surrogatepass").
        let Ok(text) = s.to_cow() else {
            return nested_pickle(obj, out, depth);
        };
        sized(out, STR8, STR32, text.len())?;
        out.extend_from_slice(text.as_bytes());
    } else if let Ok(b) = obj.downcast_exact::<PyBytes>() {
        sized(out, BYTES8, BYTES32, b.as_bytes().len())?;
        out.extend_from_slice(b.as_bytes());
    } else if depth < MAX_DEPTH && obj.is_exact_instance_of::<PyTuple>() {
        let t = obj.downcast::<PyTuple>()?;
        sized(out, TUPLE8, TUPLE32, t.len())?;
        for item in t.iter() {
            if !encode_value(&item, out, depth + 1, lists)? {
                return Ok(false);
            }
        }
    } else if depth < MAX_DEPTH && obj.is_exact_instance_of::<PyList>() {
        let address = obj.as_ptr() as usize;
        if lists.contains(&address) {
            return Ok(false);
        }
        lists.push(address);
        let l = obj.downcast::<PyList>()?;
        let items: Vec<Bound<'_, PyAny>> = l.iter().collect();
        sized(out, LIST8, LIST32, items.len())?;
        for item in &items {
            if !encode_value(item, out, depth + 1, lists)? {
                return Ok(false);
            }
        }
    } else {
        return nested_pickle(obj, out, depth);
    }
    Ok(true)
}

/// A value inside a tuple or list that is no plain value: its own pickle. At the top of an
/// item, false: the item is pickled whole.
fn nested_pickle(obj: &Bound<'_, PyAny>, out: &mut Vec<u8>, depth: usize) -> PyResult<bool> {
    if depth == 0 {
        return Ok(false);
    }
    let pickled = super::pickle::dumps(obj)?;
    sized(out, PICKLED, PICKLED, pickled.as_bytes().len())?;
    out.extend_from_slice(pickled.as_bytes());
    Ok(true)
}

fn integer(v: i64, out: &mut Vec<u8>) {
    if let Ok(v) = i8::try_from(v) {
        out.push(INT8);
        out.extend_from_slice(&v.to_le_bytes());
    } else if let Ok(v) = i16::try_from(v) {
        out.push(INT16);
        out.extend_from_slice(&v.to_le_bytes());
    } else if let Ok(v) = i32::try_from(v) {
        out.push(INT32);
        out.extend_from_slice(&v.to_le_bytes());
    } else {
        out.push(INT64);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// A tag and a length: `short` with one byte up to 255, else `long` with four (`short ==
/// long`: always four).
fn sized(out: &mut Vec<u8>, short: u8, long: u8, len: usize) -> PyResult<()> {
    match u8::try_from(len) {
        Ok(n) if short != long => out.extend_from_slice(&[short, n]),
        _ => {
            let n = u32::try_from(len)
                .map_err(|_| PyValueError::new_err("a shared value of 4 GiB or more"))?;
            out.push(long);
            out.extend_from_slice(&n.to_le_bytes());
        }
    }
    Ok(())
}

fn damaged() -> PyErr {
    PyValueError::new_err("a damaged shared item")
}

/// Reads back what [`encode`] wrote (an item that starts with a plain value's tag).
pub fn decode<'py>(py: Python<'py>, bytes: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let mut reader = Reader { bytes, at: 0 };
    let value = reader.value(py, 0)?;
    if reader.at != bytes.len() {
        return Err(damaged());
    }
    Ok(value)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> PyResult<&'a [u8]> {
        let end = self.at.checked_add(n).ok_or_else(damaged)?;
        let taken = self.bytes.get(self.at..end).ok_or_else(damaged)?;
        self.at = end;
        Ok(taken)
    }

    fn array<const N: usize>(&mut self) -> PyResult<[u8; N]> {
        self.take(N)?.try_into().map_err(|_| damaged())
    }

    /// A length: one byte after a short tag, four after a long one.
    fn len(&mut self, short: bool) -> PyResult<usize> {
        Ok(if short {
            usize::from(self.array::<1>()?[0])
        } else {
            u32::from_le_bytes(self.array()?) as usize
        })
    }

    fn value<'py>(&mut self, py: Python<'py>, depth: usize) -> PyResult<Bound<'py, PyAny>> {
        let tag = self.array::<1>()?[0];
        Ok(match tag {
            NONE => py.None().into_bound(py),
            FALSE | TRUE => PyBool::new(py, tag == TRUE).to_owned().into_any(),
            INT8 => i8::from_le_bytes(self.array()?)
                .into_pyobject(py)?
                .into_any(),
            INT16 => i16::from_le_bytes(self.array()?)
                .into_pyobject(py)?
                .into_any(),
            INT32 => i32::from_le_bytes(self.array()?)
                .into_pyobject(py)?
                .into_any(),
            INT64 => i64::from_le_bytes(self.array()?)
                .into_pyobject(py)?
                .into_any(),
            FLOAT => PyFloat::new(py, f64::from_le_bytes(self.array()?)).into_any(),
            STR8 | STR32 => {
                let len = self.len(tag == STR8)?;
                string(py, self.take(len)?)?
            }
            BYTES8 | BYTES32 => {
                let len = self.len(tag == BYTES8)?;
                PyBytes::new(py, self.take(len)?).into_any()
            }
            TUPLE8 | TUPLE32 | LIST8 | LIST32 if depth < MAX_DEPTH => {
                let len = self.len(tag == TUPLE8 || tag == LIST8)?;
                // Every item takes a byte at least: a longer one is refused before allocating.
                if len > self.bytes.len() - self.at {
                    return Err(damaged());
                }
                self.sequence(py, len, tag == TUPLE8 || tag == TUPLE32, depth)?
            }
            PICKLED => {
                let len = self.len(false)?;
                super::pickle::load(py, self.take(len)?)?.into_bound(py)
            }
            _ => return Err(damaged()),
        })
    }
}

impl Reader<'_> {
    /// A tuple or list of `len` values, filled as they are read (no list in between).
    fn sequence<'py>(
        &mut self,
        py: Python<'py>,
        len: usize,
        tuple: bool,
        depth: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = isize::try_from(len).map_err(|_| damaged())?;
        // SAFETY: a new tuple or list of `n` empty slots (NULL), owned here; a failure to
        // allocate is NULL with an exception set, which `from_owned_ptr_or_err` returns.
        let made = unsafe {
            let ptr = if tuple {
                ffi::PyTuple_New(n)
            } else {
                ffi::PyList_New(n)
            };
            Bound::from_owned_ptr_or_err(py, ptr)?
        };
        for i in 0..n {
            let item = self.value(py, depth + 1)?.into_ptr();
            // SAFETY: `i` is in range and its slot empty; SetItem steals the new reference
            // `item`. A slot left empty by an error is NULL, which dealloc skips.
            unsafe {
                if tuple {
                    ffi::PyTuple_SetItem(made.as_ptr(), i, item);
                } else {
                    ffi::PyList_SetItem(made.as_ptr(), i, item);
                }
            }
        }
        Ok(made)
    }
}

/// A str from UTF-8 bytes, checked by CPython's own decoder.
fn string<'py>(py: Python<'py>, utf8: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let len = isize::try_from(utf8.len()).map_err(|_| damaged())?;
    // SAFETY: `utf8` is valid for `len` bytes during the call; the decoder copies them and
    // returns a new reference (or NULL with an exception set, which `from_owned_ptr_or_err`
    // turns into the error).
    unsafe {
        let ptr = ffi::PyUnicode_DecodeUTF8(utf8.as_ptr().cast::<c_char>(), len, std::ptr::null());
        Bound::from_owned_ptr_or_err(py, ptr)
    }
}
