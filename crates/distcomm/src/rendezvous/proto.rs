//! The TCPStore wire protocol: a command byte, then arguments. Strings and byte vectors are a
//! little-endian u64 length and the bytes; integers are little-endian. A connection first sends
//! `VALIDATE` with the magic number.

/// First message of a connection: `VALIDATE` followed by this u32.
pub const MAGIC: u32 = 0x3C85_F7CE;

pub const VALIDATE: u8 = 0;
pub const SET: u8 = 1;
pub const COMPARE_SET: u8 = 2;
pub const GET: u8 = 3;
pub const ADD: u8 = 4;
pub const CHECK: u8 = 5;
pub const WAIT: u8 = 6;
pub const GETNUMKEYS: u8 = 7;
pub const DELETE_KEY: u8 = 8;
pub const APPEND: u8 = 9;
pub const MULTI_GET: u8 = 10;
pub const MULTI_SET: u8 = 11;
pub const CANCEL_WAIT: u8 = 12;
pub const PING: u8 = 13;
pub const QUEUE_PUSH: u8 = 14;
pub const QUEUE_POP: u8 = 15;
pub const QUEUE_LEN: u8 = 16;

pub const CHECK_READY: u8 = 0;
pub const CHECK_NOT_READY: u8 = 1;
pub const STOP_WAITING: u8 = 0;
pub const WAIT_CANCELED: u8 = 1;

/// Longest key accepted (bytes).
pub const MAX_KEY: u64 = 64 * 1024;
/// Largest value accepted (bytes).
pub const MAX_VALUE: u64 = 256 << 20;
/// Most keys in one multi-key command (torch's limit).
pub const MAX_KEY_COUNT: u64 = 128 * 1024;

use std::io::{self, Read, Write};

pub fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

pub fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    Ok(read_u64(r)? as i64)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// Reads a length-prefixed byte string, refusing lengths over `max` before allocating.
pub fn read_bytes(r: &mut impl Read, max: u64) -> io::Result<Vec<u8>> {
    let n = read_u64(r)?;
    if n > max {
        return Err(invalid(format!("length {n} exceeds the limit of {max}")));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

pub fn read_key(r: &mut impl Read) -> io::Result<String> {
    let b = read_bytes(r, MAX_KEY)?;
    String::from_utf8(b).map_err(|_| invalid("key is not UTF-8".into()))
}

/// Reads a key count, bounded by [`MAX_KEY_COUNT`].
pub fn read_count(r: &mut impl Read) -> io::Result<u64> {
    let n = read_u64(r)?;
    if n > MAX_KEY_COUNT {
        return Err(invalid(format!(
            "{n} keys exceed the limit of {MAX_KEY_COUNT}"
        )));
    }
    Ok(n)
}

pub fn put_bytes(w: &mut Vec<u8>, b: &[u8]) {
    w.extend_from_slice(&(b.len() as u64).to_le_bytes());
    w.extend_from_slice(b);
}

pub fn send(w: &mut impl Write, buf: &[u8]) -> io::Result<()> {
    w.write_all(buf)?;
    w.flush()
}
