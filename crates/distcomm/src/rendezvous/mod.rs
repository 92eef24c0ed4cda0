//! Rendezvous: a key-value store every rank can reach, wire-compatible with PyTorch's
//! `TCPStore` (torch ≥ 2.4), so distcomm ranks can join a store hosted by `torchrun`'s agent and
//! PyTorch clients can use a store hosted by distcomm.
//!
//! * [`TcpStore`]: the client;
//! * [`TcpStoreServer`]: the server (thread per connection);
//! * [`PrefixStore`]: namespacing over any [`Store`].
//!
//! By default the store is not authenticated: PyTorch clients cannot authenticate, and
//! compatibility with them is the point of this protocol, so keep the store port on a trusted
//! network (a job whose ranks are all local listens on loopback only). Jobs made only of
//! distcomm ranks can turn on the authenticated mode (`DISTCOMM_STORE_AUTH=1`,
//! [`TcpStoreServer::bind_authenticated`], [`TcpStore::connect_authenticated`]): every
//! connection then proves the job secret (HMAC-SHA256, both ways) before its first command, and
//! torch clients are refused.

mod auth;
mod client;
mod prefix;
pub mod proto;
mod server;

pub use client::TcpStore;
pub use prefix::PrefixStore;
pub use server::TcpStoreServer;

use std::time::Duration;

use crate::error::Result;

/// A rendezvous key-value store (the subset of torch's `Store` that distcomm uses, plus the
/// extended API).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, waking waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits (default timeout) for `key`, then returns its value.
    fn get(&self, key: &str) -> Result<Vec<u8>>;
    /// Adds `delta` to the integer stored (as decimal text) at `key`; returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Sets `key` to `desired` if it currently holds `expected` (or is absent and `expected` is
    /// empty); returns the value now stored.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Whether all `keys` exist, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Waits until all `keys` exist or `timeout` passes ([`crate::Error::StoreTimeout`]).
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Deletes `key`; returns whether it existed.
    fn delete_key(&self, key: &str) -> Result<bool>;
    /// Number of keys in the whole store.
    fn num_keys(&self) -> Result<i64>;
    /// Appends `value` to the bytes stored at `key` (creating it).
    fn append(&self, key: &str, value: &[u8]) -> Result<()>;
    /// The default timeout of blocking calls.
    fn timeout(&self) -> Duration;
}
