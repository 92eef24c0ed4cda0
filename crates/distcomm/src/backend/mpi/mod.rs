//! The MPI backend (feature `mpi`, over rsmpi's bindings to the system MPI): the same
//! [`ProcessGroup`](crate::ProcessGroup) API and [`Work`](crate::Work) contract, with MPI
//! underneath — for clusters whose MPI is tuned to their fabric.
//!
//! * **Selection**: `DISTCOMM_BACKEND=mpi` (or [`GroupBuilder::backend`](crate::GroupBuilder::backend))
//!   under `mpirun`/`srun`: rank and world come from MPI itself. Asking for it without the
//!   feature, or when MPI sees another world than the launcher's variables say, is a
//!   [`Error::Config`](crate::Error::Config) naming both.
//! * **Threads**: every MPI call distcomm makes holds one process-wide lock, so MPI only needs
//!   `MPI_THREAD_SERIALIZED` (which every MPI offers, unlike `MPI_THREAD_MULTIPLE`); a library
//!   that got less refuses to start. Where `MPI_THREAD_MULTIPLE` is granted (Open MPI grants
//!   it), blocking all_reduce calls MPI's blocking `MPI_Allreduce` outside the lock, because
//!   Open MPI's tuned blocking algorithms are much faster than its nonblocking ones; its
//!   deadline is then watched by the progress thread. No call that can block holds it: receives are matched
//!   with `MPI_Improbe` (so a receive buffer can take the size of the message, and a message
//!   larger than the buffer is a typed error with both sizes) and finished with `MPI_Imrecv`;
//!   collectives are the nonblocking `MPI_I*` ones, tested until done or the deadline.
//! * **Work handles** test their requests: `wait` drives and tests, `is_completed` never blocks,
//!   and a background thread tests pending requests so that they finish without anyone
//!   waiting. Outcomes are sticky as on the native backend.
//! * **Errors**: communicators return errors (`MPI_ERRORS_RETURN`, rsmpi's default is to
//!   abort), and every code maps to a typed [`Error`](crate::Error).
//! * **What MPI cannot do**: withdraw a collective. A collective still pending at its deadline
//!   may yet write into the caller's buffer, so returning would be unsound: the job is aborted
//!   (`MPI_Abort`) with a message naming the operation instead of hanging. Element types are not
//!   checked between sender and receiver (MPI does not carry them), and buffers of device
//!   memory are staged as on TCP (MPI here addresses host memory only).

#[cfg(feature = "mpi")]
pub(crate) use imp::*;
#[cfg(not(feature = "mpi"))]
pub(crate) use stub::*;

use std::sync::Arc;
use std::time::Duration;

use super::{typed, typed_mut, with_dtype, Backend, CollCall, Posted, Split};
use crate::device::Memory;
use crate::error::{Error, Result};
use crate::reduce::{ReduceOp, Reducible};
use crate::transport::Envelope;
use crate::work::BoxBuf;

/// One group on MPI: its communicators.
pub(crate) struct MpiBackend {
    comm: Comm,
}

impl MpiBackend {
    /// The world group (rank and world as the launcher says; MPI must agree).
    pub(crate) fn world(rank: usize, world: usize) -> Result<MpiBackend> {
        Ok(MpiBackend {
            comm: self::world(rank, world)?,
        })
    }

    /// The typed collective `c` on MPI, once every collective issued before it in this group
    /// has run (MPI needs every rank to start a communicator's collectives in one order).
    fn typed<T: Reducible>(&self, c: CollCall, coll: super::Coll<'_>) -> Result<()> {
        let op = c.call.kind.name();
        c.turn.wait(op, self.comm.world_rank(), c.timeout)?;
        let coll = match coll {
            super::Coll::AllReduce(b, o) => Coll::AllReduce(typed_mut::<T>(op, b)?, o),
            super::Coll::Broadcast(b, root) => Coll::Broadcast(typed_mut::<T>(op, b)?, root),
            super::Coll::Reduce(b, root, o) => Coll::Reduce(typed_mut::<T>(op, b)?, root, o),
            super::Coll::AllGather(i, o) => {
                Coll::AllGather(typed::<T>(op, i)?, typed_mut::<T>(op, o)?)
            }
            super::Coll::Gather(i, o, root) => {
                let o = o.map(|o| typed_mut::<T>(op, o)).transpose()?;
                Coll::Gather(typed::<T>(op, i)?, o, root)
            }
            super::Coll::Scatter(i, o, root) => {
                let i = i.map(|i| typed::<T>(op, i)).transpose()?;
                Coll::Scatter(i, typed_mut::<T>(op, o)?, root)
            }
            super::Coll::ReduceScatter(i, o, r) => {
                Coll::ReduceScatter(typed::<T>(op, i)?, typed_mut::<T>(op, o)?, r)
            }
            super::Coll::AllToAll((i, sc), (o, rc)) => {
                Coll::AllToAll((typed::<T>(op, i)?, sc), (typed_mut::<T>(op, o)?, rc))
            }
        };
        // The turn passes when `c` drops, after the call: MPI's order is then the issue order.
        self.comm.collective(coll, c.timeout)
    }
}

impl Backend for MpiBackend {
    fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize, _timeout: Duration) -> Result<Posted> {
        self.comm.isend(env, buf, dst)
    }

    fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
        _timeout: Duration,
    ) -> Result<Posted> {
        self.comm.irecv(env, buf, src)
    }

    fn collective(&self, c: CollCall, coll: super::Coll<'_>) -> Result<()> {
        with_dtype!(c.dtype, T => self.typed::<T>(c, coll))
    }

    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.comm.barrier(timeout)
    }

    fn split(&self, how: &Split) -> Result<Option<Arc<dyn Backend>>> {
        if !how.collective {
            return Err(Error::InvalidArgument {
                op: "subgroup",
                rank: self.comm.world_rank(),
                detail: "MPI splits a communicator with every rank of it: use new_group".into(),
            });
        }
        let comm = self.comm.split(how.me)?;
        Ok(comm.map(|comm| Arc::new(MpiBackend { comm }) as Arc<dyn Backend>))
    }

    fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    /// Host memory only (a CUDA-aware MPI could take device pointers, but the buffers distcomm
    /// hands MPI are host memory).
    fn addresses(&self, mem: Memory) -> bool {
        mem == Memory::Host
    }

    fn transport(&self) -> &'static str {
        "mpi"
    }

    fn transport_to(&self, _peer: usize) -> &'static str {
        "mpi"
    }

    fn peer_failure(&self, _peer: usize) -> Option<String> {
        None
    }

    fn eager_max(&self) -> Option<usize> {
        None
    }
}

/// One collective call, as the MPI backend receives it (arguments already checked).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) enum Coll<'a, T> {
    AllReduce(&'a mut [T], ReduceOp),
    Broadcast(&'a mut [T], usize),
    Reduce(&'a mut [T], usize, ReduceOp),
    AllGather(&'a [T], &'a mut [T]),
    /// Input, output (root only), root.
    Gather(&'a [T], Option<&'a mut [T]>, usize),
    /// Input (root only), output, root.
    Scatter(Option<&'a [T]>, &'a mut [T], usize),
    ReduceScatter(&'a [T], &'a mut [T], ReduceOp),
    /// Input and counts per peer, output and counts per peer.
    AllToAll((&'a [T], &'a [usize]), (&'a mut [T], &'a [usize])),
}

#[cfg(not(feature = "mpi"))]
mod stub {
    //! Without the feature there is no communicator: `Inner::mpi` is always `None`, and these
    //! methods cannot be called (the type has no values).
    use std::time::Duration;

    use super::Coll;
    use crate::backend::Posted;
    use crate::error::Result;
    use crate::reduce::Reducible;
    use crate::transport::Envelope;
    use crate::work::BoxBuf;

    pub(crate) enum Comm {}

    impl Comm {
        pub(crate) fn isend(&self, _: Envelope, _: BoxBuf, _: usize) -> Result<Posted> {
            match *self {}
        }
        pub(crate) fn irecv(&self, _: Envelope, _: BoxBuf, _: Option<usize>) -> Result<Posted> {
            match *self {}
        }
        pub(crate) fn collective<T: Reducible>(&self, _: Coll<'_, T>, _: Duration) -> Result<()> {
            match *self {}
        }
        pub(crate) fn barrier(&self, _: Duration) -> Result<()> {
            match *self {}
        }
        pub(crate) fn split(&self, _: Option<usize>) -> Result<Option<Comm>> {
            match *self {}
        }
        pub(crate) fn abort(&self, _: &str) {
            match *self {}
        }
        pub(crate) fn world_rank(&self) -> usize {
            match *self {}
        }
    }

    fn unavailable() -> crate::Error {
        crate::Error::Config(
            "DISTCOMM_BACKEND=mpi, but distcomm was built without the `mpi` feature".into(),
        )
    }

    pub(crate) fn world(_: usize, _: usize) -> Result<Comm> {
        Err(unavailable())
    }

    pub(crate) fn world_size() -> Result<(usize, usize)> {
        Err(unavailable())
    }
}

#[cfg(feature = "mpi")]
mod imp {
    use std::ffi::{c_int, c_void};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
    use std::time::{Duration, Instant};

    use mpi::ffi;

    use super::Coll;
    use crate::backend::Posted;
    use crate::backend::{CTX_PER_GROUP, CTX_PIPE, CTX_USER};
    use crate::completion::{BoxBuf, Deadline, Driver, OpCell, Status};
    use crate::dtype::DType;
    use crate::error::{Error, Result};
    use crate::reduce::{ReduceOp, Reducible};
    use crate::transport::Envelope;

    /// An MPI handle (communicator, request, message): an opaque pointer that MPI lets any
    /// thread use; distcomm only ever uses one under the process-wide lock ([`mpi_lock`]).
    #[derive(Clone, Copy)]
    struct Handle<H>(H);
    // SAFETY: see above: MPI handles are process-global identifiers, valid in every thread
    // (the library was initialised for MPI_THREAD_SERIALIZED), and every use is serialised by
    // the lock, so moving or sharing one between threads cannot race inside MPI.
    unsafe impl<H> Send for Handle<H> {}
    // SAFETY: as for Send.
    unsafe impl<H> Sync for Handle<H> {}

    /// A receive waiting for its message, or receiving it: matched by a probe (source and
    /// length known), or posted to MPI directly (learnt from the status at the end).
    enum RecvState {
        Probing,
        Receiving(Handle<ffi::MPI_Request>, usize, usize),
        Posted(Handle<ffi::MPI_Request>),
    }

    /// Receives into fixed buffers of at least this many bytes are posted to MPI directly
    /// (`MPI_Irecv`), so that large messages go straight into place the moment they arrive;
    /// smaller ones, and buffers sized by the message, are matched by probing, which also gives
    /// a too-long message's exact size. Measured on 2 ranks (Open MPI, shared memory): 64 MiB
    /// ping-pong 5.3–6.3 GB/s probed, against MPI's own 7.0–7.3.
    const DIRECT_MIN: usize = 64 << 10;

    enum Kind {
        Send(Handle<ffi::MPI_Request>),
        Recv {
            comm: Handle<ffi::MPI_Comm>,
            /// Which communicator (unique in the process), for ordering probes.
            chan: u64,
            src: c_int,
            state: RecvState,
        },
    }

    struct Pending {
        id: u64,
        kind: Kind,
        cell: Arc<OpCell>,
        buf: Option<BoxBuf>,
        op: &'static str,
        peer: usize,
        tag: u32,
        bytes: usize,
        rank: usize,
        family: u64,
    }

    /// Everything behind the lock: the requests in flight, in posting order.
    struct Table {
        pending: Vec<Pending>,
        finalized: bool,
        /// Set by [`Comm::abort`], per world group and its subgroups (a "family", as the
        /// native backend's engine): every later operation of the family fails with it.
        aborted: std::collections::HashMap<u64, String>,
    }

    struct Global {
        /// MPI granted MPI_THREAD_MULTIPLE: blocking all_reduce may then call MPI's own
        /// blocking `MPI_Allreduce` outside the lock (see [`Comm::reduce_raw`]).
        multiple: bool,
        /// Deadlines of blocking MPI calls in progress (id, deadline, what), enforced by the
        /// progress thread.
        watch: Mutex<Vec<(u64, Instant, String)>>,
        table: Mutex<Table>,
        work: Condvar,
        next_id: AtomicU64,
        world: (usize, usize),
    }

    static GLOBAL: OnceLock<std::result::Result<Global, String>> = OnceLock::new();

    fn global() -> Result<&'static Global> {
        let g = GLOBAL
            .get_or_init(init_mpi)
            .as_ref()
            .map_err(|e| Error::Config(e.clone()))?;
        static PROGRESS: std::sync::Once = std::sync::Once::new();
        PROGRESS.call_once(|| {
            // Without it, operations still finish when waited on; is_completed alone would not
            // see them finish.
            if let Err(e) = std::thread::Builder::new()
                .name("distcomm-mpi".into())
                .spawn(move || progress_thread(g))
            {
                crate::diag::always!(
                    WARN,
                    target: "distcomm::mpi",
                    "could not start the MPI progress thread: {e}"
                );
            }
        });
        Ok(g)
    }

    fn mpi_lock(g: &Global) -> MutexGuard<'_, Table> {
        g.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Initialises MPI once per process (`MPI_THREAD_SERIALIZED`), makes the world communicator
    /// return errors, starts the progress thread and registers `MPI_Finalize` at exit.
    fn init_mpi() -> std::result::Result<Global, String> {
        let mut provided: c_int = 0;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: plain MPI calls with pointers to live locals; MPI_Init_thread accepts null
        // argc/argv. This runs once per process (inside the OnceLock).
        let rc = unsafe {
            let mut done: c_int = 0;
            ffi::MPI_Initialized(&mut done);
            let rc = if done == 0 {
                ffi::MPI_Init_thread(
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    ffi::RSMPI_THREAD_MULTIPLE,
                    &mut provided,
                )
            } else {
                ffi::MPI_Query_thread(&mut provided)
            };
            ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
            ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
            rc
        };
        if rc != ffi::MPI_SUCCESS as c_int {
            return Err(format!("MPI_Init_thread failed: {}", describe(rc)));
        }
        // SAFETY: reading rsmpi's exported constant.
        if provided < unsafe { ffi::RSMPI_THREAD_SERIALIZED } {
            return Err(format!(
                "the MPI library offers thread level {provided}; distcomm needs \
                 MPI_THREAD_SERIALIZED (it serialises its own calls, but calls from several threads)"
            ));
        }
        // SAFETY: registering a plain extern "C" fn with no captured state.
        unsafe { libc::atexit(finalize_at_exit) };
        // SAFETY: reading rsmpi's exported constant.
        let multiple = provided >= unsafe { ffi::RSMPI_THREAD_MULTIPLE };
        Ok(Global {
            multiple,
            watch: Mutex::new(Vec::new()),
            table: Mutex::new(Table {
                pending: Vec::new(),
                finalized: false,
                aborted: Default::default(),
            }),
            work: Condvar::new(),
            next_id: AtomicU64::new(1),
            world: (rank as usize, size as usize),
        })
    }

    extern "C" fn finalize_at_exit() {
        let Some(Ok(g)) = GLOBAL.get() else { return };
        let mut t = mpi_lock(g);
        t.finalized = true;
        // SAFETY: under the lock, so no other distcomm MPI call runs; MPI was initialised.
        unsafe {
            let mut done: c_int = 0;
            ffi::MPI_Finalized(&mut done);
            if done == 0 {
                ffi::MPI_Finalize();
            }
        }
    }

    /// Tests pending requests while there are any, so that operations finish (and
    /// `is_completed` turns true) without anyone waiting on them.
    fn progress_thread(g: &'static Global) {
        loop {
            let overdue = {
                let w = g.watch.lock().unwrap_or_else(|e| e.into_inner());
                w.iter()
                    .find(|(_, d, _)| Instant::now() >= *d)
                    .map(|(_, _, m)| m.clone())
            };
            if let Some(msg) = overdue {
                abort_job(&msg);
            }
            let mut t = mpi_lock(g);
            if t.finalized {
                return;
            }
            if t.pending.is_empty() {
                let _unused = g.work.wait_timeout(t, Duration::from_millis(50));
                continue;
            }
            progress(&mut t);
            drop(t);
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn overdue(op: &str, rank: usize, timeout: Duration) -> String {
        format!(
            "distcomm (MPI backend): {op} on rank {rank} did not complete within {timeout:?}; \
             MPI cannot withdraw a collective that may still write into its buffers, so the job \
             is aborted"
        )
    }

    fn abort_job(msg: &str) {
        crate::diag::always!(ERROR, target: "distcomm::mpi", "{msg}");
        // SAFETY: aborting the job is always allowed.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    }

    /// MPI's description of an error code.
    fn describe(code: c_int) -> String {
        let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
        let mut len: c_int = 0;
        // SAFETY: buf holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires.
        unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
        buf.truncate(len.max(0) as usize);
        String::from_utf8_lossy(&buf).into_owned()
    }

    fn class(code: c_int) -> u32 {
        let mut class: c_int = 0;
        // SAFETY: a pure query with a pointer to a local.
        unsafe { ffi::MPI_Error_class(code, &mut class) };
        class as u32
    }

    /// Maps an MPI return code to a typed error (`Ok` for MPI_SUCCESS).
    fn check(code: c_int, op: &'static str, rank: usize, peer: Option<usize>) -> Result<()> {
        if code == ffi::MPI_SUCCESS as c_int {
            return Ok(());
        }
        let detail = format!("MPI: {}", describe(code));
        Err(match class(code) {
            ffi::MPI_ERR_RANK => Error::InvalidRank {
                op,
                rank,
                peer: peer.unwrap_or(usize::MAX),
                world: 0,
            },
            ffi::MPI_ERR_TRUNCATE => Error::MessageTooLarge {
                op,
                rank,
                src: peer.unwrap_or(usize::MAX),
                dst: rank,
                tag: 0,
                sent: 0,
                capacity: 0,
            },
            ffi::MPI_ERR_ARG | ffi::MPI_ERR_COUNT | ffi::MPI_ERR_TAG | ffi::MPI_ERR_ROOT => {
                Error::InvalidArgument { op, rank, detail }
            }
            _ => Error::Aborted {
                op,
                rank,
                reason: detail,
            },
        })
    }

    /// Moves every pending operation as far as it goes without blocking (under the lock).
    ///
    /// Receives take messages in posting order: once a receive on (communicator, tag) found
    /// nothing, later ones on the same pair wait for the next pass, since a message arriving
    /// in between belongs to the earlier one.
    fn progress(t: &mut Table) {
        if t.finalized {
            return;
        }
        let mut waiting: Vec<(u64, u32)> = Vec::new();
        let mut i = 0;
        while i < t.pending.len() {
            let p = &t.pending[i];
            if let Kind::Recv {
                chan,
                state: RecvState::Probing,
                ..
            } = p.kind
            {
                if waiting.contains(&(chan, p.tag)) {
                    i += 1;
                    continue;
                }
            }
            let done = step(&mut t.pending[i]);
            let p = &t.pending[i];
            if let Kind::Recv {
                chan,
                state: RecvState::Probing,
                ..
            } = p.kind
            {
                if !done {
                    waiting.push((chan, p.tag));
                }
            }
            if done {
                let p = t.pending.remove(i);
                finish(p);
            } else {
                i += 1;
            }
        }
    }

    /// One look at one operation; true when it is terminal (outcome recorded in `p.cell`,
    /// except the buffer, which [`finish`] hands over).
    fn step(p: &mut Pending) -> bool {
        match &mut p.kind {
            Kind::Send(req) => {
                let req = req.0;
                test(p, req)
            }
            Kind::Recv {
                comm, src, state, ..
            } => match state {
                RecvState::Probing => {
                    let mut flag: c_int = 0;
                    let mut msg = std::mem::MaybeUninit::<ffi::MPI_Message>::uninit();
                    let mut st = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
                    let tag = p.tag as c_int;
                    // SAFETY: valid communicator under the lock; out-pointers to locals.
                    let rc = unsafe {
                        ffi::MPI_Improbe(
                            *src,
                            tag,
                            comm.0,
                            &mut flag,
                            msg.as_mut_ptr(),
                            st.as_mut_ptr(),
                        )
                    };
                    if let Err(e) = check(rc, p.op, p.rank, Some(p.peer)) {
                        p.cell.complete(Err(e), None);
                        return true;
                    }
                    if flag == 0 {
                        return false;
                    }
                    // SAFETY: flag set: MPI filled both.
                    let (mut msg, st) = unsafe { (msg.assume_init(), st.assume_init()) };
                    let mut count: c_int = 0;
                    // SAFETY: a status MPI just filled, a pointer to a local.
                    unsafe { ffi::MPI_Get_count(&st, ffi::RSMPI_UINT8_T, &mut count) };
                    let (len, from) = (count.max(0) as usize, st.MPI_SOURCE.max(0) as usize);
                    let Some(buf) = p.buf.as_mut() else {
                        return true;
                    };
                    let cap = buf.bytes().len();
                    // A buffer sized by what arrives takes the message's length; a fixed one
                    // takes a shorter message into a prefix, and refuses a longer one.
                    let fitted = len != cap && buf.fit(len);
                    if len > cap && !fitted {
                        // Too large: take the message off the queue into scratch (it is
                        // matched: the copy completes), and fail the receive with both sizes.
                        let mut scratch = vec![0u8; len];
                        let mut st2 = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
                        // SAFETY: scratch holds `len` bytes; the message handle came from
                        // MPI_Improbe above and is received exactly once.
                        unsafe {
                            ffi::MPI_Mrecv(
                                scratch.as_mut_ptr().cast(),
                                count,
                                ffi::RSMPI_UINT8_T,
                                &mut msg,
                                st2.as_mut_ptr(),
                            )
                        };
                        p.cell.complete(
                            Err(Error::MessageTooLarge {
                                op: p.op,
                                rank: p.rank,
                                src: from,
                                dst: p.rank,
                                tag: p.tag,
                                sent: len as u64,
                                capacity: cap as u64,
                            }),
                            None,
                        );
                        return true;
                    }
                    let dst = buf.bytes_mut();
                    let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                    // SAFETY: `dst` holds at least `len` bytes and is owned by this pending
                    // operation until the request completes (the entry keeps the buffer; it is
                    // never dropped or handed back before MPI_Test reports completion).
                    let rc = unsafe {
                        ffi::MPI_Imrecv(
                            bytes_ptr(dst).cast_mut(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            &mut msg,
                            req.as_mut_ptr(),
                        )
                    };
                    if let Err(e) = check(rc, p.op, p.rank, Some(from)) {
                        p.cell.complete(Err(e), None);
                        return true;
                    }
                    // SAFETY: MPI_Imrecv succeeded and wrote the request.
                    let req = unsafe { req.assume_init() };
                    p.cell.kick();
                    *state = RecvState::Receiving(Handle(req), from, len);
                    step(p)
                }
                RecvState::Receiving(req, from, len) => {
                    let (req, from, len) = (req.0, *from, *len);
                    p.peer = from;
                    p.bytes = len;
                    test(p, req)
                }
                RecvState::Posted(req) => {
                    let mut req = req.0;
                    let mut flag: c_int = 0;
                    let mut st = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
                    // SAFETY: our live request, under the lock; the status is a local.
                    let rc = unsafe { ffi::MPI_Test(&mut req, &mut flag, st.as_mut_ptr()) };
                    // SAFETY: zero-initialised, and written by MPI_Test when it finished.
                    let st = unsafe { st.assume_init() };
                    if class(rc) == ffi::MPI_ERR_TRUNCATE
                        || (rc != 0
                            && st.MPI_ERROR != 0
                            && class(st.MPI_ERROR) == ffi::MPI_ERR_TRUNCATE)
                    {
                        let cap = p.buf.as_ref().map_or(0, |b| b.bytes().len());
                        p.cell.complete(
                            Err(Error::MessageTooLarge {
                                op: p.op,
                                rank: p.rank,
                                src: st.MPI_SOURCE.max(0) as usize,
                                dst: p.rank,
                                tag: p.tag,
                                // MPI does not say how long it was: more than the buffer.
                                sent: cap as u64 + 1,
                                capacity: cap as u64,
                            }),
                            None,
                        );
                        p.buf = None;
                        return true;
                    }
                    if let Err(e) = check(rc, p.op, p.rank, Some(p.peer)) {
                        p.cell.complete(Err(e), None);
                        p.buf = None;
                        return true;
                    }
                    if flag == 0 {
                        return false;
                    }
                    let mut count: c_int = 0;
                    // SAFETY: a status MPI just filled, a pointer to a local.
                    unsafe { ffi::MPI_Get_count(&st, ffi::RSMPI_UINT8_T, &mut count) };
                    p.peer = st.MPI_SOURCE.max(0) as usize;
                    p.bytes = count.max(0) as usize;
                    true
                }
            },
        }
    }

    /// Tests request `req` of `p`; records the outcome when it finished.
    fn test(p: &mut Pending, mut req: ffi::MPI_Request) -> bool {
        let mut flag: c_int = 0;
        let mut st = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
        // SAFETY: a live request of ours, under the lock.
        let rc = unsafe { ffi::MPI_Test(&mut req, &mut flag, st.as_mut_ptr()) };
        if let Err(e) = check(rc, p.op, p.rank, Some(p.peer)) {
            p.cell.complete(Err(e), None);
            p.buf = None;
            return true;
        }
        flag != 0
    }

    /// Hands a terminal operation's outcome to its handle.
    fn finish(mut p: Pending) {
        if p.cell.is_done() {
            return;
        }
        let status = Status {
            peer: p.peer,
            tag: p.tag,
            bytes: p.bytes,
        };
        p.cell.complete(Ok(status), p.buf.take());
    }

    /// Drives MPI progress for handles of this backend.
    struct MpiDriver {
        rank: usize,
    }

    impl Driver for MpiDriver {
        fn drive_until(&self, cell: &OpCell, deadline: &mut Deadline) -> bool {
            let Ok(g) = global() else {
                return cell.is_done();
            };
            let deadline = deadline.get();
            let mut turns = 0u32;
            loop {
                if cell.is_done() {
                    return true;
                }
                progress(&mut mpi_lock(g));
                if cell.is_done() {
                    return true;
                }
                if Instant::now() >= deadline {
                    return cell.is_done();
                }
                turns = turns.wrapping_add(1);
                if turns > 1000 {
                    std::thread::yield_now();
                }
            }
        }

        /// A dropped receive that no message matched yet is withdrawn; anything else finishes
        /// in the background (its buffer stays with the table until MPI is done with it).
        fn cancel(&self, op_id: u64) {
            let Ok(g) = global() else { return };
            let mut t = mpi_lock(g);
            t.pending.retain(|p| {
                p.id != op_id
                    || !matches!(
                        p.kind,
                        Kind::Recv {
                            state: RecvState::Probing,
                            ..
                        }
                    )
            });
        }

        fn rank(&self) -> usize {
            self.rank
        }
    }

    /// The communicators of one group: one per message context, so that user messages,
    /// pipeline traffic and collectives never match each other.
    pub(crate) struct Comm {
        user: Handle<ffi::MPI_Comm>,
        pipe: Handle<ffi::MPI_Comm>,
        coll: Handle<ffi::MPI_Comm>,
        rank: usize,
        size: usize,
        /// Global (world) rank, for error messages.
        world_rank: usize,
        /// The world group this one descends from (for `abort`).
        family: u64,
        /// Unique in the process.
        id: u64,
    }

    /// This process's rank and the world size, as MPI sees them.
    pub(crate) fn world_size() -> Result<(usize, usize)> {
        Ok(global()?.world)
    }

    /// The world group's communicators; `rank`/`world` are what the launcher's variables say,
    /// checked against MPI's own view.
    pub(crate) fn world(rank: usize, world: usize) -> Result<Comm> {
        let g = global()?;
        if g.world != (rank, world) {
            return Err(Error::Config(format!(
                "DISTCOMM_BACKEND=mpi: the launcher says rank {rank} of {world}, MPI says rank {} of {} \
                 (start the job with mpirun or srun, or use the native backend)",
                g.world.0, g.world.1
            )));
        }
        let t = mpi_lock(g);
        let family = g.next_id.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the world communicator is valid after init; under the lock.
        let c = unsafe { Comm::dup_all(ffi::RSMPI_COMM_WORLD, rank, family) };
        drop(t);
        c
    }

    impl Comm {
        /// Three duplicates of `parent` (collective over it). Call with the lock held.
        unsafe fn dup_all(parent: ffi::MPI_Comm, world_rank: usize, family: u64) -> Result<Comm> {
            let mut out = Vec::with_capacity(3);
            for _ in 0..3 {
                let mut d = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
                // SAFETY (caller): `parent` is a valid communicator and the lock is held.
                let rc = unsafe { ffi::MPI_Comm_dup(parent, d.as_mut_ptr()) };
                check(rc, "init", world_rank, None)?;
                // SAFETY: MPI_Comm_dup succeeded and wrote the handle.
                let c = unsafe { d.assume_init() };
                // SAFETY: a communicator we just made.
                unsafe { ffi::MPI_Comm_set_errhandler(c, ffi::RSMPI_ERRORS_RETURN) };
                out.push(c);
            }
            let (mut rank, mut size): (c_int, c_int) = (0, 0);
            // SAFETY: valid communicator, pointers to locals.
            unsafe {
                ffi::MPI_Comm_rank(out[0], &mut rank);
                ffi::MPI_Comm_size(out[0], &mut size);
            }
            Ok(Comm {
                user: Handle(out[0]),
                pipe: Handle(out[1]),
                coll: Handle(out[2]),
                rank: rank as usize,
                size: size as usize,
                world_rank,
                family,
                id: global()?.next_id.fetch_add(1, Ordering::Relaxed),
            })
        }

        /// This process's world rank (errors name it).
        pub(crate) fn world_rank(&self) -> usize {
            self.world_rank
        }

        fn comm_for(&self, env: &Envelope) -> Handle<ffi::MPI_Comm> {
            match env.ctx {
                CTX_USER => self.user,
                CTX_PIPE => self.pipe,
                _ => self.coll,
            }
        }

        fn posted(&self, cell: Arc<OpCell>, id: u64) -> Posted {
            let driver: Arc<dyn Driver> = Arc::new(MpiDriver { rank: self.rank });
            Posted {
                cell,
                driver,
                id,
                map: None,
            }
        }

        /// After [`abort`](Self::abort): a handle that has already failed.
        fn refused(&self, t: &Table, op: &'static str) -> Option<Posted> {
            let reason = t.aborted.get(&self.family)?.clone();
            let cell = Arc::new(OpCell::default());
            cell.complete(
                Err(Error::Aborted {
                    op,
                    rank: self.world_rank,
                    reason,
                }),
                None,
            );
            Some(self.posted(cell, 0))
        }

        /// Posts a send of `buf` to group rank `dst`.
        pub(crate) fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize) -> Result<Posted> {
            let g = global()?;
            let len = buf.bytes().len();
            let count = c_int::try_from(len).map_err(|_| too_big(env.op, self.rank, len))?;
            let comm = self.comm_for(&env);
            let mut t = mpi_lock(g);
            if let Some(w) = self.refused(&t, env.op) {
                return Ok(w);
            }
            let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            // SAFETY: `buf` is heap memory owned by the pending entry pushed below until MPI
            // reports the request complete; the communicator is valid; under the lock.
            let rc = unsafe {
                ffi::MPI_Isend(
                    bytes_ptr(buf.bytes()),
                    count,
                    ffi::RSMPI_UINT8_T,
                    dst as c_int,
                    env.tag as c_int,
                    comm.0,
                    req.as_mut_ptr(),
                )
            };
            check(rc, env.op, self.world_rank, Some(dst))?;
            // SAFETY: MPI_Isend succeeded and wrote the request.
            let req = unsafe { req.assume_init() };
            let id = g.next_id.fetch_add(1, Ordering::Relaxed);
            let cell = Arc::new(OpCell::default());
            t.pending.push(Pending {
                id,
                kind: Kind::Send(Handle(req)),
                cell: cell.clone(),
                buf: Some(buf),
                op: env.op,
                peer: dst,
                tag: env.tag,
                bytes: len,
                rank: self.world_rank,
                family: self.family,
            });
            g.work.notify_one();
            drop(t);
            Ok(self.posted(cell, id))
        }

        /// Posts a receive into `buf` from group rank `src` (`None`: any).
        pub(crate) fn irecv(
            &self,
            env: Envelope,
            buf: BoxBuf,
            src: Option<usize>,
        ) -> Result<Posted> {
            let g = global()?;
            let comm = self.comm_for(&env);
            let id = g.next_id.fetch_add(1, Ordering::Relaxed);
            let cell = Arc::new(OpCell::default());
            let mut t = mpi_lock(g);
            if let Some(w) = self.refused(&t, env.op) {
                return Ok(w);
            }
            let chan = self.id * u64::from(CTX_PER_GROUP) + u64::from(env.ctx);
            // SAFETY: reading rsmpi's exported constant.
            let mpi_src = src.map_or(unsafe { ffi::RSMPI_ANY_SOURCE }, |s| s as c_int);
            // Posted directly only when no earlier receive on this channel and tag is still
            // probing: MPI would hand the next message to the posted one first.
            let mut buf = buf;
            let probing_before = t.pending.iter().any(|p| {
                p.tag == env.tag
                    && matches!(p.kind, Kind::Recv { chan: c, state: RecvState::Probing, .. } if c == chan)
            });
            let len = buf.bytes().len();
            let state = match c_int::try_from(len) {
                Ok(count) if len >= DIRECT_MIN && !buf.sized_by_message() && !probing_before => {
                    let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
                    // SAFETY: the buffer is owned by the pending entry pushed below until MPI
                    // reports the request complete; valid communicator; under the lock.
                    let rc = unsafe {
                        ffi::MPI_Irecv(
                            bytes_ptr(buf.bytes_mut()).cast_mut(),
                            count,
                            ffi::RSMPI_UINT8_T,
                            mpi_src,
                            env.tag as c_int,
                            comm.0,
                            req.as_mut_ptr(),
                        )
                    };
                    check(rc, env.op, self.world_rank, src)?;
                    // SAFETY: MPI_Irecv succeeded and wrote the request.
                    RecvState::Posted(Handle(unsafe { req.assume_init() }))
                }
                _ => RecvState::Probing,
            };
            t.pending.push(Pending {
                id,
                kind: Kind::Recv {
                    comm,
                    chan,
                    src: mpi_src,
                    state,
                },
                cell: cell.clone(),
                buf: Some(buf),
                op: env.op,
                peer: src.unwrap_or(0),
                tag: env.tag,
                bytes: 0,
                rank: self.world_rank,
                family: self.family,
            });
            // One look now: a message already here completes a small receive at once.
            progress(&mut t);
            g.work.notify_one();
            drop(t);
            Ok(self.posted(cell, id))
        }

        /// Waits for a collective's request; at the deadline, aborts the job (see the module).
        fn wait(
            &self,
            mut req: ffi::MPI_Request,
            op: &'static str,
            timeout: Duration,
        ) -> Result<()> {
            let g = global()?;
            let deadline = Instant::now() + timeout;
            let mut turns = 0u32;
            loop {
                let mut t = mpi_lock(g);
                let mut flag: c_int = 0;
                // SAFETY: our live request, under the lock.
                let rc = unsafe { ffi::MPI_Test(&mut req, &mut flag, ffi::RSMPI_STATUS_IGNORE) };
                progress(&mut t);
                drop(t);
                check(rc, op, self.world_rank, None)?;
                if flag != 0 {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    let msg = format!(
                        "distcomm (MPI backend): {op} on rank {} did not complete within {timeout:?}; \
                         MPI cannot withdraw a collective that may still write into its buffers, \
                         so the job is aborted",
                        self.world_rank
                    );
                    crate::diag::always!(ERROR, target: "distcomm::mpi", "{msg}");
                    // SAFETY: aborting the job is always allowed.
                    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
                    return Err(Error::Aborted {
                        op,
                        rank: self.world_rank,
                        reason: msg,
                    });
                }
                turns = turns.wrapping_add(1);
                if turns > 1000 {
                    std::thread::yield_now();
                }
            }
        }

        /// Starts a nonblocking collective with `start` (under the lock) and waits for it.
        fn run(
            &self,
            op: &'static str,
            timeout: Duration,
            start: impl FnOnce(*mut ffi::MPI_Request) -> c_int,
        ) -> Result<()> {
            let g = global()?;
            let mut req = std::mem::MaybeUninit::<ffi::MPI_Request>::uninit();
            let t = mpi_lock(g);
            if let Some(reason) = t.aborted.get(&self.family).cloned() {
                return Err(Error::Aborted {
                    op,
                    rank: self.world_rank,
                    reason,
                });
            }
            let rc = start(req.as_mut_ptr());
            drop(t);
            check(rc, op, self.world_rank, None)?;
            // SAFETY: the start call succeeded and wrote the request.
            self.wait(unsafe { req.assume_init() }, op, timeout)
        }

        /// On the user communicator: data collectives on `coll` may be in flight from the
        /// group's async thread, and MPI wants collectives of one communicator started in the
        /// same order everywhere.
        pub(crate) fn barrier(&self, timeout: Duration) -> Result<()> {
            let comm = self.user.0;
            // SAFETY: valid communicator; called under the lock by `run`.
            self.run("barrier", timeout, |req| unsafe {
                ffi::MPI_Ibarrier(comm, req)
            })
        }

        /// Runs a collective. 16-bit floats are reduced in f32 (widened here, rounded once),
        /// averages are sums divided at the end, as on the native backend.
        pub(crate) fn collective<T: Reducible>(
            &self,
            c: Coll<'_, T>,
            timeout: Duration,
        ) -> Result<()> {
            let n = self.size;
            match c {
                Coll::AllReduce(buf, op) => self.reducing(buf, op, None, timeout),
                Coll::Reduce(buf, root, op) => self.reducing(buf, op, Some(root), timeout),
                Coll::ReduceScatter(input, output, op)
                    if bytes_as_i32(&[] as &[T], op).is_some() =>
                {
                    let wide = bytes_as_i32(input, op).unwrap_or_default();
                    let mut out = vec![0i32; output.len()];
                    self.reduce_scatter(&wide, &mut out, sum_for_avg(op), timeout)?;
                    i32_to_bytes(output, &out);
                    if op == ReduceOp::Avg {
                        T::finish_avg(output, n);
                    }
                    Ok(())
                }
                Coll::ReduceScatter(input, output, op) => match (T::widen(input), op) {
                    (Some(wide), _) => {
                        let mut out = vec![0f32; output.len()];
                        self.reduce_scatter(&wide, &mut out, op, timeout)?;
                        if op == ReduceOp::Avg {
                            f32::finish_avg(&mut out, n);
                        }
                        T::narrow(output, &out);
                        Ok(())
                    }
                    (None, _) => {
                        self.reduce_scatter(input, output, op, timeout)?;
                        if op == ReduceOp::Avg {
                            T::finish_avg(output, n);
                        }
                        Ok(())
                    }
                },
                Coll::Broadcast(buf, root) => {
                    let (ptr, count, ty) = raw_mut(buf)?;
                    let comm = self.coll.0;
                    // SAFETY: `buf` is borrowed for this whole call, which returns only once
                    // the request completed (or after aborting the job).
                    self.run("broadcast", timeout, |req| unsafe {
                        ffi::MPI_Ibcast(ptr, count, ty, root as c_int, comm, req)
                    })
                }
                Coll::AllGather(input, output) => {
                    let (sp, sc, ty) = raw(input)?;
                    let (rp, _, _) = raw_mut(output)?;
                    let comm = self.coll.0;
                    // SAFETY: as for broadcast; output holds n × input elements (checked by the
                    // caller).
                    self.run("all_gather", timeout, |req| unsafe {
                        ffi::MPI_Iallgather(sp, sc, ty, rp, sc, ty, comm, req)
                    })
                }
                Coll::Gather(input, output, root) => {
                    let (sp, sc, ty) = raw(input)?;
                    let rp = match output {
                        Some(o) => raw_mut(o)?.0,
                        None => std::ptr::null_mut(),
                    };
                    let comm = self.coll.0;
                    // SAFETY: as for broadcast; the receive buffer matters at the root only.
                    self.run("gather", timeout, |req| unsafe {
                        ffi::MPI_Igather(sp, sc, ty, rp, sc, ty, root as c_int, comm, req)
                    })
                }
                Coll::Scatter(input, output, root) => {
                    let (rp, rc, ty) = raw_mut(output)?;
                    let sp = match input {
                        Some(i) => raw(i)?.0,
                        None => std::ptr::null(),
                    };
                    let comm = self.coll.0;
                    // SAFETY: as for gather.
                    self.run("scatter", timeout, |req| unsafe {
                        ffi::MPI_Iscatter(sp, rc, ty, rp, rc, ty, root as c_int, comm, req)
                    })
                }
                Coll::AllToAll((input, sc), (output, rcounts)) => {
                    let (sp, _, ty) = raw(input)?;
                    let (rp, _, _) = raw_mut(output)?;
                    let ints = |v: &[usize]| -> Result<(Vec<c_int>, Vec<c_int>)> {
                        let counts = v
                            .iter()
                            .map(|&x| {
                                c_int::try_from(x).map_err(|_| too_big("all_to_all", self.rank, x))
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let mut displs = Vec::with_capacity(v.len());
                        let mut at = 0usize;
                        for &x in v {
                            displs.push(
                                c_int::try_from(at)
                                    .map_err(|_| too_big("all_to_all", self.rank, at))?,
                            );
                            at += x;
                        }
                        Ok((counts, displs))
                    };
                    let (scnt, sdis) = ints(sc)?;
                    let (rcnt, rdis) = ints(rcounts)?;
                    let comm = self.coll.0;
                    // SAFETY: as for broadcast; counts and displacements live until `run`
                    // returns, i.e. until the request completed.
                    self.run("all_to_all", timeout, |req| unsafe {
                        ffi::MPI_Ialltoallv(
                            sp,
                            scnt.as_ptr(),
                            sdis.as_ptr(),
                            ty,
                            rp,
                            rcnt.as_ptr(),
                            rdis.as_ptr(),
                            ty,
                            comm,
                            req,
                        )
                    })
                }
            }
        }

        /// All-reduce (`root` None) or reduce of `buf` in place: 16-bit floats widened to f32
        /// and rounded once, averages summed and divided at the end (at the root for reduce).
        fn reducing<T: Reducible>(
            &self,
            buf: &mut [T],
            op: ReduceOp,
            root: Option<usize>,
            timeout: Duration,
        ) -> Result<()> {
            let n = self.size;
            let finish = op == ReduceOp::Avg && root.is_none_or(|r| r == self.rank);
            if let Some(mut wide) = bytes_as_i32(buf, op) {
                self.reduce_raw(&mut wide, sum_for_avg(op), root, timeout)?;
                i32_to_bytes(buf, &wide);
                if finish {
                    T::finish_avg(buf, n);
                }
                return Ok(());
            }
            match T::widen(buf) {
                Some(mut wide) => {
                    self.reduce_raw(&mut wide, op, root, timeout)?;
                    if finish {
                        f32::finish_avg(&mut wide, n);
                    }
                    T::narrow(buf, &wide);
                }
                None => {
                    self.reduce_raw(buf, op, root, timeout)?;
                    if finish {
                        T::finish_avg(buf, n);
                    }
                }
            }
            Ok(())
        }

        /// MPI_Iallreduce / MPI_Ireduce of `x` in place (through a copy of the input when the
        /// library's `MPI_IN_PLACE` is not known: see [`in_place`]).
        fn reduce_raw<U: Reducible>(
            &self,
            x: &mut [U],
            op: ReduceOp,
            root: Option<usize>,
            timeout: Duration,
        ) -> Result<()> {
            let copy;
            let send = match in_place() {
                Some(p) if root.is_none_or(|r| r == self.rank) => p.cast_const(),
                _ => {
                    copy = x.to_vec();
                    raw(&copy)?.0
                }
            };
            let (ptr, count, ty) = raw_mut(x)?;
            let (mop, comm) = (mpi_op(op), self.coll.0);
            let g = global()?;
            if root.is_none() && g.multiple {
                // Open MPI's blocking MPI_Allreduce (coll/tuned) is much faster than its
                // nonblocking one (libnbc): 64 MiB on 2 ranks 1.9 vs 1.1 GB/s. With
                // MPI_THREAD_MULTIPLE it runs outside the lock, its deadline watched by the
                // progress thread.
                let id = g.next_id.fetch_add(1, Ordering::Relaxed);
                let deadline = Instant::now() + timeout;
                let msg = overdue("all_reduce", self.world_rank, timeout);
                let mut w = g.watch.lock().unwrap_or_else(|e| e.into_inner());
                w.push((id, deadline, msg));
                drop(w);
                if let Some(reason) = mpi_lock(g).aborted.get(&self.family).cloned() {
                    g.watch
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .retain(|e| e.0 != id);
                    return Err(Error::Aborted {
                        op: "all_reduce",
                        rank: self.world_rank,
                        reason,
                    });
                }
                // SAFETY: `x` (and `copy`) are borrowed for the whole blocking call; MPI was
                // initialised with MPI_THREAD_MULTIPLE, so calling outside the lock is allowed.
                let rc = unsafe { ffi::MPI_Allreduce(send, ptr, count, ty, mop, comm) };
                g.watch
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|e| e.0 != id);
                return check(rc, "all_reduce", self.world_rank, None);
            }
            match root {
                // SAFETY: `x` (and `copy`) outlive the request: `run` returns only once it
                // completed (or after aborting the job).
                None => self.run("all_reduce", timeout, |req| unsafe {
                    ffi::MPI_Iallreduce(send, ptr, count, ty, mop, comm, req)
                }),
                // SAFETY: as above.
                Some(root) => self.run("reduce", timeout, |req| unsafe {
                    ffi::MPI_Ireduce(send, ptr, count, ty, mop, root as c_int, comm, req)
                }),
            }
        }

        fn reduce_scatter<T: Reducible>(
            &self,
            input: &[T],
            output: &mut [T],
            op: ReduceOp,
            timeout: Duration,
        ) -> Result<()> {
            let (sp, _, ty) = raw(input)?;
            let (rp, rc, _) = raw_mut(output)?;
            let (mop, comm) = (mpi_op(op), self.coll.0);
            // SAFETY: as for broadcast.
            self.run("reduce_scatter", timeout, |req| unsafe {
                ffi::MPI_Ireduce_scatter_block(sp, rp, rc, ty, mop, comm, req)
            })
        }

        /// The subgroup of this group whose members call with `Some(position)` (collective
        /// over this group; ranks passing `None` get `None`).
        pub(crate) fn split(&self, key: Option<usize>) -> Result<Option<Comm>> {
            let g = global()?;
            let t = mpi_lock(g);
            // SAFETY: reading rsmpi's exported constant.
            let color = if key.is_some() {
                0
            } else {
                unsafe { ffi::RSMPI_UNDEFINED }
            };
            let mut c = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY: valid communicator, pointer to a local; under the lock.
            let rc = unsafe {
                ffi::MPI_Comm_split(
                    self.coll.0,
                    color,
                    key.unwrap_or(0) as c_int,
                    c.as_mut_ptr(),
                )
            };
            check(rc, "new_group", self.world_rank, None)?;
            // SAFETY: MPI_Comm_split succeeded.
            let c = unsafe { c.assume_init() };
            if key.is_none() {
                return Ok(None);
            }
            // SAFETY: a valid communicator, under the lock.
            let out = unsafe { Comm::dup_all(c, self.world_rank, self.family) };
            // SAFETY: `c` is ours and no longer needed (its duplicates are independent).
            unsafe { ffi::MPI_Comm_free(&mut { c }) };
            drop(t);
            out.map(Some)
        }

        /// Fails every pending point-to-point operation of this group's family (the world group
        /// it came from and its subgroups) with `Aborted`, and every later one; MPI keeps the
        /// buffers of started transfers until they finish.
        pub(crate) fn abort(&self, reason: &str) {
            let Ok(g) = global() else { return };
            let mut t = mpi_lock(g);
            t.aborted.insert(self.family, reason.to_string());
            for p in t.pending.iter_mut().filter(|p| p.family == self.family) {
                p.cell.complete(
                    Err(Error::Aborted {
                        op: p.op,
                        rank: p.rank,
                        reason: reason.to_string(),
                    }),
                    None,
                );
            }
            // Receives still probing hold no MPI resources: drop them now.
            let family = self.family;
            t.pending.retain(|p| {
                p.family != family
                    || !matches!(
                        p.kind,
                        Kind::Recv {
                            state: RecvState::Probing,
                            ..
                        }
                    )
            });
        }
    }

    /// Sums and products of 8-bit integers go to MPI as i32 (`None` for every other type and
    /// operator): Open MPI's 8-bit sums saturate, where distcomm's wrap, so they are computed
    /// wide and wrapped on the way back ([`i32_to_bytes`]).
    fn bytes_as_i32<T: Reducible>(x: &[T], op: ReduceOp) -> Option<Vec<i32>> {
        if !matches!(op, ReduceOp::Sum | ReduceOp::Product | ReduceOp::Avg) {
            return None;
        }
        match T::DTYPE {
            DType::I8 => Some(
                bytemuck::cast_slice::<T, i8>(x)
                    .iter()
                    .map(|&v| i32::from(v))
                    .collect(),
            ),
            DType::U8 => Some(
                bytemuck::cast_slice::<T, u8>(x)
                    .iter()
                    .map(|&v| i32::from(v))
                    .collect(),
            ),
            _ => None,
        }
    }

    /// Wraps i32 results back into 8-bit elements.
    fn i32_to_bytes<T: Reducible>(dst: &mut [T], src: &[i32]) {
        for (d, s) in bytemuck::cast_slice_mut::<T, u8>(dst).iter_mut().zip(src) {
            *d = *s as u8;
        }
    }

    /// Integer averages are wrapped sums divided at the end.
    fn sum_for_avg(op: ReduceOp) -> ReduceOp {
        if op == ReduceOp::Avg {
            ReduceOp::Sum
        } else {
            op
        }
    }

    /// The library's `MPI_IN_PLACE` marker, which rsmpi does not export: `(void *) 1` in
    /// Open MPI, `(void *) -1` in MPICH and its derivatives (Intel MPI, MVAPICH, MS-MPI), read
    /// from `MPI_Get_library_version`. Unknown libraries get `None`: reductions then send a
    /// copy of the input instead.
    fn in_place() -> Option<*mut c_void> {
        static MARKER: OnceLock<Option<usize>> = OnceLock::new();
        let m = MARKER.get_or_init(|| {
            let mut buf = vec![0u8; 8192];
            let mut len: c_int = 0;
            // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING in every
            // implementation (Open MPI: 256, MPICH: 8192).
            unsafe { ffi::MPI_Get_library_version(buf.as_mut_ptr().cast(), &mut len) };
            let v = String::from_utf8_lossy(&buf[..len.clamp(0, 8192) as usize]).into_owned();
            if v.contains("Open MPI") {
                Some(1)
            } else if ["MPICH", "Intel(R) MPI", "MVAPICH", "Microsoft MPI"]
                .iter()
                .any(|k| v.contains(k))
            {
                Some(usize::MAX)
            } else {
                None
            }
        });
        m.map(|v| v as *mut c_void)
    }

    fn too_big(op: &'static str, rank: usize, n: usize) -> Error {
        Error::InvalidArgument {
            op,
            rank,
            detail: format!(
                "{n} elements: the MPI backend sends at most {} per message",
                c_int::MAX
            ),
        }
    }

    fn datatype(d: DType) -> ffi::MPI_Datatype {
        // SAFETY: reading rsmpi's exported handles to MPI's predefined datatypes.
        unsafe {
            match d {
                DType::Bytes | DType::U8 => ffi::RSMPI_UINT8_T,
                DType::I8 => ffi::RSMPI_INT8_T,
                DType::I16 => ffi::RSMPI_INT16_T,
                DType::I32 => ffi::RSMPI_INT32_T,
                DType::I64 => ffi::RSMPI_INT64_T,
                DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
                DType::F32 => ffi::RSMPI_FLOAT,
                DType::F64 => ffi::RSMPI_DOUBLE,
            }
        }
    }

    fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
        // SAFETY: reading rsmpi's exported handles to MPI's predefined operations.
        unsafe {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
                ReduceOp::Product => ffi::RSMPI_PROD,
                ReduceOp::Min => ffi::RSMPI_MIN,
                ReduceOp::Max => ffi::RSMPI_MAX,
                ReduceOp::BAnd => ffi::RSMPI_BAND,
                ReduceOp::BOr => ffi::RSMPI_BOR,
                ReduceOp::BXor => ffi::RSMPI_BXOR,
            }
        }
    }

    /// Where an empty buffer points: Rust's dangling pointer of an empty slice can be exactly
    /// a library's `MPI_IN_PLACE` (`(void *) 1` in Open MPI), so empty buffers point here
    /// instead (MPI reads and writes nothing through it: the count is 0).
    static EMPTY: [u64; 1] = [0];

    /// A byte buffer's address for MPI (see [`EMPTY`]).
    fn bytes_ptr(x: &[u8]) -> *const c_void {
        if x.is_empty() {
            EMPTY.as_ptr().cast()
        } else {
            x.as_ptr().cast()
        }
    }

    fn raw<T: Reducible>(x: &[T]) -> Result<(*const c_void, c_int, ffi::MPI_Datatype)> {
        let n = c_int::try_from(x.len()).map_err(|_| too_big("collective", 0, x.len()))?;
        let p = if x.is_empty() {
            EMPTY.as_ptr().cast()
        } else {
            x.as_ptr().cast()
        };
        Ok((p, n, datatype(T::DTYPE)))
    }

    fn raw_mut<T: Reducible>(x: &mut [T]) -> Result<(*mut c_void, c_int, ffi::MPI_Datatype)> {
        let n = c_int::try_from(x.len()).map_err(|_| too_big("collective", 0, x.len()))?;
        let p = if x.is_empty() {
            EMPTY.as_ptr().cast_mut().cast()
        } else {
            x.as_mut_ptr().cast()
        };
        Ok((p, n, datatype(T::DTYPE)))
    }
}
