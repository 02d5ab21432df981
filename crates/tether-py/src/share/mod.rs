//! `tether.share`'s native half: the shared items of a list or dict (`items`), a dict key's
//! canonical bytes (`keys`), and the meeting point of a key (`meet`).

use pyo3::prelude::*;

mod codec;
mod items;
mod keys;
mod meet;
mod pickle;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<items::SharedItems>()?;
    m.add_class::<items::SharedTable>()?;
    m.add_class::<items::SharedIter>()?;
    m.add_class::<meet::ShareMeeting>()?;
    m.add_class::<meet::ShareWaiter>()?;
    m.add_class::<meet::ShareReady>()?;
    m.add_class::<meet::ShareFailed>()?;
    m.add_class::<meet::ShareBuilderDied>()?;
    m.add_class::<meet::ShareLost>()?;
    m.add_class::<meet::ShareVault>()?;
    m.add_function(wrap_pyfunction!(items::share_is_dict, m)?)?;
    m.add_function(wrap_pyfunction!(meet::share_claim, m)?)?;
    m.add_function(wrap_pyfunction!(meet::share_names, m)?)?;
    m.add_function(wrap_pyfunction!(meet::share_enter_job, m)?)?;
    m.add_function(wrap_pyfunction!(meet::share_job, m)?)?;
    m.add("SHARE_JOB_ENV", tether_core::share::JOB_ENV)?;
    Ok(())
}
