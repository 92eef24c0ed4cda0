//! distcomm's [`Store`] over whatever store object torch hands a backend (a `PrefixStore`
//! chain over torchrun's `TCPStore`, a `FileStore`, a `HashStore`, ...): every call attaches
//! to the interpreter just for the call. distcomm calls it only from threads that hold no
//! interpreter lock (rendezvous runs with the GIL released), and torch's stores release the
//! GIL while they block, so a rank waiting for a key never stops other Python threads.

use std::time::Duration;

use distcomm::rendezvous::Store;
use distcomm::{Error, Result};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

/// A Python store object seen as a distcomm [`Store`].
pub struct PyStore {
    store: Py<PyAny>,
    timeout: Duration,
}

impl PyStore {
    pub fn new(store: Py<PyAny>, timeout: Duration) -> PyStore {
        PyStore { store, timeout }
    }

    /// Calls `method` on the store; a Python exception becomes a store error naming it.
    fn call<T>(
        &self,
        method: &str,
        key: &str,
        f: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
        out: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        Python::attach(|py| {
            let store = self.store.bind(py);
            f(store)
                .and_then(|r| out(&r))
                .map_err(|e| store_error(py, method, key, e, self.timeout))
        })
    }
}

fn store_error(py: Python<'_>, method: &str, key: &str, e: PyErr, after: Duration) -> Error {
    let text = e.value(py).to_string();
    // torch reports a store timeout as a DistStoreError / RuntimeError mentioning the wait.
    if text.contains("imeout") || text.contains("timed out") {
        return Error::StoreTimeout {
            keys: vec![key.to_string()],
            after,
        };
    }
    Error::StoreProtocol(format!("torch store {method}({key:?}) failed: {text}"))
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            "set",
            key,
            |s| s.call_method1("set", (key, PyBytes::new(s.py(), value))),
            |_| Ok(()),
        )
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.call(
            "get",
            key,
            |s| s.call_method1("get", (key,)),
            |v| v.extract::<Vec<u8>>(),
        )
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call(
            "add",
            key,
            |s| s.call_method1("add", (key, delta)),
            |v| v.extract::<i64>(),
        )
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.call(
            "compare_set",
            key,
            |s| {
                let py = s.py();
                s.call_method1(
                    "compare_set",
                    (key, PyBytes::new(py, expected), PyBytes::new(py, desired)),
                )
            },
            |v| v.extract::<Vec<u8>>(),
        )
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let first = keys.first().copied().unwrap_or("");
        self.call(
            "check",
            first,
            |s| s.call_method1("check", (PyList::new(s.py(), keys)?,)),
            |v| v.extract::<bool>(),
        )
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let first = keys.first().copied().unwrap_or("");
        let r = self.call(
            "wait",
            first,
            |s| s.call_method1("wait", (PyList::new(s.py(), keys)?, timeout)),
            |_| Ok(()),
        );
        match r {
            Err(Error::StoreTimeout { .. }) => Err(Error::StoreTimeout {
                keys: keys.iter().map(|k| k.to_string()).collect(),
                after: timeout,
            }),
            r => r,
        }
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        self.call(
            "delete_key",
            key,
            |s| s.call_method1("delete_key", (key,)),
            |v| v.extract::<bool>(),
        )
    }

    fn num_keys(&self) -> Result<i64> {
        self.call(
            "num_keys",
            "",
            |s| s.call_method0("num_keys"),
            |v| v.extract::<i64>(),
        )
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(
            "append",
            key,
            |s| s.call_method1("append", (key, PyBytes::new(s.py(), value))),
            |_| Ok(()),
        )
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
