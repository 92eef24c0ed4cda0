//! Cross-memory attach (`process_vm_readv`/`process_vm_writev`): copies straight between two
//! processes' memory, for large messages between shared-memory peers.
//!
//! Knows addresses and byte counts only.

use super::*;
use crate::copy::{copy_bytes, index_at_page_offset, PAGE};
use std::time::Duration;

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (cross-memory attach).
pub(crate) fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    match skewed(dst.as_ptr() as u64, addr) {
        false => read_raw(pid, addr, dst),
        true => read_bounced(pid, addr, dst),
    }
}

/// Copies `src` to `addr` in process `pid` (cross-memory attach).
pub(crate) fn cma_write(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    match skewed(addr, src.as_ptr() as u64) {
        false => write_raw(pid, addr, src),
        true => write_bounced(pid, addr, src),
    }
}

/// [`cma_read`] through this thread's bounce buffer, [`BOUNCE`] bytes at a time.
pub(super) fn read_bounced(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    with_bounce(addr, &mut |bounce| {
        for (i, piece) in dst.chunks_mut(BOUNCE).enumerate() {
            let tmp = &mut bounce[..piece.len()];
            read_raw(pid, addr.wrapping_add((i * BOUNCE) as u64), tmp)?;
            copy_bytes(piece, tmp);
        }
        Ok(())
    })
}

/// [`cma_write`] through this thread's bounce buffer, [`BOUNCE`] bytes at a time.
pub(super) fn write_bounced(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    with_bounce(addr, &mut |bounce| {
        for (i, piece) in src.chunks(BOUNCE).enumerate() {
            let tmp = &mut bounce[..piece.len()];
            copy_bytes(tmp, piece);
            write_raw(pid, addr.wrapping_add((i * BOUNCE) as u64), tmp)?;
        }
        Ok(())
    })
}

/// Whether the kernel's copy to `dst` from `src` (in whichever processes) would lie 1-31 bytes
/// past its source modulo a page, and is slow there on this machine. The kernel copies with
/// `rep movsb`, which on AMD Zen (the EPYC machines this library is measured on) runs at a
/// fraction of its speed at some of those skews, though not on every model: one measured 32 KiB
/// read across processes in 14.6 µs at skews 1-31 against 4.1-4.2 at every other skew from −64
/// to +96 bytes; another (Zen 5, kernel 6.18) reads 64 KiB in 35-45 µs at skews 1-15 and in
/// 6.2-8.7 at every skew from 16 to 40 and from −40 to −1. So each of the two ranges is timed
/// once per process ([`slow_at`]). Two buffers of the same program in two ranks are apt to be
/// skewed so (the heap lies at a random page, but its layout within pages is the same): one
/// chunk's header, 16 bytes, is the skew between a rank's input and the output allocated after
/// it, as in `distcomm bench`: world 2 gather of 64 KiB by direct step 16.5 µs against the
/// slots' 3.0 on the first machine.
fn skewed(dst: u64, src: u64) -> bool {
    match dst.wrapping_sub(src) % PAGE as u64 {
        1..=15 => slow_at(0),
        16..=31 => slow_at(1),
        _ => false,
    }
}

/// Whether the kernel's cross-memory copy is slow at the skews of `range` (0: 1-15 bytes, 1:
/// 16-31), measured once per process by [`time_skews`]; where that fails, as if it were.
fn slow_at(range: usize) -> bool {
    static SLOW: [std::sync::OnceLock<bool>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    *SLOW[range].get_or_init(|| {
        let skew = [8, 24][range];
        let slow = time_skews(skew).is_none_or(|(straight, skewed)| skewed > 2 * straight);
        tracing::debug!(target: "distcomm::shm", skew, slow, "cross-memory copies at a skew");
        slow
    })
}

/// Bytes of the reads that [`time_skews`] times.
const SKEW_PROBE: usize = 32 << 10;

/// The fastest of a few cross-memory reads of [`SKEW_PROBE`] bytes from this process into
/// itself, unskewed and `skew` bytes past the source, each: the two times, or `None` when such
/// a read failed.
pub(super) fn time_skews(skew: usize) -> Option<(Duration, Duration)> {
    let src = vec![1u8; SKEW_PROBE + PAGE];
    let mut dst = vec![0u8; SKEW_PROBE + 2 * PAGE];
    let from = index_at_page_offset(src.as_ptr() as usize, 0);
    let addr = src[from..].as_ptr() as u64;
    let pid = i32::try_from(std::process::id()).ok()?;
    let mut best = [Duration::MAX; 2];
    for _ in 0..5 {
        for (i, skew) in [0, skew].into_iter().enumerate() {
            let at = index_at_page_offset(dst.as_ptr() as usize, skew);
            let t = std::time::Instant::now();
            read_raw(pid, addr, &mut dst[at..at + SKEW_PROBE]).ok()?;
            best[i] = best[i].min(t.elapsed());
        }
    }
    Some((best[0], best[1]))
}

/// Bytes a skewed copy moves per system call, through a bounce buffer that lies at the same
/// offset within its page as the other process's range (so the kernel's copy is not skewed),
/// and a vector copy between it and the caller's buffer (not slowed by the skew, and from a
/// buffer still in the cache).
const BOUNCE: usize = 64 << 10;

thread_local! {
    static BOUNCE_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on [`BOUNCE`] bytes of this thread's bounce buffer lying at `remote`'s offset
/// within a page (a buffer of its own where the thread's is gone: a copy from a thread-local's
/// destructor).
fn with_bounce(remote: u64, f: &mut dyn FnMut(&mut [u8]) -> io::Result<()>) -> io::Result<()> {
    let mut on = |buf: &mut Vec<u8>| {
        buf.resize(BOUNCE + PAGE, 0);
        let at = index_at_page_offset(buf.as_ptr() as usize, remote as usize);
        f(&mut buf[at..at + BOUNCE])
    };
    match BOUNCE_BUF.try_with(|cell| on(&mut cell.borrow_mut())) {
        Ok(done) => done,
        Err(_) => on(&mut Vec::new()),
    }
}

pub(super) fn read_raw(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
    let len = dst.len();
    let base = dst.as_mut_ptr();
    cma_all(len, "read", |done| {
        let (local, remote) = iovecs(base.wrapping_add(done), len - done, addr, done);
        // SAFETY: `local` describes the writable remainder of `dst`, which we borrow exclusively
        // for this call; `remote` is only interpreted by the kernel in the other process's
        // address space, where a bad address is an EFAULT, never an access to our memory.
        unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) }
    })
}

pub(super) fn write_raw(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
    let len = src.len();
    let base = src.as_ptr().cast_mut();
    cma_all(len, "write", |done| {
        let (local, remote) = iovecs(base.wrapping_add(done), len - done, addr, done);
        // SAFETY: `local` describes the remainder of `src`, which the kernel only reads;
        // `remote` is interpreted in the other process, where a bad address is an EFAULT.
        unsafe { libc::process_vm_writev(pid, &local, 1, &remote, 1, 0) }
    })
}

/// The local and remote iovecs of the part of a cross-memory copy still to do.
pub(super) fn iovecs(
    local: *mut u8,
    left: usize,
    addr: u64,
    done: usize,
) -> (libc::iovec, libc::iovec) {
    (
        libc::iovec {
            iov_base: local.cast(),
            iov_len: left,
        },
        libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: left,
        },
    )
}

/// Repeats a partial cross-memory copy (`step(done)` returns what the system call returned)
/// until `len` bytes moved, retrying interrupted calls.
pub(super) fn cma_all(
    len: usize,
    what: &str,
    mut step: impl FnMut(usize) -> isize,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let n = step(done);
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("cross-memory {what} made no progress"),
            ));
        }
        done += n as usize;
    }
    Ok(())
}
