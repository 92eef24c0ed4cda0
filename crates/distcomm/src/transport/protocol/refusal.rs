//! Whether a matched receive takes a message, and what each side reports when it does not.
//! The receiver checks (too large, wrong element type, a check word that differs) and answers
//! Nack with its [`NackReason`] and its side of the story; the sender turns that Nack into its
//! own error. Both errors come from here, so the two sides always agree.
//!
//! The check word ([`Fingerprint`]) is opaque: it is compared, never interpreted, and rendered
//! for errors by its own leaf module. A message whose check word is not empty is *scheduled*:
//! both sides know its size and element type, so the receive must expect exactly those.
//!
//! Knows headers and sizes; nothing of queues, links or buffers.

use crate::dtype::DType;
use crate::error::Error;
use crate::transport::frame::{Fingerprint, Header, NackReason};

/// What a receive expects.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expect {
    pub op: &'static str,
    pub dtype: DType,
    pub check: Fingerprint,
    /// Its capacity in bytes.
    pub cap: u64,
}

/// Whether a message with check word `check` is scheduled (see the module doc).
#[inline]
pub(crate) fn scheduled(check: Fingerprint) -> bool {
    check != Fingerprint::NONE
}

/// Checks a receive (on `rank`) against the header of a message from `src`: the receiver's
/// error and the reason its Nack gives on refusal.
#[inline]
pub(crate) fn check(
    rank: usize,
    want: Expect,
    src: usize,
    h: &Header,
) -> Result<(), (Error, NackReason)> {
    let Expect {
        op,
        dtype,
        check,
        cap,
    } = want;
    if check != h.fp || (scheduled(check) && (h.len != cap || h.dtype != dtype)) {
        return Err((
            Error::Desync {
                op,
                rank,
                peer: src,
                ours: format!("{} (expecting {cap} bytes)", check.describe(dtype)),
                theirs: format!("{} (sending {} bytes)", h.fp.describe(h.dtype), h.len),
            },
            NackReason::Mismatch,
        ));
    }
    if dtype != DType::Bytes && dtype != h.dtype {
        return Err((
            Error::DTypeMismatch {
                op,
                rank,
                src,
                dst: rank,
                tag: h.tag,
                sent: h.dtype,
                expected: dtype,
            },
            NackReason::DType,
        ));
    }
    if h.len > cap {
        return Err((
            Error::MessageTooLarge {
                op,
                rank,
                src,
                dst: rank,
                tag: h.tag,
                sent: h.len,
                capacity: cap,
            },
            NackReason::TooLarge,
        ));
    }
    Ok(())
}

/// What a send was, for its error.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sent {
    pub op: &'static str,
    pub dtype: DType,
    pub check: Fingerprint,
    pub tag: u32,
    pub len: usize,
}

/// The sender's (`rank`) error for the Nack `h` from `dst`: the Nack's `aux` is the reason,
/// `len` the receive's capacity, `dtype` and `fp` what it expected.
pub(crate) fn refused(rank: usize, s: Sent, dst: usize, h: &Header) -> Error {
    if h.aux == NackReason::Cancelled as u32 {
        Error::Aborted {
            op: s.op,
            rank,
            reason: format!("rank {dst} had already cancelled it"),
        }
    } else if h.aux == NackReason::Mismatch as u32 {
        Error::Desync {
            op: s.op,
            rank,
            peer: dst,
            ours: format!("{} (sending {} bytes)", s.check.describe(s.dtype), s.len),
            theirs: format!("{} (expecting {} bytes)", h.fp.describe(h.dtype), h.len),
        }
    } else if h.aux == NackReason::DType as u32 {
        Error::DTypeMismatch {
            op: s.op,
            rank,
            src: rank,
            dst,
            tag: s.tag,
            sent: s.dtype,
            expected: h.dtype,
        }
    } else {
        Error::MessageTooLarge {
            op: s.op,
            rank,
            src: rank,
            dst,
            tag: s.tag,
            sent: s.len as u64,
            capacity: h.len,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::call::CallKind;
    use crate::transport::frame::Kind;

    fn msg(len: u64, dtype: DType, fp: Fingerprint) -> Header {
        Header {
            kind: Kind::Eager,
            dtype,
            ctx: 0,
            tag: 4,
            aux: 0,
            msg_id: 1,
            len,
            fp,
        }
    }

    fn want(cap: u64, dtype: DType, check: Fingerprint) -> Expect {
        Expect {
            op: "recv",
            dtype,
            check,
            cap,
        }
    }

    /// The Nack a receiver sends for `reason` (as the engine builds it).
    fn nack(reason: NackReason, w: Expect) -> Header {
        Header {
            kind: Kind::Nack,
            aux: reason as u32,
            len: w.cap,
            dtype: w.dtype,
            fp: w.check,
            ..msg(0, w.dtype, w.check)
        }
    }

    fn sent(h: &Header) -> Sent {
        Sent {
            op: "send",
            dtype: h.dtype,
            check: h.fp,
            tag: h.tag,
            len: h.len as usize,
        }
    }

    #[test]
    fn fitting_messages_pass() {
        let none = Fingerprint::NONE;
        assert!(check(1, want(8, DType::F32, none), 0, &msg(8, DType::F32, none)).is_ok());
        assert!(check(1, want(16, DType::F32, none), 0, &msg(8, DType::F32, none)).is_ok());
        assert!(check(1, want(8, DType::Bytes, none), 0, &msg(8, DType::I64, none)).is_ok());
    }

    #[test]
    fn too_large_is_refused_on_both_sides() {
        let none = Fingerprint::NONE;
        let (w, h) = (want(4, DType::U8, none), msg(9, DType::U8, none));
        let (e, reason) = check(1, w, 0, &h).unwrap_err();
        assert_eq!(reason, NackReason::TooLarge);
        assert!(matches!(
            e,
            Error::MessageTooLarge {
                rank: 1,
                src: 0,
                dst: 1,
                sent: 9,
                capacity: 4,
                ..
            }
        ));
        let theirs = refused(0, sent(&h), 1, &nack(reason, w));
        assert!(matches!(
            theirs,
            Error::MessageTooLarge {
                rank: 0,
                src: 0,
                dst: 1,
                sent: 9,
                capacity: 4,
                tag: 4,
                ..
            }
        ));
    }

    #[test]
    fn wrong_element_type_is_refused_on_both_sides() {
        let none = Fingerprint::NONE;
        let (w, h) = (want(8, DType::F32, none), msg(8, DType::I32, none));
        let (e, reason) = check(1, w, 0, &h).unwrap_err();
        assert_eq!(reason, NackReason::DType);
        assert!(matches!(
            e,
            Error::DTypeMismatch {
                sent: DType::I32,
                expected: DType::F32,
                ..
            }
        ));
        let theirs = refused(0, sent(&h), 1, &nack(reason, w));
        assert!(matches!(
            theirs,
            Error::DTypeMismatch {
                rank: 0,
                dst: 1,
                sent: DType::I32,
                expected: DType::F32,
                ..
            }
        ));
    }

    #[test]
    fn check_words_must_agree_and_scheduled_messages_fit_exactly() {
        let a = Fingerprint::of(CallKind::AllReduce, None, 0, 2);
        let b = Fingerprint::of(CallKind::Broadcast, None, 1, 2);
        let (w, h) = (want(8, DType::F32, a), msg(8, DType::F32, b));
        let (e, reason) = check(2, w, 3, &h).unwrap_err();
        assert_eq!(reason, NackReason::Mismatch);
        assert!(matches!(
            e,
            Error::Desync {
                rank: 2,
                peer: 3,
                ..
            }
        ));
        let theirs = refused(3, sent(&h), 2, &nack(reason, w));
        assert!(matches!(
            theirs,
            Error::Desync {
                rank: 3,
                peer: 2,
                ..
            }
        ));
        // Same check word but a smaller message: refused too (both sides know the size).
        assert!(check(2, want(8, DType::F32, a), 3, &msg(4, DType::F32, a)).is_err());
        assert!(check(2, want(8, DType::F32, a), 3, &msg(8, DType::F32, a)).is_ok());
        assert!(scheduled(a) && !scheduled(Fingerprint::NONE));
    }

    #[test]
    fn a_cancelled_key_aborts_the_sender() {
        let none = Fingerprint::NONE;
        let h = msg(8, DType::U8, none);
        let e = refused(
            0,
            sent(&h),
            5,
            &nack(NackReason::Cancelled, want(0, DType::U8, none)),
        );
        assert!(
            matches!(e, Error::Aborted { rank: 0, ref reason, .. } if reason.contains("rank 5"))
        );
    }
}
