//! Setting up shared-memory links over a connected mesh: which peers share this host, the
//! hello exchange that offers and opens each pair's rings, and the fallback to TCP.
//!
//! Knows the mesh's sockets and the segments; nothing of the engine that will use the links.

use super::*;

/// What a rank tells each peer before deciding on the link.
pub(super) struct Hello {
    host: String,
    pid: i32,
    /// What the peer asked for (unknown words, from a newer peer, read as `auto`).
    kind: TransportKind,
    cma: bool,
    seg: String,
}

impl Hello {
    fn encode(&self) -> String {
        format!(
            "host={} pid={} kind={} cma={} seg={}\n",
            self.host,
            self.pid,
            self.kind.word(),
            u8::from(self.cma),
            self.seg
        )
    }

    fn decode(line: &str) -> Option<Hello> {
        let mut h = Hello {
            host: String::new(),
            pid: 0,
            kind: TransportKind::Auto,
            cma: false,
            seg: String::new(),
        };
        for field in line.split_whitespace() {
            let (k, v) = field.split_once('=')?;
            match k {
                "host" => h.host = v.to_string(),
                "pid" => h.pid = v.parse().ok()?,
                "kind" => h.kind = TransportKind::parse(v).unwrap_or_default(),
                "cma" => h.cma = v == "1",
                "seg" => h.seg = v.to_string(),
                _ => {}
            }
        }
        Some(h)
    }
}

/// Reads one `\n`-terminated line of at most 1 KiB from a blocking stream.
pub(super) fn read_line(stream: &TcpStream, deadline: Instant) -> io::Result<String> {
    let left = deadline.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1))))?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while line.len() < 1024 {
        if (&*stream).read(&mut b)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] == b'\n' {
            stream.set_read_timeout(None)?;
            return String::from_utf8(line)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "not UTF-8"));
        }
        line.push(b[0]);
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, "line too long"))
}

/// Decides, with every peer, which links use shared memory, and sets those up. Runs on the
/// freshly authenticated, still blocking streams. Returns one entry per rank (`None`: TCP).
pub(crate) fn setup(
    streams: &[Option<TcpStream>],
    rank: usize,
    cfg: &ShmConfig,
    deadline: Instant,
) -> Result<Vec<Option<ShmLink>>> {
    let world = streams.len();
    let mut links: Vec<Option<ShmLink>> = (0..world).map(|_| None).collect();
    if world <= 1 {
        return Ok(links);
    }
    let proto = |peer: usize, detail: String| Error::Protocol { rank, peer, detail };
    // Even a rank that wants TCP says so, so that a peer insisting on shared memory can fail
    // with a clear error instead of confusing these lines with frames.
    let host = if cfg.kind == TransportKind::Tcp {
        None
    } else {
        host_identity()
    };
    if cfg.kind == TransportKind::Shm && host.is_none() {
        return Err(Error::Config(format!(
            "DISTCOMM_TRANSPORT=shm, but {SHM_DIR} or /proc is unavailable here"
        )));
    }
    if host.is_some() {
        sweep_stale();
    }
    let pid = std::process::id() as i32;
    let mut nonce = [0u8; 4];
    getrandom::getrandom(&mut nonce).map_err(|e| Error::Config(format!("randomness: {e}")))?;
    let nonce = u32::from_le_bytes(nonce);
    let cap = cfg.ring.max(4096).next_power_of_two();

    // Phase 1: create our outbound rings and tell every peer about them.
    let mut tx: Vec<Option<(String, Ring)>> = (0..world).map(|_| None).collect();
    let cleanup = |tx: &[Option<(String, Ring)>]| {
        for (name, _) in tx.iter().flatten() {
            let _ = std::fs::remove_file(format!("{SHM_DIR}/{name}"));
        }
    };
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let mut seg = String::from("-");
        if host.is_some() {
            let name = format!("{PREFIX}{pid}-{nonce:08x}-{rank}to{peer}");
            match create(&name, cap) {
                Ok(ring) => {
                    seg = name.clone();
                    tx[peer] = Some((name, ring));
                }
                Err(e) if cfg.kind == TransportKind::Shm => {
                    cleanup(&tx);
                    return Err(Error::io(format!("create {SHM_DIR}/{name}"), e));
                }
                Err(_) => {}
            }
        }
        let hello = Hello {
            host: host.clone().unwrap_or_else(|| "-".into()),
            pid,
            kind: cfg.kind,
            cma: cfg.cma,
            seg,
        };
        if let Err(e) = (&*s).write_all(hello.encode().as_bytes()) {
            cleanup(&tx);
            return Err(Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            });
        }
    }

    // Phase 2: read every peer's hello, map the rings of those on this host.
    let mut rx: Vec<Option<(Hello, Ring)>> = (0..world).map(|_| None).collect();
    let mut verdict: Vec<std::result::Result<(), String>> = vec![Ok(()); world];
    // Links where either side insists on shared memory.
    let mut forced = vec![cfg.kind == TransportKind::Shm; world];
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let line = read_line(s, deadline).map_err(|e| {
            cleanup(&tx);
            Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            }
        })?;
        let Some(h) = Hello::decode(&line) else {
            cleanup(&tx);
            return Err(proto(peer, format!("bad shared-memory hello {line:?}")));
        };
        forced[peer] |= h.kind == TransportKind::Shm;
        let why_not = if cfg.kind == TransportKind::Tcp || h.kind == TransportKind::Tcp {
            Some("one side chose tcp")
        } else if host.as_deref().is_none_or(|me| me != h.host) {
            Some("another host, or no shared memory there")
        } else {
            None
        };
        if let Some(why) = why_not {
            if forced[peer] {
                cleanup(&tx);
                return Err(Error::Config(format!(
                    "DISTCOMM_TRANSPORT=shm, but ranks {rank} and {peer} cannot share memory \
                     ({why}; rank {peer} asked for {})",
                    h.kind.word()
                )));
            }
            verdict[peer] = Err(why.into());
            continue;
        }
        if tx[peer].is_none() || !h.seg.starts_with(PREFIX) || h.seg.contains('/') {
            verdict[peer] = Err("no segment".into());
            continue;
        }
        match open(&h.seg) {
            Ok(ring) => rx[peer] = Some((h, ring)),
            Err(e) => verdict[peer] = Err(format!("map {}: {e}", h.seg)),
        }
    }

    // Phase 3: tell every peer whether we mapped its ring; phase 4: learn whether it mapped
    // ours. A link uses shared memory only if both sides succeeded.
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let word = if verdict[peer].is_ok() {
            "ok\n"
        } else {
            "no\n"
        };
        if let Err(e) = (&*s).write_all(word.as_bytes()) {
            cleanup(&tx);
            return Err(Error::PeerLost {
                op: "shared-memory setup",
                rank,
                peer,
                reason: e.to_string(),
            });
        }
    }
    // What each link chose and why (the init summary).
    let mut chose: Vec<String> = vec![String::new(); world];
    for (peer, s) in streams.iter().enumerate() {
        let Some(s) = s else { continue };
        let theirs = read_line(s, deadline);
        let _ = std::fs::remove_file(format!(
            "{SHM_DIR}/{}",
            tx[peer].as_ref().map_or("", |t| t.0.as_str())
        ));
        let theirs = match theirs {
            Ok(w) => w,
            Err(e) => {
                cleanup(&tx);
                return Err(Error::PeerLost {
                    op: "shared-memory setup",
                    rank,
                    peer,
                    reason: e.to_string(),
                });
            }
        };
        let ours = std::mem::replace(&mut verdict[peer], Ok(()));
        chose[peer] = match (&ours, theirs == "ok") {
            (Ok(()), true) => "shm".into(),
            (Err(why), _) => format!("tcp ({why})"),
            (Ok(()), false) => "tcp (the peer could not map our ring)".into(),
        };
        match (ours, theirs == "ok", tx[peer].take(), rx[peer].take()) {
            (Ok(()), true, Some((_, t)), Some((h, r))) => {
                let cma = cfg.cma && h.cma;
                if !cma {
                    chose[peer] = "shm (no cross-memory attach)".into();
                }
                links[peer] = Some(ShmLink::new(t, r, h.pid, cma))
            }
            (ours, _, _, _) if forced[peer] => {
                cleanup(&tx);
                let why = ours
                    .err()
                    .unwrap_or_else(|| "the peer could not map ours".into());
                return Err(Error::Config(format!(
                    "DISTCOMM_TRANSPORT=shm, but the shared-memory link between ranks {rank} \
                     and {peer} failed: {why}"
                )));
            }
            _ => {}
        }
    }
    if tracing::enabled!(target: "distcomm::init", tracing::Level::INFO) {
        let chose: Vec<String> = (0..world)
            .filter(|&p| p != rank)
            .map(|p| format!("{p}:{}", chose[p]))
            .collect();
        tracing::info!(
            target: "distcomm::init",
            rank,
            asked = cfg.kind.word(),
            ring = cap,
            "links of rank {rank}: {}",
            chose.join(", ")
        );
    }
    Ok(links)
}
