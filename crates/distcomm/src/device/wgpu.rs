//! GPU buffers through [wgpu](https://wgpu.rs): Vulkan (Mesa's lavapipe where there is no GPU),
//! Metal on Apple GPUs, DX12 on Windows. No transport addresses this memory, so every operation
//! on it is staged.
//!
//! wgpu copies in whole 4-byte words; a buffer's length need not be one: allocations are padded,
//! and an upload whose length is not a multiple of four rewrites its last word around the bytes
//! it does not cover, so bytes past an upload always keep their contents.
//!
//! Every wgpu call runs inside error scopes, so a validation or out-of-memory error is a typed
//! [`Error::Device`](crate::Error::Device) rather than wgpu's default panic.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use wgpu::{BufferUsages, ErrorFilter, MapMode};

use super::{failed, fits, unavailable, Device, Memory};
use crate::error::Result;

const NAME: &str = "wgpu";
/// How long one copy may take before it is reported as failed (a GPU that stops answering must
/// not hang the caller).
const COPY_DEADLINE: Duration = Duration::from_secs(60);

/// A wgpu device and its queue.
///
/// ```no_run
/// # fn main() -> distcomm::Result<()> {
/// use std::sync::Arc;
/// use distcomm::device::{Device, Wgpu};
/// let g = distcomm::init()?;
/// let gpu = Arc::new(Wgpu::new()?);
/// let mut grads = gpu.alloc(4 << 20)?;
/// gpu.upload(bytemuck::cast_slice(&vec![1.0f32; 1 << 20]), &mut grads)?;
/// g.all_reduce_device::<_, f32>(gpu.as_ref(), &mut grads, distcomm::ReduceOp::Sum)?;
/// # Ok(()) }
/// ```
pub struct Wgpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    adapter: String,
    max_buffer: u64,
    /// A mappable buffer for downloads, kept and grown (mapping fresh memory per copy costs).
    readback: Mutex<Option<wgpu::Buffer>>,
}

/// A buffer of [`Wgpu`] memory (usable as a storage buffer and as a copy source and target).
#[derive(Debug)]
pub struct WgpuBuffer {
    buf: wgpu::Buffer,
    len: usize,
}

impl WgpuBuffer {
    /// The wgpu buffer, to bind in the application's own passes (it is at least
    /// [`len`](Device::len) bytes, padded to a multiple of four).
    pub fn raw(&self) -> &wgpu::Buffer {
        &self.buf
    }
}

impl std::fmt::Debug for Wgpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wgpu")
            .field("adapter", &self.adapter)
            .finish()
    }
}

impl Wgpu {
    /// The first adapter wgpu offers (`WGPU_BACKEND`, `WGPU_ADAPTER_NAME` and wgpu's other
    /// environment variables choose), with its own limits. No adapter is
    /// [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable).
    pub fn new() -> Result<Wgpu> {
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        let instance = wgpu::Instance::new(desc);
        let options = wgpu::RequestAdapterOptions::default();
        let adapter = pollster::block_on(instance.request_adapter(&options))
            .map_err(|e| unavailable(NAME, e))?;
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("distcomm"),
            required_limits: limits,
            ..Default::default()
        };
        let (device, queue) =
            pollster::block_on(adapter.request_device(&desc)).map_err(|e| unavailable(NAME, e))?;
        let info = adapter.get_info();
        Ok(Self::from_device(
            device,
            queue,
            format!("{} ({:?})", info.name, info.backend),
        ))
    }

    /// Wraps the application's own device and queue (buffers it allocates elsewhere then work
    /// with [`upload`](Device::upload) and friends only through [`WgpuBuffer`]s made here).
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, adapter: String) -> Wgpu {
        // Errors outside our scopes (the application's) must not abort the process from a
        // library: wgpu's default handler panics.
        device.on_uncaptured_error(Arc::new(|e: wgpu::Error| {
            crate::diag::always!(WARN, target: "distcomm::device", "uncaptured wgpu error: {e}");
        }));
        let max_buffer = device.limits().max_buffer_size;
        Wgpu {
            device,
            queue,
            adapter,
            max_buffer,
            readback: Mutex::new(None),
        }
    }

    /// The adapter's name and backend, e.g. `llvmpipe (LLVM 15.0.6, 256 bits) (Vulkan)`.
    pub fn adapter(&self) -> &str {
        &self.adapter
    }

    /// Runs `f` with validation and out-of-memory errors captured and returned.
    fn scoped<R>(&self, what: &str, f: impl FnOnce() -> R) -> Result<R> {
        let oom = self.device.push_error_scope(ErrorFilter::OutOfMemory);
        let invalid = self.device.push_error_scope(ErrorFilter::Validation);
        let r = f();
        let invalid = pollster::block_on(invalid.pop());
        let oom = pollster::block_on(oom.pop());
        match invalid.or(oom) {
            Some(e) => Err(failed(NAME, what, e)),
            None => Ok(r),
        }
    }

    /// Waits for every submitted command.
    fn wait_idle(&self) -> Result<()> {
        let poll = wgpu::PollType::Wait {
            submission_index: None,
            timeout: Some(COPY_DEADLINE),
        };
        self.device
            .poll(poll)
            .map(drop)
            .map_err(|e| failed(NAME, "wait", e))
    }

    fn buffer(&self, size: u64, usage: BufferUsages) -> Result<wgpu::Buffer> {
        if size > self.max_buffer {
            return Err(failed(
                NAME,
                "alloc",
                format!(
                    "{size} bytes exceed the adapter's largest buffer ({})",
                    self.max_buffer
                ),
            ));
        }
        self.scoped("alloc", || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("distcomm"),
                size,
                usage,
                mapped_at_creation: false,
            })
        })
    }

    /// Copies `dst.len()` bytes at `offset` of `src` (a multiple of four) to the host.
    fn read(&self, src: &wgpu::Buffer, offset: u64, dst: &mut [u8]) -> Result<()> {
        let n = words(dst.len());
        let mut readback = self.readback.lock().unwrap_or_else(|e| e.into_inner());
        let staging = match readback.take() {
            Some(b) if b.size() >= n => b,
            _ => self.buffer(n, BufferUsages::MAP_READ | BufferUsages::COPY_DST)?,
        };
        let r = self.read_via(src, offset, &staging, dst);
        *readback = Some(staging);
        r
    }

    fn read_via(
        &self,
        src: &wgpu::Buffer,
        offset: u64,
        staging: &wgpu::Buffer,
        dst: &mut [u8],
    ) -> Result<()> {
        let n = words(dst.len());
        self.scoped("download", || {
            let mut enc = self.device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(src, offset, staging, 0, n);
            self.queue.submit([enc.finish()]);
        })?;
        let (tx, rx) = std::sync::mpsc::channel();
        let slice = staging.slice(..n);
        slice.map_async(MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait_idle()?;
        match rx.recv_timeout(COPY_DEADLINE) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(failed(NAME, "map for download", e)),
            Err(e) => return Err(failed(NAME, "map for download", e)),
        }
        let copied = match slice.get_mapped_range() {
            Ok(view) => {
                dst.copy_from_slice(&view[..dst.len()]);
                Ok(())
            }
            Err(e) => Err(failed(NAME, "download", e)),
        };
        staging.unmap();
        copied
    }
}

/// `n` rounded up to whole 4-byte words (wgpu's copy granularity).
fn words(n: usize) -> u64 {
    n.div_ceil(4) as u64 * 4
}

impl Device for Wgpu {
    type Buffer = WgpuBuffer;

    fn name(&self) -> &'static str {
        NAME
    }
    fn memory(&self) -> Memory {
        Memory::Wgpu
    }
    fn alloc(&self, bytes: usize) -> Result<WgpuBuffer> {
        let usage = BufferUsages::STORAGE | BufferUsages::COPY_SRC | BufferUsages::COPY_DST;
        let buf = self.buffer(words(bytes).max(4), usage)?;
        Ok(WgpuBuffer { buf, len: bytes })
    }
    fn len(&self, buf: &WgpuBuffer) -> usize {
        buf.len
    }
    fn upload(&self, src: &[u8], dst: &mut WgpuBuffer) -> Result<()> {
        fits(src.len(), dst.len)?;
        let whole = src.len() / 4 * 4;
        let tail = &src[whole..];
        let mut last = [0u8; 4];
        if !tail.is_empty() {
            // The bytes of the last word past the upload keep their contents.
            self.read(&dst.buf, whole as u64, &mut last)?;
            last[..tail.len()].copy_from_slice(tail);
        }
        self.scoped("upload", || {
            if whole > 0 {
                self.queue.write_buffer(&dst.buf, 0, &src[..whole]);
            }
            if !tail.is_empty() {
                self.queue.write_buffer(&dst.buf, whole as u64, &last);
            }
            self.queue.submit([]);
        })?;
        self.wait_idle()
    }
    fn download(&self, src: &WgpuBuffer, dst: &mut [u8]) -> Result<()> {
        let n = dst.len().min(src.len);
        if n == 0 {
            return Ok(());
        }
        self.read(&src.buf, 0, &mut dst[..n])
    }
    fn synchronize(&self) -> Result<()> {
        self.wait_idle()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs a wgpu adapter (CI: lavapipe from `mesa-vulkan-drivers libvulkan1`).
    #[test]
    fn odd_lengths_keep_the_bytes_past_an_upload() {
        let gpu = Wgpu::new().unwrap_or_else(|e| panic!("{e} (install mesa-vulkan-drivers)"));
        let mut buf = gpu.alloc(11).unwrap();
        assert_eq!(gpu.len(&buf), 11);
        gpu.upload(&[9; 11], &mut buf).unwrap();
        gpu.upload(&[1, 2, 3, 4, 5], &mut buf).unwrap();
        let mut back = [0u8; 11];
        gpu.download(&buf, &mut back).unwrap();
        assert_eq!(back, [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 9]);
        let mut three = [0u8; 3];
        gpu.download(&buf, &mut three).unwrap();
        assert_eq!(three, [1, 2, 3]);
        assert!(
            gpu.upload(&[0; 12], &mut buf).is_err(),
            "too long an upload"
        );
        let mut empty = gpu.alloc(0).unwrap();
        gpu.upload(&[], &mut empty).unwrap();
        assert_eq!(gpu.len(&empty), 0);
        let err = gpu.alloc(usize::MAX / 2).unwrap_err();
        assert!(
            matches!(err, crate::Error::Device { device: "wgpu", .. }),
            "{err}"
        );
    }
}
