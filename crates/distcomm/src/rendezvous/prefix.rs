use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::error::Result;

/// A view of a [`Store`] in which every key is prefixed with `prefix/` (as torch's `PrefixStore`).
///
/// ```no_run
/// use distcomm::rendezvous::{PrefixStore, Store, TcpStore};
/// use std::{sync::Arc, time::Duration};
/// # fn main() -> distcomm::Result<()> {
/// let base = Arc::new(TcpStore::connect("127.0.0.1:29500", Duration::from_secs(30))?);
/// let job = PrefixStore::new("job1", base);
/// job.set("ready", b"1")?; // stored as "job1/ready"
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Wraps `inner`, prefixing keys with `prefix/`.
    pub fn new(prefix: &str, inner: Arc<dyn Store>) -> Self {
        PrefixStore {
            prefix: format!("{prefix}/"),
            inner,
        }
    }

    fn k(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.k(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.k(key))
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.k(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.k(key), expected, desired)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let owned: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        let refs: Vec<&str> = owned.iter().map(|s| s.as_str()).collect();
        self.inner.check(&refs)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let owned: Vec<String> = keys.iter().map(|k| self.k(k)).collect();
        let refs: Vec<&str> = owned.iter().map(|s| s.as_str()).collect();
        self.inner.wait(&refs, timeout)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.k(key))
    }
    fn num_keys(&self) -> Result<i64> {
        self.inner.num_keys()
    }
    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.append(&self.k(key), value)
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}
