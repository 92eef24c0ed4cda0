//! Pipeline-stage point-to-point: tensors that carry their element type and shape, so that the
//! receiver allocates for them, and byte objects of any length — DeepSpeed's `pipe/p2p.py`, but
//! nonblocking like the rest of distcomm.
//!
//! A tensor travels as two messages on the same tag: a small header (magic, element type,
//! rank, dimensions) and the elements. The receiver posts both receives at once, the second into
//! a buffer that takes the size of the message that matches it, so both move without the caller
//! polling; [`TensorWork`] waits for both and checks the header against the data. A sender of
//! the wrong element type gets [`Error::DTypeMismatch`] on both sides, like any receive.
//!
//! [`PipeStage`] gives the usual schedule vocabulary on top: activations go forward to the next
//! stage (the last stage's forward goes to the first), gradients backward to the previous one,
//! on a context of their own so that they never match the group's other traffic.

use std::time::{Duration, Instant};

use crate::backend::{CTX_PIPE, CTX_USER};
use crate::call::Envelope;
use crate::call::Fingerprint;
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::group::ProcessGroup;
use crate::work::{Fitted, Status, Work};

/// At most this many dimensions per tensor.
pub const MAX_DIMS: usize = 8;
/// The largest tensor or object a receive will allocate for, in bytes (a larger one fails both
/// sides with [`Error::MessageTooLarge`]).
pub const MAX_RECV_BYTES: usize = 1 << 36;

const MAGIC: [u8; 4] = *b"DCT1";
const HEADER_MAX: usize = 6 + 8 * MAX_DIMS;

/// A dense tensor: row-major elements and their shape (`shape` empty for a scalar).
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    pub shape: Vec<usize>,
    pub data: Vec<T>,
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` over `data`; an error unless the shape holds exactly `data.len()`
    /// elements and has at most [`MAX_DIMS`] dimensions.
    ///
    /// ```
    /// let t = distcomm::Tensor::new(vec![2, 3], vec![0f32; 6]).unwrap();
    /// assert_eq!(t.numel(), 6);
    /// assert!(distcomm::Tensor::new(vec![2, 2], vec![0f32; 6]).is_err());
    /// ```
    pub fn new(shape: Vec<usize>, data: Vec<T>) -> Result<Tensor<T>> {
        let numel = numel(&shape);
        if shape.len() > MAX_DIMS || numel != Some(data.len()) {
            return Err(Error::InvalidArgument {
                op: "tensor",
                rank: 0,
                detail: format!(
                    "shape {shape:?} does not hold {} elements (or has more than {MAX_DIMS} dimensions)",
                    data.len()
                ),
            });
        }
        Ok(Tensor { shape, data })
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn encode_header(dtype: DType, shape: &[usize]) -> Vec<u8> {
    let mut h = Vec::with_capacity(6 + 8 * shape.len());
    h.extend_from_slice(&MAGIC);
    h.push(dtype as u8);
    h.push(shape.len() as u8);
    for &d in shape {
        h.extend_from_slice(&(d as u64).to_le_bytes());
    }
    h
}

/// Decodes a header: the element type and the shape, or what is wrong with it.
fn decode_header(h: &[u8]) -> std::result::Result<(DType, Vec<usize>), String> {
    let (Some(magic), Some(&dt), Some(&ndim)) = (h.get(..4), h.get(4), h.get(5)) else {
        return Err(format!("tensor header of {} bytes is too short", h.len()));
    };
    if magic != MAGIC {
        return Err("not a tensor header (bad magic)".into());
    }
    let dtype = DType::from_wire(dt).ok_or_else(|| format!("unknown element type {dt}"))?;
    let ndim = usize::from(ndim);
    if ndim > MAX_DIMS || h.len() != 6 + 8 * ndim {
        return Err(format!(
            "tensor header of {} bytes for {ndim} dimensions",
            h.len()
        ));
    }
    let shape = h[6..]
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            usize::try_from(u64::from_le_bytes(b)).map_err(|_| "dimension out of range".to_string())
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((dtype, shape))
}

/// A tensor send or receive in flight: [`wait`](TensorWork::wait) /
/// [`is_completed`](TensorWork::is_completed) like a [`Work`], and
/// [`into_tensor`](TensorWork::into_tensor) for the result (the sent tensor back, or the one
/// received).
#[must_use = "a TensorWork should be waited; dropping it detaches the operation"]
#[derive(Debug)]
pub struct TensorWork<T> {
    header: Work<Vec<u8>>,
    data: Work<Vec<T>>,
    /// The sender's shape (None on the receiving side, where the header brings it).
    shape: Option<Vec<usize>>,
    peer: usize,
    rank: usize,
    timeout: Duration,
}

impl<T: Element> TensorWork<T> {
    /// True once both messages are terminal. Never blocks.
    pub fn is_completed(&self) -> bool {
        self.header.is_completed() && self.data.is_completed()
    }

    /// Waits up to the group's timeout; the status is the data message's.
    pub fn wait(&self) -> Result<Status> {
        self.wait_timeout(self.timeout)
    }

    /// Waits up to `timeout` for both messages; on timeout both stay pending.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Status> {
        let start = Instant::now();
        self.header.wait_timeout(timeout)?;
        let left = timeout.saturating_sub(start.elapsed());
        self.data.wait_timeout(left).map_err(|e| match e {
            Error::Timeout { op, rank, peer, .. } => Error::Timeout {
                op,
                rank,
                peer,
                after: timeout,
            },
            e => e,
        })
    }

    /// Waits, then returns the tensor: on the receiving side with the shape the sender gave,
    /// checked against the elements that arrived.
    pub fn into_tensor(self) -> Result<Tensor<T>> {
        self.wait()?;
        let header = self.header.into_buffer()?;
        let data = self.data.into_buffer()?;
        let shape = match self.shape {
            Some(shape) => shape,
            None => {
                let protocol = |detail: String| Error::Protocol {
                    peer: self.peer,
                    rank: self.rank,
                    detail,
                };
                let (dtype, shape) = decode_header(&header).map_err(protocol)?;
                if dtype != T::DTYPE || numel(&shape) != Some(data.len()) {
                    return Err(protocol(format!(
                        "tensor header says {dtype} {shape:?}, but {} elements of {} arrived",
                        data.len(),
                        T::DTYPE
                    )));
                }
                shape
            }
        };
        Ok(Tensor { shape, data })
    }
}

impl ProcessGroup {
    /// Starts sending `tensor` (its element type, shape and data) to `dst`; the receiver does
    /// not need to know its size. Tensor traffic uses two messages on `tag` of the ordinary
    /// point-to-point space: do not mix tensor and plain receives on one (peer, tag).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let g = distcomm::init()?;
    /// if g.rank() == 0 {
    ///     let t = distcomm::Tensor::new(vec![2, 2], vec![1f32, 2., 3., 4.])?;
    ///     g.isend_tensor(t, 1, 0)?.wait()?;
    /// } else if g.rank() == 1 {
    ///     let t = g.irecv_tensor::<f32>(0, 0)?.into_tensor()?;
    ///     assert_eq!(t.shape, vec![2, 2]);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn isend_tensor<T: Element>(
        &self,
        tensor: Tensor<T>,
        dst: usize,
        tag: u32,
    ) -> Result<TensorWork<T>> {
        self.tensor_send(CTX_USER, "isend_tensor", tensor, dst, tag)
    }

    /// Starts receiving a tensor of element type `T` from `src`, whatever its shape (up to
    /// [`MAX_RECV_BYTES`]).
    pub fn irecv_tensor<T: Element>(&self, src: usize, tag: u32) -> Result<TensorWork<T>> {
        self.tensor_recv(CTX_USER, "irecv_tensor", src, tag)
    }

    /// Blocking [`isend_tensor`](Self::isend_tensor) (group timeout).
    pub fn send_tensor<T: Element>(&self, tensor: Tensor<T>, dst: usize, tag: u32) -> Result<()> {
        self.isend_tensor(tensor, dst, tag)?.wait().map(|_| ())
    }

    /// Blocking [`irecv_tensor`](Self::irecv_tensor) (group timeout).
    pub fn recv_tensor<T: Element>(&self, src: usize, tag: u32) -> Result<Tensor<T>> {
        self.irecv_tensor(src, tag)?.into_tensor()
    }

    /// Starts sending a byte object (serialized by the caller, of any length) to `dst`.
    pub fn isend_object(&self, bytes: Vec<u8>, dst: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.isend_bytes(bytes, dst, tag)
    }

    /// Starts receiving a byte object from `src`: the buffer that comes back has the length
    /// the sender sent (up to [`MAX_RECV_BYTES`]).
    ///
    /// ```no_run
    /// # fn main() -> distcomm::Result<()> {
    /// let g = distcomm::init()?;
    /// if g.rank() == 0 {
    ///     g.isend_object(b"{\"step\": 3}".to_vec(), 1, 5)?.wait()?;
    /// } else if g.rank() == 1 {
    ///     let obj = g.irecv_object(0, 5)?.into_buffer()?;
    ///     assert_eq!(obj, b"{\"step\": 3}");
    /// }
    /// # Ok(()) }
    /// ```
    pub fn irecv_object(&self, src: usize, tag: u32) -> Result<Work<Vec<u8>>> {
        self.check_tag("irecv_object", tag)?;
        self.inner.post_recv(
            envelope("irecv_object", DType::Bytes, CTX_USER, tag),
            Box::new(fitted::<u8>()),
            Some(src),
        )
    }

    fn tensor_send<T: Element>(
        &self,
        ctx: u32,
        op: &'static str,
        tensor: Tensor<T>,
        dst: usize,
        tag: u32,
    ) -> Result<TensorWork<T>> {
        self.check_tag(op, tag)?;
        let Tensor { shape, data } =
            Tensor::new(tensor.shape, tensor.data).map_err(|e| match e {
                Error::InvalidArgument { detail, .. } => Error::InvalidArgument {
                    op,
                    rank: self.rank(),
                    detail,
                },
                e => e,
            })?;
        let header = encode_header(T::DTYPE, &shape);
        let header =
            self.inner
                .post_send(envelope(op, DType::Bytes, ctx, tag), Box::new(header), dst)?;
        let data = self
            .inner
            .post_send(envelope(op, T::DTYPE, ctx, tag), Box::new(data), dst)?;
        Ok(TensorWork {
            header,
            data,
            shape: Some(shape),
            peer: dst,
            rank: self.rank(),
            timeout: self.timeout(),
        })
    }

    fn tensor_recv<T: Element>(
        &self,
        ctx: u32,
        op: &'static str,
        src: usize,
        tag: u32,
    ) -> Result<TensorWork<T>> {
        self.check_tag(op, tag)?;
        let header = Fitted::<u8> {
            vec: Vec::with_capacity(HEADER_MAX),
            max_bytes: HEADER_MAX,
        };
        let header = self.inner.post_recv(
            envelope(op, DType::Bytes, ctx, tag),
            Box::new(header),
            Some(src),
        )?;
        let data = self.inner.post_recv(
            envelope(op, T::DTYPE, ctx, tag),
            Box::new(fitted::<T>()),
            Some(src),
        )?;
        Ok(TensorWork {
            header,
            data,
            shape: None,
            peer: src,
            rank: self.rank(),
            timeout: self.timeout(),
        })
    }
}

fn fitted<T>() -> Fitted<T> {
    Fitted {
        vec: Vec::new(),
        max_bytes: MAX_RECV_BYTES,
    }
}

fn envelope(op: &'static str, dtype: DType, ctx: u32, tag: u32) -> Envelope {
    Envelope {
        op,
        dtype,
        ctx,
        tag,
        fp: Fingerprint::NONE,
    }
}

/// Forward activations go to the next stage and backward gradients to the previous one.
const FORWARD: u32 = 0;
const BACKWARD: u32 = 1;

/// One stage of a pipeline over a group: stage = group rank, in order. Forward sends go to the
/// next stage (the last stage's to the first, as DeepSpeed allows), backward sends to the
/// previous one; each direction is a FIFO, so micro-batches arrive in the order sent.
///
/// ```no_run
/// # fn main() -> distcomm::Result<()> {
/// use distcomm::{PipeStage, Tensor};
/// let g = distcomm::init()?;
/// let stage = PipeStage::new(&g);
/// let x = if stage.is_first() {
///     Tensor::new(vec![4], vec![1f32; 4])?
/// } else {
///     stage.recv_forward::<f32>()?.into_tensor()?
/// };
/// let y = Tensor::new(x.shape.clone(), x.data.iter().map(|v| v * 2.0).collect())?;
/// if !stage.is_last() {
///     stage.send_forward(y)?.wait()?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy)]
pub struct PipeStage<'g> {
    group: &'g ProcessGroup,
}

impl<'g> PipeStage<'g> {
    /// The stage of this rank in `group`.
    pub fn new(group: &'g ProcessGroup) -> PipeStage<'g> {
        PipeStage { group }
    }

    /// This stage's index (the group rank).
    pub fn stage(&self) -> usize {
        self.group.rank()
    }

    /// The number of stages (the group size).
    pub fn stages(&self) -> usize {
        self.group.size()
    }

    pub fn is_first(&self) -> bool {
        self.stage() == 0
    }

    pub fn is_last(&self) -> bool {
        self.stage() + 1 == self.stages()
    }

    /// The next stage (the first, after the last).
    pub fn next(&self) -> usize {
        (self.stage() + 1) % self.stages()
    }

    /// The previous stage (the last, before the first).
    pub fn prev(&self) -> usize {
        (self.stage() + self.stages() - 1) % self.stages()
    }

    /// Sends activations to the next stage.
    pub fn send_forward<T: Element>(&self, t: Tensor<T>) -> Result<TensorWork<T>> {
        let g = self.group;
        g.tensor_send(CTX_PIPE, "send_forward", t, self.next(), FORWARD)
    }

    /// Receives activations from the previous stage.
    pub fn recv_forward<T: Element>(&self) -> Result<TensorWork<T>> {
        let g = self.group;
        g.tensor_recv(CTX_PIPE, "recv_forward", self.prev(), FORWARD)
    }

    /// Sends gradients to the previous stage.
    pub fn send_backward<T: Element>(&self, t: Tensor<T>) -> Result<TensorWork<T>> {
        let g = self.group;
        g.tensor_send(CTX_PIPE, "send_backward", t, self.prev(), BACKWARD)
    }

    /// Receives gradients from the next stage.
    pub fn recv_backward<T: Element>(&self) -> Result<TensorWork<T>> {
        let g = self.group;
        g.tensor_recv(CTX_PIPE, "recv_backward", self.next(), BACKWARD)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        let h = encode_header(DType::BF16, &[3, 1, 4]);
        assert_eq!(decode_header(&h), Ok((DType::BF16, vec![3, 1, 4])));
        assert_eq!(
            decode_header(&encode_header(DType::F32, &[])),
            Ok((DType::F32, vec![]))
        );
        assert!(decode_header(&h[..h.len() - 1]).is_err());
        assert!(decode_header(&h[..3]).is_err());
        let mut bad = h.clone();
        bad[0] = b'X';
        assert!(decode_header(&bad).is_err());
        let mut bad = h.clone();
        bad[4] = 99;
        assert!(decode_header(&bad).is_err());
        let mut bad = h;
        bad[5] = 9;
        assert!(decode_header(&bad).is_err());
    }

    #[test]
    fn shapes_must_hold_the_data() {
        assert!(Tensor::new(vec![], vec![1i64]).is_ok());
        assert!(Tensor::new(vec![0, 5], Vec::<i64>::new()).is_ok());
        assert!(Tensor::new(vec![usize::MAX, 2], vec![1i64]).is_err());
        assert!(Tensor::new(vec![1; MAX_DIMS + 1], vec![1i64]).is_err());
    }
}
