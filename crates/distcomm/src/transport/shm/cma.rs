//! Cross-memory attach (`process_vm_readv`/`process_vm_writev`): copies straight between two
//! processes' memory, for large messages between shared-memory peers.
//!
//! Knows addresses and byte counts only.

use super::*;

/// Copies `dst.len()` bytes at `addr` in process `pid` into `dst` (cross-memory attach).
pub(crate) fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> io::Result<()> {
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

/// Copies `src` to `addr` in process `pid` (cross-memory attach).
pub(crate) fn cma_write(pid: i32, addr: u64, src: &[u8]) -> io::Result<()> {
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
