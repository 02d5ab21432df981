//! A dict key's canonical bytes: what a shared dict hashes and compares, the same for keys
//! that Python holds equal (`1`, `1.0`, `True`; a frozenset in any order) and the same in
//! every process, whatever its hash seed. Numbers (bool, int, float, complex), str, bytes,
//! None, and tuples and frozensets of them are encoded here; a key of another type that a
//! dict holds equal to an int or float (numpy's scalars, a `Decimal(1)`) as that number; any
//! other key by its pickle (protocol 5), after a `hash()` that refuses an unhashable one, as
//! a dict would.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyComplex, PyFloat, PyFrozenSet, PyInt, PyString, PyTuple};

/// The largest float that converts exactly to an i64 bound (2^63).
const I64_BOUND: f64 = 9_223_372_036_854_775_808.0;

/// Appends the canonical bytes of `key` to `out`.
pub fn canonical(key: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    if key.is_none() {
        out.push(b'n');
    } else if let Ok(s) = key.downcast::<PyString>() {
        out.push(b's');
        match s.to_cow() {
            Ok(text) => out.extend_from_slice(text.as_bytes()),
            // Lone surrogates: UTF-8 with them kept, as Python's "surrogatepass" writes it.
            Err(_) => {
                let encoded = s.call_method1("encode", ("utf-8", "surrogatepass"))?;
                out.extend_from_slice(encoded.downcast::<PyBytes>()?.as_bytes());
            }
        }
    } else if let Ok(i) = key.downcast::<PyInt>() {
        integer(i, out)?;
    } else if let Ok(f) = key.downcast::<PyFloat>() {
        float(key.py(), f.value(), out)?;
    } else if let Ok(c) = key.downcast::<PyComplex>() {
        if c.imag() == 0.0 {
            float(key.py(), c.real(), out)?;
        } else {
            out.push(b'c');
            out.extend_from_slice(&c.real().to_bits().to_le_bytes());
            out.extend_from_slice(&c.imag().to_bits().to_le_bytes());
        }
    } else if let Ok(b) = key.downcast::<PyBytes>() {
        out.push(b'b');
        out.extend_from_slice(b.as_bytes());
    } else if let Ok(t) = key.downcast::<PyTuple>() {
        out.push(b't');
        for item in t.iter() {
            nested(&item, out)?;
        }
    } else if let Ok(set) = key.downcast::<PyFrozenSet>() {
        let mut parts = Vec::with_capacity(set.len());
        for item in set.iter() {
            let mut part = Vec::new();
            nested(&item, &mut part)?;
            parts.push(part);
        }
        parts.sort_unstable();
        out.push(b'z');
        parts.iter().for_each(|p| out.extend_from_slice(p));
    } else if let Some(number) = as_number(key)? {
        canonical(&number, out)?;
    } else {
        key.hash()?;
        let pickled = super::pickle::dumps(key)?;
        out.push(b'p');
        out.extend_from_slice(pickled.as_bytes());
    }
    Ok(())
}

/// The int or float that a key of another type stands for in a dict (numpy's integers,
/// floats and bools, a `Decimal` or `Fraction` of the same value): the number it converts
/// to (`__index__`, else `__complex__`, else `__float__`) when the two are equal and hash
/// alike, as a dict
/// needs to hold them one key; None for any other key.
fn as_number<'py>(key: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    let py = key.py();
    let number = if let Ok(n) = key.call_method0(intern!(py, "__index__")) {
        n.is_instance_of::<PyInt>().then_some(n)
    } else if let Ok(n) = key.call_method0(intern!(py, "__complex__")) {
        // Before `__float__`, which warns for numpy's complex numbers.
        n.is_instance_of::<PyComplex>().then_some(n)
    } else if let Ok(n) = key.call_method0(intern!(py, "__float__")) {
        n.is_instance_of::<PyFloat>().then_some(n)
    } else {
        None
    };
    let Some(number) = number else {
        return Ok(None);
    };
    let Ok(hash) = key.hash() else {
        return Ok(None); // unhashable: the caller says so
    };
    Ok((number.hash()? == hash && number.eq(key)?).then_some(number))
}

/// An element of a tuple or frozenset: its canonical bytes after their length, so that
/// no two sequences of elements read alike.
fn nested(item: &Bound<'_, PyAny>, out: &mut Vec<u8>) -> PyResult<()> {
    let mut part = Vec::new();
    canonical(item, &mut part)?;
    out.extend_from_slice(&(part.len() as u64).to_le_bytes());
    out.extend_from_slice(&part);
    Ok(())
}

fn integer(i: &Bound<'_, PyInt>, out: &mut Vec<u8>) -> PyResult<()> {
    if let Ok(v) = i.extract::<i64>() {
        out.push(b'i');
        out.extend_from_slice(&v.to_le_bytes());
        return Ok(());
    }
    // Beyond 64 bits: two's complement, little-endian, as few bytes as hold it.
    let bits: usize = i.call_method0("bit_length")?.extract()?;
    let kwargs = [("signed", true)].into_py_dict(i.py())?;
    let bytes = i.call_method("to_bytes", (bits / 8 + 1, "little"), Some(&kwargs))?;
    out.push(b'I');
    out.extend_from_slice(bytes.downcast::<PyBytes>()?.as_bytes());
    Ok(())
}

fn float(py: Python<'_>, v: f64, out: &mut Vec<u8>) -> PyResult<()> {
    if v.is_finite() && v.fract() == 0.0 {
        if (-I64_BOUND..I64_BOUND).contains(&v) {
            out.push(b'i');
            out.extend_from_slice(&(v as i64).to_le_bytes());
            return Ok(());
        }
        let whole = py.get_type::<PyInt>().call1((v,))?;
        return integer(whole.downcast::<PyInt>()?, out);
    }
    out.push(b'f');
    out.extend_from_slice(&v.to_bits().to_le_bytes());
    Ok(())
}
