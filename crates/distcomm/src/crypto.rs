//! Authentication primitives shared by the transport handshake and the store's authenticated
//! mode: HMAC-SHA-256 (`hmac` + `sha2`, never a hand-rolled MAC) over a list of parts,
//! verified in constant time, and fresh random nonces.
//!
//! Owns: the MAC and the nonce. Must not know: what is authenticated (each protocol builds its
//! own transcript, with its own domain-separation label as the first part).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a MAC.
pub(crate) const TOKEN_LEN: usize = 32;

/// A MAC or a nonce.
pub(crate) type Token = [u8; TOKEN_LEN];

fn keyed(secret: &[u8], parts: &[&[u8]]) -> Option<Hmac<Sha256>> {
    // HMAC takes keys of any length: the error branch cannot happen.
    let mut m = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    for p in parts {
        m.update(p);
    }
    Some(m)
}

/// HMAC-SHA-256 of the concatenation of `parts` under `secret`.
pub(crate) fn mac(secret: &[u8], parts: &[&[u8]]) -> Token {
    let mut out = [0u8; TOKEN_LEN];
    if let Some(m) = keyed(secret, parts) {
        out.copy_from_slice(&m.finalize().into_bytes());
    }
    out
}

/// Whether `got` is the MAC of `parts` under `secret` (constant time).
pub(crate) fn verify(secret: &[u8], parts: &[&[u8]], got: &[u8]) -> bool {
    keyed(secret, parts).is_some_and(|m| m.verify_slice(got).is_ok())
}

/// A fresh random nonce.
pub(crate) fn nonce() -> Result<Token, String> {
    let mut n = [0u8; TOKEN_LEN];
    getrandom::getrandom(&mut n).map_err(|e| format!("no randomness for a nonce: {e}"))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_verify_only_with_the_same_secret_and_parts() {
        let m = mac(b"k", &[b"label", b"a", b"b"]);
        assert!(verify(b"k", &[b"label", b"a", b"b"], &m));
        // Concatenation: where the parts split does not matter; their bytes do.
        assert!(verify(b"k", &[b"labelab"], &m));
        assert!(!verify(b"k2", &[b"label", b"a", b"b"], &m));
        assert!(!verify(b"k", &[b"label", b"b", b"a"], &m));
        assert!(!verify(b"k", &[b"label", b"a", b"b"], &m[..31]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
