//! Containers of plain values (see `python/tether/_plain.py`): which lists and tuples hold
//! only plain values, and whether one still holds the very objects of its shadow. Both run
//! with the GIL held and call no Python code, so no thread can change the list meanwhile.

use pyo3::ffi;
use pyo3::prelude::*;

/// How deep tuples and frozensets of plain values may nest before a value counts as not
/// plain (a bound on the recursion, not a limit anyone meets).
const MAX_NESTING: usize = 32;

/// Whether the list or tuple `current` holds exactly the objects of the tuple `shadow`, in
/// order: identity, item by item (one comparison of their item arrays where this
/// interpreter lays lists and tuples out as CPython does). False for anything else.
#[pyfunction]
fn same_items(current: &Bound<'_, PyAny>, shadow: &Bound<'_, PyAny>) -> bool {
    let layout = LAYOUT.get_or_init(current.py(), || Layout::probe(current.py()));
    let (cur, sh) = (current.as_ptr(), shadow.as_ptr());
    // SAFETY: both pointers are live objects borrowed for this call, and the GIL is held;
    // the type checks pick the accessor each object supports, every index is below the
    // size read just before, and nothing here runs Python code that could change them.
    unsafe {
        if ffi::PyTuple_Check(sh) == 0 {
            return false;
        }
        let n = ffi::PyTuple_Size(sh);
        let size = if ffi::PyList_Check(cur) != 0 {
            ffi::PyList_Size(cur)
        } else if ffi::PyTuple_Check(cur) != 0 {
            if cur == sh {
                return true;
            }
            ffi::PyTuple_Size(cur)
        } else {
            return false;
        };
        if size != n {
            return false;
        }
        match (layout.items(cur), layout.items(sh)) {
            (Some(a), Some(b)) => {
                std::slice::from_raw_parts(a, n as usize)
                    == std::slice::from_raw_parts(b, n as usize)
            }
            _ => (0..n).all(|i| item(cur, i) == ffi::PyTuple_GetItem(sh, i)),
        }
    }
}

/// # Safety
/// `seq` is a live list or tuple, `i` below its size, and the GIL is held.
unsafe fn item(seq: *mut ffi::PyObject, i: ffi::Py_ssize_t) -> *mut ffi::PyObject {
    if ffi::PyList_Check(seq) != 0 {
        ffi::PyList_GetItem(seq, i)
    } else {
        ffi::PyTuple_GetItem(seq, i)
    }
}

static LAYOUT: pyo3::sync::GILOnceCell<Layout> = pyo3::sync::GILOnceCell::new();

/// Where this interpreter keeps the item arrays of lists and tuples: byte offsets from the
/// object (a list holds a pointer to its array there; a tuple holds the array itself), as
/// CPython lays them out, checked on a list and a tuple made for the purpose; None when
/// they are not there.
struct Layout {
    list: Option<usize>,
    tuple: Option<usize>,
}

impl Layout {
    /// `PyObject_VAR_HEAD`: reference count, type, size.
    const HEAD: usize = 3 * std::mem::size_of::<usize>();

    fn probe(py: Python<'_>) -> Layout {
        let a = py.None();
        let b = pyo3::types::PyTuple::empty(py);
        let list = pyo3::types::PyList::new(py, [a.bind(py).as_any(), b.as_any()]).ok();
        let tuple = pyo3::types::PyTuple::new(py, [a.bind(py).as_any(), b.as_any()]).ok();
        let want = [a.as_ptr(), b.as_ptr()];
        // SAFETY: the probe is a live list; the word at HEAD is its item array in every
        // CPython this abi3 module loads in (3.9 on, without free threading), read and
        // followed for its two items only when it is not null; the items read are compared,
        // never dereferenced.
        let list_ok = list.is_some_and(|l| unsafe {
            let array = *(l.as_ptr() as *const u8)
                .add(Self::HEAD)
                .cast::<*mut *mut ffi::PyObject>();
            !array.is_null() && std::slice::from_raw_parts(array, 2) == want
        });
        // SAFETY: the probe is a live tuple of two items, so the two words after its header
        // lie inside the object (its items, or a field before them in another layout);
        // they are compared, never dereferenced.
        let tuple_ok = tuple.is_some_and(|t| unsafe {
            std::slice::from_raw_parts(
                (t.as_ptr() as *const u8)
                    .add(Self::HEAD)
                    .cast::<*mut ffi::PyObject>(),
                2,
            ) == want
        });
        Layout {
            list: list_ok.then_some(Self::HEAD),
            tuple: tuple_ok.then_some(Self::HEAD),
        }
    }

    /// The item array of a live list or tuple, where the layout was confirmed.
    ///
    /// # Safety
    /// `seq` is a live list or tuple and the GIL is held.
    unsafe fn items(&self, seq: *mut ffi::PyObject) -> Option<*const *mut ffi::PyObject> {
        let base = seq as *const u8;
        if ffi::PyList_Check(seq) != 0 {
            let array = *base.add(self.list?).cast::<*const *mut ffi::PyObject>();
            (!array.is_null()).then_some(array)
        } else {
            Some(base.add(self.tuple?).cast::<*mut ffi::PyObject>())
        }
    }
}

/// The address of a list's item array and the bytes it spans, `(start, end)` (None for
/// anything else, or where this interpreter does not lay lists out as CPython does): a big
/// list's array is watched for writes, so that an unchanged list is proven so without
/// reading it (see `python/tether/pool/snapshot/plain.py`).
#[pyfunction]
fn item_array(items: &Bound<'_, PyAny>) -> Option<(usize, usize)> {
    let layout = LAYOUT.get_or_init(items.py(), || Layout::probe(items.py()));
    let ptr = items.as_ptr();
    // SAFETY: `ptr` is a live object borrowed for this call and the GIL is held; the list
    // check comes before the layout's accessor reads its array pointer.
    unsafe {
        if ffi::PyList_CheckExact(ptr) == 0 {
            return None;
        }
        let start = layout.items(ptr)? as usize;
        let size = usize::try_from(ffi::PyList_Size(ptr)).ok()?;
        Some((
            start,
            start + size * std::mem::size_of::<*mut ffi::PyObject>(),
        ))
    }
}

/// Whether every item of the list or tuple `items` is plain: None, a bool, int, float,
/// complex, str or bytes (exact types), or a tuple or frozenset of plain values. None for a
/// container of another type (the caller looks at it itself).
#[pyfunction]
fn plain_items(items: &Bound<'_, PyAny>) -> Option<bool> {
    let ptr = items.as_ptr();
    // SAFETY: `ptr` is a live object borrowed for this call and the GIL is held; see
    // `plain` for the items.
    unsafe {
        if ffi::PyList_Check(ptr) != 0 {
            let n = ffi::PyList_Size(ptr);
            Some((0..n).all(|i| plain(ffi::PyList_GetItem(ptr, i), 0)))
        } else if ffi::PyTuple_Check(ptr) != 0 {
            Some(all_plain_in_tuple(ptr, 0))
        } else {
            None
        }
    }
}

/// # Safety
/// `tuple` is a live tuple and the GIL is held.
unsafe fn all_plain_in_tuple(tuple: *mut ffi::PyObject, depth: usize) -> bool {
    let n = ffi::PyTuple_Size(tuple);
    (0..n).all(|i| plain(ffi::PyTuple_GetItem(tuple, i), depth))
}

/// # Safety
/// `obj` is a live object (a borrowed reference) and the GIL is held.
unsafe fn plain(obj: *mut ffi::PyObject, depth: usize) -> bool {
    if obj.is_null() {
        return false;
    }
    if obj == ffi::Py_None() || ffi::PyBool_Check(obj) != 0 {
        return true;
    }
    if ffi::PyLong_CheckExact(obj) != 0
        || ffi::PyFloat_CheckExact(obj) != 0
        || ffi::PyUnicode_CheckExact(obj) != 0
        || ffi::PyBytes_CheckExact(obj) != 0
        || ffi::PyComplex_CheckExact(obj) != 0
    {
        return true;
    }
    if depth >= MAX_NESTING {
        return false;
    }
    if ffi::PyTuple_CheckExact(obj) != 0 {
        return all_plain_in_tuple(obj, depth + 1);
    }
    if ffi::PyFrozenSet_CheckExact(obj) != 0 {
        return all_plain_in_iterable(obj, depth + 1);
    }
    false
}

/// # Safety
/// `obj` is a live frozenset and the GIL is held. Iterating a frozenset runs no Python
/// code (its items' hashes are cached in the set).
unsafe fn all_plain_in_iterable(obj: *mut ffi::PyObject, depth: usize) -> bool {
    let iter = ffi::PyObject_GetIter(obj);
    if iter.is_null() {
        ffi::PyErr_Clear();
        return false;
    }
    let mut all = true;
    loop {
        let item = ffi::PyIter_Next(iter);
        if item.is_null() {
            break;
        }
        let ok = plain(item, depth);
        ffi::Py_DECREF(item);
        if !ok {
            all = false;
            break;
        }
    }
    ffi::Py_DECREF(iter);
    if !ffi::PyErr_Occurred().is_null() {
        ffi::PyErr_Clear();
        return false;
    }
    all
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(same_items, m)?)?;
    m.add_function(wrap_pyfunction!(plain_items, m)?)?;
    m.add_function(wrap_pyfunction!(item_array, m)?)?;
    Ok(())
}
