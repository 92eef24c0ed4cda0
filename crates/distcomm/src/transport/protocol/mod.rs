//! The protocol core: the decisions of point-to-point messaging as plain state machines, with
//! no sockets, clocks, threads or locks (quinn's sans-I/O shape; the `ob1` PML over Open MPI's
//! byte-moving BTLs). The engine (`tcp`) feeds them what arrived and what was posted and
//! carries out what they decide.
//!
//! * [`matching`]: posted and unexpected queues, non-overtaking per (source, context, tag),
//!   receives from any source;
//! * [`choice`]: which protocol a message takes (lane, eager, cross-memory fetch, rendezvous)
//!   from its size and what the link can do;
//! * [`refusal`]: whether a matched receive takes a message, and the errors both sides report
//!   when it does not (too large, wrong element type, a check word that differs);
//! * [`reassembly`]: large messages arriving in chunks into the receive cleared for them;
//! * [`cancel`]: keys (context, tag) whose traffic was cancelled, with an opaque record of why.
//!
//! What it must not know: how bytes move (sockets, rings, `poll(2)`), time, and what the layers
//! above use a context, a tag or a check word for.

pub(crate) mod cancel;
pub(crate) mod choice;
pub(crate) mod matching;
pub(crate) mod reassembly;
pub(crate) mod refusal;
