//! Typed errors. Every error that concerns a peer names the operation, the local rank and the
//! peer rank, so a log line from any rank says what went wrong and with whom.

use std::sync::Arc;
use std::time::Duration;

use crate::dtype::DType;

/// Result alias used across distcomm.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in distcomm.
///
/// Errors are `Clone` so that a terminal [`crate::Work`] state can hand the same error to every
/// `wait()` call.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A rank argument outside `0..world`.
    #[error("{op} on rank {rank}: invalid peer rank {peer} (world size {world})")]
    InvalidRank {
        op: &'static str,
        rank: usize,
        peer: usize,
        world: usize,
    },
    /// A user tag above [`crate::MAX_TAG`].
    #[error("{op} on rank {rank}: tag {tag} out of range (0..={max})")]
    TagOutOfRange {
        op: &'static str,
        rank: usize,
        tag: u32,
        max: u32,
    },
    /// The sender's message is larger than the posted receive buffer. Both sides get this error
    /// and nothing is written into the receive buffer.
    #[error("{op} on rank {rank}: message from rank {src} to rank {dst} (tag {tag}) has {sent} bytes but the receive buffer holds {capacity} bytes")]
    MessageTooLarge {
        op: &'static str,
        rank: usize,
        src: usize,
        dst: usize,
        tag: u32,
        sent: u64,
        capacity: u64,
    },
    /// Sender and receiver disagree on the element type.
    #[error("{op} on rank {rank}: element type mismatch between rank {src} (sent {sent}) and rank {dst} (expects {expected}), tag {tag}")]
    DTypeMismatch {
        op: &'static str,
        rank: usize,
        src: usize,
        dst: usize,
        tag: u32,
        sent: DType,
        expected: DType,
    },
    /// A deadline passed before the operation finished.
    #[error("{op} on rank {rank}: timed out after {after:?}{}", peer_suffix(*.peer))]
    Timeout {
        op: &'static str,
        rank: usize,
        peer: Option<usize>,
        after: Duration,
    },
    /// The connection to a peer closed or failed while an operation depended on it.
    #[error("{op} on rank {rank}: lost connection to peer rank {peer}: {reason}")]
    PeerLost {
        op: &'static str,
        rank: usize,
        peer: usize,
        reason: String,
    },
    /// The operation was aborted (group shut down or handle cancelled).
    #[error("{op} on rank {rank}: aborted: {reason}")]
    Aborted {
        op: &'static str,
        rank: usize,
        reason: String,
    },
    /// A store wait passed its deadline. Names the keys that were waited for.
    #[error("store: timed out after {after:?} waiting for keys {keys:?}")]
    StoreTimeout { keys: Vec<String>, after: Duration },
    /// The store peer broke the protocol or sent something out of bounds.
    #[error("store protocol error: {0}")]
    StoreProtocol(String),
    /// The store (authenticated mode) and this process do not share the job secret, or the
    /// store does not authenticate at all (a PyTorch store).
    #[error("store {addr}: authentication failed: {detail}")]
    StoreAuth { addr: String, detail: String },
    /// A connection failed authentication (missing or different job secret).
    #[error("rank {rank}: authentication with rank {peer} failed: {detail}")]
    Auth {
        rank: usize,
        peer: usize,
        detail: String,
    },
    /// A transport peer broke the wire protocol.
    #[error("protocol error with rank {peer} (local rank {rank}): {detail}")]
    Protocol {
        rank: usize,
        peer: usize,
        detail: String,
    },
    /// An argument that cannot work (buffer sizes, operator for the element type, root, ...).
    #[error("{op} on rank {rank}: {detail}")]
    InvalidArgument {
        op: &'static str,
        rank: usize,
        detail: String,
    },
    /// Ranks called different collectives (or the same with different arguments) at the same
    /// point of their sequence.
    #[error("{op} on rank {rank}: collective mismatch with rank {peer}: this rank called {ours}, rank {peer} called {theirs}")]
    Desync {
        op: &'static str,
        rank: usize,
        peer: usize,
        ours: String,
        theirs: String,
    },
    /// The environment does not describe a complete job.
    #[error("incomplete environment: missing {}", missing.join(", "))]
    MissingEnv { missing: Vec<String> },
    /// An environment variable or option has a value we cannot use.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A launched rank failed (launcher and test harness).
    #[error("rank {rank} {how}")]
    RankFailed { rank: usize, how: String },
    /// A device (GPU API, driver) is not there on this machine: no driver library, no adapter,
    /// no such ordinal.
    #[error("{device} device unavailable: {detail}")]
    DeviceUnavailable {
        device: &'static str,
        detail: String,
    },
    /// A device operation (allocation, copy, synchronisation) failed.
    #[error("{device} device: {detail}")]
    Device {
        device: &'static str,
        detail: String,
    },
    /// An I/O error with what we were doing when it happened.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Arc<std::io::Error>,
    },
}

fn peer_suffix(peer: Option<usize>) -> String {
    match peer {
        Some(p) => format!(" waiting on peer rank {p}"),
        None => String::new(),
    }
}

impl Error {
    /// Wraps an I/O error with a description of what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// True for [`Error::Timeout`] and [`Error::StoreTimeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::StoreTimeout { .. })
    }
}
