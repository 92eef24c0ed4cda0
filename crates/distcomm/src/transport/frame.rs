//! The wire format of the native transports: a fixed 48-byte little-endian header, optionally
//! followed by a payload whose length the header states.
//!
//! ```text
//! offset size field
//!      0    1 kind     (Eager, Rts, Cts, Data, Ack, Nack, Cancel, Rget)
//!      1    1 dtype    (DType wire byte)
//!      2    2 reserved (zero)
//!      4    4 ctx      (communication context, chosen by the layer above)
//!      8    4 tag
//!     12    4 aux      (Nack: reason code; Eager: flags; Cancel: the canceller's reason word)
//!     16    8 msg_id   (sender-chosen, unique per connection)
//!     24    8 len      (payload bytes for Eager/Data; announced size for Rts/Rget; capacity for Nack)
//!     32   16 fp       (the check word, opaque here: all zero for an ordinary message)
//!                      laid out as kind (1), op (1), reserved zero (2), root (4), count (8)
//! ```
//!
//! The check word travels with every message; a receive whose own check word differs refuses
//! the message on both sides instead of delivering wrong data (the layer above puts its call's
//! fingerprint there, `crate::call`). The transport compares it, never interprets it.
//!
//! The decoder is pure (no I/O) and rejects anything out of bounds before any allocation.

use crate::dtype::DType;

/// Header size in bytes.
pub const HEADER_LEN: usize = 48;

/// Payload of an Rget (Rput) frame: the sender's (receiver's) buffer address, little-endian.
pub const RGET_PAYLOAD: usize = 8;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Small message with its payload inline; the receiver answers Ack or Nack once matched
    /// (only Nack, on refusal, when `aux` has [`EAGER_NO_ACK`]).
    Eager = 1,
    /// Request to send a large message; the receiver answers Cts or Nack once matched.
    Rts = 2,
    /// Clear to send: the receiver has a buffer for `msg_id`.
    Cts = 3,
    /// The payload of a large message, after Cts.
    Data = 4,
    /// An eager message was matched and delivered.
    Ack = 5,
    /// The receiver refused the message (`aux` says why).
    Nack = 6,
    /// The sender cancelled key (`ctx`, `tag`) (`fp`, `dtype`: its check word and element type;
    /// `aux`: its opaque reason word): fail everything of that key here too.
    Cancel = 7,
    /// Request to fetch a large message (shared-memory links): like Rts, followed by an 8-byte
    /// payload, the address of the sender's buffer, which the receiver copies from directly;
    /// it answers Ack when done, or Cts to have the data streamed instead.
    Rget = 8,
    /// Answer to an Rget of a large message (shared-memory links): the receiver copies the tail
    /// itself and asks the sender to write the first `len` bytes in parallel, at the address in
    /// the 8-byte payload, then answer Put.
    Rput = 9,
    /// The sender wrote what an Rput asked for (`aux` 0), or could not (`aux` 1).
    Put = 10,
}

/// `aux` flag of an Eager frame: the sender does not wait for an Ack (scheduled messages, with
/// a check word: the layer above handles a refusal by cancelling their key).
pub const EAGER_NO_ACK: u32 = 1;

/// `aux` flag of an Eager header that arrived through a shared-memory *lane* slot (see
/// [`Header::decode_lane`]; its `msg_id` is the slot's sequence number), and of a Nack frame
/// refusing such a message (its `msg_id` is that sequence number, its reason the rest of `aux`).
pub const LANE: u32 = 1 << 8;

/// Bytes of a lane message's header (the shared-memory lane, `transport::shm`, carries the
/// message's length and sequence number itself). It stands for an Eager frame:
///
/// ```text
/// offset size field
///      0    4 ctx
///      4    4 tag
///      8    1 dtype
///      9    1 fp.kind  (0: point-to-point, answered through the lane's answer word)
///     10    1 fp.op
///     11    1 reserved (zero)
///     12    4 fp.root
///     16    8 fp.count
/// ```
pub const LANE_HEAD: usize = 24;
/// Largest message the lane carries.
pub const LANE_MAX: usize = 1024;
/// Answered lane messages (point-to-point) outstanding per direction at most: each has its own
/// answer word until it is answered.
pub const LANE_ACKS: u64 = 16;

/// Why a receiver refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NackReason {
    /// The posted receive is smaller than the message; `len` carries its capacity.
    TooLarge = 1,
    /// The posted receive expects another element type; `dtype` carries it.
    DType = 2,
    /// The posted receive carries another check word, or is scheduled and expects another size
    /// or element type; `fp`, `len` and `dtype` carry what it expected.
    Mismatch = 3,
    /// The message's key (context, tag) was cancelled at the receiver.
    Cancelled = 4,
}

/// The fingerprint vocabulary is the call module's: the frame carries it opaquely.
pub use crate::call::Fingerprint;

/// A decoded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub dtype: DType,
    pub ctx: u32,
    pub tag: u32,
    pub aux: u32,
    pub msg_id: u64,
    pub len: u64,
    pub fp: Fingerprint,
}

/// A header that breaks the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl Header {
    /// Encodes into the fixed wire layout.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = self.kind as u8;
        b[1] = self.dtype as u8;
        b[4..8].copy_from_slice(&self.ctx.to_le_bytes());
        b[8..12].copy_from_slice(&self.tag.to_le_bytes());
        b[12..16].copy_from_slice(&self.aux.to_le_bytes());
        b[16..24].copy_from_slice(&self.msg_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32] = self.fp.kind;
        b[33] = self.fp.op;
        b[36..40].copy_from_slice(&self.fp.root.to_le_bytes());
        b[40..48].copy_from_slice(&self.fp.count.to_le_bytes());
        b
    }

    /// Decodes and validates a header. `eager_max` bounds the inline payload of an Eager frame,
    /// the only payload a receiver may have to allocate for.
    pub fn decode(b: &[u8; HEADER_LEN], eager_max: u64) -> Result<Header, DecodeError> {
        let kind = match b[0] {
            1 => Kind::Eager,
            2 => Kind::Rts,
            3 => Kind::Cts,
            4 => Kind::Data,
            5 => Kind::Ack,
            6 => Kind::Nack,
            7 => Kind::Cancel,
            8 => Kind::Rget,
            9 => Kind::Rput,
            10 => Kind::Put,
            k => return Err(DecodeError(format!("unknown frame kind {k}"))),
        };
        let dtype =
            DType::from_wire(b[1]).ok_or_else(|| DecodeError(format!("unknown dtype {}", b[1])))?;
        if b[2] != 0 || b[3] != 0 || b[34] != 0 || b[35] != 0 {
            return Err(DecodeError("reserved header bytes are not zero".into()));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let h = Header {
            kind,
            dtype,
            ctx: u32_at(4),
            tag: u32_at(8),
            aux: u32_at(12),
            msg_id: u64_at(16),
            len: u64_at(24),
            fp: Fingerprint {
                kind: b[32],
                op: b[33],
                root: u32_at(36),
                count: u64_at(40),
            },
        };
        if h.kind == Kind::Eager && h.len > eager_max {
            return Err(DecodeError(format!(
                "eager frame of {} bytes exceeds the limit of {eager_max}",
                h.len
            )));
        }
        if h.len % h.dtype.size() as u64 != 0
            && matches!(h.kind, Kind::Eager | Kind::Rts | Kind::Rget)
        {
            return Err(DecodeError(format!(
                "{} bytes is not a whole number of {} elements",
                h.len, h.dtype
            )));
        }
        Ok(h)
    }

    /// Encodes the lane header of this Eager message. Kind, `aux`, `msg_id` and `len` are
    /// implied by the lane.
    pub fn encode_lane(&self) -> [u8; LANE_HEAD] {
        let mut b = [0u8; LANE_HEAD];
        b[0..4].copy_from_slice(&self.ctx.to_le_bytes());
        b[4..8].copy_from_slice(&self.tag.to_le_bytes());
        b[8] = self.dtype as u8;
        b[9] = self.fp.kind;
        b[10] = self.fp.op;
        b[12..16].copy_from_slice(&self.fp.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.fp.count.to_le_bytes());
        b
    }

    /// Decodes and validates the header of lane message `seq` of `len` bytes: the Eager header
    /// it stands for ([`LANE`] in `aux`, plus [`EAGER_NO_ACK`] for scheduled messages; `msg_id`
    /// = `seq`).
    pub fn decode_lane(b: &[u8; LANE_HEAD], seq: u64, len: usize) -> Result<Header, DecodeError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut count = [0u8; 8];
        count.copy_from_slice(&b[16..24]);
        if len > LANE_MAX {
            return Err(DecodeError(format!("lane message of {len} bytes")));
        }
        let dtype =
            DType::from_wire(b[8]).ok_or_else(|| DecodeError(format!("unknown dtype {}", b[8])))?;
        if b[11] != 0 {
            return Err(DecodeError("reserved lane header byte is not zero".into()));
        }
        if len % dtype.size() != 0 {
            return Err(DecodeError(format!(
                "{len} bytes is not a whole number of {dtype} elements"
            )));
        }
        let fp = Fingerprint {
            kind: b[9],
            op: b[10],
            root: u32_at(12),
            count: u64::from_le_bytes(count),
        };
        Ok(Header {
            kind: Kind::Eager,
            dtype,
            ctx: u32_at(0),
            tag: u32_at(4),
            // A scheduled message (a collective's, see `protocol::refusal`) awaits no answer.
            aux: LANE
                | if fp != Fingerprint::NONE {
                    EAGER_NO_ACK
                } else {
                    0
                },
            msg_id: seq,
            len: len as u64,
            fp,
        })
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            Kind::Eager | Kind::Data => self.len,
            Kind::Rget | Kind::Rput => RGET_PAYLOAD as u64,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), HEADER_LEN)) {
            let mut raw = [0u8; HEADER_LEN];
            raw.copy_from_slice(&bytes);
            let _ = Header::decode(&raw, 1 << 16);
        }

        #[test]
        fn roundtrip(kind in 1u8..=10, dt in 0u8..=8, ctx: u32, tag: u32, aux: u32, id: u64, n in 0u64..1000, fk: u8, fo: u8, root: u32, count: u64) {
            let dtype = DType::from_wire(dt).unwrap();
            let mut raw = [0u8; HEADER_LEN];
            raw[0] = kind;
            let kind = Header::decode(&raw, 0).unwrap().kind;
            let fp = Fingerprint { kind: fk, op: fo, root, count };
            let h = Header { kind, dtype, ctx, tag, aux, msg_id: id, len: n * dtype.size() as u64, fp };
            prop_assert_eq!(Header::decode(&h.encode(), u64::MAX).unwrap(), h);
        }
    }

    proptest! {
        #[test]
        fn lane_roundtrip(dt in 0u8..=8, ctx: u32, tag: u32, seq: u64, fk: u8, fo: u8, root: u32, count: u64, n in 0usize..=LANE_MAX) {
            let dtype = DType::from_wire(dt).unwrap();
            let n = n / dtype.size() * dtype.size();
            let fp = Fingerprint { kind: fk, op: fo, root, count };
            let h = Header { kind: Kind::Eager, dtype, ctx, tag, aux: 0, msg_id: 0, len: n as u64, fp };
            let got = Header::decode_lane(&h.encode_lane(), seq, n).unwrap();
            let aux = LANE | if fp != Fingerprint::NONE { EAGER_NO_ACK } else { 0 };
            prop_assert_eq!(got, Header { aux, msg_id: seq, ..h });
        }

        #[test]
        fn lane_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), LANE_HEAD), seq: u64, len: usize) {
            let mut head = [0u8; LANE_HEAD];
            head.copy_from_slice(&bytes);
            if let Ok(h) = Header::decode_lane(&head, seq, len) {
                prop_assert!(len <= LANE_MAX && h.len == len as u64);
            }
        }
    }

    #[test]
    fn oversized_eager_is_refused() {
        let h = Header {
            kind: Kind::Eager,
            dtype: DType::U8,
            ctx: 0,
            tag: 0,
            aux: 0,
            msg_id: 0,
            len: 1 << 40,
            fp: Fingerprint::NONE,
        };
        assert!(Header::decode(&h.encode(), 1 << 16).is_err());
    }
}
