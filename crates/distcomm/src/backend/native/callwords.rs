//! The words by which a rank says in the arena which collective it runs: its call packed in
//! two words, and the chain of every call it made before (see the arena's module doc).

use crate::call::Fingerprint;
use crate::dtype::DType;

/// The chain of a rank's calls: `prev` combined with the words of the next call. Ranks that
/// made the same calls have the same chain, so a rank that reads another's part checks, with
/// one word, every call the other made before as well (a rank that reads nobody in a step does
/// not wait to check; the first rank to read its part after a call that differed finds it).
pub(super) fn chain(prev: u64, w0: u64, w1: u64) -> u64 {
    // splitmix64's finaliser over the three words: a collision of two different call
    // histories is a 2^-64 chance.
    let mut x = prev ^ w0.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ w1.rotate_left(31);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Bits of the second word that hold the count; the root is above them.
const COUNT_BITS: u32 = 40;

/// The words a call publishes: (kind, op, dtype, tag) and (root, count).
pub(super) fn fp_words(fp: &Fingerprint, dtype: DType, tag: u32) -> (u64, u64) {
    // Bit 24 marks the words as written (a fresh arena is all zeros).
    let w0 = u64::from(fp.kind)
        | u64::from(fp.op) << 8
        | (dtype as u64) << 16
        | 1 << 24
        | u64::from(tag) << 32;
    let count = fp.count & ((1 << COUNT_BITS) - 1);
    (w0, count | u64::from(fp.root) << COUNT_BITS)
}

/// The call behind the words, for a desync error.
pub(super) fn describe(w0: u64, w1: u64) -> String {
    let fp = Fingerprint {
        kind: w0 as u8,
        op: (w0 >> 8) as u8,
        root: (w1 >> COUNT_BITS) as u32,
        count: w1 & ((1 << COUNT_BITS) - 1),
    };
    let dtype = DType::from_wire((w0 >> 16) as u8).unwrap_or(DType::Bytes);
    format!("{} (collective #{})", fp.describe(dtype), w0 >> 32)
}
