//! Diagnostics, NCCL_DEBUG-style: distcomm emits [`tracing`] events and leaves the choice of
//! subscriber to the program.
//!
//! * `DISTCOMM_DEBUG=WARN|INFO|DEBUG|TRACE` (also `ERROR`, `OFF`; any case) sets the level:
//!   at `INFO`, each rank says at init who it is (rank, world, host, pid), which backend and
//!   transport it runs, what each link chose and why, whether the shared-memory arena is on, and
//!   how connections are authenticated; at `DEBUG`, which algorithm every collective takes; at
//!   `TRACE`, every message posted (in builds with the `trace-messages` feature).
//! * `DISTCOMM_DEBUG_SUBSYS=init,coll,...` keeps only those subsystems (`^net,msg` keeps all
//!   but those), like `NCCL_DEBUG_SUBSYS`. The subsystems are the event targets
//!   `distcomm::<name>`: see [`SUBSYSTEMS`].
//!
//! [`crate::init`] and [`crate::GroupBuilder::build`] install a stderr subscriber with that
//! filter when `DISTCOMM_DEBUG` is set and the program has no global subscriber of its own
//! (one installed before is kept, and then decides what is shown: filter on the targets
//! above). The `distcomm` command always installs one, showing warnings by default.
//!
//! Off costs nothing measurable: without a subscriber (or at a level it does not want) an event
//! is one relaxed atomic load and a branch, no event sits inside a wait loop, and the
//! per-message events are compiled in only with the `trace-messages` feature, so the 8 B path
//! has no check at all by default.

use std::sync::Once;

use crate::error::{Error, Result};

/// The subsystems `DISTCOMM_DEBUG_SUBSYS` names, each the target `distcomm::<name>`:
/// `init` (group set-up, the per-rank summary), `net` (TCP mesh, handshakes, refused
/// connections), `shm` (shared-memory links and the all_reduce arena), `coll` (algorithm per
/// collective), `msg` (every message, at TRACE), `mpi` (the MPI backend), `device` (GPU
/// staging), `launch` (`distcomm launch`).
pub const SUBSYSTEMS: [&str; 8] = [
    "init", "net", "shm", "coll", "msg", "mpi", "device", "launch",
];

/// The `tracing_subscriber::EnvFilter` directives that `DISTCOMM_DEBUG` and
/// `DISTCOMM_DEBUG_SUBSYS` ask for; `None` when `DISTCOMM_DEBUG` is unset or empty.
///
/// ```
/// let d = distcomm::diag::directives(Some("info"), Some("init,coll")).unwrap();
/// assert_eq!(d.as_deref(), Some("distcomm::init=info,distcomm::coll=info"));
/// let d = distcomm::diag::directives(Some("DEBUG"), Some("^msg")).unwrap();
/// assert_eq!(d.as_deref(), Some("distcomm=debug,distcomm::msg=off"));
/// assert!(distcomm::diag::directives(Some("loud"), None).is_err());
/// ```
pub fn directives(level: Option<&str>, subsys: Option<&str>) -> Result<Option<String>> {
    let Some(level) = level.map(str::trim).filter(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let level = match level.to_ascii_lowercase().as_str() {
        l @ ("off" | "error" | "warn" | "info" | "debug" | "trace") => l.to_string(),
        "warning" => "warn".into(),
        // NCCL's name for "print the version": the init summary has it.
        "version" => "info".into(),
        _ => {
            return Err(Error::ConfigVar {
                var: crate::config::DEBUG,
                value: level.to_string(),
                expected: "WARN, INFO, DEBUG or TRACE (or ERROR, OFF)",
            })
        }
    };
    let subsys = subsys
        .map(str::trim)
        .filter(|s| !s.is_empty() && *s != "ALL");
    let Some(list) = subsys else {
        return Ok(Some(format!("distcomm={level}")));
    };
    let (negate, list) = match list.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, list),
    };
    let mut out: Vec<String> = Vec::new();
    if negate {
        out.push(format!("distcomm={level}"));
    }
    for name in list.split(',').map(|n| n.trim().to_ascii_lowercase()) {
        if name.is_empty() {
            continue;
        }
        if !SUBSYSTEMS.contains(&name.as_str()) {
            return Err(Error::Config(format!(
                "DISTCOMM_DEBUG_SUBSYS: unknown subsystem {name:?} (known: {})",
                SUBSYSTEMS.join(", ")
            )));
        }
        let to = if negate { "off" } else { level.as_str() };
        out.push(format!("distcomm::{name}={to}"));
    }
    Ok(Some(out.join(",")))
}

/// [`directives`] from the environment.
fn directives_from_env() -> Result<Option<String>> {
    let env = crate::config::Reader::env();
    let level = env.raw(crate::config::DEBUG);
    let subsys = env.raw(crate::config::DEBUG_SUBSYS);
    directives(level.as_deref(), subsys.as_deref())
}

/// Installs the stderr subscriber as the global default, with the filter of `DISTCOMM_DEBUG`,
/// or `fallback` (directives such as `"distcomm=warn"`) when it is unset; does nothing when
/// neither says anything. A program that installed its own global subscriber keeps it (then
/// this returns `Ok` and changes nothing). An unusable `DISTCOMM_DEBUG` is an
/// [`Error::Config`].
pub fn install_stderr(fallback: Option<&str>) -> Result<()> {
    let Some(filter) = directives_from_env()?.or_else(|| fallback.map(str::to_string)) else {
        return Ok(());
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .map_err(|e| Error::Config(format!("log filter {filter:?}: {e}")))?;
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .finish();
    // Fails only when the program has a subscriber already: then that one decides.
    let _ = tracing::subscriber::set_global_default(subscriber);
    Ok(())
}

/// What [`crate::init`] does first: the stderr subscriber when `DISTCOMM_DEBUG` asks for one
/// (once per process; a bad value is an error every time).
pub(crate) fn install_default() -> Result<()> {
    static ONCE: Once = Once::new();
    if std::env::var_os(crate::config::DEBUG).is_none() {
        return Ok(());
    }
    directives_from_env()?;
    let mut result = Ok(());
    ONCE.call_once(|| result = install_stderr(None));
    result
}

/// This host's name, for the init summary.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "?".into())
}

/// An event that must reach the user even when nobody listens: through tracing when a
/// subscriber takes it, else on stderr (messages before an abort, refused connections).
macro_rules! always {
    ($level:ident, target: $target:literal, $($arg:tt)+) => {
        if tracing::enabled!(target: $target, tracing::Level::$level) {
            tracing::event!(target: $target, tracing::Level::$level, $($arg)+);
        } else {
            eprintln!("distcomm: {}", format_args!($($arg)+));
        }
    };
}
pub(crate) use always;

/// What the init summary says beyond what the group knows about itself.
pub(crate) struct Ready {
    pub store: String,
    pub hosts_store: bool,
    pub secret: bool,
    pub store_auth: bool,
    /// Whether the arena is set up, and why not when it is not.
    pub arena: std::result::Result<(), &'static str>,
    pub spin: std::time::Duration,
    pub oversubscribed: bool,
}

impl Ready {
    /// The arena's state from what decided it.
    pub fn arena_state(
        set_up: bool,
        enabled: bool,
        all_shm: bool,
        world: usize,
    ) -> std::result::Result<(), &'static str> {
        match (set_up, enabled, all_shm) {
            (true, _, _) => Ok(()),
            _ if world < 2 => Err("single rank"),
            (_, false, _) => Err("off (DISTCOMM_SHM_ALLREDUCE=0)"),
            (_, _, false) => Err("off (not every link is shared memory)"),
            _ => Err("unavailable on this platform or /dev/shm"),
        }
    }

    /// The one INFO line per rank that says how this rank is set up: `links` names what carries
    /// messages to each rank (its own included, and skipped).
    pub fn log(&self, me: usize, links: &[&str], transport: &str, timeout: std::time::Duration) {
        if !tracing::enabled!(target: "distcomm::init", tracing::Level::INFO) {
            return;
        }
        let world = links.len();
        let links: Vec<String> = (0..world)
            .filter(|&p| p != me)
            .map(|p| format!("{p}:{}", links[p]))
            .collect();
        let auth = match (self.secret, self.store_auth) {
            (true, true) => "HMAC on every link and on the store",
            (true, false) => "HMAC on every link (store unauthenticated)",
            (false, _) => "none (no DISTCOMM_SECRET)",
        };
        let arena = match self.arena {
            Ok(()) => "on".to_string(),
            Err(why) => why.to_string(),
        };
        tracing::info!(
            target: "distcomm::init",
            rank = me,
            world,
            host = %host_name(),
            pid = std::process::id(),
            backend = "native",
            transport,
            links = %links.join(" "),
            arena = %arena,
            auth,
            store = %self.store,
            hosts_store = self.hosts_store,
            timeout = ?timeout,
            spin = ?self.spin,
            oversubscribed = self.oversubscribed,
            version = env!("CARGO_PKG_VERSION"),
            "rank {me} of {world} ready"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::directives;

    #[test]
    fn levels_and_subsystems() {
        assert_eq!(directives(None, Some("init")).unwrap(), None);
        assert_eq!(directives(Some(" "), None).unwrap(), None);
        assert_eq!(
            directives(Some("Trace"), Some("ALL")).unwrap().as_deref(),
            Some("distcomm=trace")
        );
        assert_eq!(
            directives(Some("WARNING"), Some("net, shm"))
                .unwrap()
                .as_deref(),
            Some("distcomm::net=warn,distcomm::shm=warn")
        );
        let e = directives(Some("INFO"), Some("init,nope")).unwrap_err();
        assert!(e.to_string().contains("\"nope\""), "{e}");
    }
}
