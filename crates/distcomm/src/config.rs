//! Configuration from the environment: every `DISTCOMM_*` tuning variable, named once, read once
//! per group construction ([`Config::from_env`]) and validated there. A malformed value is an
//! [`Error::ConfigVar`] naming the variable, the value and what it accepts; nothing is silently
//! ignored.
//!
//! Owns: the variables' names, their parsing and their accepted values, and the two choices made
//! from them before anything else exists ([`BackendKind`], [`TransportKind`]). Must not know: what
//! the settings do (defaults that depend on the machine, such as the spin time, are applied by
//! the layer that uses them), or any layer above the leaves. The launcher's variables (rank,
//! world, master address: torchrun's, mpirun's, srun's and `DISTCOMM_MASTER_ADDR`/`_PORT`)
//! belong to [`crate::env`]; `DISTCOMM_DEBUG` is parsed by [`crate::diag`] from the values read
//! here.

use std::net::IpAddr;
use std::time::Duration;

use crate::error::{Error, Result};

/// `DISTCOMM_BACKEND`: `native` or `mpi`.
pub const BACKEND: &str = "DISTCOMM_BACKEND";
/// `DISTCOMM_TIMEOUT`: default deadline of blocking calls, seconds.
pub const TIMEOUT: &str = "DISTCOMM_TIMEOUT";
/// `DISTCOMM_SECRET`: the job secret of transport (and store) authentication.
pub const SECRET: &str = "DISTCOMM_SECRET";
/// `DISTCOMM_STORE_AUTH`: the store's authenticated mode.
pub const STORE_AUTH: &str = "DISTCOMM_STORE_AUTH";
/// `DISTCOMM_TRANSPORT`: `auto`, `tcp` or `shm`.
pub const TRANSPORT: &str = "DISTCOMM_TRANSPORT";
/// `DISTCOMM_HOST`: the address to advertise to peers.
pub const HOST: &str = "DISTCOMM_HOST";
/// `DISTCOMM_SHM_RING`: shared-memory ring bytes per direction.
pub const SHM_RING: &str = "DISTCOMM_SHM_RING";
/// `DISTCOMM_SHM_CMA`: `0` turns cross-memory attach off.
pub const SHM_CMA: &str = "DISTCOMM_SHM_CMA";
/// `DISTCOMM_SHM_SHARED_CACHES`: whether the ranks of a host share a core's caches, `1` or
/// `0`; unset or `auto`, the arena measures it at set-up.
pub const SHM_SHARED_CACHES: &str = "DISTCOMM_SHM_SHARED_CACHES";
/// `DISTCOMM_SHM_STREAM`: whether large copies into the arena's slots take non-temporal
/// stores, `1` or `0`; unset or `auto`, the arena measures it at set-up.
pub const SHM_STREAM: &str = "DISTCOMM_SHM_STREAM";
/// `DISTCOMM_SHM_EAGER_MAX`: largest message sent through the ring, bytes.
pub const SHM_EAGER_MAX: &str = "DISTCOMM_SHM_EAGER_MAX";
/// `DISTCOMM_SPIN_US`: how long waiters spin before they sleep, microseconds.
pub const SPIN_US: &str = "DISTCOMM_SPIN_US";
/// `DISTCOMM_EAGER_MAX`: largest message sent inline over TCP, bytes.
pub const EAGER_MAX: &str = "DISTCOMM_EAGER_MAX";
/// `DISTCOMM_SOCKBUF`: socket buffer size, bytes.
pub const SOCKBUF: &str = "DISTCOMM_SOCKBUF";
/// `DISTCOMM_DATA_CHUNK`: bytes per frame of a large message.
pub const DATA_CHUNK: &str = "DISTCOMM_DATA_CHUNK";
/// `DISTCOMM_SHM_ALLREDUCE`: `0` turns the intra-node all_reduce off.
pub const SHM_ALLREDUCE: &str = "DISTCOMM_SHM_ALLREDUCE";
/// `DISTCOMM_SHM_ALLREDUCE_MAX`: largest all_reduce the arena takes, bytes.
pub const SHM_ALLREDUCE_MAX: &str = "DISTCOMM_SHM_ALLREDUCE_MAX";
/// `DISTCOMM_SHM_ARENA_CHUNK`: slot size of the arena, bytes.
pub const SHM_ARENA_CHUNK: &str = "DISTCOMM_SHM_ARENA_CHUNK";
/// `DISTCOMM_ALL_REDUCE_RING_MIN`: all_reduce switches to the ring at this many bytes.
pub const ALL_REDUCE_RING_MIN: &str = "DISTCOMM_ALL_REDUCE_RING_MIN";
/// `DISTCOMM_BROADCAST_SCATTER_MIN`: broadcast switches to scatter + all-gather here, bytes.
pub const BROADCAST_SCATTER_MIN: &str = "DISTCOMM_BROADCAST_SCATTER_MIN";
/// `DISTCOMM_RING_CHUNK_MAX`: bytes per rank one round of the ring all_reduce moves at most
/// (also the segments of the 16-bit all_reduce over the network).
pub const RING_CHUNK_MAX: &str = "DISTCOMM_RING_CHUNK_MAX";
/// `DISTCOMM_COMMS_LOG`: record per-op statistics.
pub const COMMS_LOG: &str = "DISTCOMM_COMMS_LOG";
/// `DISTCOMM_DEBUG`: diagnostics level.
pub const DEBUG: &str = "DISTCOMM_DEBUG";
/// `DISTCOMM_DEBUG_SUBSYS`: diagnostics subsystems.
pub const DEBUG_SUBSYS: &str = "DISTCOMM_DEBUG_SUBSYS";

/// Every variable this module reads (the README's environment table lists each).
pub const VARS: [&str; 24] = [
    BACKEND,
    TIMEOUT,
    SECRET,
    STORE_AUTH,
    TRANSPORT,
    HOST,
    SHM_RING,
    SHM_CMA,
    SHM_SHARED_CACHES,
    SHM_STREAM,
    SHM_EAGER_MAX,
    SPIN_US,
    EAGER_MAX,
    SOCKBUF,
    DATA_CHUNK,
    SHM_ALLREDUCE,
    SHM_ALLREDUCE_MAX,
    SHM_ARENA_CHUNK,
    ALL_REDUCE_RING_MIN,
    BROADCAST_SCATTER_MIN,
    RING_CHUNK_MAX,
    COMMS_LOG,
    DEBUG,
    DEBUG_SUBSYS,
];

/// What the yes/no variables accept.
const FLAG: &str = "1 or 0 (also true/false, yes/no, on/off)";
/// When ranks outnumber cores, waiters spin this briefly, yielding the core on every turn, and
/// then sleep: a short yielding spin catches a reply from a rank that is running now without
/// keeping anyone from the core (see the README for the measurements behind it).
pub const OVERSUBSCRIBED_SPIN: Duration = Duration::from_micros(200);

/// What the byte-size variables accept.
const BYTES: &str = "a whole number of bytes, optionally with K, M or G (64K: 65536 bytes)";
/// What the on/off switches whose default is on accept (any other number also means on).
const OFF_SWITCH: &str = "0 (off) or 1 (on)";

/// A size in bytes as the environment variables and `distcomm bench --sizes` take it: a whole
/// number, with an optional binary suffix `K`, `M` or `G` (either case) or a trailing `B`;
/// `None` for anything else, and for sizes this machine cannot address.
///
/// ```
/// use distcomm::config::parse_bytes;
/// assert_eq!(parse_bytes("64K"), Some(65536));
/// assert_eq!(parse_bytes(" 2m "), Some(2 << 20));
/// assert_eq!(parse_bytes("4099"), Some(4099));
/// assert_eq!(parse_bytes("8B"), Some(8));
/// assert_eq!(parse_bytes("1.5M"), None);
/// assert_eq!(parse_bytes("-1"), None);
/// ```
pub fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, shift) = match s.chars().last()? {
        'K' | 'k' => (&s[..s.len() - 1], 10),
        'M' | 'm' => (&s[..s.len() - 1], 20),
        'G' | 'g' => (&s[..s.len() - 1], 30),
        'B' | 'b' => (&s[..s.len() - 1], 0),
        _ => (s, 0),
    };
    let n: usize = num.parse().ok()?;
    n.checked_mul(1 << shift)
}

/// Which backend carries a group's traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// distcomm's own transports (TCP, shared memory) and collective schedules.
    Native,
    /// The system MPI (feature `mpi`): for jobs started by `mpirun` or `srun`.
    Mpi,
}

impl BackendKind {
    /// `DISTCOMM_BACKEND`: `native` (default, also when unset or empty) or `mpi`.
    pub fn from_env() -> Result<BackendKind> {
        Reader::env().backend()
    }

    fn parse(v: &str) -> Option<BackendKind> {
        match v.trim() {
            "" | "native" => Some(BackendKind::Native),
            "mpi" => Some(BackendKind::Mpi),
            _ => None,
        }
    }
}

/// The former name of [`BackendKind`].
#[deprecated(
    since = "0.1.0",
    note = "renamed BackendKind (the backends themselves are now a trait)"
)]
pub type Backend = BackendKind;

/// How ranks on one host talk (`DISTCOMM_TRANSPORT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// Shared memory towards ranks on this host, TCP towards the others (the default).
    #[default]
    Auto,
    /// TCP everywhere.
    Tcp,
    /// Shared memory everywhere; an error if any peer is on another host or the platform has no
    /// shared-memory transport.
    Shm,
}

impl TransportKind {
    /// Parses `auto`, `tcp` or `shm` (a [`Error::ConfigVar`] on `DISTCOMM_TRANSPORT` otherwise).
    pub fn parse(s: &str) -> Result<TransportKind> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(TransportKind::Auto),
            "tcp" => Ok(TransportKind::Tcp),
            "shm" => Ok(TransportKind::Shm),
            _ => Err(bad(TRANSPORT, s, "auto, tcp or shm")),
        }
    }

    pub(crate) fn word(self) -> &'static str {
        match self {
            TransportKind::Auto => "auto",
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
        }
    }
}

/// Every `DISTCOMM_*` setting, validated; `None` where the variable is unset or empty (the
/// user of the setting applies its default).
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Config {
    pub backend: Option<BackendKind>,
    pub timeout: Option<Duration>,
    pub secret: Option<Vec<u8>>,
    pub store_auth: bool,
    pub transport: TransportKind,
    pub host: Option<IpAddr>,
    pub shm_ring: Option<usize>,
    pub shm_cma: bool,
    /// `None`: measured (`auto`).
    pub shm_shared_caches: Option<bool>,
    /// `None`: measured (`auto`).
    pub shm_stream: Option<bool>,
    pub shm_eager_max: Option<usize>,
    pub spin: Option<Duration>,
    pub eager_max: Option<usize>,
    pub sockbuf: Option<usize>,
    pub data_chunk: Option<usize>,
    pub shm_allreduce: bool,
    pub shm_allreduce_max: Option<usize>,
    pub shm_arena_chunk: Option<usize>,
    pub all_reduce_ring_min: Option<usize>,
    pub broadcast_scatter_min: Option<usize>,
    pub ring_chunk_max: Option<usize>,
    pub comms_log: bool,
}

impl Config {
    /// Reads and checks every variable of the process environment.
    pub fn from_env() -> Result<Config> {
        Reader::env().config()
    }

    /// [`Config::from_env`] over any lookup (tests).
    #[cfg(test)]
    fn from_lookup(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Config> {
        Reader { lookup }.config()
    }
}

/// The error of a malformed variable.
fn bad(var: &'static str, value: &str, expected: &'static str) -> Error {
    Error::ConfigVar {
        var,
        value: value.to_string(),
        expected,
    }
}

/// Typed reads of variables through a lookup.
pub(crate) struct Reader<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
}

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl Reader<'static> {
    /// The process environment.
    pub fn env() -> Reader<'static> {
        Reader {
            lookup: &process_env,
        }
    }
}

impl Reader<'_> {
    /// The raw value, `None` when unset or empty.
    pub fn raw(&self, var: &str) -> Option<String> {
        (self.lookup)(var).filter(|v| !v.is_empty())
    }

    fn u64(&self, var: &'static str, expected: &'static str) -> Result<Option<u64>> {
        match self.raw(var) {
            Some(v) => v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| bad(var, &v, expected)),
            None => Ok(None),
        }
    }

    fn bytes(&self, var: &'static str) -> Result<Option<usize>> {
        match self.raw(var) {
            Some(v) => parse_bytes(&v).map(Some).ok_or_else(|| bad(var, &v, BYTES)),
            None => Ok(None),
        }
    }

    /// A switch whose default is on: only `0` turns it off.
    fn off_switch(&self, var: &'static str) -> Result<bool> {
        Ok(self.u64(var, OFF_SWITCH)? != Some(0))
    }

    /// A yes/no setting: `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off` (unset: no).
    pub fn flag(&self, var: &'static str) -> Result<bool> {
        match (self.lookup)(var) {
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "0" | "false" | "no" | "off" => Ok(false),
                "1" | "true" | "yes" | "on" => Ok(true),
                _ => Err(bad(var, &v, FLAG)),
            },
            None => Ok(false),
        }
    }

    /// A yes/no setting that may be left to a measurement: unset or `auto` is `None`.
    fn auto_flag(&self, var: &'static str) -> Result<Option<bool>> {
        match self.raw(var) {
            Some(v) if v.trim().eq_ignore_ascii_case("auto") => Ok(None),
            Some(_) => self.flag(var).map(Some),
            None => Ok(None),
        }
    }

    fn seconds(&self, var: &'static str) -> Result<Option<Duration>> {
        match self.raw(var) {
            Some(v) => v
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(|s| Some(Duration::from_secs_f64(s)))
                .ok_or_else(|| bad(var, &v, "a positive number of seconds")),
            None => Ok(None),
        }
    }

    pub fn backend(&self) -> Result<BackendKind> {
        let v = (self.lookup)(BACKEND).unwrap_or_default();
        BackendKind::parse(&v).ok_or_else(|| bad(BACKEND, &v, "native or mpi"))
    }

    pub fn timeout(&self) -> Result<Option<Duration>> {
        self.seconds(TIMEOUT)
    }

    pub fn secret(&self) -> Option<Vec<u8>> {
        self.raw(SECRET).map(String::into_bytes)
    }

    pub fn host(&self) -> Result<Option<IpAddr>> {
        match self.raw(HOST) {
            Some(h) => h
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| bad(HOST, &h, "an IP address (IPv4 or IPv6)")),
            None => Ok(None),
        }
    }

    fn config(&self) -> Result<Config> {
        let transport = match self.raw(TRANSPORT) {
            Some(v) => TransportKind::parse(&v)?,
            None => TransportKind::Auto,
        };
        Ok(Config {
            backend: match self.raw(BACKEND) {
                Some(_) => Some(self.backend()?),
                None => None,
            },
            timeout: self.timeout()?,
            secret: self.secret(),
            store_auth: self.flag(STORE_AUTH)?,
            transport,
            host: self.host()?,
            shm_ring: self.bytes(SHM_RING)?,
            shm_cma: self.off_switch(SHM_CMA)?,
            shm_shared_caches: self.auto_flag(SHM_SHARED_CACHES)?,
            shm_stream: self.auto_flag(SHM_STREAM)?,
            shm_eager_max: self.bytes(SHM_EAGER_MAX)?,
            spin: self
                .u64(SPIN_US, "a whole number of microseconds")?
                .map(Duration::from_micros),
            eager_max: self.bytes(EAGER_MAX)?,
            sockbuf: self.bytes(SOCKBUF)?,
            data_chunk: self.bytes(DATA_CHUNK)?,
            shm_allreduce: self.off_switch(SHM_ALLREDUCE)?,
            shm_allreduce_max: self.bytes(SHM_ALLREDUCE_MAX)?,
            shm_arena_chunk: self.bytes(SHM_ARENA_CHUNK)?,
            all_reduce_ring_min: self.bytes(ALL_REDUCE_RING_MIN)?,
            broadcast_scatter_min: self.bytes(BROADCAST_SCATTER_MIN)?,
            ring_chunk_max: self.bytes(RING_CHUNK_MAX)?,
            comms_log: self.flag(COMMS_LOG)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Result<Config> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |n| vars.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()))
    }

    fn rejected(var: &str, value: &str) -> (String, &'static str) {
        match with(&[(var, value)]) {
            Err(Error::ConfigVar {
                var: v,
                value: got,
                expected,
            }) => {
                assert_eq!(v, var);
                (got, expected)
            }
            other => panic!("{var}={value:?}: expected ConfigVar, got {other:?}"),
        }
    }

    #[test]
    fn unset_and_empty_mean_defaults() {
        let c = with(&[]).unwrap();
        assert_eq!(c.transport, TransportKind::Auto);
        assert!(c.shm_cma && c.shm_allreduce && !c.store_auth && !c.comms_log);
        assert_eq!((c.backend, c.timeout, c.eager_max), (None, None, None));
        let empty: Vec<(&str, &str)> = VARS.iter().map(|v| (*v, "")).collect();
        assert_eq!(with(&empty).unwrap(), c);
    }

    #[test]
    fn values_are_parsed() {
        let c = with(&[
            (BACKEND, "mpi"),
            (TIMEOUT, "2.5"),
            (SECRET, "s"),
            (STORE_AUTH, "yes"),
            (TRANSPORT, " TCP "),
            (HOST, "10.0.0.7"),
            (SHM_CMA, "0"),
            (SHM_SHARED_CACHES, "yes"),
            (SHM_STREAM, "off"),
            (SHM_ALLREDUCE, "0"),
            (SPIN_US, "50"),
            (EAGER_MAX, " 4096 "),
            (ALL_REDUCE_RING_MIN, "1"),
            (RING_CHUNK_MAX, "4099"),
            (SHM_ARENA_CHUNK, "128K"),
            (DATA_CHUNK, "2m"),
            (COMMS_LOG, "1"),
        ])
        .unwrap();
        assert_eq!(c.backend, Some(BackendKind::Mpi));
        assert_eq!(c.timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.secret.as_deref(), Some(&b"s"[..]));
        assert!(c.store_auth && c.comms_log && !c.shm_cma && !c.shm_allreduce);
        assert_eq!(c.transport, TransportKind::Tcp);
        assert_eq!(c.host, Some("10.0.0.7".parse().unwrap()));
        assert_eq!(c.spin, Some(Duration::from_micros(50)));
        assert_eq!(c.eager_max, Some(4096));
        assert_eq!(c.all_reduce_ring_min, Some(1));
        assert_eq!(c.ring_chunk_max, Some(4099));
        assert_eq!(c.shm_arena_chunk, Some(128 << 10));
        assert_eq!(c.data_chunk, Some(2 << 20));
        assert_eq!(c.shm_shared_caches, Some(true));
        assert_eq!(c.shm_stream, Some(false));
        assert_eq!(with(&[(SHM_STREAM, "auto")]).unwrap().shm_stream, None);
        let auto = with(&[(SHM_SHARED_CACHES, " Auto ")]).unwrap();
        assert_eq!(auto.shm_shared_caches, None);
        assert_eq!(
            with(&[(SHM_SHARED_CACHES, "0")]).unwrap().shm_shared_caches,
            Some(false)
        );
    }

    #[test]
    fn every_malformed_variable_is_named_with_what_it_accepts() {
        assert_eq!(rejected(BACKEND, "nccl").1, "native or mpi");
        assert_eq!(rejected(TRANSPORT, "ib").1, "auto, tcp or shm");
        assert_eq!(rejected(TIMEOUT, "-3").1, "a positive number of seconds");
        assert_eq!(rejected(TIMEOUT, "soon").0, "soon");
        assert!(rejected(STORE_AUTH, "maybe").1.starts_with("1 or 0"));
        assert!(rejected(COMMS_LOG, "verbose").1.starts_with("1 or 0"));
        assert!(rejected(SHM_SHARED_CACHES, "some").1.starts_with("1 or 0"));
        assert!(rejected(SHM_STREAM, "always").1.starts_with("1 or 0"));
        assert!(rejected(HOST, "node0").1.contains("IP address"));
        assert!(rejected(SPIN_US, "2ms").1.contains("microseconds"));
        assert_eq!(rejected(SHM_CMA, "off").1, OFF_SWITCH);
        assert_eq!(rejected(SHM_ALLREDUCE, "no").1, OFF_SWITCH);
        for var in [
            SHM_RING,
            SHM_EAGER_MAX,
            EAGER_MAX,
            SOCKBUF,
            DATA_CHUNK,
            SHM_ALLREDUCE_MAX,
            SHM_ARENA_CHUNK,
            // These three were silently ignored when malformed before the config module.
            ALL_REDUCE_RING_MIN,
            BROADCAST_SCATTER_MIN,
            RING_CHUNK_MAX,
        ] {
            let (value, expected) = rejected(var, "64Q");
            assert_eq!((value.as_str(), expected), ("64Q", BYTES), "{var}");
            let _ = rejected(var, "-1");
            let _ = rejected(var, "99999999999G");
        }
    }

    #[test]
    fn the_error_says_variable_value_and_accepted_values() {
        let e = with(&[(ALL_REDUCE_RING_MIN, "big")]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("DISTCOMM_ALL_REDUCE_RING_MIN=\"big\"") && text.contains(BYTES),
            "{text}"
        );
        assert!(e.is_config(), "{e:?}");
        assert!(format!("{e:?}").contains("[Error::ConfigVar]"), "{e:?}");
    }

    #[test]
    fn transport_kind_parse_names_the_variable() {
        assert_eq!(TransportKind::parse("shm").unwrap(), TransportKind::Shm);
        let e = TransportKind::parse("rdma").unwrap_err();
        assert!(e.to_string().contains("DISTCOMM_TRANSPORT=\"rdma\""), "{e}");
    }

    #[test]
    fn the_readme_lists_every_variable() {
        let readme = include_str!("../../../README.md");
        for var in VARS {
            assert!(
                readme.contains(var),
                "README's environment table lacks {var}"
            );
        }
    }
}
