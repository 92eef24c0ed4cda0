//! # distcomm
//!
//! The communication layer of distributed training: process groups, blocking and truly
//! nonblocking point-to-point with waitable [`Work`] handles, a PyTorch-compatible rendezvous
//! store, a TCP transport with its own progress engine, and a launcher.
//!
//! Layers (each knows only the one below):
//! * [`group`]: the [`ProcessGroup`] API — point-to-point, subgroups — and its collectives
//!   (blocking and async, desync detection, [`commslog`]);
//! * [`algorithms`]: collective schedules as pure data, with a simulator; [`reduce`]: kernels;
//! * [`transport`]: how bytes move between two ranks (TCP mesh, authenticated handshake,
//!   progress engine);
//! * [`rendezvous`]: the TCPStore-compatible store and prefix store;
//! * [`env`](mod@env): discovery of rank, world and master from torchrun / mpirun / srun variables;
//! * [`launch`]: starting local ranks (used by `distcomm launch` and the test harness).
//!
//! ```no_run
//! # fn main() -> distcomm::Result<()> {
//! let group = distcomm::init()?; // e.g. under `distcomm launch -n 2 -- ./my_prog`
//! let peer = 1 - group.rank();
//! let recv = group.irecv(vec![0i64; 3], peer, 0)?;
//! let send = group.isend(vec![group.rank() as i64; 3], peer, 0)?;
//! recv.wait()?;
//! assert_eq!(recv.into_buffer()?, vec![peer as i64; 3]);
//! send.into_buffer()?;
//! # Ok(()) }
//! ```

pub mod algorithms;
mod collectives;
pub mod commslog;
pub mod device;
pub mod diag;
pub mod dtype;
pub mod env;
pub mod error;
pub mod group;
#[cfg(target_os = "linux")]
mod intranode;
#[cfg(not(target_os = "linux"))]
#[path = "intranode_stub.rs"]
mod intranode;
pub mod launch;
pub mod mpi;
mod onebit;
pub mod pipeline;
pub mod reduce;
pub mod rendezvous;
pub mod staging;
pub mod transport;
mod work;

pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use group::{init, Backend, GroupBuilder, ProcessGroup, DEFAULT_TIMEOUT, MAX_TAG};
pub use onebit::{padded_len, OneBitState};
pub use pipeline::{PipeStage, Tensor, TensorWork};
pub use reduce::{ReduceOp, Reducible};
pub use staging::{CopyStats, StagedWork};
pub use transport::TransportKind;
pub use work::{Status, Work};

/// The README's examples, compiled as doctests so that they cannot drift from the API.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
