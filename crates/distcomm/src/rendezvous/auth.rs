//! The store's authenticated mode, for jobs made only of distcomm ranks.
//!
//! PyTorch's TCPStore protocol has no authentication, and torch clients cannot be taught one,
//! so by default the store speaks it unmodified (keep its port on a trusted network). With
//! `DISTCOMM_STORE_AUTH=1` every connection first proves the job secret, both ways, before
//! the first store command: the client sends [`AUTH_MAGIC`] and a nonce, the server answers its
//! nonce and an HMAC-SHA256 over both, and the client answers its own HMAC. A torch client (or
//! any stranger) is refused at its first byte, before it can read or write a key.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::crypto::{self, nonce, TOKEN_LEN};

/// First bytes of an authenticating client (never a TCPStore opcode: torch's first byte is
/// its validation command, 0).
pub(crate) const AUTH_MAGIC: [u8; 4] = *b"DCSA";

/// How long either side waits for the other's part of the exchange.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);

/// Domain separation of the store's MACs from the transport handshake's.
const LABEL: &[u8] = b"distcomm-store-auth-v1";

fn tag(secret: &[u8], role: u8, client: &[u8], server: &[u8]) -> [u8; TOKEN_LEN] {
    crypto::mac(secret, &[LABEL, &[role], client, server])
}

fn check(secret: &[u8], role: u8, client: &[u8], server: &[u8], got: &[u8]) -> bool {
    crypto::verify(secret, &[LABEL, &[role], client, server], got)
}

fn refused(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, why.to_string())
}

fn no_nonce(e: String) -> io::Error {
    io::Error::other(e)
}

/// Client side: proves the secret and checks the server's proof.
pub(crate) fn client(stream: &TcpStream, secret: &[u8]) -> io::Result<()> {
    stream.set_read_timeout(Some(AUTH_TIMEOUT))?;
    let cn = nonce().map_err(no_nonce)?;
    let mut hello = AUTH_MAGIC.to_vec();
    hello.extend_from_slice(&cn);
    (&*stream).write_all(&hello)?;
    let mut reply = [0u8; 2 * TOKEN_LEN];
    (&*stream).read_exact(&mut reply)?;
    let (sn, proof) = reply.split_at(TOKEN_LEN);
    if !check(secret, b'S', &cn, sn, proof) {
        return Err(refused("the store does not know the job secret"));
    }
    (&*stream).write_all(&tag(secret, b'C', &cn, sn))?;
    // The server closes the connection if it refuses ours; the caller's first request finds out.
    stream.set_read_timeout(None)
}

/// Server side: runs after the first bytes were seen to be [`AUTH_MAGIC`].
pub(crate) fn server(stream: &TcpStream, secret: &[u8]) -> io::Result<()> {
    stream.set_read_timeout(Some(AUTH_TIMEOUT))?;
    // The magic alone first: a torch client's validation is refused at once, not after the
    // timeout.
    let mut magic = [0u8; AUTH_MAGIC.len()];
    (&*stream).read_exact(&mut magic)?;
    if magic != AUTH_MAGIC {
        return Err(refused("not an authenticating client"));
    }
    let mut cn = [0u8; TOKEN_LEN];
    (&*stream).read_exact(&mut cn)?;
    let cn = &cn[..];
    let sn = nonce().map_err(no_nonce)?;
    let mut reply = sn.to_vec();
    reply.extend_from_slice(&tag(secret, b'S', cn, &sn));
    (&*stream).write_all(&reply)?;
    let mut proof = [0u8; TOKEN_LEN];
    (&*stream).read_exact(&mut proof)?;
    if !check(secret, b'C', cn, &sn, &proof) {
        return Err(refused("client does not know the job secret"));
    }
    stream.set_read_timeout(None)
}
