//! Device memory behind the few operations staging needs: allocate, copy host → device and
//! device → host, synchronise. A device says whether transports can address its memory
//! directly (host memory: yes); operations on memory they cannot address are staged through
//! host memory by [`crate::staging`].
//!
//! Implemented here: [`Host`] (no staging) and [`Emulated`], host memory that transports are
//! told not to address, so that staging can be exercised and measured on any machine — the
//! stand-in for a GPU in the tests. GPU devices (wgpu, CUDA) are to come behind the same trait.

use crate::error::{Error, Result};

/// Memory a buffer can live in.
pub trait Device: Send + Sync + 'static {
    /// A buffer in this device's memory.
    type Buffer: Send + 'static;

    /// For messages and statistics.
    fn name(&self) -> &'static str;
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
    /// The buffer as host memory the transports can use directly, when it is that (then
    /// nothing is staged); the buffer back otherwise.
    fn host_memory(&self, buf: Self::Buffer) -> std::result::Result<Vec<u8>, Self::Buffer> {
        Err(buf)
    }
    /// Host memory back as a buffer of this device (the inverse of [`host_memory`](Self::host_memory)).
    fn buffer_of_host(&self, _host: Vec<u8>) -> Option<Self::Buffer> {
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
    let n = src.len();
    if n > dst.len() {
        return Err(Error::InvalidArgument {
            op: "upload",
            rank: 0,
            detail: format!("{} bytes do not fit a buffer of {}", src.len(), dst.len()),
        });
    }
    dst[..n].copy_from_slice(&src[..n]);
    Ok(())
}
