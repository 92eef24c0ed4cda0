//! Starting the ranks of a job on this host, torchrun-style: each rank gets torchrun's
//! variables, this process hosts the rendezvous store (as torchrun's agent does, so ranks are
//! all clients: `TORCHELASTIC_USE_AGENT_STORE=True`), every output line is prefixed with its
//! rank, and when one rank fails the others are stopped and the failure is named.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::rendezvous::TcpStoreServer;

/// What to launch.
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    /// Ranks on this node.
    pub nproc: usize,
    /// Number of nodes.
    pub nnodes: usize,
    /// This node's index; node 0 hosts the store.
    pub node_rank: usize,
    /// Address of node 0.
    pub master_addr: String,
    /// Store port on node 0 (0: any free port, single node only).
    pub master_port: u16,
    /// Program and arguments.
    pub program: OsString,
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(OsString, OsString)>,
    /// Kill everything and fail after this long.
    pub timeout: Option<Duration>,
    /// Prefix every output line with `[rankN]: ` (otherwise ranks share our stdout/stderr).
    pub prefix_output: bool,
}

impl LaunchConfig {
    /// `nproc` local ranks of `program` on one node, store on any free loopback port.
    pub fn local(nproc: usize, program: impl Into<OsString>) -> Self {
        LaunchConfig {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            timeout: None,
            prefix_output: true,
        }
    }
}

/// Describes how a process ended.
pub fn describe_exit(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    match status.signal() {
        Some(sig) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        None => "ended in an unknown way".into(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGINT => "SIGINT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        _ => "signal",
    }
}

fn pump<R: Read + Send + 'static>(
    src: R,
    prefix: String,
    to_stderr: bool,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(prefix.clone())
        .spawn(move || {
            let mut r = BufReader::new(src);
            let mut line = Vec::new();
            loop {
                line.clear();
                match r.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        if line.last() != Some(&b'\n') {
                            line.push(b'\n');
                        }
                        let text = String::from_utf8_lossy(&line);
                        // Output goes through print!/eprint! so the test harness's capture sees it.
                        if to_stderr {
                            eprint!("{prefix}{text}");
                        } else {
                            print!("{prefix}{text}");
                            let _ = std::io::stdout().flush();
                        }
                    }
                }
            }
        })
}

/// Signals a rank's whole process group (each rank leads its own), so that processes a rank
/// started die with it and release its output pipes.
fn signal(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on the process group of a child we spawned with process_group(0) and have
        // not reaped yet, so the group id cannot have been reused; no memory is involved.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

static INTERRUPTED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    INTERRUPTED.store(sig, Ordering::SeqCst);
}

/// Makes SIGINT and SIGTERM to this process stop the launched ranks (which run in their own
/// process groups, so a terminal's Ctrl-C does not reach them directly) before [`launch`]
/// returns an error. For command-line launchers; call once before [`launch`].
pub fn forward_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe; the
        // function pointer has the C ABI signal(2) expects.
        unsafe {
            libc::signal(sig, on_signal as *const () as libc::sighandler_t);
        }
    }
}

/// Launches the ranks of this node and waits for them. Succeeds when every rank exits with
/// code 0; otherwise stops the others (SIGTERM, then SIGKILL after 3 s) and returns
/// [`Error::RankFailed`] naming the first rank that failed and how.
pub fn launch(cfg: &LaunchConfig) -> Result<()> {
    if cfg.nproc == 0 || cfg.nnodes == 0 || cfg.node_rank >= cfg.nnodes {
        return Err(Error::Config(format!(
            "cannot launch {} ranks on node {} of {}",
            cfg.nproc, cfg.node_rank, cfg.nnodes
        )));
    }
    let loopback = matches!(cfg.master_addr.as_str(), "127.0.0.1" | "localhost" | "::1");
    let world = cfg.nproc * cfg.nnodes;
    // A job secret for the transport handshake: the caller's, or a fresh one on a single node
    // (several nodes must share one: set DISTCOMM_SECRET on every launcher).
    let env = crate::config::Reader::env();
    let secret = match env.raw(crate::config::SECRET) {
        Some(s) => Some(s),
        None if cfg.nnodes == 1 => {
            let mut raw = [0u8; 32];
            getrandom::getrandom(&mut raw)
                .map_err(|e| Error::Config(format!("no randomness for the job secret: {e}")))?;
            Some(raw.iter().map(|b| format!("{b:02x}")).collect())
        }
        None => {
            crate::diag::always!(
                WARN,
                target: "distcomm::launch",
                "launch: no DISTCOMM_SECRET set for a multi-node job; connections will not be \
                 authenticated"
            );
            None
        }
    };
    let store_auth = env.flag(crate::config::STORE_AUTH)?
        || cfg
            .env
            .iter()
            .any(|(k, v)| k == "DISTCOMM_STORE_AUTH" && v == "1");
    let (server, port) = if cfg.node_rank == 0 {
        let bind = format!(
            "{}:{}",
            if loopback { "127.0.0.1" } else { "0.0.0.0" },
            cfg.master_port
        );
        let s = match (&secret, store_auth) {
            (Some(secret), true) => TcpStoreServer::bind_authenticated(&bind, secret.as_bytes())?,
            (None, true) => {
                return Err(Error::Config(
                    "DISTCOMM_STORE_AUTH=1 needs a job secret: set DISTCOMM_SECRET".into(),
                ))
            }
            (_, false) => TcpStoreServer::bind(&bind)?,
        };
        let p = s.local_addr().port();
        (Some(s), p)
    } else {
        (None, cfg.master_port)
    };
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    let mut spawn_error = None;
    for local in 0..cfg.nproc {
        let rank = cfg.node_rank * cfg.nproc + local;
        let mut cmd = Command::new(&cfg.program);
        cmd.args(&cfg.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("TORCHELASTIC_USE_AGENT_STORE", "True")
            .envs(secret.iter().map(|s| ("DISTCOMM_SECRET", s)))
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .process_group(0)
            .stdin(Stdio::null());
        if cfg.prefix_output {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut child) => {
                let prefix = format!("[rank{rank}]: ");
                if let Some(out) = child.stdout.take() {
                    pumps.extend(pump(out, prefix.clone(), false).ok());
                }
                if let Some(err) = child.stderr.take() {
                    pumps.extend(pump(err, prefix, true).ok());
                }
                children.push(Some(child));
            }
            Err(e) => {
                spawn_error = Some(Error::io(
                    format!("start rank {rank} ({})", cfg.program.to_string_lossy()),
                    e,
                ));
                break;
            }
        }
    }
    let started = Instant::now();
    let mut failure: Option<Error> = spawn_error;
    let mut running = children.iter().filter(|c| c.is_some()).count();
    while running > 0 && failure.is_none() {
        for (local, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            if let Ok(Some(status)) = child.try_wait() {
                *slot = None;
                running -= 1;
                if !status.success() {
                    failure = Some(Error::RankFailed {
                        rank: cfg.node_rank * cfg.nproc + local,
                        how: describe_exit(&status),
                    });
                    break;
                }
            }
        }
        let sig = INTERRUPTED.load(Ordering::SeqCst);
        if failure.is_none() && sig != 0 {
            failure = Some(Error::Aborted {
                op: "launch",
                rank: cfg.node_rank * cfg.nproc,
                reason: format!("launcher received signal {sig}"),
            });
        }
        if let Some(t) = cfg.timeout {
            if failure.is_none() && started.elapsed() > t {
                failure = Some(Error::Timeout {
                    op: "launch",
                    rank: cfg.node_rank * cfg.nproc,
                    peer: None,
                    after: t,
                });
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if failure.is_some() {
        stop_all(&mut children);
    }
    for p in pumps {
        let _ = p.join();
    }
    drop(server);
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn stop_all(children: &mut [Option<Child>]) {
    for c in children.iter().flatten() {
        signal(c, libc::SIGTERM);
    }
    let grace = Instant::now() + Duration::from_secs(3);
    for c in children.iter_mut().flatten() {
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= grace => {
                    signal(c, libc::SIGKILL);
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
        // Whatever the rank started dies with it.
        signal(c, libc::SIGKILL);
    }
}
