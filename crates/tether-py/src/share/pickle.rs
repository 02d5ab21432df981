//! Pickling a shared item's parts (the values that are no plain values, see `codec`), and
//! unpickling them where they lie in the shared pages.

use std::os::raw::c_char;

use pyo3::exceptions::PyOverflowError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyBytes;

/// `PyBUF_READ` of CPython's memoryobject.h: a read-only memoryview.
const PYBUF_READ: std::os::raw::c_int = 0x100;

/// The pickle protocol of every item (and of a key pickled for lookups): fixed, so that
/// the same key pickles alike in every process.
const PROTOCOL: u8 = 5;

/// `pickle.dumps` and `pickle.loads`, looked up once.
static PICKLE: GILOnceCell<(Py<PyAny>, Py<PyAny>)> = GILOnceCell::new();

fn pickle(py: Python<'_>) -> PyResult<&(Py<PyAny>, Py<PyAny>)> {
    PICKLE.get_or_try_init(py, || {
        let module = py.import("pickle")?;
        Ok((
            module.getattr("dumps")?.unbind(),
            module.getattr("loads")?.unbind(),
        ))
    })
}

/// `obj` pickled alone, with protocol [`PROTOCOL`].
pub fn dumps<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    let py = obj.py();
    let pickled = pickle(py)?.0.bind(py).call1((obj, PROTOCOL))?;
    Ok(pickled.downcast_into::<PyBytes>()?)
}

/// Unpickles `bytes` where they lie: through a read-only memoryview, released before this
/// returns (nothing can keep it, and with it a pointer into the mapping).
pub fn load(py: Python<'_>, bytes: &[u8]) -> PyResult<PyObject> {
    let len = isize::try_from(bytes.len()).map_err(|_| PyOverflowError::new_err("too large"))?;
    // SAFETY: `bytes` stays valid for the whole call (the caller borrows it from a mapping
    // it keeps); the memoryview is read-only (PyBUF_READ), so the cast to a mutable pointer
    // is never written through, and it is released below: an unpickling keeps no export of
    // its input (it is given no out-of-band buffers), so nothing can outlive the call.
    let view = unsafe {
        let ptr = ffi::PyMemoryView_FromMemory(bytes.as_ptr() as *mut c_char, len, PYBUF_READ);
        Bound::from_owned_ptr_or_err(py, ptr)?
    };
    let loaded = pickle(py)?.1.bind(py).call1((&view,));
    view.call_method0("release")?;
    Ok(loaded?.unbind())
}
