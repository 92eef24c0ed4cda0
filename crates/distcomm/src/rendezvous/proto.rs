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

/// One client request, decoded. Decoding is separate from serving so that it can be tested and
/// fuzzed on its own; every length is bounded before allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Validate(u32),
    Set(String, Vec<u8>),
    CompareSet(String, Vec<u8>, Vec<u8>),
    Get(String),
    Add(String, i64),
    Check(Vec<String>),
    Wait(Vec<String>),
    GetNumKeys,
    DeleteKey(String),
    Append(String, Vec<u8>),
    MultiGet(Vec<String>),
    MultiSet(Vec<(String, Vec<u8>)>),
    CancelWait,
    Ping(u32),
    QueuePush(String, Vec<u8>),
    QueuePop(String),
    QueueLen(String),
}

fn read_keys(r: &mut impl Read) -> io::Result<Vec<String>> {
    let n = read_count(r)?;
    (0..n).map(|_| read_key(r)).collect()
}

impl Command {
    /// Reads one command (its opcode byte first).
    pub fn read(r: &mut impl Read) -> io::Result<Command> {
        Ok(match read_u8(r)? {
            VALIDATE => Command::Validate(read_u32(r)?),
            SET => Command::Set(read_key(r)?, read_bytes(r, MAX_VALUE)?),
            COMPARE_SET => Command::CompareSet(
                read_key(r)?,
                read_bytes(r, MAX_VALUE)?,
                read_bytes(r, MAX_VALUE)?,
            ),
            GET => Command::Get(read_key(r)?),
            ADD => Command::Add(read_key(r)?, read_i64(r)?),
            CHECK => Command::Check(read_keys(r)?),
            WAIT => Command::Wait(read_keys(r)?),
            GETNUMKEYS => Command::GetNumKeys,
            DELETE_KEY => Command::DeleteKey(read_key(r)?),
            APPEND => Command::Append(read_key(r)?, read_bytes(r, MAX_VALUE)?),
            MULTI_GET => Command::MultiGet(read_keys(r)?),
            MULTI_SET => {
                let n = read_count(r)?;
                let mut pairs = Vec::new();
                for _ in 0..n {
                    pairs.push((read_key(r)?, read_bytes(r, MAX_VALUE)?));
                }
                Command::MultiSet(pairs)
            }
            CANCEL_WAIT => Command::CancelWait,
            PING => Command::Ping(read_u32(r)?),
            QUEUE_PUSH => Command::QueuePush(read_key(r)?, read_bytes(r, MAX_VALUE)?),
            QUEUE_POP => Command::QueuePop(read_key(r)?),
            QUEUE_LEN => Command::QueueLen(read_key(r)?),
            other => return Err(invalid(format!("unknown command {other}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn decodes_what_clients_send() {
        let mut m = vec![SET];
        put_bytes(&mut m, b"key");
        put_bytes(&mut m, b"value");
        m.push(ADD);
        put_bytes(&mut m, b"n");
        m.extend_from_slice(&(-3i64).to_le_bytes());
        m.push(WAIT);
        m.extend_from_slice(&2u64.to_le_bytes());
        put_bytes(&mut m, b"a");
        put_bytes(&mut m, b"b");
        let mut r = &m[..];
        assert_eq!(
            Command::read(&mut r).unwrap(),
            Command::Set("key".into(), b"value".to_vec())
        );
        assert_eq!(Command::read(&mut r).unwrap(), Command::Add("n".into(), -3));
        assert_eq!(
            Command::read(&mut r).unwrap(),
            Command::Wait(vec!["a".into(), "b".into()])
        );
        assert!(Command::read(&mut r).is_err());
    }

    #[test]
    fn huge_lengths_are_refused_before_allocating() {
        let mut m = vec![SET];
        m.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(Command::read(&mut &m[..]).is_err());
        let mut m = vec![MULTI_GET];
        m.extend_from_slice(&(MAX_KEY_COUNT + 1).to_le_bytes());
        assert!(Command::read(&mut &m[..]).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut r = &bytes[..];
            while Command::read(&mut r).is_ok() {}
        }
    }
}
