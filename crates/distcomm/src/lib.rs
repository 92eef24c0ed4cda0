//! # distcomm
//!
//! The communication layer of distributed training, what `torch.distributed` and
//! `deepspeed.comm` are to Python: process groups and subgroups, blocking and truly nonblocking
//! point-to-point with waitable (and awaitable) [`Work`] handles, every collective (blocking and
//! async, with desync detection), staging of device buffers through host memory, a
//! PyTorch-compatible rendezvous store and a torchrun-compatible launcher (`distcomm launch`).
//!
//! Ranks on one host talk through **shared memory** (rings, a one-cache-line lane for small
//! messages, cross-memory attach for large ones, and a shared arena for `all_reduce`), ranks on
//! other hosts over **TCP**, both under one progress engine; with the `mpi` feature and
//! `DISTCOMM_BACKEND=mpi` the same API runs on the system **MPI**.
//!
//! ## Start
//!
//! [`init`] reads the launcher's environment (`distcomm launch`, torchrun, mpirun, srun); run
//! the program with e.g. `distcomm launch -n 4 -- ./target/release/my_prog`.
//!
//! ```no_run
//! use distcomm::ReduceOp;
//!
//! fn main() -> distcomm::Result<()> {
//!     let group = distcomm::init()?;
//!     let (rank, n) = (group.rank(), group.size());
//!
//!     // Collectives work in place on slices; `_async` forms take the buffer and return a Work.
//!     let mut grads = vec![rank as f32; 1024];
//!     group.all_reduce(&mut grads, ReduceOp::Avg)?;
//!     let mut params = vec![0f32; 16];
//!     group.broadcast(&mut params, 0)?;
//!     let mut all = vec![0i64; n];
//!     group.all_gather(&[rank as i64], &mut all)?;
//!     let sums = group.all_reduce_async(vec![1u8; 8], ReduceOp::Sum)?.into_buffer()?;
//!     assert_eq!(sums, vec![n as u8; 8]);
//!
//!     // Point-to-point: nonblocking calls own their buffer until it comes back.
//!     let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
//!     let recv = group.irecv(vec![0f32; 4], prev, 7)?;
//!     let send = group.isend(vec![rank as f32; 4], next, 7)?;
//!     let status = recv.wait()?; // who sent, the tag, the byte count
//!     assert_eq!((status.peer, status.bytes), (prev, 16));
//!     assert_eq!(recv.into_buffer()?, vec![prev as f32; 4]);
//!     send.wait()?;
//!     group.barrier()
//! }
//! ```
//!
//! Element types: `u8 i8 i32 i64 f32 f64` and [`half::f16`]/[`half::bf16`] (re-exported as
//! [`distcomm::half`](half)). Errors ([`Error`]) name the operation, the local rank and the
//! peer, print readably from `main` and carry a hint where there is a likely fix.
//! `DISTCOMM_DEBUG=INFO` (or `DEBUG`, `TRACE`) says how every rank was set up, which algorithm
//! each collective takes and every message posted: see [`diag`].
//!
//! ## Layers (each knows only the one below)
//! * [`group`]: the [`ProcessGroup`] API — point-to-point, subgroups, init and the builder
//!   ([`GroupBuilder`]) — and its collectives (blocking and async, desync detection,
//!   [`commslog`]); [`pipeline`]: tensors with shapes and pipeline stages; [`staging`] and
//!   [`device`]: device buffers through host memory;
//! * [`algorithms`]: collective schedules as pure data, with a simulator; [`reduce`]: kernels;
//! * [`transport`]: how bytes move between two ranks (TCP mesh, authenticated handshake,
//!   shared-memory links, the progress engine); [`mpi`]: the MPI backend;
//! * [`rendezvous`]: the TCPStore-compatible store and prefix store;
//! * [`env`](mod@env): discovery of rank, world and master from torchrun / mpirun / srun
//!   variables; [`launch`]: starting local ranks (`distcomm launch` and the test harness);
//! * leaves anyone may use: [`config`] (every `DISTCOMM_*` variable, read once and validated),
//!   [`call`] (collective kinds and fingerprints, defined once), [`error`], [`dtype`],
//!   [`reduce`], and the crate's HMAC helper.

pub mod algorithms;
pub mod backend;
pub mod call;
pub mod commslog;
mod completion;
pub mod config;
pub mod copy;
mod crypto;
pub mod device;
pub mod diag;
pub mod dtype;
pub mod env;
pub mod error;
pub mod group;
pub mod launch;
mod onebit;
mod order;
pub mod pipeline;
mod pool;
pub mod reduce;
pub mod rendezvous;
pub mod staging;
pub mod transport;
/// Wire internals for the fuzz targets (`fuzz/`), which enable the `fuzzing` feature: not
/// public API, no stability promise.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    /// The frame header codec.
    pub mod frame {
        pub use crate::transport::frame::{DecodeError, Header, Kind, HEADER_LEN};
    }
    /// The connection handshake's hello codec and MAC.
    pub mod handshake {
        pub use crate::transport::handshake::{mac, verify, Hello, HELLO_LEN, TOKEN_LEN};
    }
}
mod work;

#[allow(deprecated)]
pub use config::Backend;
pub use config::BackendKind;
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use group::{init, GroupBuilder, ProcessGroup, DEFAULT_TIMEOUT, MAX_TAG};
/// The `half` crate, whose [`f16`](half::f16) and [`bf16`](half::bf16) are element types.
pub use half;
pub use onebit::{padded_len, OneBitState};
pub use pipeline::{PipeStage, Tensor, TensorWork};
pub use reduce::{ReduceOp, Reducible};
pub use staging::{CopyStats, StagedWork};
pub use transport::TransportKind;
pub use work::{Lent, Status, Work};

/// The README's examples, compiled as doctests so that they cannot drift from the API.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
