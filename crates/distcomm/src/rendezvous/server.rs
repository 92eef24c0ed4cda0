use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::proto::{self, *};
use crate::error::{Error, Result};

#[derive(Default)]
struct Data {
    map: HashMap<String, Vec<u8>>,
    queues: HashMap<String, VecDeque<Vec<u8>>>,
}

impl Data {
    fn ready(&self, keys: &[String]) -> bool {
        keys.iter()
            .all(|k| self.map.contains_key(k) || self.queues.get(k).is_some_and(|q| !q.is_empty()))
    }
}

struct Shared {
    data: Mutex<Data>,
    changed: Condvar,
    stop: AtomicBool,
    clients: Mutex<HashMap<u64, TcpStream>>,
    /// The job secret every client must prove (authenticated mode), if any.
    secret: Option<Vec<u8>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Data> {
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A TCPStore server, wire-compatible with PyTorch's (torch ≥ 2.4 clients can use it).
/// One thread per connection; stops and disconnects everyone when dropped.
///
/// ```
/// use distcomm::rendezvous::TcpStoreServer;
/// # fn main() -> distcomm::Result<()> {
/// let server = TcpStoreServer::bind("127.0.0.1:0")?;
/// println!("store at {}", server.local_addr());
/// # Ok(()) }
/// ```
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl TcpStoreServer {
    /// Listens on `addr` (`host:port`; port 0 picks a free one) and serves in the background.
    pub fn bind(addr: &str) -> Result<TcpStoreServer> {
        Self::bind_with(addr, None)
    }

    /// Like [`bind`](Self::bind), in the authenticated mode: every connection must prove
    /// `secret` before its first command ([`TcpStore::connect_authenticated`]); PyTorch
    /// clients, which cannot, are refused.
    ///
    /// ```
    /// use distcomm::rendezvous::{Store, TcpStore, TcpStoreServer};
    /// use std::time::Duration;
    /// # fn main() -> distcomm::Result<()> {
    /// let server = TcpStoreServer::bind_authenticated("127.0.0.1:0", b"job secret")?;
    /// let addr = server.local_addr().to_string();
    /// let store = TcpStore::connect_authenticated(&addr, Duration::from_secs(5), b"job secret")?;
    /// store.set("k", b"v")?;
    /// assert!(TcpStore::connect_authenticated(&addr, Duration::from_secs(5), b"guess").is_err());
    /// # Ok(()) }
    /// ```
    ///
    /// [`TcpStore::connect_authenticated`]: super::TcpStore::connect_authenticated
    pub fn bind_authenticated(addr: &str, secret: &[u8]) -> Result<TcpStoreServer> {
        Self::bind_with(addr, Some(secret.to_vec()))
    }

    fn bind_with(addr: &str, secret: Option<Vec<u8>>) -> Result<TcpStoreServer> {
        let sa = addr
            .to_socket_addrs()
            .map_err(|e| Error::io(format!("resolve store address {addr}"), e))?
            .next()
            .ok_or_else(|| Error::Config(format!("store address {addr} did not resolve")))?;
        let listener =
            TcpListener::bind(sa).map_err(|e| Error::io(format!("store: listen on {sa}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("store: local address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("store: nonblocking listener", e))?;
        let shared = Arc::new(Shared {
            data: Mutex::new(Data::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
            secret,
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("distcomm-store".into())
            .spawn(move || accept_loop(listener, sh))
            .map_err(|e| Error::io("store: spawn", e))?;
        Ok(TcpStoreServer {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.changed.notify_all();
        for c in self
            .shared
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    let mut next_id = 0u64;
    while !sh.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_nodelay(true);
                let Ok(clone) = stream.try_clone() else {
                    continue;
                };
                next_id += 1;
                let id = next_id;
                sh.clients
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id, clone);
                let sh2 = sh.clone();
                let _ = std::thread::Builder::new()
                    .name("distcomm-store-client".into())
                    .spawn(move || {
                        // A client that breaks the protocol (or leaves) is disconnected.
                        let _ = serve(&stream, &sh2);
                        let _ = stream.shutdown(Shutdown::Both);
                        sh2.clients
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .remove(&id);
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

fn readable(stream: &TcpStream) -> bool {
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack, length 1, zero timeout; poll only writes revents.
    unsafe { libc::poll(&mut fd, 1, 0) > 0 }
}

fn serve(stream: &TcpStream, sh: &Shared) -> io::Result<()> {
    if let Some(secret) = &sh.secret {
        // Strangers (torch clients included) fail here, before any command is read.
        super::auth::server(stream, secret)?;
    }
    let mut w = stream;
    let mut r = BufReader::new(stream);
    // Refuse on the first byte: a stranger's other command could keep us waiting for its body.
    if r.fill_buf()?.first() != Some(&VALIDATE)
        || Command::read(&mut r)? != Command::Validate(MAGIC)
    {
        return Err(bad("connection did not validate"));
    }
    loop {
        let mut out = Vec::new();
        match Command::read(&mut r)? {
            Command::Validate(m) if m == MAGIC => {}
            Command::Validate(_) => return Err(bad("bad magic")),
            Command::Ping(nonce) => out.extend_from_slice(&nonce.to_le_bytes()),
            Command::Set(k, v) => {
                sh.lock().map.insert(k, v);
                sh.changed.notify_all();
            }
            Command::CompareSet(k, expected, desired) => {
                let mut d = sh.lock();
                let now = match d.map.get(&k) {
                    None if expected.is_empty() => {
                        d.map.insert(k, desired.clone());
                        desired
                    }
                    None => expected,
                    Some(cur) if *cur == expected => {
                        d.map.insert(k, desired.clone());
                        desired
                    }
                    Some(cur) => cur.clone(),
                };
                drop(d);
                sh.changed.notify_all();
                put_bytes(&mut out, &now);
            }
            Command::Get(k) => {
                let d = sh.lock();
                put_bytes(&mut out, d.map.get(&k).map(|v| v.as_slice()).unwrap_or(&[]));
            }
            Command::Add(k, delta) => {
                let mut d = sh.lock();
                let cur = match d.map.get(&k) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or_else(|| bad("add on a value that is not an integer"))?,
                };
                let new = cur.wrapping_add(delta);
                d.map.insert(k, new.to_string().into_bytes());
                drop(d);
                sh.changed.notify_all();
                out.extend_from_slice(&new.to_le_bytes());
            }
            Command::Check(keys) => out.push(if sh.lock().ready(&keys) {
                CHECK_READY
            } else {
                CHECK_NOT_READY
            }),
            Command::Wait(keys) => out.push(if wait_keys(sh, &keys, &mut r)? {
                STOP_WAITING
            } else {
                WAIT_CANCELED
            }),
            Command::CancelWait => out.push(WAIT_CANCELED),
            Command::GetNumKeys => {
                out.extend_from_slice(&(sh.lock().map.len() as i64).to_le_bytes())
            }
            Command::DeleteKey(k) => {
                let n = i64::from(sh.lock().map.remove(&k).is_some());
                out.extend_from_slice(&n.to_le_bytes());
            }
            Command::Append(k, v) => {
                let mut d = sh.lock();
                let entry = d.map.entry(k).or_default();
                if entry.len() as u64 + v.len() as u64 > MAX_VALUE {
                    return Err(bad("append would exceed the value limit"));
                }
                entry.extend_from_slice(&v);
                drop(d);
                sh.changed.notify_all();
            }
            Command::MultiGet(keys) => {
                let d = sh.lock();
                for k in keys {
                    put_bytes(&mut out, d.map.get(&k).map(|v| v.as_slice()).unwrap_or(&[]));
                }
            }
            Command::MultiSet(pairs) => {
                sh.lock().map.extend(pairs);
                sh.changed.notify_all();
            }
            Command::QueuePush(k, v) => {
                sh.lock().queues.entry(k).or_default().push_back(v);
                sh.changed.notify_all();
            }
            Command::QueuePop(k) => {
                let mut d = sh.lock();
                let q = d.queues.entry(k).or_default();
                out.extend_from_slice(&(q.len() as i64).to_le_bytes());
                if let Some(v) = q.pop_front() {
                    put_bytes(&mut out, &v);
                }
            }
            Command::QueueLen(k) => {
                let n = sh.lock().queues.get(&k).map_or(0, |q| q.len());
                out.extend_from_slice(&(n as i64).to_le_bytes());
            }
        }
        if !out.is_empty() {
            w.write_all(&out)?;
        }
    }
}

/// Blocks until `keys` exist (true) or the client sends CANCEL_WAIT (false).
fn wait_keys(sh: &Shared, keys: &[String], r: &mut BufReader<&TcpStream>) -> io::Result<bool> {
    let mut d = sh.lock();
    loop {
        if d.ready(keys) {
            return Ok(true);
        }
        if sh.stop.load(Ordering::Acquire) {
            return Err(bad("server stopping"));
        }
        d = match sh.changed.wait_timeout(d, Duration::from_millis(20)) {
            Ok((g, _)) => g,
            Err(e) => e.into_inner().0,
        };
        if !r.buffer().is_empty() || readable(r.get_ref()) {
            drop(d);
            return match proto::read_u8(r)? {
                CANCEL_WAIT => Ok(false),
                _ => Err(bad("command sent while waiting")),
            };
        }
    }
}
