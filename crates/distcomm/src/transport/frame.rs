//! The wire format of the native transports: a fixed 32-byte little-endian header, optionally
//! followed by a payload whose length the header states.
//!
//! ```text
//! offset size field
//!      0    1 kind     (Eager, Rts, Cts, Data, Ack, Nack)
//!      1    1 dtype    (DType wire byte)
//!      2    2 reserved (zero)
//!      4    4 ctx      (communication context: user p2p, internal collectives, subgroups)
//!      8    4 tag
//!     12    4 aux      (Nack: reason code)
//!     16    8 msg_id   (sender-chosen, unique per connection)
//!     24    8 len      (payload bytes for Eager/Data; announced size for Rts; capacity for Nack)
//! ```
//!
//! The decoder is pure (no I/O) and rejects anything out of bounds before any allocation.

use crate::dtype::DType;

/// Header size in bytes.
pub const HEADER_LEN: usize = 32;

/// Frame kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Small message with its payload inline; the receiver answers Ack or Nack once matched.
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
}

/// Why a receiver refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum NackReason {
    /// The posted receive is smaller than the message; `len` carries its capacity.
    TooLarge = 1,
    /// The posted receive expects another element type; `dtype` carries it.
    DType = 2,
}

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
            k => return Err(DecodeError(format!("unknown frame kind {k}"))),
        };
        let dtype =
            DType::from_wire(b[1]).ok_or_else(|| DecodeError(format!("unknown dtype {}", b[1])))?;
        if b[2] != 0 || b[3] != 0 {
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
        };
        if h.kind == Kind::Eager && h.len > eager_max {
            return Err(DecodeError(format!(
                "eager frame of {} bytes exceeds the limit of {eager_max}",
                h.len
            )));
        }
        if h.len % h.dtype.size() as u64 != 0 && matches!(h.kind, Kind::Eager | Kind::Rts) {
            return Err(DecodeError(format!(
                "{} bytes is not a whole number of {} elements",
                h.len, h.dtype
            )));
        }
        Ok(h)
    }

    /// Bytes of payload that follow this header on the wire.
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            Kind::Eager | Kind::Data => self.len,
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
        fn decode_never_panics(bytes in proptest::array::uniform32(any::<u8>())) {
            let _ = Header::decode(&bytes, 1 << 16);
        }

        #[test]
        fn roundtrip(kind in 1u8..=6, dt in 0u8..=8, ctx: u32, tag: u32, aux: u32, id: u64, n in 0u64..1000) {
            let dtype = DType::from_wire(dt).unwrap();
            let mut raw = [0u8; HEADER_LEN];
            raw[0] = kind;
            let kind = Header::decode(&raw, 0).unwrap().kind;
            let h = Header { kind, dtype, ctx, tag, aux, msg_id: id, len: n * dtype.size() as u64 };
            prop_assert_eq!(Header::decode(&h.encode(), u64::MAX).unwrap(), h);
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
        };
        assert!(Header::decode(&h.encode(), 1 << 16).is_err());
    }
}
