//! distcomm errors as the exceptions torch users catch: a lost peer, a timeout, a desync or an
//! abort is torch's `DistBackendError` (a `RuntimeError`), named by the Python layer with
//! [`set_backend_error`]; bad arguments are `ValueError`, a wrong element type `TypeError`.
//! The message is distcomm's own, which names the operation, the local rank and the peer.

use distcomm::Error;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

static BACKEND_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Makes `cls` (torch's `DistBackendError`) the class of communication failures.
#[pyfunction]
pub fn set_backend_error(py: Python<'_>, cls: Bound<'_, PyType>) {
    let _ = BACKEND_ERROR.set(py, cls.unbind());
}

/// The Python exception for `e`.
pub fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidRank { .. }
        | Error::TagOutOfRange { .. }
        | Error::InvalidArgument { .. }
        | Error::Config(_)
        | Error::ConfigVar { .. }
        | Error::MissingEnv { .. } => PyValueError::new_err(msg),
        Error::DTypeMismatch { .. } => PyTypeError::new_err(msg),
        _ => match BACKEND_ERROR.get(py) {
            Some(cls) => PyErr::from_type(cls.bind(py).clone(), msg),
            None => PyRuntimeError::new_err(msg),
        },
    }
}

/// A `ValueError` for a bad argument the Python layer passed through.
pub fn invalid(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}
