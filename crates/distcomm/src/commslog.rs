//! The comms log: opt-in statistics of every collective a group runs — count, bytes, latency
//! percentiles, algbw and busbw per (op, size) — as data ([`ProcessGroup::comms_log`](crate::ProcessGroup::comms_log)) and as a
//! summary table like DeepSpeed's `log_summary` ([`ProcessGroup::comms_log_summary`](crate::ProcessGroup::comms_log_summary)).
//!
//! Turn it on with `DISTCOMM_COMMS_LOG=1` or [`ProcessGroup::set_comms_log`](crate::ProcessGroup::set_comms_log). Recording happens
//! where the collective ends, in whichever thread ran it (the caller for blocking calls, the
//! group's collective thread for async ones): it never waits on an async operation, so logging
//! does not make async collectives synchronous. The latency of an async collective is its
//! execution time on the collective thread, not including time queued behind earlier ones.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::call::CallKind;

/// Statistics of one (op, size).
#[derive(Debug, Clone, PartialEq)]
pub struct CommsStat {
    /// The API's name (`all_reduce`, ...).
    pub op: &'static str,
    /// Size per call, nccl-tests convention.
    pub bytes: usize,
    pub count: usize,
    pub total_bytes: u64,
    /// Bytes this rank actually handed to the transport over all `count` calls (for
    /// shared-memory all_reduce: what it put into the shared arena). Compare ops by this: a
    /// ring all_reduce of `b` bytes sends about 2·b·(n−1)/n, a 1-bit one about b/16·(n−1)/n.
    pub sent_bytes: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Bytes / median time, GB/s.
    pub algbw_gbs: f64,
    /// algbw × the op's bus factor (nccl-tests), GB/s.
    pub busbw_gbs: f64,
}

/// (op, bytes) -> (group size, latencies in µs, bytes sent).
type Samples = BTreeMap<(&'static str, usize), (usize, Vec<f64>, u64)>;

#[derive(Default)]
pub(crate) struct CommsLog {
    on: AtomicBool,
    samples: Mutex<Samples>,
}

/// The nccl-tests bus-bandwidth factor of collective `op` on `n` ranks: busbw = algbw × factor.
/// Ops that are no [`CallKind`] (the 1-bit all_reduce) count like all-gathers.
pub fn bus_factor(op: &str, n: usize) -> f64 {
    CallKind::from_name(op)
        .unwrap_or(CallKind::AllGather)
        .bus_factor(n)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

impl CommsLog {
    /// A log, recording from the start when `on` (`DISTCOMM_COMMS_LOG`).
    pub(crate) fn new(on: bool) -> CommsLog {
        let log = CommsLog::default();
        log.on.store(on, Ordering::Relaxed);
        log
    }

    /// Whether recording is on.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    pub(crate) fn record(
        &self,
        op: &'static str,
        bytes: usize,
        n: usize,
        took: Duration,
        sent: u64,
    ) {
        if !self.on.load(Ordering::Relaxed) {
            return;
        }
        let mut s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let e = s.entry((op, bytes)).or_insert((n, Vec::new(), 0));
        e.1.push(took.as_secs_f64() * 1e6);
        e.2 += sent;
    }

    pub(crate) fn stats(&self) -> Vec<CommsStat> {
        let s = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        s.iter()
            .map(|(&(op, bytes), (n, lat, sent))| {
                let mut v = lat.clone();
                v.sort_by(|a, b| a.total_cmp(b));
                let p50 = percentile(&v, 0.5);
                let algbw = if p50 > 0.0 {
                    bytes as f64 / p50 / 1e3
                } else {
                    0.0
                };
                CommsStat {
                    op,
                    bytes,
                    count: v.len(),
                    total_bytes: bytes as u64 * v.len() as u64,
                    sent_bytes: *sent,
                    p50_us: p50,
                    p90_us: percentile(&v, 0.9),
                    p99_us: percentile(&v, 0.99),
                    max_us: v.last().copied().unwrap_or(0.0),
                    algbw_gbs: algbw,
                    busbw_gbs: algbw * bus_factor(op, *n),
                }
            })
            .collect()
    }
}

impl CommsLog {
    /// Turns recording on or off.
    pub(crate) fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The statistics as a table, one line per (op, size).
    pub(crate) fn summary(&self) -> String {
        let mut out = format!(
            "{:<17} {:>12} {:>7} {:>14} {:>14} {:>10} {:>10} {:>10} {:>11} {:>11}\n",
            "op",
            "size(B)",
            "count",
            "total(B)",
            "sent(B)",
            "p50(us)",
            "p90(us)",
            "p99(us)",
            "algbw(GB/s)",
            "busbw(GB/s)"
        );
        for s in self.stats() {
            out += &format!(
                "{:<17} {:>12} {:>7} {:>14} {:>14} {:>10.1} {:>10.1} {:>10.1} {:>11.3} {:>11.3}\n",
                s.op,
                s.bytes,
                s.count,
                s.total_bytes,
                s.sent_bytes,
                s.p50_us,
                s.p90_us,
                s.p99_us,
                s.algbw_gbs,
                s.busbw_gbs
            );
        }
        out
    }
}

thread_local! {
    /// Bytes this thread's collectives handed to the transport (or put into a shared arena).
    static SENT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bytes sent so far by collectives run on this thread: a collective runs wholly on one thread,
/// so the difference across a call is what that call sent (backends count what they send with
/// [`count_sent`]).
pub(crate) fn sent_bytes() -> u64 {
    SENT.with(|s| s.get())
}

/// Counts `n` bytes a collective of this thread sent.
pub(crate) fn count_sent(n: usize) {
    SENT.with(|s| s.set(s.get() + n as u64));
}
