//! Point-to-point: user sends and receives, blocking and nonblocking, and the posting every
//! other part of the API goes through.
//!
//! Owns: tag and rank checks, the blocking forms. Must not know: how the backend matches.

use std::time::Duration;

use super::{Inner, ProcessGroup};
use crate::backend::{Small, CTX_USER};
use crate::call::Envelope;
use crate::call::Fingerprint;
use crate::copy::copy;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::work::{boxed, BoxBuf, Status, Work};

impl Inner {
    /// Posts a send to group rank `dst`; `env.ctx` is relative to the group's contexts.
    pub(crate) fn post_send<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        dst: usize,
    ) -> Result<Work<B>> {
        self.check_rank(env.op, dst)?;
        let posted = self.backend.isend(env, buf, dst, self.timeout)?;
        Ok(posted
            .into_work(env.op, Some(dst), self.timeout)
            .detach_on_drop())
    }

    /// Posts a receive from group rank `src` (`None`: any source, world group only).
    pub(crate) fn post_recv<B: 'static>(
        &self,
        env: Envelope,
        buf: BoxBuf,
        src: Option<usize>,
    ) -> Result<Work<B>> {
        match src {
            Some(s) => self.check_rank(env.op, s)?,
            None if self.world => {}
            None => {
                return Err(self.invalid(
                    env.op,
                    "receive from any source is only supported on the world group".into(),
                ))
            }
        }
        let posted = self.backend.irecv(env, buf, src, self.timeout)?;
        Ok(posted.into_work(env.op, src, self.timeout))
    }

    /// A blocking send to group rank `dst` on the backend's small-message path; `None` when it
    /// does not apply (then nothing was sent).
    fn send_small(
        &self,
        env: Envelope,
        data: &[u8],
        dst: usize,
        timeout: Duration,
    ) -> Result<Option<Result<()>>> {
        self.check_rank(env.op, dst)?;
        Ok(match self.backend.send_small(env, data, dst) {
            Small::Declined => None,
            Small::Done(r) => Some(r),
            Small::Posted(p) => {
                let w: Work<()> = p
                    .into_work(env.op, Some(dst), self.timeout)
                    .detach_on_drop();
                Some(w.wait_timeout(timeout).map(|_| ()))
            }
        })
    }

    /// A blocking receive from group rank `src` on the backend's small-message path; `None`
    /// when it does not apply (then nothing was received).
    fn recv_small(
        &self,
        env: Envelope,
        out: &mut [u8],
        src: usize,
        timeout: Duration,
    ) -> Result<Option<Result<Status>>> {
        self.check_rank(env.op, src)?;
        Ok(match self.backend.recv_small(env, out, src) {
            Small::Declined => None,
            Small::Done(r) => Some(r.map(|st| Status { peer: src, ..st })),
            Small::Posted(p) => {
                let w: Work<()> = p.into_work(env.op, Some(src), self.timeout);
                Some(w.wait_timeout(timeout))
            }
        })
    }
}

impl ProcessGroup {
    /// A user point-to-point send: checks the tag, no fingerprint.
    fn user_send<B: 'static>(
        &self,
        op: &'static str,
        buf: BoxBuf,
        dtype: DType,
        dst: usize,
        tag: u32,
    ) -> Result<Work<B>> {
        self.check_tag(op, tag)?;
        self.inner.post_send(user(op, dtype, tag), buf, dst)
    }

    /// A user point-to-point receive (`src` `None`: any source).
    fn user_recv<B: 'static>(
        &self,
        op: &'static str,
        buf: BoxBuf,
        dtype: DType,
        src: Option<usize>,
        tag: u32,
    ) -> Result<Work<B>> {
        self.check_tag(op, tag)?;
        self.inner.post_recv(user(op, dtype, tag), buf, src)
    }

    /// Starts sending `buf` to `dst`; returns at once. The buffer comes back from
    /// [`Work::into_buffer`] when the receiver has taken the message.
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// # let group = distcomm::init()?;
    /// let work = group.isend(vec![1.0f32, 2.0], 1, 0)?;
    /// let buf: Vec<f32> = work.into_buffer()?;
    /// # Ok(()) }
    /// ```
    pub fn isend<T: Element>(&self, buf: Vec<T>, dst: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_send("isend", boxed(buf), T::DTYPE, dst, tag)
    }

    /// Starts receiving into `buf` from `src`; returns at once. A message longer than `buf` fails
    /// both sides with [`Error::MessageTooLarge`]; a shorter one fills a prefix (the status says
    /// how many bytes).
    pub fn irecv<T: Element>(&self, buf: Vec<T>, src: usize, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_recv("irecv", boxed(buf), T::DTYPE, Some(src), tag)
    }

    /// Like [`irecv`](Self::irecv) from whichever rank sends first with `tag`; the status names
    /// the source. World group only.
    pub fn irecv_any<T: Element>(&self, buf: Vec<T>, tag: u32) -> Result<Work<Vec<T>>> {
        self.user_recv("irecv", boxed(buf), T::DTYPE, None, tag)
    }

    /// Starts sending memory lent by another runtime (a torch tensor, say) as elements of
    /// `dtype`; the operation holds `buf` until it is terminal. See [`isend`](Self::isend).
    pub fn isend_lent(
        &self,
        buf: crate::Lent,
        dtype: DType,
        dst: usize,
        tag: u32,
    ) -> Result<Work<crate::Lent>> {
        self.check_lent("isend", &buf, dtype)?;
        self.user_send("isend", boxed(buf), dtype, dst, tag)
    }

    /// Starts receiving into lent memory from `src` (`None`: any source, world group only);
    /// [`DType::Bytes`] accepts a message of any element type. See [`irecv`](Self::irecv).
    pub fn irecv_lent(
        &self,
        buf: crate::Lent,
        dtype: DType,
        src: Option<usize>,
        tag: u32,
    ) -> Result<Work<crate::Lent>> {
        self.check_lent("irecv", &buf, dtype)?;
        self.user_recv("irecv", boxed(buf), dtype, src, tag)
    }

    fn check_lent(&self, op: &'static str, buf: &crate::Lent, dtype: DType) -> Result<()> {
        if buf.len() % dtype.size() != 0 {
            return Err(Error::InvalidArgument {
                op,
                rank: self.rank(),
                detail: format!(
                    "{} bytes are not a whole number of {dtype} elements",
                    buf.len()
                ),
            });
        }
        Ok(())
    }

    /// Sends raw bytes (element type `bytes`).
    pub fn isend_bytes(&self, buf: Vec<u8>, dst: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.user_send("isend", boxed(buf), DType::Bytes, dst, tag)
    }

    /// Receives raw bytes; accepts a message of any element type.
    pub fn irecv_bytes(&self, buf: Vec<u8>, src: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.user_recv("irecv", boxed(buf), DType::Bytes, Some(src), tag)
    }

    /// Blocking send of a slice (copied once into an owned buffer; use [`isend`](Self::isend)
    /// to avoid the copy). Bounded by the group's timeout.
    pub fn send<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        self.send_timeout(data, dst, tag, self.timeout())
    }

    /// [`send`](Self::send) with its own deadline. On timeout the message is not withdrawn: it
    /// is delivered if the receiver still takes it.
    pub fn send_timeout<T: Element>(
        &self,
        data: &[T],
        dst: usize,
        tag: u32,
        timeout: Duration,
    ) -> Result<()> {
        self.check_tag("send", tag)?;
        let env = user("send", T::DTYPE, tag);
        if let Some(r) = self
            .inner
            .send_small(env, bytemuck::cast_slice(data), dst, timeout)?
        {
            return r;
        }
        let w: Work<Vec<T>> = self.inner.post_send(env, Box::new(data.to_vec()), dst)?;
        w.wait_timeout(timeout).map(|_| ())
    }

    /// Blocking receive into a slice; returns the source and byte count. Bounded by the group's
    /// timeout.
    pub fn recv<T: Element>(&self, out: &mut [T], src: usize, tag: u32) -> Result<Status> {
        self.recv_timeout(out, src, tag, self.timeout())
    }

    /// [`recv`](Self::recv) with its own deadline. On timeout the receive is withdrawn (a
    /// message that had already begun to arrive is taken and discarded) and `out` is untouched.
    pub fn recv_timeout<T: Element>(
        &self,
        out: &mut [T],
        src: usize,
        tag: u32,
        timeout: Duration,
    ) -> Result<Status> {
        self.check_tag("recv", tag)?;
        let env = user("recv", T::DTYPE, tag);
        if let Some(r) = self
            .inner
            .recv_small(env, bytemuck::cast_slice_mut(out), src, timeout)?
        {
            return r;
        }
        let buf = vec![T::zeroed(); out.len()];
        let w = self.inner.post_recv(env, boxed(buf), Some(src))?;
        finish_recv(w, out, timeout)
    }

    /// Blocking receive from any source (world group only).
    pub fn recv_any<T: Element>(&self, out: &mut [T], tag: u32) -> Result<Status> {
        let buf = vec![T::zeroed(); out.len()];
        let w = self.user_recv("recv", boxed(buf), T::DTYPE, None, tag)?;
        finish_recv(w, out, self.timeout())
    }

    /// Blocks until every rank of the group has entered the barrier (native backend: through the
    /// shared-memory arena when the group has one, else dissemination, ⌈log₂ n⌉ rounds of
    /// zero-byte messages).
    pub fn barrier(&self) -> Result<()> {
        let turn = self.inner.issue();
        let call = crate::call::Call::new(crate::call::CallKind::Barrier, 0).quiet(true);
        self.inner
            .run::<u8>(call, turn, crate::backend::Coll::Barrier)
    }
}

/// The envelope of a user point-to-point message.
fn user(op: &'static str, dtype: DType, tag: u32) -> Envelope {
    Envelope {
        op,
        dtype,
        ctx: CTX_USER,
        tag,
        fp: Fingerprint::NONE,
    }
}

fn finish_recv<T: Element>(w: Work<Vec<T>>, out: &mut [T], timeout: Duration) -> Result<Status> {
    let status = w.wait_timeout(timeout)?;
    let buf = w.into_buffer()?;
    let n = status.bytes / std::mem::size_of::<T>().max(1);
    copy(&mut out[..n], &buf[..n]);
    Ok(status)
}
