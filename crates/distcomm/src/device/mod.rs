//! Device memory behind the few operations staging needs: allocate, copy host → device and
//! device → host, synchronise. A device says whether transports can address its memory
//! directly (host memory: yes); operations on memory they cannot address are staged through
//! host memory by [`crate::staging`].
//!
//! **Capabilities, not special cases.** A device says which [`Memory`] its buffers live in;
//! each transport and backend declares which memory it can address
//! ([`ProcessGroup::addresses`](crate::ProcessGroup::addresses), like NCCL's `ptrSupport` or
//! gloo's `hasGPUDirect`). Staging asks that question and nothing else: buffers the group
//! addresses go straight through, all others are staged.
//!
//! Devices:
//! * [`Host`]: host memory, addressed by every transport — nothing is staged;
//! * [`Emulated`]: host memory that transports are told not to address, so that staging can
//!   be exercised and measured on any machine, with per-buffer upload counters for tests;
//! * `Wgpu` (feature `wgpu`): GPU buffers through wgpu — Vulkan (Mesa's lavapipe on a machine
//!   without a GPU), Metal on Apple GPUs, DX12 on Windows;
//! * `Cuda` (feature `cuda`): CUDA device memory through cudarc, loaded at run time: a machine
//!   without the CUDA driver gets a typed [`Error::DeviceUnavailable`], never a panic.

use crate::error::{Error, Result};

#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "wgpu")]
mod wgpu;
#[cfg(feature = "cuda")]
pub use cuda::{Cuda, CudaBuffer};
#[cfg(feature = "wgpu")]
pub use wgpu::{Wgpu, WgpuBuffer};

/// Where a buffer's bytes live: what a transport may or may not be able to address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Memory {
    /// Ordinary host memory (pageable, in this process's address space).
    Host,
    /// Host memory that transports are told they cannot address ([`Emulated`]).
    Emulated,
    /// A wgpu buffer (GPU memory behind Vulkan, Metal or DX12).
    Wgpu,
    /// CUDA device memory.
    Cuda,
}

/// Memory a buffer can live in.
pub trait Device: Send + Sync + 'static {
    /// A buffer in this device's memory.
    type Buffer: Send + 'static;

    /// For messages and statistics.
    fn name(&self) -> &'static str;
    /// The memory this device's buffers live in.
    fn memory(&self) -> Memory;
    /// A buffer of `bytes` bytes (contents unspecified).
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;
    /// The buffer's size in bytes.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Copies `src` (host) into the start of `dst`.
    fn upload(&self, src: &[u8], dst: &mut Self::Buffer) -> Result<()>;
    /// Copies the start of `src` into `dst` (host).
    fn download(&self, src: &Self::Buffer, dst: &mut [u8]) -> Result<()>;
    /// Waits for the device's queued work.
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    /// The buffer as host memory, moved, when it is that (a transport that addresses this
    /// device's [`Memory`] then works on it directly); the buffer back otherwise.
    fn host_memory(&self, buf: Self::Buffer) -> std::result::Result<Vec<u8>, Self::Buffer> {
        Err(buf)
    }
    /// Host memory back as a buffer of this device (the inverse of [`host_memory`](Self::host_memory)).
    fn buffer_of_host(&self, _host: Vec<u8>) -> Option<Self::Buffer> {
        None
    }
    /// The buffer's bytes in place, when they are host memory (for collectives that work on the
    /// buffer directly).
    fn host_bytes<'a>(&self, _buf: &'a Self::Buffer) -> Option<&'a [u8]> {
        None
    }
    /// [`host_bytes`](Self::host_bytes), mutably.
    fn host_bytes_mut<'a>(&self, _buf: &'a mut Self::Buffer) -> Option<&'a mut [u8]> {
        None
    }
}

/// Host memory: the transports address it directly; nothing is copied.
#[derive(Debug, Clone, Copy, Default)]
pub struct Host;

impl Device for Host {
    type Buffer = Vec<u8>;

    fn name(&self) -> &'static str {
        "host"
    }
    fn memory(&self) -> Memory {
        Memory::Host
    }
    fn alloc(&self, bytes: usize) -> Result<Vec<u8>> {
        Ok(vec![0; bytes])
    }
    fn len(&self, buf: &Vec<u8>) -> usize {
        buf.len()
    }
    fn upload(&self, src: &[u8], dst: &mut Vec<u8>) -> Result<()> {
        copy(src, dst.as_mut_slice())
    }
    fn download(&self, src: &Vec<u8>, dst: &mut [u8]) -> Result<()> {
        copy(&src[..dst.len().min(src.len())], dst)
    }
    fn host_memory(&self, buf: Vec<u8>) -> std::result::Result<Vec<u8>, Vec<u8>> {
        Ok(buf)
    }
    fn buffer_of_host(&self, host: Vec<u8>) -> Option<Vec<u8>> {
        Some(host)
    }
    fn host_bytes<'a>(&self, buf: &'a Vec<u8>) -> Option<&'a [u8]> {
        Some(buf)
    }
    fn host_bytes_mut<'a>(&self, buf: &'a mut Vec<u8>) -> Option<&'a mut [u8]> {
        Some(buf)
    }
}

/// Host memory the transports are told they cannot address, so every operation on it is
/// staged. Each buffer counts the uploads into it, so tests can prove that a send's source is
/// never written and a failed receive publishes nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Emulated;

/// A buffer of [`Emulated`] memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EmulatedBuffer {
    bytes: Vec<u8>,
    uploads: u32,
}

impl EmulatedBuffer {
    /// A buffer holding `bytes` (no upload counted).
    pub fn from_bytes(bytes: Vec<u8>) -> EmulatedBuffer {
        EmulatedBuffer { bytes, uploads: 0 }
    }
    /// What the buffer holds (reading device memory directly: for tests).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// How many times something was uploaded into it.
    pub fn uploads(&self) -> u32 {
        self.uploads
    }
}

impl Device for Emulated {
    type Buffer = EmulatedBuffer;

    fn name(&self) -> &'static str {
        "emulated"
    }
    fn memory(&self) -> Memory {
        Memory::Emulated
    }
    fn alloc(&self, bytes: usize) -> Result<EmulatedBuffer> {
        Ok(EmulatedBuffer::from_bytes(vec![0; bytes]))
    }
    fn len(&self, buf: &EmulatedBuffer) -> usize {
        buf.bytes.len()
    }
    fn upload(&self, src: &[u8], dst: &mut EmulatedBuffer) -> Result<()> {
        copy(src, &mut dst.bytes)?;
        dst.uploads += 1;
        Ok(())
    }
    fn download(&self, src: &EmulatedBuffer, dst: &mut [u8]) -> Result<()> {
        copy(&src.bytes[..dst.len().min(src.bytes.len())], dst)
    }
}

/// Copies all of `src` into the start of `dst`.
fn copy(src: &[u8], dst: &mut [u8]) -> Result<()> {
    fits(src.len(), dst.len())?;
    dst[..src.len()].copy_from_slice(src);
    Ok(())
}

/// An upload of `n` bytes into a buffer of `cap`, or why not.
fn fits(n: usize, cap: usize) -> Result<()> {
    if n > cap {
        return Err(Error::InvalidArgument {
            op: "upload",
            rank: 0,
            detail: format!("{n} bytes do not fit a buffer of {cap}"),
        });
    }
    Ok(())
}

/// A device-layer failure as the error staging reports.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn unavailable(device: &'static str, detail: impl std::fmt::Display) -> Error {
    Error::DeviceUnavailable {
        device,
        detail: detail.to_string(),
    }
}

/// A failed device operation (allocation, copy, synchronisation).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn failed(device: &'static str, what: &str, detail: impl std::fmt::Display) -> Error {
    Error::Device {
        device,
        detail: format!("{what}: {detail}"),
    }
}
