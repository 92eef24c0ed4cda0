//! What a benchmark run reports, shared by every suite and by the plot: the [`Record`] of one
//! result (the `--json` format), the [`Title`] of a run, the row a record prints as, the
//! statistics of timed repetitions, and writing a result file.
//!
//! Owns: the record format and the output's row layout. Must not know: which suites exist, how
//! any op is run or timed, or the command line. A leaf: it uses nothing else of the command.

use std::path::Path;

use distcomm::{DType, Error, ProcessGroup, Result};
use serde::Serialize;

/// One result line, as written by `--json`.
#[derive(Serialize, Clone)]
pub struct Record {
    pub op: &'static str,
    pub bytes: usize,
    /// Element type (`u8` for point-to-point).
    pub dtype: &'static str,
    /// Bytes per element.
    #[serde(skip)]
    pub elem: usize,
    /// Timed between ranks 0 and 1 one message at a time (pingpong, stream): its row has one
    /// bandwidth and no element count, and its chart is apart from the collectives'.
    #[serde(skip)]
    pub point_to_point: bool,
    pub world: usize,
    pub transport: &'static str,
    pub iters: usize,
    pub time_us: f64,
    /// Interquartile range of the timed repetitions (batches, loops), % of the reported time.
    pub spread_pct: f64,
    pub algbw_gbs: f64,
    pub busbw_gbs: f64,
    /// `bench staging` only.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub staging: Option<Staging>,
}

/// What `bench staging` adds to a record.
#[derive(Serialize, Clone)]
pub struct Staging {
    pub device: &'static str,
    pub copies_per_op: u64,
    pub staged_bytes_per_op: u64,
    /// The same receive into host memory.
    pub host_time_us: f64,
    /// The copies the op must make (a download for a send, an upload for a receive, both for
    /// an all_reduce), timed alone.
    pub copy_us: f64,
    /// Staged time ÷ (host time + those copies).
    pub ratio: f64,
}

/// A result with algbw = bytes / time and busbw = algbw × `factor` (nccl-tests).
pub fn record(
    g: &ProcessGroup,
    op: &'static str,
    dtype: DType,
    bytes: usize,
    iters: usize,
    secs: f64,
    factor: f64,
) -> Record {
    let algbw = if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    };
    Record {
        op,
        bytes,
        dtype: dtype.name(),
        elem: dtype.size(),
        point_to_point: false,
        world: g.size(),
        transport: g.transport(),
        iters,
        time_us: secs * 1e6,
        spread_pct: 0.0,
        algbw_gbs: algbw,
        busbw_gbs: algbw * factor,
        staging: None,
    }
}

/// What a run measured on what: the output's first line and the plot's title.
pub struct Title {
    /// The suite as named on the command line (`all`, `p2p`, ...).
    pub suite: &'static str,
    pub world: usize,
    pub transport: &'static str,
    pub backend: &'static str,
    /// The collectives' element type.
    pub dtype: &'static str,
}

impl Title {
    /// `distcomm bench SUITE: world N, transport T, backend B, collectives on DTYPE`.
    pub fn line(&self) -> String {
        format!(
            "distcomm bench {}: world {}, transport {}, backend {}, collectives on {}",
            self.suite, self.world, self.transport, self.backend, self.dtype
        )
    }
}

/// How the headers explain the spread column.
pub const SPREAD: &str = "spread = interquartile range of the timed repetitions, % of time";

/// One result line under its header; `check` is the check column (`ok` or `skip`), which
/// staged rows have not.
pub fn row(rec: &Record, check: &str) -> String {
    if let Some(st) = &rec.staging {
        return format!(
            "  {:>10} {:>8} {:>17} staged {:>10.1} us  host {:>10.1} us  copies {} ({:>9.1} us)  ratio {:.3}",
            rec.bytes, st.device, rec.op, rec.time_us, st.host_time_us, st.copies_per_op, st.copy_us, st.ratio
        );
    }
    let spread = format!("{:.0}%", rec.spread_pct);
    if rec.point_to_point {
        return format!(
            "  {:>10} {:>14} {:>7} {:>11.2} {:>10.3} {:>7} {:>6}",
            rec.bytes, rec.op, rec.iters, rec.time_us, rec.algbw_gbs, spread, check
        );
    }
    format!(
        "  {:>10} {:>10} {:>6} {:>17} {:>7} {:>11.2} {:>12.3} {:>12.3} {:>7} {:>6}",
        rec.bytes,
        rec.bytes / rec.elem.max(1),
        rec.dtype,
        rec.op,
        rec.iters,
        rec.time_us,
        rec.algbw_gbs,
        rec.busbw_gbs,
        spread,
        check
    )
}

/// The median of `samples` and their interquartile range in % of it.
pub fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |p: f64| {
        v.get(((v.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
    };
    let med = at(0.5).unwrap_or(0.0);
    let iqr = at(0.75).unwrap_or(0.0) - at(0.25).unwrap_or(0.0);
    (med, if med > 0.0 { 100.0 * iqr / med } else { 0.0 })
}

/// The median of `samples`.
pub fn median(v: Vec<f64>) -> f64 {
    median_spread(v).0
}

/// Writes `text` to `path` and says so (`# wrote WHAT to PATH`).
pub fn write_out(path: &Path, text: &str, what: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| Error::io(format!("write {}", path.display()), e))?;
    let shown = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    println!("# wrote {what} to {}", shown.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median_spread;

    #[test]
    fn median_and_spread_of_samples() {
        assert_eq!(median_spread(vec![]), (0.0, 0.0));
        let (med, spread) = median_spread(vec![4.0, 1.0, 2.0, 3.0, 5.0]);
        assert_eq!(med, 3.0);
        assert!((spread - 100.0 * 2.0 / 3.0).abs() < 1e-9);
    }
}
