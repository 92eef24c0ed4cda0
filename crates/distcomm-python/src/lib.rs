//! `distcomm._distcomm`: the Rust half of the `distcomm` Python package. The Python half
//! (`python/distcomm/torch.py`) makes it a torch.distributed backend; this module knows
//! nothing of torch beyond the store object it is handed and the exception class it is told
//! to raise.

mod errors;
mod group;
mod scratch;
mod store;
mod work;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _distcomm(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::Group>()?;
    m.add_class::<work::Work>()?;
    m.add_function(wrap_pyfunction!(errors::set_backend_error, m)?)?;
    m.add("MAX_TAG", distcomm::MAX_TAG)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
