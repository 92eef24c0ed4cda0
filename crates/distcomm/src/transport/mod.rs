//! Transports: how bytes move between two ranks. They know nothing of collectives or of the API
//! above them.
//!
//! * [`frame`]: the bounded wire header shared by the native transports;
//! * [`tcp`]: the TCP mesh and its progress engine;
//! * [`connect_mesh`]: establishing the mesh through the rendezvous store, with a versioned
//!   handshake that is checked before any user buffer is touched.

pub mod frame;
pub(crate) mod tcp;

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::rendezvous::Store;

const HELLO_MAGIC: &[u8; 4] = b"DCM1";
const HELLO_VERSION: u32 = 1;
const HELLO_LEN: usize = 16;

fn hello(rank: usize, world: usize) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..4].copy_from_slice(HELLO_MAGIC);
    b[4..8].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&(rank as u32).to_le_bytes());
    b[12..16].copy_from_slice(&(world as u32).to_le_bytes());
    b
}

/// Parses a peer's hello; returns its rank.
fn parse_hello(b: &[u8; HELLO_LEN], world: usize) -> std::result::Result<usize, String> {
    if &b[..4] != HELLO_MAGIC {
        return Err("not a distcomm peer (bad magic)".into());
    }
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]) as usize;
    if word(4) != HELLO_VERSION as usize {
        return Err(format!(
            "protocol version {} (we speak {HELLO_VERSION})",
            word(4)
        ));
    }
    if word(12) != world {
        return Err(format!(
            "peer believes the world has {} ranks, we have {world}",
            word(12)
        ));
    }
    let r = word(8);
    if r >= world {
        return Err(format!("peer claims rank {r} of {world}"));
    }
    Ok(r)
}

/// The address other ranks should use to reach this host: `DISTCOMM_HOST` if set, loopback when
/// the master is on loopback, otherwise the local interface that routes to the master.
pub fn advertise_ip(master: &str) -> Result<IpAddr> {
    if let Ok(h) = std::env::var("DISTCOMM_HOST") {
        return h
            .parse()
            .map_err(|_| Error::Config(format!("DISTCOMM_HOST={h} is not an IP address")));
    }
    let target = (master, 9)
        .to_socket_addrs()
        .map_err(|e| Error::io(format!("resolve master address {master}"), e))?
        .next()
        .ok_or_else(|| Error::Config(format!("master address {master} did not resolve")))?;
    if target.ip().is_loopback() {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let bind: SocketAddr = if target.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .map_err(|_| Error::Config("bad bind".into()))?
    } else {
        "[::]:0"
            .parse()
            .map_err(|_| Error::Config("bad bind".into()))?
    };
    let probe = UdpSocket::bind(bind).map_err(|e| Error::io("probe local address", e))?;
    probe
        .connect(target)
        .map_err(|e| Error::io(format!("route to master {master}"), e))?;
    Ok(probe
        .local_addr()
        .map_err(|e| Error::io("probe local address", e))?
        .ip())
}

/// Connects every pair of ranks: each rank listens, publishes its address under `key_prefix`,
/// connects to every lower rank and accepts every higher one. Returns one stream per peer
/// (`None` at our own rank).
pub(crate) fn connect_mesh(
    store: &dyn Store,
    rank: usize,
    world: usize,
    ip: IpAddr,
    timeout: Duration,
) -> Result<Vec<Option<TcpStream>>> {
    let deadline = Instant::now() + timeout;
    let listener =
        TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("listen on {ip}"), e))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::io("listener address", e))?;
    store.set(&format!("tcp/addr/{rank}"), local.to_string().as_bytes())?;
    let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();

    for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
        let raw = store.get(&format!("tcp/addr/{peer}"))?;
        let text = String::from_utf8_lossy(&raw).to_string();
        let addr: SocketAddr = text.parse().map_err(|_| Error::Protocol {
            rank,
            peer,
            detail: format!("published address {text:?} is not host:port"),
        })?;
        let mut s = connect_retry(addr, deadline).map_err(|e| Error::PeerLost {
            op: "connect",
            rank,
            peer,
            reason: e.to_string(),
        })?;
        let lost = |e: std::io::Error| Error::PeerLost {
            op: "handshake",
            rank,
            peer,
            reason: e.to_string(),
        };
        s.set_read_timeout(Some(remaining(deadline)))
            .map_err(lost)?;
        s.write_all(&hello(rank, world)).map_err(lost)?;
        let mut reply = [0u8; HELLO_LEN];
        s.read_exact(&mut reply).map_err(lost)?;
        match parse_hello(&reply, world) {
            Ok(r) if r == peer => *slot = Some(s),
            Ok(r) => {
                return Err(Error::Protocol {
                    rank,
                    peer,
                    detail: format!("address of rank {peer} answered as rank {r}"),
                })
            }
            Err(detail) => return Err(Error::Protocol { rank, peer, detail }),
        }
    }

    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("listener nonblocking", e))?;
    let mut missing = world - rank - 1;
    while missing > 0 {
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let waiting: Vec<usize> = (rank + 1..world)
                        .filter(|&p| streams[p].is_none())
                        .collect();
                    return Err(Error::Timeout {
                        op: "connect mesh",
                        rank,
                        peer: waiting.first().copied(),
                        after: timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(Error::io("accept", e)),
        };
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(remaining(deadline).min(Duration::from_secs(10))));
        let mut buf = [0u8; HELLO_LEN];
        let verdict = match s.read_exact(&mut buf) {
            Err(e) => Err(format!("no hello: {e}")),
            Ok(()) => parse_hello(&buf, world).and_then(|r| {
                if r <= rank || streams[r].is_some() {
                    Err(format!("unexpected connection claiming rank {r}"))
                } else {
                    Ok(r)
                }
            }),
        };
        match verdict {
            Ok(r) => {
                if s.write_all(&hello(rank, world)).is_ok() {
                    streams[r] = Some(s);
                    missing -= 1;
                }
            }
            Err(why) => {
                eprintln!("distcomm rank {rank}: refused connection from {from}: {why}");
            }
        }
    }
    Ok(streams)
}

fn remaining(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

fn connect_retry(addr: SocketAddr, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut backoff = Duration::from_millis(1);
    loop {
        match TcpStream::connect_timeout(&addr, remaining(deadline)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => {
                std::thread::sleep(backoff);
                backoff = (backoff * 2).min(Duration::from_millis(100));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_checks() {
        assert_eq!(parse_hello(&hello(3, 5), 5), Ok(3));
        assert!(parse_hello(&hello(3, 5), 4).is_err());
        let mut bad = hello(1, 2);
        bad[0] = b'X';
        assert!(parse_hello(&bad, 2).is_err());
        assert!(parse_hello(&hello(7, 8), 5).is_err());
    }
}
