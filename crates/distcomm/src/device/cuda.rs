//! CUDA device memory through [cudarc](https://docs.rs/cudarc), with the driver library loaded
//! at run time: the `cuda` feature builds on any machine, and opening a device where there is
//! no CUDA driver is [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable), never a panic.
//! No transport distcomm has addresses CUDA memory yet (a CUDA-aware backend would declare
//! [`Memory::Cuda`]), so every operation on it is staged.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};

use super::{failed, fits, unavailable, Device, Memory};
use crate::error::Result;

const NAME: &str = "cuda";

/// One CUDA device (its primary context) and a stream for the copies.
///
/// ```no_run
/// # fn main() -> distcomm::Result<()> {
/// use std::sync::Arc;
/// use distcomm::device::{Cuda, Device};
/// let g = distcomm::init()?;
/// let gpu = Arc::new(Cuda::new(0)?); // Err(DeviceUnavailable) without a CUDA driver
/// let buf = gpu.alloc(1 << 20)?;
/// let w = g.isend_device(&gpu, buf, (g.rank() + 1) % g.size(), 0)?;
/// let _buf = w.into_buffer()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Cuda {
    stream: Arc<CudaStream>,
    ordinal: usize,
}

/// A buffer of [`Cuda`] device memory.
#[derive(Debug)]
pub struct CudaBuffer {
    slice: CudaSlice<u8>,
}

impl CudaBuffer {
    /// The device memory, for the application's own kernels and copies.
    pub fn slice(&self) -> &CudaSlice<u8> {
        &self.slice
    }
    /// The device memory, mutably.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.slice
    }
}

impl Cuda {
    /// Whether the CUDA driver library can be loaded on this machine.
    pub fn driver_present() -> bool {
        // SAFETY: the probe only asks the dynamic loader to open libcuda (`dlopen`) and drops
        // the handle; it calls no CUDA function. Running a shared library's initialisers is
        // what loading any library does, and it is the library every other cudarc call loads.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }

    /// Device `ordinal`'s primary context. [`Error::DeviceUnavailable`](crate::Error::DeviceUnavailable)
    /// when there is no CUDA driver, no such device, or the driver refuses.
    pub fn new(ordinal: usize) -> Result<Cuda> {
        if !Self::driver_present() {
            return Err(unavailable(
                NAME,
                "the CUDA driver library (libcuda) is not installed",
            ));
        }
        // cudarc panics when a driver symbol it expects is missing (an older driver than the
        // API version it was built for): report that as unavailable too.
        let ctx = std::panic::catch_unwind(|| CudaContext::new(ordinal))
            .map_err(|_| unavailable(NAME, "the CUDA driver lacks a required entry point"))?
            .map_err(|e| unavailable(NAME, format!("device {ordinal}: {e}")))?;
        Ok(Cuda {
            stream: ctx.default_stream(),
            ordinal,
        })
    }

    /// How many CUDA devices this process sees (`CUDA_VISIBLE_DEVICES` applies).
    pub fn device_count() -> Result<usize> {
        if !Self::driver_present() {
            return Err(unavailable(
                NAME,
                "the CUDA driver library (libcuda) is not installed",
            ));
        }
        let n = std::panic::catch_unwind(CudaContext::device_count)
            .map_err(|_| unavailable(NAME, "the CUDA driver lacks a required entry point"))?
            .map_err(|e| unavailable(NAME, e))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// The device for local rank `local_rank`: ranks share the devices round-robin.
    pub fn for_local_rank(local_rank: usize) -> Result<Cuda> {
        match Self::device_count()? {
            0 => Err(unavailable(NAME, "no CUDA device")),
            n => Self::new(local_rank % n),
        }
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.stream.synchronize().map_err(|e| failed(NAME, what, e))
    }
}

impl Device for Cuda {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        NAME
    }
    fn memory(&self) -> Memory {
        Memory::Cuda
    }
    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| failed(NAME, "alloc", e))?;
        Ok(CudaBuffer { slice })
    }
    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.slice.len()
    }
    fn upload(&self, src: &[u8], dst: &mut CudaBuffer) -> Result<()> {
        fits(src.len(), dst.slice.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice.slice_mut(..src.len());
        self.stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| failed(NAME, "upload", e))?;
        self.sync("upload")
    }
    fn download(&self, src: &CudaBuffer, dst: &mut [u8]) -> Result<()> {
        let n = dst.len().min(src.slice.len());
        if n == 0 {
            return Ok(());
        }
        let view = src.slice.slice(..n);
        self.stream
            .memcpy_dtoh(&view, &mut dst[..n])
            .map_err(|e| failed(NAME, "download", e))?;
        self.sync("download")
    }
    fn synchronize(&self) -> Result<()> {
        self.sync("synchronize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where CUDA is missing, opening a device is a typed error, never a panic; where it is
    /// there, bytes go up and come back.
    #[test]
    fn opening_is_typed_and_copies_round_trip() {
        match Cuda::new(0) {
            Err(e) => {
                assert!(
                    matches!(e, crate::Error::DeviceUnavailable { device: "cuda", .. }),
                    "{e}"
                );
                assert!(!Cuda::driver_present() || e.to_string().contains("device 0"));
            }
            Ok(gpu) => {
                let mut buf = gpu.alloc(10).unwrap();
                gpu.upload(&[1, 2, 3], &mut buf).unwrap();
                let mut back = [9u8; 10];
                gpu.download(&buf, &mut back).unwrap();
                assert_eq!(back, [1, 2, 3, 0, 0, 0, 0, 0, 0, 0]);
                assert!(gpu.upload(&[0; 11], &mut buf).is_err());
            }
        }
    }
}
