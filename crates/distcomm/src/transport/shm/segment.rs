//! Segment lifecycle: the files under `/dev/shm` that hold rings and regions, created,
//! mapped, opened by the peer, unlinked, and swept when their owner died.
//!
//! Knows files and mappings; nothing of what travels in them.

use super::*;

/// Identifies the shared-memory domain of this process: the running kernel (boot id) and the
/// `/dev/shm` file system. Two processes with equal identities can map each other's segments.
pub(super) fn host_identity() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let meta = std::fs::metadata(SHM_DIR).ok()?;
    Some(format!("{}:{}:{}", boot.trim(), meta.dev(), meta.ino()))
}

pub(super) fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing; it only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Unlinks segments left by processes that died during initialisation.
pub(super) fn sweep_stale() {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else {
            continue;
        };
        let pid = rest.split('-').next().and_then(|p| p.parse::<i32>().ok());
        if pid.is_some_and(|p| p > 0 && !pid_alive(p)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

pub(super) fn segment_len(cap: usize) -> usize {
    OFF_DATA + cap
}

/// Creates segment `name` of `len` bytes (only for us: mode 0600) and maps it.
pub(super) fn map_new(name: &str, len: usize) -> io::Result<MmapRaw> {
    let path = format!("{SHM_DIR}/{name}");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    // Reserve the pages now: on a full /dev/shm (containers often have 64 MiB) a sparse file
    // maps fine and then kills the process with SIGBUS on first touch; this way it is an error
    // here, and `auto` falls back to TCP.
    let made = file
        .set_len(len as u64)
        .and_then(|()| reserve(&file, len))
        .and_then(|()| MmapRaw::map_raw(&file));
    if made.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    made
}

/// Allocates the backing pages of `file` (`posix_fallocate`).
pub(super) fn reserve(file: &File, len: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "segment too large"))?;
    // SAFETY: posix_fallocate on a descriptor we own, with an in-range offset and length; it
    // touches no memory of ours.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Maps the existing segment `name` (and with `unlink`, removes its name); returns the mapping
/// and its length.
pub(super) fn map_existing(name: &str, unlink: bool) -> io::Result<(MmapRaw, usize)> {
    if !name.starts_with(PREFIX) || name.contains('/') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a distcomm segment"),
        ));
    }
    let path = format!("{SHM_DIR}/{name}");
    let file: File = OpenOptions::new().read(true).write(true).open(&path)?;
    if unlink {
        let _ = std::fs::remove_file(&path);
    }
    let len = file.metadata()?.len() as usize;
    Ok((MmapRaw::map_raw(&file)?, len))
}

/// Creates and maps our outbound ring for `peer`.
pub(super) fn create(name: &str, cap: usize) -> io::Result<Ring> {
    let ring = Ring {
        map: map_new(name, segment_len(cap))?,
        cap: cap as u64,
    };
    ring.atomic64(OFF_CAP).store(cap as u64, Ordering::Relaxed);
    ring.atomic64(OFF_MAGIC).store(MAGIC, Ordering::Release);
    Ok(ring)
}

/// Maps the peer's ring `name`, checks its header, and unlinks the name.
pub(super) fn open(name: &str) -> io::Result<Ring> {
    let (map, len) = map_existing(name, true)?;
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    if len < OFF_DATA {
        return Err(bad(format!("segment {name} is only {len} bytes")));
    }
    let ring = Ring { map, cap: 0 };
    let magic = ring.atomic64(OFF_MAGIC).load(Ordering::Acquire);
    let cap = ring.atomic64(OFF_CAP).load(Ordering::Relaxed);
    if magic != MAGIC || cap == 0 || segment_len(cap as usize) != len {
        return Err(bad(format!(
            "segment {name} has a foreign header (magic {magic:#x}, capacity {cap}, {len} bytes)"
        )));
    }
    Ok(Ring { cap, ..ring })
}

/// A shared memory region every rank of a group maps (the arena of intra-node collectives):
/// atomic words for synchronisation and byte ranges for data. What may be accessed when is
/// the user's protocol; this type only keeps every access inside the mapping.
pub(crate) struct Region {
    map: MmapRaw,
    len: usize,
}

impl Region {
    /// Creates segment `name` of `len` bytes for the group (named per job: see the module).
    pub fn create(len: usize) -> io::Result<(Region, String)> {
        let mut nonce = [0u8; 4];
        getrandom::getrandom(&mut nonce).map_err(|e| io::Error::other(e.to_string()))?;
        let name = format!(
            "{PREFIX}{}-{:08x}-arena",
            std::process::id(),
            u32::from_le_bytes(nonce)
        );
        Ok((
            Region {
                map: map_new(&name, len)?,
                len,
            },
            name,
        ))
    }

    /// Maps the group's segment `name`; it must be `len` bytes. Its creator unlinks it once
    /// every rank has mapped it.
    pub fn open(name: &str, len: usize) -> io::Result<Region> {
        let (map, got) = map_existing(name, false)?;
        if got != len {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment {name} is {got} bytes, expected {len}"),
            ));
        }
        Ok(Region { map, len })
    }

    /// Removes the name of segment `name` (every rank has mapped it).
    pub fn unlink(name: &str) {
        if name.starts_with(PREFIX) && !name.contains('/') {
            let _ = std::fs::remove_file(format!("{SHM_DIR}/{name}"));
        }
    }

    /// The 8-byte word at `off` (rounded down to a multiple of 8, clamped into the region).
    pub fn word(&self, off: usize) -> &AtomicU64 {
        let off = (off & !7).min(self.len.saturating_sub(8));
        // SAFETY: `off` is 8-aligned (the mapping is page aligned) and `off + 8 <= len`; the
        // mapping lives as long as `self`; every process accesses these words atomically only.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    /// Asks the CPU to take the cache line at `off` for writing ahead of time (`prefetchw`,
    /// on CPUs that have it): another core's copy is invalidated now, in the background,
    /// instead of when this core stores to the line and has to wait for it. A hint: it reads
    /// and writes nothing, so any offset is fine; a no-op where the CPU has no such
    /// instruction.
    pub fn prefetch_write(&self, off: usize) {
        #[cfg(target_arch = "x86_64")]
        if has_prefetchw() {
            let p = self
                .map
                .as_ptr()
                .wrapping_add(off.min(self.len.saturating_sub(1)));
            // SAFETY: the CPU has PREFETCHW (checked above); a prefetch neither faults nor
            // reads or writes memory as far as the program can tell, and touches no register
            // but the one holding its address.
            unsafe {
                std::arch::asm!(
                    "prefetchw [{0}]",
                    in(reg) p,
                    options(nostack, preserves_flags, readonly)
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = off;
    }

    /// Bytes `off..off + n` as a slice of `T` (clamped into the region).
    ///
    /// # Safety
    /// No process may write the range while the slice lives (the caller's protocol ensures it),
    /// and `off` must be aligned for `T`.
    pub unsafe fn view<T: bytemuck::Pod>(&self, off: usize, n: usize) -> &[T] {
        let off = off.min(self.len);
        let n = n.min((self.len - off) / std::mem::size_of::<T>().max(1));
        std::slice::from_raw_parts(self.map.as_mut_ptr().add(off).cast::<T>(), n)
    }

    /// Bytes `off..off + n` as a mutable slice of `T` (clamped into the region).
    ///
    /// # Safety
    /// No other access to the range, from any process, while the slice lives (the caller's
    /// protocol ensures it), and `off` must be aligned for `T`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn view_mut<T: bytemuck::Pod>(&self, off: usize, n: usize) -> &mut [T] {
        let off = off.min(self.len);
        let n = n.min((self.len - off) / std::mem::size_of::<T>().max(1));
        std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off).cast::<T>(), n)
    }
}

/// Whether the CPU has PREFETCHW (CPUID 8000_0001h, ECX bit 8; stable Rust cannot ask
/// `is_x86_feature_detected!` for it yet), looked up once.
#[cfg(target_arch = "x86_64")]
fn has_prefetchw() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        use std::arch::x86_64::__cpuid;
        // Every x86-64 CPU has CPUID and the extended leaves up to 8000_0001h.
        let max = __cpuid(0x8000_0000).eax;
        max >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
    })
}
