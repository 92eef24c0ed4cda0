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
///
/// `Debug` prints the same sentence as `Display` followed by the variant's name (and an I/O
/// error's OS code), so that `fn main() -> distcomm::Result<()>`, `unwrap()` and `{:?}` all show
/// a message people can read. Errors with a likely fix carry it ([`Error::hint`]; `Display`
/// appends it).
///
/// ```
/// let missing = vec!["RANK".into(), "WORLD_SIZE".into()];
/// let e = distcomm::Error::MissingEnv { missing };
/// assert!(format!("{e:?}").starts_with("incomplete environment: missing RANK, WORLD_SIZE"));
/// assert!(format!("{e:?}").contains("distcomm launch -n"));
/// assert!(format!("{e:?}").contains("[Error::MissingEnv]\n  hint: "));
/// ```
#[derive(Clone, thiserror::Error)]
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
    #[error("incomplete environment: missing {}{}", missing.join(", "), hint_suffix(self))]
    MissingEnv { missing: Vec<String> },
    /// A setting that cannot work (an option, or a combination of settings); a malformed
    /// environment variable is [`Error::ConfigVar`] ([`Error::is_config`] is true for both).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A `DISTCOMM_*` environment variable whose value is malformed: the variable, its value
    /// and what it accepts (see [`crate::config`]).
    #[error("invalid configuration: {var}={value:?}: expected {expected}")]
    ConfigVar {
        var: &'static str,
        value: String,
        expected: &'static str,
    },
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
    #[error("{context}: {source}{}", hint_suffix(self))]
    Io {
        context: String,
        #[source]
        source: Arc<std::io::Error>,
    },
}

/// What a launcher does for a job that has none (the [`Error::MissingEnv`] hint).
const LAUNCHER_HINT: &str = "this program expects a launcher: start it with `distcomm launch -n 2 -- PROGRAM` (or torchrun --nproc-per-node 2, or mpirun -n 2), or build the group explicitly with distcomm::GroupBuilder::new(rank, world)";

/// The [`Error::MissingEnv`] hint of an mpirun or srun job over several hosts.
const MASTER_HINT: &str = "ranks on several hosts need the address of rank 0's host: set DISTCOMM_MASTER_ADDR (and DISTCOMM_MASTER_PORT) for every rank, e.g. mpirun -x DISTCOMM_MASTER_ADDR=node0";

/// The [`Error::Io`] hint when the store's port is taken.
const PORT_HINT: &str = "another job on this host probably holds the port: pick a free one with DISTCOMM_MASTER_PORT (mpirun, srun), MASTER_PORT (torchrun-style variables) or `distcomm launch --master-port` (which picks a free port by itself when the option is left out)";

/// What separates a message from its hint.
const HINT_SEP: &str = "\n  hint: ";

fn hint_suffix(e: &Error) -> String {
    match e.hint() {
        Some(h) => format!("{HINT_SEP}{h}"),
        None => String::new(),
    }
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

    /// A likely fix, for errors that have one: how to start a job when no launcher's variables
    /// are there, how to choose another store port when the port is taken. `Display` shows it
    /// on a line of its own after the message.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            // No launcher at all (the list names every launcher's variables).
            Error::MissingEnv { missing } if missing.len() > 1 => Some(LAUNCHER_HINT),
            Error::MissingEnv { missing } if missing.iter().any(|m| m.contains("MASTER_ADDR")) => {
                Some(MASTER_HINT)
            }
            Error::Io { context, source }
                if source.kind() == std::io::ErrorKind::AddrInUse
                    && context.starts_with("store: listen") =>
            {
                Some(PORT_HINT)
            }
            _ => None,
        }
    }

    /// The variant's name (`"PeerLost"`, `"Timeout"`, ...), as `Debug` shows it.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Error::InvalidRank { .. } => "InvalidRank",
            Error::TagOutOfRange { .. } => "TagOutOfRange",
            Error::MessageTooLarge { .. } => "MessageTooLarge",
            Error::DTypeMismatch { .. } => "DTypeMismatch",
            Error::Timeout { .. } => "Timeout",
            Error::PeerLost { .. } => "PeerLost",
            Error::Aborted { .. } => "Aborted",
            Error::StoreTimeout { .. } => "StoreTimeout",
            Error::StoreProtocol(_) => "StoreProtocol",
            Error::StoreAuth { .. } => "StoreAuth",
            Error::Auth { .. } => "Auth",
            Error::Protocol { .. } => "Protocol",
            Error::InvalidArgument { .. } => "InvalidArgument",
            Error::Desync { .. } => "Desync",
            Error::MissingEnv { .. } => "MissingEnv",
            Error::Config(_) => "Config",
            Error::ConfigVar { .. } => "ConfigVar",
            Error::RankFailed { .. } => "RankFailed",
            Error::DeviceUnavailable { .. } => "DeviceUnavailable",
            Error::Device { .. } => "Device",
            Error::Io { .. } => "Io",
        }
    }

    /// True for [`Error::Config`] and [`Error::ConfigVar`]: the job's settings, not a peer or
    /// the network, are wrong.
    pub fn is_config(&self) -> bool {
        matches!(self, Error::Config(_) | Error::ConfigVar { .. })
    }

    /// True for [`Error::Timeout`] and [`Error::StoreTimeout`].
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. } | Error::StoreTimeout { .. })
    }
}

/// The readable form (see [`Error`]): the `Display` sentence, then `[Error::Variant]` (an I/O
/// error adds its kind; the sentence has the OS error code), then the hint if there is one. Every field is in the sentence; match on the variant to get
/// them as values.
impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = self.to_string();
        let (message, hint) = match text.split_once(HINT_SEP) {
            Some((m, h)) => (m, Some(h)),
            None => (text.as_str(), None),
        };
        write!(f, "{message} [Error::{}", self.kind_name())?;
        if let Error::Io { source, .. } = self {
            write!(f, ", {:?}", source.kind())?;
        }
        f.write_str("]")?;
        match hint {
            Some(h) => write!(f, "{HINT_SEP}{h}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_reads_like_display_and_names_the_variant() {
        let e = Error::MessageTooLarge {
            op: "recv",
            rank: 1,
            src: 0,
            dst: 1,
            tag: 0,
            sent: 400,
            capacity: 40,
        };
        assert_eq!(format!("{e:?}"), format!("{e} [Error::MessageTooLarge]"),);
        assert!(e.hint().is_none());
        let busy = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = Error::io("store: listen on 127.0.0.1:29500", busy);
        let text = format!("{e:?}");
        assert!(text.contains("DISTCOMM_MASTER_PORT"), "{text}");
        assert!(text.contains("[Error::Io, AddrInUse]\n  hint: "), "{text}");
        let other = Error::io(
            "resolve x",
            std::io::Error::from(std::io::ErrorKind::AddrInUse),
        );
        assert!(other.hint().is_none());
    }
}
