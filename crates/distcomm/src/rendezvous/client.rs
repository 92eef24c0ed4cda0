use std::io::{self, BufReader};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::proto::{self, *};
use super::Store;
use crate::error::{Error, Result};

struct Conn {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

/// A client of a TCPStore server (ours or PyTorch's).
///
/// ```no_run
/// use distcomm::rendezvous::{Store, TcpStore, TcpStoreServer};
/// use std::time::Duration;
/// # fn main() -> distcomm::Result<()> {
/// let server = TcpStoreServer::bind("127.0.0.1:0")?;
/// let store = TcpStore::connect(&server.local_addr().to_string(), Duration::from_secs(5))?;
/// store.set("k", b"v")?;
/// assert_eq!(store.get("k")?, b"v");
/// assert_eq!(store.add("n", 2)?, 2);
/// # Ok(()) }
/// ```
pub struct TcpStore {
    conn: Mutex<Conn>,
    addr: String,
    timeout: Duration,
}

fn io_err(addr: &str, what: &str) -> impl Fn(io::Error) -> Error {
    let ctx = format!("store {addr}: {what}");
    move |e| Error::io(ctx.clone(), e)
}

/// Retrying a connection to a local port nobody listens on can connect the socket to itself
/// (TCP simultaneous open, when the kernel picks the destination port as the source port):
/// that is a refusal too, not a store.
fn refuse_self_connection(s: TcpStream) -> io::Result<TcpStream> {
    if s.local_addr()? == s.peer_addr()? {
        return Err(io::Error::new(
            io::ErrorKind::ConnectionRefused,
            "connected to itself: nothing listens there",
        ));
    }
    Ok(s)
}

impl TcpStore {
    /// Connects to `addr` (`host:port`), retrying until `timeout` passes (the server may not be
    /// up yet), validates the connection and checks it with a ping. `timeout` is also the default
    /// for blocking calls.
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        Self::connect_with(addr, timeout, None)
    }

    /// Like [`connect`](Self::connect), to a server in the authenticated mode
    /// ([`TcpStoreServer::bind_authenticated`](super::TcpStoreServer::bind_authenticated)):
    /// both sides prove `secret` before the first command. A server that does not know it (or
    /// does not authenticate) is [`Error::StoreAuth`].
    pub fn connect_authenticated(addr: &str, timeout: Duration, secret: &[u8]) -> Result<TcpStore> {
        Self::connect_with(addr, timeout, Some(secret))
    }

    fn connect_with(addr: &str, timeout: Duration, secret: Option<&[u8]>) -> Result<TcpStore> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(5);
        let stream = loop {
            let attempt = addr
                .to_socket_addrs()
                .and_then(|mut it| {
                    it.next()
                        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))
                })
                .and_then(|sa| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    TcpStream::connect_timeout(&sa, left.max(Duration::from_millis(10)))
                })
                .and_then(refuse_self_connection);
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(Error::io(
                        format!("connect to store {addr} (gave up after {timeout:?})"),
                        e,
                    ))
                }
                Err(_) => {
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
            }
        };
        stream.set_nodelay(true).map_err(io_err(addr, "nodelay"))?;
        if let Some(secret) = secret {
            super::auth::client(&stream, secret).map_err(|e| Error::StoreAuth {
                addr: addr.to_string(),
                detail: e.to_string(),
            })?;
        }
        let writer = stream.try_clone().map_err(io_err(addr, "clone socket"))?;
        let store = TcpStore {
            conn: Mutex::new(Conn {
                reader: BufReader::new(stream),
                writer,
            }),
            addr: addr.to_string(),
            timeout,
        };
        {
            let mut c = store.lock();
            let mut msg = vec![VALIDATE];
            msg.extend_from_slice(&MAGIC.to_le_bytes());
            proto::send(&mut c.writer, &msg).map_err(io_err(addr, "validate"))?;
        }
        store.ping()?;
        Ok(store)
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Round trip with a nonce; checks the server echoes it.
    pub fn ping(&self) -> Result<()> {
        let nonce = std::process::id() ^ 0x5a5a_1234;
        let mut c = self.lock();
        let mut msg = vec![PING];
        msg.extend_from_slice(&nonce.to_le_bytes());
        self.request(&mut c, &msg, "ping")?;
        c.writer
            .set_read_timeout(Some(self.timeout))
            .map_err(io_err(&self.addr, "ping"))?;
        let got = proto::read_u32(&mut c.reader).map_err(io_err(&self.addr, "ping"))?;
        let _ = c.writer.set_read_timeout(None);
        if got != nonce {
            return Err(Error::StoreProtocol(format!(
                "ping answered {got:#x}, expected {nonce:#x}"
            )));
        }
        Ok(())
    }

    fn request(&self, c: &mut Conn, msg: &[u8], what: &str) -> Result<()> {
        proto::send(&mut c.writer, msg).map_err(io_err(&self.addr, what))
    }

    fn keys_msg(cmd: u8, keys: &[&str]) -> Vec<u8> {
        let mut msg = vec![cmd];
        msg.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            put_bytes(&mut msg, k.as_bytes());
        }
        msg
    }

    fn do_wait(&self, c: &mut Conn, keys: &[&str], timeout: Duration) -> Result<()> {
        self.request(c, &Self::keys_msg(WAIT, keys), "wait")?;
        let t = timeout.max(Duration::from_millis(1));
        c.writer
            .set_read_timeout(Some(t))
            .map_err(io_err(&self.addr, "wait"))?;
        let first = proto::read_u8(&mut c.reader);
        let _ = c.writer.set_read_timeout(None);
        match first {
            Ok(STOP_WAITING) => return Ok(()),
            Ok(other) => {
                return Err(Error::StoreProtocol(format!(
                    "wait answered {other}, expected STOP_WAITING"
                )))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(Error::io(format!("store {}: wait", self.addr), e)),
        }
        // Timed out: cancel server-side; the server may have answered STOP_WAITING meanwhile.
        self.request(c, &[CANCEL_WAIT], "cancel wait")?;
        let mut r = proto::read_u8(&mut c.reader).map_err(io_err(&self.addr, "cancel wait"))?;
        if r == STOP_WAITING {
            r = proto::read_u8(&mut c.reader).map_err(io_err(&self.addr, "cancel wait"))?;
        }
        if r != WAIT_CANCELED {
            return Err(Error::StoreProtocol(format!(
                "cancel wait answered {r}, expected WAIT_CANCELED"
            )));
        }
        Err(Error::StoreTimeout {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            after: timeout,
        })
    }

    fn read_value(&self, c: &mut Conn, what: &str) -> Result<Vec<u8>> {
        proto::read_bytes(&mut c.reader, MAX_VALUE).map_err(io_err(&self.addr, what))
    }

    fn read_i64(&self, c: &mut Conn, what: &str) -> Result<i64> {
        proto::read_i64(&mut c.reader).map_err(io_err(&self.addr, what))
    }

    /// Sets several keys in one message.
    pub fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<()> {
        let mut msg = vec![MULTI_SET];
        msg.extend_from_slice(&(pairs.len() as u64).to_le_bytes());
        for (k, v) in pairs {
            put_bytes(&mut msg, k.as_bytes());
            put_bytes(&mut msg, v);
        }
        let mut c = self.lock();
        self.request(&mut c, &msg, "multi_set")
    }

    /// Waits for all keys, then returns their values in order.
    pub fn multi_get(&self, keys: &[&str]) -> Result<Vec<Vec<u8>>> {
        let mut c = self.lock();
        self.do_wait(&mut c, keys, self.timeout)?;
        self.request(&mut c, &Self::keys_msg(MULTI_GET, keys), "multi_get")?;
        keys.iter()
            .map(|_| self.read_value(&mut c, "multi_get"))
            .collect()
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut msg = vec![SET];
        put_bytes(&mut msg, key.as_bytes());
        put_bytes(&mut msg, value);
        let mut c = self.lock();
        self.request(&mut c, &msg, "set")
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        let mut c = self.lock();
        self.do_wait(&mut c, &[key], self.timeout)?;
        let mut msg = vec![GET];
        put_bytes(&mut msg, key.as_bytes());
        self.request(&mut c, &msg, "get")?;
        self.read_value(&mut c, "get")
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut msg = vec![ADD];
        put_bytes(&mut msg, key.as_bytes());
        msg.extend_from_slice(&delta.to_le_bytes());
        let mut c = self.lock();
        self.request(&mut c, &msg, "add")?;
        self.read_i64(&mut c, "add")
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut msg = vec![COMPARE_SET];
        put_bytes(&mut msg, key.as_bytes());
        put_bytes(&mut msg, expected);
        put_bytes(&mut msg, desired);
        let mut c = self.lock();
        self.request(&mut c, &msg, "compare_set")?;
        self.read_value(&mut c, "compare_set")
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let mut c = self.lock();
        self.request(&mut c, &Self::keys_msg(CHECK, keys), "check")?;
        match proto::read_u8(&mut c.reader).map_err(io_err(&self.addr, "check"))? {
            CHECK_READY => Ok(true),
            CHECK_NOT_READY => Ok(false),
            x => Err(Error::StoreProtocol(format!("check answered {x}"))),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut c = self.lock();
        self.do_wait(&mut c, keys, timeout)
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        let mut msg = vec![DELETE_KEY];
        put_bytes(&mut msg, key.as_bytes());
        let mut c = self.lock();
        self.request(&mut c, &msg, "delete_key")?;
        Ok(self.read_i64(&mut c, "delete_key")? == 1)
    }

    fn num_keys(&self) -> Result<i64> {
        let mut c = self.lock();
        self.request(&mut c, &[GETNUMKEYS], "num_keys")?;
        self.read_i64(&mut c, "num_keys")
    }

    fn append(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut msg = vec![APPEND];
        put_bytes(&mut msg, key.as_bytes());
        put_bytes(&mut msg, value);
        let mut c = self.lock();
        self.request(&mut c, &msg, "append")
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .finish()
    }
}
