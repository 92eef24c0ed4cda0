//! The engine's operations: start, post sends and receives (choosing each message's protocol
//! with `choice`), cancel a key, abort, reclaim buffers, the blocking lane fast paths, and the
//! polite shutdown on drop.
//!
//! What callers above the transport see of it: `Engine`, `Envelope`, `EngineConfig`, `Fast`.

use super::*;

impl Engine {
    /// Takes over a connected mesh (`streams[rank]` is `None`) and starts the progress thread.
    /// `links[p]` is the shared-memory link to `p`, if it has one.
    pub(crate) fn start(
        rank: usize,
        streams: Vec<Option<TcpStream>>,
        links: Vec<Option<ShmLink>>,
        cfg: EngineConfig,
    ) -> Result<Arc<Engine>> {
        let mut peers = Vec::with_capacity(streams.len());
        let mut links = links.into_iter();
        for s in streams {
            let shm = links.next().flatten();
            peers.push(match s {
                None => None,
                Some(stream) => {
                    stream
                        .set_nonblocking(true)
                        .map_err(|e| Error::io("set socket nonblocking", e))?;
                    stream
                        .set_nodelay(true)
                        .map_err(|e| Error::io("set TCP_NODELAY", e))?;
                    let shm_peer = shm.is_some();
                    let local = same_host(&stream) || shm_peer;
                    let sockbuf = match cfg.sockbuf {
                        Some(both) => (both, both),
                        None if local && cfg.yield_spin => CROWDED_LOCAL_SOCKBUF,
                        None if local => LOCAL_SOCKBUF,
                        None => (0, 0),
                    };
                    if sockbuf != (0, 0) && shm.is_none() {
                        set_buffers(&stream, sockbuf)?;
                    }
                    let (rxbuf, rx_base) = rxbuf::rx_buffer();
                    Some(Peer {
                        link: Link { stream, shm },
                        out: VecDeque::new(),
                        out_off: 0,
                        rx: Rx::Header,
                        rxbuf,
                        rx_base,
                        copy: Default::default(),
                        tx: Default::default(),
                        rx_start: rx_base,
                        rx_end: rx_base,
                        dead: None,
                        chunk: cfg.data_chunk.unwrap_or(if local {
                            LOCAL_DATA_CHUNK
                        } else {
                            DATA_CHUNK
                        }),
                        lane_waits: (0..if shm_peer { LANE_ACKS } else { 0 })
                            .map(|_| None)
                            .collect(),
                        lane_ops: 0,
                        out_watched: false,
                    })
                }
            });
        }
        let watch = peers
            .iter()
            .map(|p| p.as_ref()?.link.shm.as_ref().map(ShmLink::watch))
            .collect();
        let (wake_tx, wake_rx) =
            UnixStream::pair().map_err(|e| Error::io("create wake pipe", e))?;
        for s in [&wake_tx, &wake_rx] {
            s.set_nonblocking(true)
                .map_err(|e| Error::io("set wake pipe nonblocking", e))?;
        }
        let sh = Arc::new(Shared {
            rank,
            st: Mutex::new(State {
                rank,
                limits: Limits {
                    eager_max: cfg.eager_max,
                    shm_eager_max: cfg.shm_eager_max,
                },
                peers,
                matcher: Matcher::default(),
                sends: HashMap::default(),
                rdv: Reassembly::default(),
                lent: HashMap::new(),
                next_id: 0,
                closed: None,
                cancelled: Cancelled::default(),
                cancel_error: cfg.cancel_error,
                wait_set: Default::default(),
                // Ranks outnumbering cores (they yield when they spin): timing writes is off.
                tx_rate: txcopy::TxRate::new(cfg.yield_spin),
                spare_temps: Pool::keeping(SPARE_TEMPS),
            }),
            watch,
            wake_tx,
            wake_rx,
            spinning: AtomicU64::new(0),
            watching: AtomicBool::new(false),
            handoff: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            spin: cfg.spin,
            yield_spin: cfg.yield_spin,
        });
        let sh2 = sh.clone();
        let thread = std::thread::Builder::new()
            .name(format!("distcomm-progress-{rank}"))
            .spawn(move || sh2.run_progress_thread())
            .map_err(|e| Error::io("spawn progress thread", e))?;
        Ok(Arc::new(Engine {
            sh,
            thread: Mutex::new(Some(thread)),
        }))
    }

    /// Posts a send. The buffer is owned by the engine until the returned cell completes; a
    /// small point-to-point message written straight into a shared-memory lane comes back
    /// with a [`Ticket`] instead, its buffer held in the cell, and its handle watches the
    /// answer itself (see [`Driver::adopt`]).
    pub(crate) fn isend(&self, env: Envelope, buf: BoxBuf, dst: usize) -> (u64, Arc<OpCell>) {
        #[cfg(feature = "trace-messages")]
        trace_post("isend", self.sh.rank, Some(dst), &env, buf.bytes().len());
        let op = env.op;
        let mut st = self.sh.lock();
        let id = st.alloc_id();
        let len = buf.bytes().len();
        let hdr = env.eager(id, len);
        // A small message to a live shared-memory peer goes through its lane when it may, and
        // first: the handle's cell and the send's entry are made after the write, off the
        // message's way (a dead peer, ourselves or a full lane decline it; the checks below
        // then report what went wrong).
        if choice::lane_fits(len)
            && st.closed.is_none()
            && !st.cancelled.contains((env.ctx, env.tag))
        {
            let waits = !refusal::scheduled(env.fp);
            let owner = if waits { Owner::Caller } else { Owner::Nobody };
            if let Some((seq, pre)) = st.lane_send(dst, &hdr, buf.bytes(), owner) {
                drop(st);
                let ticket = Ticket {
                    peer: dst,
                    seq,
                    env,
                    len,
                };
                // Taken by a posted receive, or not answered: done.
                if pre || !waits {
                    let cell = OpCell::fresh();
                    cell.complete(Ok(ticket.status()), Some(buf));
                    return (id, cell);
                }
                return (id, OpCell::watched(ticket, buf));
            }
        }
        let cell = OpCell::fresh();
        let mut pending = env.pending(dst, len, cell.clone());
        if let Some(reason) = st.closed.clone() {
            let e = Error::Aborted {
                op,
                rank: self.sh.rank,
                reason,
            };
            cell.complete(Err(e), None);
            return (id, cell);
        }
        // A key already cancelled (a later step of a failed collective, say) sends nothing: the
        // receiver would refuse it, or have left meanwhile and be blamed for the failure.
        if let Some(c) = st.cancelled.get((env.ctx, env.tag)) {
            let e = st.cancelled_error(c, op, env.fp, env.dtype);
            cell.complete(Err(e), None);
            return (id, cell);
        }
        if dst == self.sh.rank {
            let data = buf.bytes().to_vec();
            pending.buf = Some(buf);
            st.sends.insert(id, pending);
            st.deliver_eager(dst, hdr, data);
            return (id, cell);
        }
        if let Some(reason) = st.dead_reason(dst) {
            cell.complete(Err(peer_lost(op, self.sh.rank, dst, &reason)), None);
            return (id, cell);
        }
        // A large message to a shared-memory peer is fetched by the receiver straight from our
        // buffer (never from a view of the caller's memory: the engine cannot stop a copy
        // under way in another process if the caller takes that memory back).
        let fetchable = !buf.is_view()
            && matches!(st.peers.get(dst), Some(Some(p)) if p.link.cma_pid().is_some());
        // Such a copy (by both sides at once) beats two copies through the ring from
        // `shm_eager_max` bytes on.
        let wire = st.limits.wire(len, fetchable);
        let out = if wire == Wire::Eager {
            let aux = if pending.waits_for_ack() {
                0
            } else {
                EAGER_NO_ACK
            };
            Out {
                hdr: Header { aux, ..hdr }.encode(),
                kind: Kind::Eager,
                payload: Some(buf),
                base: 0,
                plen: len,
                send_id: Some(id),
            }
        } else if wire == Wire::Fetch {
            let addr = buf.bytes().as_ptr() as u64;
            pending.buf = Some(buf);
            pending.lent = true;
            Out {
                hdr: Header {
                    kind: Kind::Rget,
                    ..hdr
                }
                .encode(),
                kind: Kind::Rget,
                payload: Some(Box::new(addr.to_le_bytes().to_vec())),
                base: 0,
                plen: RGET_PAYLOAD,
                send_id: Some(id),
            }
        } else {
            pending.buf = Some(buf);
            Out {
                hdr: Header {
                    kind: Kind::Rts,
                    ..hdr
                }
                .encode(),
                kind: Kind::Rts,
                payload: None,
                base: 0,
                plen: 0,
                send_id: Some(id),
            }
        };
        st.sends.insert(id, pending);
        st.push_out(dst, out);
        if let Err(reason) = st.pump_tx(dst) {
            st.mark_dead(dst, reason);
        }
        let backlog = st.unwatched_backlog(Some(dst));
        drop(st);
        self.nudge(backlog);
        (id, cell)
    }

    /// Sends a scheduled eager message (a collective's: it has a check word, so nobody answers
    /// it and it is done once written, see `refusal`) from `data` at once and without a handle,
    /// when `dst` is a socket peer with nothing queued: the frame goes straight to its socket,
    /// and what the socket does not take now is queued as a copy. Returns whether it did; when
    /// not (a shared-memory peer, frames already queued, a rendezvous-sized message, a
    /// cancelled key, a closed engine or a dead peer) nothing was sent and the caller posts the
    /// message as usual ([`Engine::isend`]), which reports what went wrong.
    ///
    /// The general path costs a small send of a collective a copy into a pooled buffer, a
    /// boxed buffer, a handle and an entry in the send table, on a root whose every call is
    /// bound by its sends: world 2 over TCP, 8 B and 1 KiB broadcast, reduce, gather and
    /// scatter took 0.94-0.97x the time with this (`scripts/ab.py`, 4 alternating pairs).
    pub(crate) fn send_scheduled(&self, env: Envelope, data: &[u8], dst: usize) -> bool {
        #[cfg(feature = "trace-messages")]
        trace_post(
            "send (scheduled)",
            self.sh.rank,
            Some(dst),
            &env,
            data.len(),
        );
        if !refusal::scheduled(env.fp) || dst == self.sh.rank {
            return false;
        }
        let mut guard = self.sh.lock();
        let st = &mut *guard;
        if st.closed.is_some()
            || st.cancelled.contains((env.ctx, env.tag))
            || st.limits.wire(data.len(), false) != Wire::Eager
        {
            return false;
        }
        let id = st.alloc_id();
        let Some(Some(peer)) = st.peers.get_mut(dst) else {
            return false;
        };
        if peer.dead.is_some() || peer.link.shm.is_some() || !peer.out.is_empty() {
            return false;
        }
        let hdr = Header {
            aux: EAGER_NO_ACK,
            ..env.eager(id, data.len())
        }
        .encode();
        let written = match peer.link.write(&[IoSlice::new(&hdr), IoSlice::new(data)]) {
            Ok(n) => n,
            Err(reason) => {
                st.mark_dead(dst, reason);
                return false;
            }
        };
        if written < HEADER_LEN + data.len() {
            peer.out.push_back(Out {
                hdr,
                kind: Kind::Eager,
                payload: Some(Box::new(data.to_vec())),
                base: 0,
                plen: data.len(),
                // Our message, not a reply owed to the peer: an abort drops it unless it is
                // half on the wire (its id has no entry in the send table: nothing completes).
                send_id: Some(id),
            });
            peer.out_off = written;
            let backlog = st.unwatched_backlog(Some(dst));
            drop(guard);
            self.nudge(backlog);
        }
        true
    }

    /// Whether peer `p` (a global rank other than ours) is reached through a TCP socket rather
    /// than shared memory (read without the lock).
    pub(crate) fn by_socket(&self, p: usize) -> bool {
        p != self.sh.rank && self.sh.watch.get(p).is_some_and(Option::is_none)
    }

    /// Takes a scheduled eager message (a collective's, as [`Engine::send_scheduled`] sends
    /// them) of `len` bytes from socket peer `src` without a handle when it has already come:
    /// waiting unexpected, or in what one read of its socket brings now. `take` gets the
    /// payload (under the engine's lock: keep it short). Returns whether it did; when not
    /// (nothing there yet, a shared-memory peer, a message that does not fit or belongs to a
    /// different call) nothing was taken and the caller posts the receive as usual
    /// ([`Engine::irecv`]), which reports what went wrong.
    ///
    /// The counterpart of `send_scheduled` on the receiving side, where back-to-back rooted
    /// calls pile up: the general path costs each small message a pooled buffer, a box, a
    /// handle, a posted entry and a wait.
    pub(crate) fn recv_scheduled(
        &self,
        env: Envelope,
        src: usize,
        len: usize,
        take: impl FnOnce(&[u8]),
    ) -> bool {
        #[cfg(feature = "trace-messages")]
        trace_post("recv (scheduled)", self.sh.rank, Some(src), &env, len);
        if !refusal::scheduled(env.fp) || src == self.sh.rank {
            return false;
        }
        let mut guard = self.sh.lock();
        let st = &mut *guard;
        if !matches!(st.peers.get(src), Some(Some(p)) if p.link.shm.is_none() && p.dead.is_none()) {
            return false;
        }
        let key = (env.ctx, env.tag);
        if !st.matcher.unexpected_from(src, key) {
            st.pump(src, true, false, true);
        }
        let want = Expect {
            op: env.op,
            dtype: env.dtype,
            check: env.fp,
            cap: len as u64,
        };
        let rank = st.rank;
        let fits = |u: &Unexpected| {
            u.hdr.kind == Kind::Eager
                && u.data.is_some()
                && refusal::check(rank, want, src, &u.hdr).is_ok()
        };
        let taken = match st.matcher.take_unexpected_if(src, key, fits) {
            Some(Unexpected {
                hdr,
                data: Some(data),
                ..
            }) => {
                take(&data);
                st.spare_temps.give(data);
                st.answer(src, &hdr, None);
                true
            }
            _ => false,
        };
        let backlog = st.unwatched_backlog(Some(src));
        drop(guard);
        self.nudge(backlog);
        taken
    }

    /// Posts a receive from `src` (`None`: any source).
    pub(crate) fn irecv(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
    ) -> (u64, Arc<OpCell>) {
        #[cfg(feature = "trace-messages")]
        trace_post("irecv", self.sh.rank, src, &env, buf.bytes().len());
        let Envelope {
            op,
            dtype,
            ctx,
            tag,
            fp,
        } = env;
        let cell = OpCell::fresh();
        let mut st = self.sh.lock();
        let id = st.alloc_id();
        st.post_recv(Posted {
            id,
            op,
            src,
            ctx,
            tag,
            dtype,
            fp,
            buf,
            cell: cell.clone(),
        });
        let backlog = st.unwatched_backlog(None);
        drop(st);
        self.nudge(backlog);
        (id, cell)
    }

    /// After posting: if frames wait to be written and the progress thread sleeps on the
    /// sockets with an interest set that predates them ([`State::unwatched_backlog`]), wake it
    /// so that it watches for writability. While waiters spin (or just spun) they write the
    /// backlog themselves, and a reply left queued there usually leaves together with the next
    /// message.
    pub(super) fn nudge(&self, backlog: bool) {
        if backlog && self.sh.watching.load(Ordering::Acquire) {
            self.sh.poke();
        }
    }

    /// Cancels key (`env.ctx`, `env.tag`) here and tells `peers` (global ranks), so that their
    /// operations of it fail too instead of waiting for us; refuses its later messages here.
    /// `why` is the caller's reason word, carried opaquely to `EngineConfig::cancel_error`
    /// here and on every peer, with `env`'s check word and element type.
    pub(crate) fn cancel_key(&self, env: Envelope, why: u32, peers: &[usize]) {
        let Envelope {
            dtype,
            ctx,
            tag,
            fp,
            ..
        } = env;
        let mut st = self.sh.lock();
        let note = CancelNote {
            by: self.sh.rank,
            check: fp,
            dtype,
            why,
        };
        st.cancelled.cancel((ctx, tag), note);
        let hdr = Header {
            kind: Kind::Cancel,
            dtype,
            ctx,
            tag,
            aux: why,
            msg_id: 0,
            len: 0,
            fp,
        };
        for &p in peers.iter().filter(|&&p| p != self.sh.rank) {
            st.push_out(
                p,
                Out {
                    hdr: hdr.encode(),
                    kind: Kind::Cancel,
                    payload: None,
                    base: 0,
                    plen: 0,
                    send_id: None,
                },
            );
            if let Err(reason) = st.pump_tx(p) {
                st.mark_dead(p, reason);
            }
        }
        let backlog = st.unwatched_backlog(None);
        drop(st);
        self.nudge(backlog);
    }

    /// Fails every pending operation and refuses new ones.
    pub(crate) fn abort(&self, reason: &str) {
        self.sh.lock().abort_all(reason);
        self.sh.poke();
    }

    /// Makes the engine let go of the buffers of operations `ids` (views of memory it does not
    /// own): queued or half-written sends get an owned copy of their data, receives not yet
    /// started are withdrawn, and receives under way continue into owned scratch memory (their
    /// data is discarded). Unfinished receives among them fail. Afterwards nothing in the engine
    /// points into the caller's memory.
    pub(crate) fn reclaim(&self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let mut st = self.sh.lock();
        st.reclaim(ids);
    }

    /// Largest message sent without the receiver-ready handshake.
    pub(crate) fn eager_max(&self) -> usize {
        self.sh.lock().limits.eager_max
    }

    /// What carries messages to global rank `peer`.
    pub(crate) fn link_kind(&self, peer: usize) -> LinkKind {
        match self.sh.lock().peers.get(peer) {
            Some(Some(p)) if p.link.shm.is_some() => LinkKind::Shm,
            Some(Some(_)) => LinkKind::Tcp,
            _ => LinkKind::Loopback,
        }
    }

    /// Whether the connection to `peer` has failed, and why.
    pub(crate) fn peer_failure(&self, peer: usize) -> Option<String> {
        self.sh.lock().dead_reason(peer)
    }

    /// A blocking send of a small point-to-point message (`data`, at most `LANE_MAX` bytes)
    /// to shared-memory peer `dst` through its lane, the caller watching the answer word itself:
    /// no handle, no allocation, no acknowledgement frame. Declined (nothing sent) when the
    /// lane cannot take it now; handed to the engine when the answer is slow to come.
    pub(crate) fn send_small(&self, env: Envelope, data: &[u8], dst: usize) -> Fast {
        #[cfg(feature = "trace-messages")]
        trace_post("send (lane)", self.sh.rank, Some(dst), &env, data.len());
        let Some(Some(watch)) = self.sh.watch.get(dst) else {
            return Fast::Declined;
        };
        if !choice::lane_fits(data.len()) || refusal::scheduled(env.fp) {
            return Fast::Declined;
        }
        let h = env.eager(0, data.len());
        let sent = {
            let mut st = self.sh.lock();
            if st.closed.is_some() {
                None
            } else {
                st.lane_send(dst, &h, data, Owner::Caller)
            }
        };
        let Some((seq, pre)) = sent else {
            return Fast::Declined;
        };
        let t = Ticket {
            peer: dst,
            seq,
            env,
            len: data.len(),
        };
        if pre {
            return Fast::Done(Ok(t.status()));
        }
        self.fast_wait(FAST_SPIN, || watch.answered(seq).is_some());
        if watch.answered(seq) == Some(true) {
            return Fast::Done(Ok(t.status()));
        }
        let cell = OpCell::fresh();
        match self.sh.lock().adopt_lane_send(&t, &cell, None, None) {
            Some(id) => Fast::Handed(id, cell),
            None => Fast::Done(cell.result().unwrap_or(Ok(t.status()))),
        }
    }

    /// A blocking receive of a point-to-point message from shared-memory peer `src` straight
    /// from its lane into `out`, when nothing can come before it (see
    /// `State::recv_from_lane`) and it arrives within a short spin. `None`: nothing was
    /// received; the caller takes the general path.
    pub(crate) fn recv_small(
        &self,
        env: Envelope,
        out: &mut [u8],
        src: usize,
    ) -> Option<Result<Status>> {
        #[cfg(feature = "trace-messages")]
        trace_post("recv (lane)", self.sh.rank, Some(src), &env, out.len());
        let owner = blocking_owner();
        self.take_from_lane(src, FAST_SPIN, owner, |st| {
            (st.recv_from_lane(src, &env, out, owner), false)
        })
    }

    /// Takes a message from shared-memory peer `src`'s lane with `take` (under the lock; it
    /// also says whether frames wait to be written), spinning up to `limit` (at most
    /// [`FAST_SPIN`]) once for one to come when the lane was empty. `None`: nothing was taken
    /// (declined, nothing came, ring bytes come first, or frames wait: the general wait writes
    /// those). The post of receive `owner` (made by `take`) is withdrawn before that; when a
    /// message it accepted took its place first, `take` gets it.
    fn take_from_lane<T>(
        &self,
        src: usize,
        limit: Duration,
        owner: u64,
        mut take: impl FnMut(&mut State) -> (LaneTake<T>, bool),
    ) -> Option<T> {
        let watch = self.sh.watch.get(src)?.as_ref()?;
        let (mut waited, mut disown) = (false, false);
        loop {
            // Ring bytes come first: the engine reads those (looked at without the lock).
            let wait = !watch.ring_incoming()
                && match take(&mut self.sh.lock()) {
                    (LaneTake::Got(got), _) => return Some(got),
                    (LaneTake::Empty, false) => !waited,
                    _ => false,
                };
            if !wait {
                // A message the posted receive accepted is taken on the next round; should
                // that decline it, the engine delivers it.
                if self.sh.lock().lane_withdraw(src, owner, disown) {
                    return None;
                }
                disown = true;
                continue;
            }
            self.fast_wait(limit.min(FAST_SPIN), || watch.incoming());
            waited = true;
        }
    }
}

/// The owner of this thread's blocking receive's post in a lane: unlike any receive's id
/// (those count up from 1) and any other live thread's.
fn blocking_owner() -> u64 {
    thread_local!(static MARK: u8 = const { 0 });
    MARK.with(|m| std::ptr::from_ref(m) as u64) | 1 << 63
}

impl Engine {
    /// The waiter of posted receive `id` takes its message itself when it is at the head of
    /// its source's lane or arrives there within a short spin ([`State::claim`]): from the
    /// lane into the receive's buffer, which comes back here, without a sweep of the links or
    /// the completion cell. `None`: nothing was taken; wait the general way.
    pub(crate) fn claim(&self, id: u64, src: usize, limit: Duration) -> Option<(Status, BoxBuf)> {
        // Spinning here writes nothing: queued frames go out with the general wait.
        self.take_from_lane(src, limit, id, |st| (st.claim(id), st.backlog()))
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.sh.stop.store(true, Ordering::Release);
        self.sh.poke();
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
        let mut st = self.sh.lock();
        // Let queued frames (acks, last sends) go out, then close politely: half-close, and
        // drain until every peer has closed too, so that no unread data turns our close into a
        // reset that would destroy data the peer has not read yet.
        let linger = Instant::now() + Duration::from_secs(5);
        while Instant::now() < linger
            && (st
                .peers
                .iter()
                .flatten()
                .any(|p| p.dead.is_none() && !p.out.is_empty())
                || !st.lent.is_empty()
                || st.sends.values().any(|s| s.lent))
        {
            st.progress(true);
            std::thread::sleep(Duration::from_micros(200));
        }
        st.abort_all("process group shut down");
        // A peer that never answered may still copy from or into these buffers: leak them
        // rather than hand the memory back to the allocator.
        for (_, l) in st.lent.drain() {
            std::mem::forget(l.r.buf);
        }
        for (_, s) in st.sends.drain() {
            std::mem::forget(s.buf);
        }
        for peer in st.peers.iter_mut().flatten() {
            if peer.dead.is_some() {
                continue;
            }
            let stream = &mut peer.link.stream;
            let _ = stream.shutdown(Shutdown::Write);
            let _ = stream.set_nonblocking(false);
            let left = linger
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            let _ = stream.set_read_timeout(Some(left));
            let mut sink = [0u8; 4096];
            while matches!(stream.read(&mut sink), Ok(n) if n > 0) {}
        }
    }
}
