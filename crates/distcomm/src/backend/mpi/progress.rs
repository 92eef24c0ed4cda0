//! The MPI backend's progress: the process-wide lock, the table of requests in flight, the
//! thread that tests them, and the mapping of MPI's error codes to typed errors.

use std::ffi::c_int;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::types::*;
use crate::completion::{BoxBuf, Deadline, Driver, OpCell, Status};
use crate::error::{Error, Result};

/// An MPI handle (communicator, request, message): an opaque pointer that MPI lets any
/// thread use; distcomm only ever uses one under the process-wide lock ([`mpi_lock`]).
#[derive(Clone, Copy)]
pub(super) struct Handle<H>(pub(super) H);
// SAFETY: see above: MPI handles are process-global identifiers, valid in every thread
// (the library was initialised for MPI_THREAD_SERIALIZED), and every use is serialised by
// the lock, so moving or sharing one between threads cannot race inside MPI.
unsafe impl<H> Send for Handle<H> {}
// SAFETY: as for Send.
unsafe impl<H> Sync for Handle<H> {}

/// A receive waiting for its message, or receiving it: matched by a probe (source and
/// length known), or posted to MPI directly (learnt from the status at the end).
pub(super) enum RecvState {
    Probing,
    Receiving(Handle<ffi::MPI_Request>, usize, usize),
    Posted(Handle<ffi::MPI_Request>),
}

/// Receives into fixed buffers of at least this many bytes are posted to MPI directly
/// (`MPI_Irecv`), so that large messages go straight into place the moment they arrive;
/// smaller ones, and buffers sized by the message, are matched by probing, which also gives
/// a too-long message's exact size. Measured on 2 ranks (Open MPI, shared memory): 64 MiB
/// ping-pong 5.3–6.3 GB/s probed, against MPI's own 7.0–7.3.
pub(super) const DIRECT_MIN: usize = 64 << 10;

pub(super) enum Kind {
    Send(Handle<ffi::MPI_Request>),
    Recv {
        comm: Handle<ffi::MPI_Comm>,
        /// Which communicator (unique in the process), for ordering probes.
        chan: u64,
        src: c_int,
        state: RecvState,
    },
}

pub(super) struct Pending {
    pub(super) id: u64,
    pub(super) kind: Kind,
    pub(super) cell: Arc<OpCell>,
    pub(super) buf: Option<BoxBuf>,
    pub(super) op: &'static str,
    pub(super) peer: usize,
    pub(super) tag: u32,
    pub(super) bytes: usize,
    pub(super) rank: usize,
    pub(super) family: u64,
}

/// Everything behind the lock: the requests in flight, in posting order.
pub(super) struct Table {
    pub(super) pending: Vec<Pending>,
    pub(super) finalized: bool,
    /// Set by [`Comm::abort`], per world group and its subgroups (a "family", as the
    /// native backend's engine): every later operation of the family fails with it.
    pub(super) aborted: std::collections::HashMap<u64, String>,
}

pub(super) struct Global {
    /// MPI granted MPI_THREAD_MULTIPLE: blocking all_reduce may then call MPI's own
    /// blocking `MPI_Allreduce` outside the lock (see [`Comm::reduce_raw`]).
    pub(super) multiple: bool,
    /// Deadlines of blocking MPI calls in progress (id, deadline, what), enforced by the
    /// progress thread.
    pub(super) watch: Mutex<Vec<(u64, Instant, String)>>,
    pub(super) table: Mutex<Table>,
    pub(super) work: Condvar,
    pub(super) next_id: AtomicU64,
    pub(super) world: (usize, usize),
}

pub(super) static GLOBAL: OnceLock<std::result::Result<Global, String>> = OnceLock::new();

pub(super) fn global() -> Result<&'static Global> {
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

pub(super) fn mpi_lock(g: &Global) -> MutexGuard<'_, Table> {
    g.table.lock().unwrap_or_else(|e| e.into_inner())
}

/// Initialises MPI once per process (`MPI_THREAD_SERIALIZED`), makes the world communicator
/// return errors, starts the progress thread and registers `MPI_Finalize` at exit.
pub(super) fn init_mpi() -> std::result::Result<Global, String> {
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
pub(super) fn progress_thread(g: &'static Global) {
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

pub(super) fn overdue(op: &str, rank: usize, timeout: Duration) -> String {
    format!(
        "distcomm (MPI backend): {op} on rank {rank} did not complete within {timeout:?}; \
         MPI cannot withdraw a collective that may still write into its buffers, so the job \
         is aborted"
    )
}

pub(super) fn abort_job(msg: &str) {
    crate::diag::always!(ERROR, target: "distcomm::mpi", "{msg}");
    // SAFETY: aborting the job is always allowed.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
}

/// MPI's description of an error code.
pub(super) fn describe(code: c_int) -> String {
    let mut buf = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: buf holds MPI_MAX_ERROR_STRING bytes, as MPI_Error_string requires.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

pub(super) fn class(code: c_int) -> u32 {
    let mut class: c_int = 0;
    // SAFETY: a pure query with a pointer to a local.
    unsafe { ffi::MPI_Error_class(code, &mut class) };
    class as u32
}

/// Maps an MPI return code to a typed error (`Ok` for MPI_SUCCESS).
pub(super) fn check(code: c_int, op: &'static str, rank: usize, peer: Option<usize>) -> Result<()> {
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
pub(super) fn progress(t: &mut Table) {
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
pub(super) fn step(p: &mut Pending) -> bool {
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
pub(super) fn test(p: &mut Pending, mut req: ffi::MPI_Request) -> bool {
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
pub(super) fn finish(mut p: Pending) {
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
pub(super) struct MpiDriver {
    pub(super) rank: usize,
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
