//! `distcomm bench p2p`: ping-pong (half a round trip, blocking calls for small messages and
//! owned buffers above, or handles at every size with `--handles`) and streaming (a window of
//! isends against as many irecvs) between ranks 0 and 1, each verified on known payloads
//! before and after the timed messages.
//!
//! Owns: the point-to-point benchmarks, their payload check and their header. Must not know:
//! the other suites, the command line, or how results are written.

use std::time::Instant;

use distcomm::{DType, Error, ProcessGroup, Result};

use super::record::{median_spread, record, Record, SPREAD};
use super::warm::warm_up;

/// The header of the point-to-point rows: what is timed and how (`window`: the stream's depth;
/// `handles`: the ping-pong uses `isend`/`irecv` handles at every size).
pub fn header(window: usize, handles: bool) -> Vec<String> {
    let calls = if handles {
        "isend/irecv handles at every size"
    } else {
        "blocking send/recv up to 1 KiB, isend/irecv handles above"
    };
    vec![
        "#".into(),
        format!(
            "# pingpong: ranks 0 and 1 send a message back and forth ({calls}); time = half a \
             round trip, median of ~40 timed batches"
        ),
        format!(
            "# stream: rank 0 posts {window} isends of size bytes, rank 1 as many irecvs; \
             time = per message, median over windows"
        ),
        format!("# bw = size / time; iters = messages timed; {SPREAD}"),
        format!(
            "# {:>10} {:>14} {:>7} {:>11} {:>10} {:>7} {:>6}",
            "size", "op", "iters", "time(us)", "bw(GB/s)", "spread", "check"
        ),
    ]
}

/// Ping-pong (with handles at every size when `handles`), then streaming with `window` messages
/// in flight, at `size` bytes (`check`: verify the payloads). Returns the records on rank 0.
pub fn run_size(
    g: &ProcessGroup,
    size: usize,
    (window, handles): (usize, bool),
    check: bool,
) -> Result<Vec<Record>> {
    let mut v = Vec::new();
    v.extend(pingpong(g, size, !handles && size <= BLOCKING_MAX, check)?);
    g.barrier()?;
    v.extend(stream(g, size, window, check)?);
    Ok(v)
}

fn iters_for(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(10, 2000)
}

/// Fills `buf` with the payload of `seed`.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
}

/// Checks that `buf` holds the payload of `seed`; the error names `what` and the first wrong byte.
fn verify(buf: &[u8], seed: u64, what: &str) -> Result<()> {
    let mut want = vec![0u8; buf.len()];
    fill(&mut want, seed);
    if let Some(i) = buf.iter().zip(&want).position(|(a, b)| a != b) {
        return Err(Error::Config(format!(
            "{what}: payload corrupted at byte {i} of {}",
            buf.len()
        )));
    }
    Ok(())
}

/// One round trip 0 -> 1 -> 0: with the blocking calls on slices (`blocking`: what
/// `MPI_Send`/`MPI_Recv` are), else with handles on owned buffers (no copies in distcomm).
fn round_trip(
    g: &ProcessGroup,
    (buf, mut rbuf): (Vec<u8>, Vec<u8>),
    blocking: bool,
) -> Result<(Vec<u8>, Vec<u8>)> {
    if blocking {
        if g.rank() == 0 {
            g.send(&buf, 1, 0)?;
            g.recv(&mut rbuf, 1, 1)?;
        } else {
            g.recv(&mut rbuf, 0, 0)?;
            g.send(&rbuf, 0, 1)?;
        }
        return Ok((buf, rbuf));
    }
    if g.rank() == 0 {
        let r = g.irecv(rbuf, 1, 1)?;
        let s = g.isend(buf, 1, 0)?;
        let buf = s.into_buffer()?;
        let rbuf = r.into_buffer()?;
        Ok((buf, rbuf))
    } else {
        let got = g.irecv(rbuf, 0, 0)?.into_buffer()?;
        let got = g.isend(got, 0, 1)?.into_buffer()?;
        Ok((buf, got))
    }
}

/// Largest ping-pong message timed with the blocking calls: those that fit a shared-memory
/// lane, where the blocking calls take their fast path (over shared memory, 8 B: 0.24 µs
/// against 0.45 µs with handles on owned buffers; 1 KiB: 0.70 against 0.94). Above it owned
/// buffers save the copies in and out of the slices.
const BLOCKING_MAX: usize = distcomm::transport::LANE_MAX;

/// The tag of rank 0's word to go on warming up.
const WARM_TAG: u32 = 2;

/// Ping-pong at `size` bytes, with the blocking calls or with handles (`blocking`).
fn pingpong(g: &ProcessGroup, size: usize, blocking: bool, check: bool) -> Result<Option<Record>> {
    if g.rank() > 1 {
        return Ok(None);
    }
    let mut buf = vec![0u8; size];
    let mut rbuf = vec![0u8; size];
    let iters = iters_for(size);
    // Verified, untimed round trips before and after the timed ones.
    let checked = |buf: Vec<u8>, rbuf: Vec<u8>, seed: u64| -> Result<(Vec<u8>, Vec<u8>)> {
        let mut buf = buf;
        if check && g.rank() == 0 {
            fill(&mut buf, seed);
        }
        let (buf, rbuf) = round_trip(g, (buf, rbuf), blocking)?;
        if check {
            verify(&rbuf, seed, "pingpong")?;
        }
        Ok((buf, rbuf))
    };
    (buf, rbuf) = checked(buf, rbuf, size as u64)?;
    // Rank 0 tells rank 1 after every batch whether to go on (a tag the round trips do not use).
    let batch = (iters / 20).max(1);
    let mut bufs = (buf, rbuf);
    warm_up(
        g.rank() == 0,
        || {
            for _ in 0..batch {
                let (b, r) = std::mem::take(&mut bufs);
                bufs = round_trip(g, (b, r), blocking)?;
            }
            Ok(())
        },
        |more| {
            let mut word = [u8::from(more)];
            if g.rank() == 0 {
                g.send(&word, 1, WARM_TAG)?;
            } else {
                g.recv(&mut word, 0, WARM_TAG)?;
            }
            Ok(word[0] == 1)
        },
    )?;
    let (mut buf, mut rbuf) = bufs;
    // Timed in batches (median over batches): reading the clock around every round trip
    // would add its own cost (~40 ns) to the smallest ones.
    let batch = (iters / 40).max(1);
    let mut samples = Vec::with_capacity(iters / batch);
    for _ in 0..iters / batch {
        let t = Instant::now();
        for _ in 0..batch {
            (buf, rbuf) = round_trip(g, (buf, rbuf), blocking)?;
        }
        samples.push(t.elapsed().as_secs_f64() / (2 * batch) as f64);
    }
    checked(buf, rbuf, size as u64 + 1)?;
    let timed = samples.len() * batch;
    Ok((g.rank() == 0).then(|| timed_record(g, "pingpong", (size, timed), samples)))
}

fn stream(g: &ProcessGroup, size: usize, window: usize, check: bool) -> Result<Option<Record>> {
    if g.rank() > 1 {
        return Ok(None);
    }
    let iters = ((256usize << 20) / (size.max(1) * window)).clamp(5, 200);
    let mut bufs: Vec<Vec<u8>> = (0..window).map(|_| vec![0u8; size]).collect();
    let mut samples = Vec::with_capacity(iters);
    for it in 0..iters + 1 {
        let verify_round = it == 0 && check;
        let t = Instant::now();
        if g.rank() == 0 {
            if verify_round {
                for (k, b) in bufs.iter_mut().enumerate() {
                    fill(b, (size * 31 + k) as u64);
                }
            }
            let works: Vec<_> = bufs
                .drain(..)
                .enumerate()
                .map(|(k, b)| g.isend(b, 1, 10 + k as u32))
                .collect::<Result<_>>()?;
            for w in works {
                bufs.push(w.into_buffer()?);
            }
            let mut ack = [0u8; 1];
            g.recv(&mut ack, 1, 9)?;
        } else {
            let works: Vec<_> = bufs
                .drain(..)
                .enumerate()
                .map(|(k, b)| g.irecv(b, 0, 10 + k as u32))
                .collect::<Result<_>>()?;
            for (k, w) in works.into_iter().enumerate() {
                let b = w.into_buffer()?;
                if verify_round {
                    verify(&b, (size * 31 + k) as u64, "stream")?;
                }
                bufs.push(b);
            }
            g.send(&[1u8], 0, 9)?;
        }
        if it > 0 {
            samples.push(t.elapsed().as_secs_f64() / window as f64);
        }
    }
    Ok((g.rank() == 0).then(|| timed_record(g, "stream", (size, iters * window), samples)))
}

/// A point-to-point record of `samples` (seconds per message) over `iters` messages.
fn timed_record(
    g: &ProcessGroup,
    op: &'static str,
    (size, iters): (usize, usize),
    samples: Vec<f64>,
) -> Record {
    let (secs, spread) = median_spread(samples);
    let mut rec = record(g, op, DType::U8, size, iters, secs, 1.0);
    rec.spread_pct = spread;
    rec.point_to_point = true;
    rec
}

#[cfg(test)]
mod tests {
    use super::{fill, verify};

    #[test]
    fn payloads_verify_and_corruption_is_located() {
        let mut buf = vec![0u8; 64];
        fill(&mut buf, 7);
        assert!(verify(&buf, 7, "x").is_ok());
        buf[9] ^= 1;
        let err = verify(&buf, 7, "x").unwrap_err().to_string();
        assert!(err.contains("byte 9 of 64"), "{err}");
    }
}
