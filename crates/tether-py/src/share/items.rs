//! `SharedItems`: a shared list's or dict's table (tether-core's `share::table`) as Python
//! reads it. Each item is written on its own when the table is built (plain values in
//! tether's form, anything else pickled: see `codec`), and read back from the shared pages
//! when it is read: reading makes new objects in the reader's own memory and never writes to
//! the pages (they are mapped read-only).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

use pyo3::exceptions::{PyIndexError, PyKeyError, PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PySlice, PyTuple};
use tether_core::share::{Kind, Table, TableBuilder};

use super::codec;
use super::keys::canonical;
use super::pickle::{dumps, load};
use crate::convert::Fd;
use crate::error::os_error;

/// A pickle without its frame header: a small object's pickle is one frame, whose 9-byte
/// header (opcode and length) only helps a reader of a file. What is left (protocol, then
/// the opcodes) unpickles the same.
fn unframed(p: &[u8]) -> [&[u8]; 2] {
    const FRAME: u8 = 0x95;
    if let (Some(&[0x80, _, FRAME]), Some(len)) = (p.get(..3), p.get(3..11)) {
        let len = u64::from_le_bytes(len.try_into().unwrap_or([0xff; 8]));
        if len == (p.len() - 11) as u64 {
            return [&p[..2], &p[11..]];
        }
    }
    [p, &[]]
}

/// An item (or a dict's key or value) as it is written: plain values in tether's form,
/// anything else pickled (see `codec`), into `scratch`; the parts to write.
fn written<'a, 'py>(
    obj: &Bound<'py, PyAny>,
    scratch: &'a mut Vec<u8>,
    pickled: &'a mut Option<Bound<'py, PyBytes>>,
) -> PyResult<[&'a [u8]; 2]> {
    scratch.clear();
    if codec::encode(obj, scratch)? {
        return Ok([scratch.as_slice(), &[]]);
    }
    Ok(unframed(pickled.insert(dumps(obj)?).as_bytes()))
}

/// An item read back: plain values decoded here, a pickle unpickled (see `unpickle`).
fn load_item(py: Python<'_>, bytes: &[u8]) -> PyResult<PyObject> {
    match bytes.first() {
        Some(&codec::PICKLE) => load(py, bytes),
        _ => Ok(codec::decode(py, bytes)?.unbind()),
    }
}

/// The items of a shared list or dict, built or opened, before a shared object takes them:
/// one constructor per kind.
#[pyclass(module = "tether._native", frozen)]
pub struct SharedTable {
    inner: Mutex<Option<SharedItems>>,
}

impl SharedTable {
    fn of(items: SharedItems) -> SharedTable {
        SharedTable {
            inner: Mutex::new(Some(items)),
        }
    }
}

#[pymethods]
impl SharedTable {
    /// The items of a list or tuple, written one by one into a new sealed memfd `name`.
    #[staticmethod]
    #[pyo3(signature = (items, name = ""))]
    fn of_list(py: Python<'_>, items: &Bound<'_, PyAny>, name: &str) -> PyResult<SharedTable> {
        SharedItems::from_sequence(py, items, name).map(SharedTable::of)
    }

    /// The pairs of a dict, in its order, with each key's canonical bytes, into a new
    /// sealed memfd `name`.
    #[staticmethod]
    #[pyo3(signature = (items, name = ""))]
    fn of_dict(py: Python<'_>, items: &Bound<'_, PyDict>, name: &str) -> PyResult<SharedTable> {
        SharedItems::from_dict(py, items, name).map(SharedTable::of)
    }

    /// The items in the memfd `fd` made so in any process (handed over: it is closed with
    /// the shared object).
    #[staticmethod]
    fn of_fd(fd: Fd) -> PyResult<SharedTable> {
        SharedItems::open(fd.take()).map(SharedTable::of)
    }
}

/// The items of a shared list or dict, in their sealed memfd, mapped read-only.
#[pyclass(module = "tether._native", frozen, subclass, weakref)]
pub struct SharedItems {
    table: Table,
    fd: OwnedFd,
}

impl SharedItems {
    fn open(fd: OwnedFd) -> PyResult<SharedItems> {
        let table = Table::open(&fd).map_err(os_error)?;
        Ok(SharedItems { table, fd })
    }

    fn finish(py: Python<'_>, builder: TableBuilder, name: &str) -> PyResult<SharedItems> {
        let fd = py
            .allow_threads(|| builder.finish(name))
            .map_err(os_error)?;
        SharedItems::open(fd)
    }

    fn item(&self, py: Python<'_>, i: usize) -> PyResult<PyObject> {
        load_item(py, self.table.item(i).map_err(os_error)?)
    }

    /// Part `what` of entry `i`: 0 the item (a list's) or the pair (a dict's), 1 the key,
    /// 2 the value.
    fn part(&self, py: Python<'_>, i: usize, what: u8) -> PyResult<PyObject> {
        if self.table.kind() == Kind::List {
            return self.item(py, i);
        }
        let (_, key, value) = self.table.entry(i).map_err(os_error)?;
        Ok(match what {
            1 => load_item(py, key)?,
            2 => load_item(py, value)?,
            _ => PyTuple::new(py, [load_item(py, key)?, load_item(py, value)?])?
                .into_any()
                .unbind(),
        })
    }

    fn find(&self, key: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
        let mut bytes = Vec::new();
        match canonical(key, &mut bytes) {
            Ok(()) => self.table.find(&bytes).map_err(os_error),
            // An unhashable key is a TypeError, as for a dict; one that does not pickle
            // cannot equal a key that did.
            Err(err) if err.is_instance_of::<PyTypeError>(key.py()) && key.hash().is_err() => {
                Err(err)
            }
            Err(_) => Ok(None),
        }
    }

    fn from_sequence(py: Python<'_>, items: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let n = items.len()?;
        let mut builder = TableBuilder::new(Kind::List, n);
        let (mut scratch, mut pickled) = (Vec::new(), None);
        for item in items.try_iter()? {
            builder.piece(&written(&item?, &mut scratch, &mut pickled)?);
        }
        SharedItems::finish(py, builder, name)
    }

    fn from_dict(py: Python<'_>, items: &Bound<'_, PyDict>, name: &str) -> PyResult<Self> {
        let mut builder = TableBuilder::new(Kind::Dict, items.len());
        let (mut scratch, mut pickled) = (Vec::new(), None);
        for (key, value) in items.iter() {
            scratch.clear();
            canonical(&key, &mut scratch)?;
            builder.piece(&[&scratch]);
            builder.piece(&written(&key, &mut scratch, &mut pickled)?);
            builder.piece(&written(&value, &mut scratch, &mut pickled)?);
        }
        SharedItems::finish(py, builder, name)
    }

    fn slice(&self, py: Python<'_>, slice: &Bound<'_, PySlice>) -> PyResult<PyObject> {
        let len = isize::try_from(self.table.len()).unwrap_or(isize::MAX);
        let range = slice.indices(len)?;
        let list = PyList::empty(py);
        let mut at = range.start;
        for _ in 0..range.slicelength {
            list.append(self.item(py, at as usize)?)?;
            at += range.step;
        }
        Ok(list.into_any().unbind())
    }
}

#[pymethods]
impl SharedItems {
    /// `SharedItems(table)`: the items that `table` (a [`SharedTable`], made by one of its
    /// constructors, one per kind) holds; a table makes one shared object. Python subclasses
    /// it (`tether.SharedList`, `tether.SharedDict`).
    #[new]
    fn new(table: &SharedTable) -> PyResult<Self> {
        let taken = table.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        taken.ok_or_else(|| PyValueError::new_err("this SharedTable has made its shared object"))
    }

    /// The memfd (still this object's).
    fn _fileno(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    #[getter]
    fn _is_dict(&self) -> bool {
        self.table.kind() == Kind::Dict
    }

    /// The size of the memfd, in bytes.
    #[getter]
    fn _nbytes(&self) -> usize {
        self.table.size()
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    /// A list's item at an int index (negative counts from the end), or a list of the
    /// items of a slice; a dict's value for a key (KeyError when it has none).
    fn __getitem__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        if self.table.kind() == Kind::Dict {
            return match self.find(key)? {
                Some(i) => self.part(py, i, 2),
                None => Err(PyKeyError::new_err(key.clone().unbind())),
            };
        }
        if let Ok(slice) = key.downcast::<PySlice>() {
            return self.slice(py, slice);
        }
        let len = self.table.len() as isize;
        let i = index(key)?;
        let at = if i < 0 { i + len } else { i };
        if !(0..len).contains(&at) {
            return Err(PyIndexError::new_err("SharedList index out of range"));
        }
        self.item(py, at as usize)
    }

    /// A list's items, or a dict's keys.
    fn __iter__(slf: Bound<'_, Self>) -> SharedIter {
        let what = u8::from(slf.get().table.kind() == Kind::Dict);
        SharedIter {
            items: slf.unbind(),
            next: 0,
            what,
        }
    }

    /// Whether a dict has `value` as a key, or a list has an item equal to it.
    fn __contains__(&self, py: Python<'_>, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        if self.table.kind() == Kind::Dict {
            return Ok(self.find(value)?.is_some());
        }
        for i in 0..self.table.len() {
            let item = self.item(py, i)?;
            if item.bind(py).is(value) || item.bind(py).eq(value)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A dict's value for `key`, or `default`.
    fn _get(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        default: PyObject,
    ) -> PyResult<PyObject> {
        match self.find(key)? {
            Some(i) => self.part(py, i, 2),
            None => Ok(default),
        }
    }

    /// An iterator from entry `start`: over a list's items, or a dict's pairs (`what` 0),
    /// keys (1) or values (2).
    #[pyo3(signature = (what=0, start=0))]
    fn _iterate(slf: Py<Self>, what: u8, start: usize) -> SharedIter {
        SharedIter {
            items: slf,
            next: start,
            what,
        }
    }

    /// Whether `other` maps the same memfd (one copy, reached twice).
    fn _same(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        let Ok(other) = other.downcast::<SharedItems>() else {
            return Ok(false);
        };
        let (a, b) = (
            rustix::fs::fstat(&self.fd).map_err(|e| os_error(e.into()))?,
            rustix::fs::fstat(&other.get().fd).map_err(|e| os_error(e.into()))?,
        );
        Ok((a.st_dev, a.st_ino) == (b.st_dev, b.st_ino))
    }
}

/// Whether the memfd `fd` (lent) holds a shared dict (else a list).
#[pyfunction]
pub fn share_is_dict(fd: Fd) -> PyResult<bool> {
    let fd = fd.borrow().try_clone_to_owned().map_err(os_error)?;
    Ok(tether_core::share::kind_of(&fd).map_err(os_error)? == Kind::Dict)
}

/// A list index, as `list` takes it (anything with `__index__`).
fn index(key: &Bound<'_, PyAny>) -> PyResult<isize> {
    let py = key.py();
    match key.extract::<isize>() {
        Ok(i) => Ok(i),
        Err(err) if err.is_instance_of::<PyOverflowError>(py) => {
            Err(PyIndexError::new_err(format!(
                "cannot fit '{}' into an index-sized integer",
                key.get_type().name()?
            )))
        }
        Err(_) => Err(PyTypeError::new_err(format!(
            "SharedList indices must be integers or slices, not {}",
            key.get_type().name()?
        ))),
    }
}

/// An iterator over a shared list or dict (see `SharedItems._iterate`).
#[pyclass(module = "tether._native")]
pub struct SharedIter {
    items: Py<SharedItems>,
    next: usize,
    what: u8,
}

#[pymethods]
impl SharedIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<PyObject>> {
        let items = self.items.get();
        if self.next >= items.table.len() {
            return Ok(None);
        }
        self.next += 1;
        items.part(py, self.next - 1, self.what).map(Some)
    }

    /// How many items are left (for `operator.length_hint`).
    fn __length_hint__(&self) -> usize {
        self.items.get().table.len().saturating_sub(self.next)
    }
}
