//! A typed Quilt buffer that cudarc takes as device memory: it implements
//! cudarc's [`DeviceSlice`], [`DevicePtr`] and [`DevicePtrMut`], so its
//! pointer goes to a kernel launched with cudarc's launch builder and to
//! cudarc's copies, while the memory stays Quilt's (cudarc never frees it).
//!
//! Stream ordering follows cudarc's own `CudaSlice` (two events, *read* and
//! *write*, used only while the context tracks events, i.e. in cudarc's
//! multi-stream mode), with two additions that make a foreign stream safe:
//!
//! - the *write* event is recorded on the buffer's stream when the buffer is
//!   made, so that a use on another stream first waits for the work the
//!   buffer's stream queued before the allocation (Quilt reuses a block freed
//!   on a stream at once on that stream, so that work may still touch it);
//! - a read waits for the previous reads too (cudarc's waits only for
//!   writes), so that the *read* event, re-recorded by each reader, always
//!   covers every read before it: reads on different streams are chained,
//!   and a later write or the free waits for all of them.
//!
//! When the buffer is dropped (or turned back into a [`Buffer`]), its stream
//! waits for both events and the block is freed on that stream: Quilt's
//! stream-ordered reuse then comes after every use on every stream, with no
//! host synchronisation. If that wait cannot be queued, the context is
//! synchronised first; if that fails too, the block is leaked rather than
//! reused under running work.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError, SyncOnDrop,
};
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{StreamId, VmmError};

use crate::api::DeviceAllocator;
use crate::buffer::Buffer;
use crate::error::AllocError;

/// What making a [`CudaBuffer`] can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CudaBufferError {
    /// The allocator refused (out of memory, invalid size, ...).
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The stream is not one of the CUDA backend's (another device, or a
    /// non-primary context).
    #[error(transparent)]
    Stream(#[from] VmmError),
    /// cudarc failed to create or record an event.
    #[error("cudarc: {0}")]
    Cuda(#[from] DriverError),
    /// The CUDA backend given is not the allocator's backend.
    #[error("the CUDA backend given is not the one the allocator allocates from")]
    OtherBackend,
    /// The buffer was allocated on another stream than the cudarc stream given.
    #[error("the buffer belongs to stream {buffer:#x}, the cudarc stream is {stream:#x}")]
    OtherStream {
        /// The buffer's stream.
        buffer: u64,
        /// The cudarc stream's.
        stream: u64,
    },
    /// `len` elements do not fit in the buffer (or their size overflows).
    #[error("{len} elements of {elem_size} bytes do not fit in a buffer of {size} bytes")]
    TooShort {
        /// Elements asked for.
        len: usize,
        /// Bytes per element.
        elem_size: usize,
        /// Bytes of the buffer.
        size: u64,
    },
}

/// `len` elements of `T` in a Quilt [`Buffer`], ordered on a cudarc stream.
/// See the [module documentation](self) for how uses on other streams are
/// ordered.
///
/// ```no_run
/// use std::sync::Arc;
/// use cudarc::driver::CudaContext;
/// use quilt_alloc::cuda_buffer::CudaBuffer;
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::DeviceAllocator;
/// use quilt_vmm::{cuda::CudaVmm, Vmm};
///
/// let cuda = Arc::new(CudaVmm::new(0)?);
/// let vmm: Arc<dyn Vmm> = cuda.clone();
/// let alloc: Arc<dyn DeviceAllocator> = Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
/// let stream = CudaContext::new(0)?.new_stream()?;
/// let mut xs = CudaBuffer::<f32>::new(alloc, &cuda, stream.clone(), 1 << 20)?;
/// stream.memcpy_htod(&vec![1.0f32; 1 << 20], &mut xs)?; // cudarc writes into Quilt memory
/// let back: Vec<f32> = stream.clone_dtoh(&xs)?;
/// assert_eq!(back[12345], 1.0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct CudaBuffer<T> {
    /// The memory; `None` only after it was handed on (drop or `into_buffer`).
    buffer: Option<Buffer>,
    /// The buffer's stream, as cudarc knows it.
    stream: Arc<CudaStream>,
    /// Its `CUdeviceptr`.
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Recorded after each read; `None` when the context tracks no events.
    read: Option<CudaEvent>,
    /// Recorded after each write and at creation; `None` likewise.
    write: Option<CudaEvent>,
    _elem: PhantomData<fn() -> T>,
}

/// Before a cudarc stream is dropped: `alloc` forgets it
/// ([`DeviceAllocator::forget_stream`]: its work made complete once, its
/// handle never given to the driver again), and so does the backend. Call
/// it once no [`CudaBuffer`] on the stream is alive (dropping one queues
/// work on its stream). `cuda` is the allocator's backend. A per-thread
/// default stream is the calling thread's ([`CudaVmm::adopt_stream`]).
pub fn forget_cudarc_stream(
    alloc: &dyn DeviceAllocator,
    cuda: &CudaVmm,
    stream: &CudaStream,
) -> Result<(), CudaBufferError> {
    if !std::ptr::addr_eq(Arc::as_ptr(alloc.vmm()), cuda as *const CudaVmm) {
        return Err(CudaBufferError::OtherBackend);
    }
    let id = cuda.adopt_cudarc_stream(stream)?;
    alloc.forget_stream(id)?;
    Ok(())
}

impl<T> CudaBuffer<T> {
    /// `len` elements of `T` from `alloc`, on `stream`. `cuda` is the
    /// allocator's backend (to adopt the stream, [`CudaVmm::adopt_cudarc_stream`]).
    pub fn new(
        alloc: Arc<dyn DeviceAllocator>,
        cuda: &CudaVmm,
        stream: Arc<CudaStream>,
        len: usize,
    ) -> Result<CudaBuffer<T>, CudaBufferError> {
        if !std::ptr::addr_eq(Arc::as_ptr(alloc.vmm()), cuda as *const CudaVmm) {
            return Err(CudaBufferError::OtherBackend);
        }
        let id = cuda.adopt_cudarc_stream(&stream)?;
        let bytes = byte_len::<T>(len).ok_or(CudaBufferError::TooShort {
            len,
            elem_size: std::mem::size_of::<T>(),
            size: 0,
        })?;
        let buffer = Buffer::new(alloc, bytes.max(1), id)?;
        CudaBuffer::from_buffer(buffer, cuda, stream, len)
    }

    /// The first `len` elements of `T` of `buffer`, which was allocated on
    /// `stream` from an allocator on `cuda`.
    pub fn from_buffer(
        buffer: Buffer,
        cuda: &CudaVmm,
        stream: Arc<CudaStream>,
        len: usize,
    ) -> Result<CudaBuffer<T>, CudaBufferError> {
        if !std::ptr::addr_eq(
            Arc::as_ptr(buffer.allocator().vmm()),
            cuda as *const CudaVmm,
        ) {
            return Err(CudaBufferError::OtherBackend);
        }
        let id = cuda.adopt_cudarc_stream(&stream)?;
        if id != buffer.stream() {
            return Err(CudaBufferError::OtherStream {
                buffer: buffer.stream().0,
                stream: id.0,
            });
        }
        if byte_len::<T>(len).is_none_or(|b| b > buffer.size()) {
            return Err(CudaBufferError::TooShort {
                len,
                elem_size: std::mem::size_of::<T>(),
                size: buffer.size(),
            });
        }
        let ctx = stream.context();
        let (read, write) = if ctx.is_event_tracking() {
            (Some(ctx.new_event(None)?), Some(stream.record_event(None)?))
        } else {
            (None, None)
        };
        Ok(CudaBuffer {
            ptr: buffer.ptr(),
            buffer: Some(buffer),
            stream,
            len,
            read,
            write,
            _elem: PhantomData,
        })
    }

    /// The Quilt buffer underneath.
    pub fn buffer(&self) -> Option<&Buffer> {
        self.buffer.as_ref()
    }

    /// The buffer's stream as Quilt knows it.
    pub fn stream_id(&self) -> StreamId {
        StreamId(self.stream.cu_stream() as usize as u64)
    }

    /// Back to an untyped [`Buffer`], after its stream was made to wait for
    /// every use on other streams (cudarc's error if that wait could not be
    /// queued; the buffer is then dropped as [`Drop`] says).
    pub fn into_buffer(mut self) -> Result<Buffer, DriverError> {
        self.join_uses()?;
        self.buffer
            .take()
            .ok_or(DriverError(sys::CUresult::CUDA_ERROR_INVALID_HANDLE))
    }

    /// Make the buffer's stream wait for the last read and write on any stream.
    fn join_uses(&self) -> Result<(), DriverError> {
        for event in [&self.read, &self.write].into_iter().flatten() {
            self.stream.wait(event)?;
        }
        Ok(())
    }
}

/// Bytes of `len` elements of `T`, `None` on overflow.
fn byte_len<T>(len: usize) -> Option<u64> {
    len.checked_mul(std::mem::size_of::<T>())
        .and_then(|b| u64::try_from(b).ok())
}

impl<T> std::fmt::Debug for CudaBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("buffer", &self.buffer)
            .field("len", &self.len)
            .field("elem", &std::any::type_name::<T>())
            .finish_non_exhaustive()
    }
}

impl<T> DeviceSlice<T> for CudaBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for CudaBuffer<T> {
    /// The pointer, for a read on `stream`: `stream` waits for the last write
    /// and the last read (chaining reads; see the module documentation), and
    /// the returned guard records the read when dropped.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            for event in [&self.write, &self.read].into_iter().flatten() {
                ctx.record_err(stream.wait(event));
            }
        }
        (self.ptr, SyncOnDrop::record_event(&self.read, stream))
    }
}

impl<T> DevicePtrMut<T> for CudaBuffer<T> {
    /// The pointer, for a write on `stream`: `stream` waits for the last read
    /// and the last write, and the returned guard records the write when dropped.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            for event in [&self.read, &self.write].into_iter().flatten() {
                ctx.record_err(stream.wait(event));
            }
        }
        (self.ptr, SyncOnDrop::record_event(&self.write, stream))
    }
}

impl<T> Drop for CudaBuffer<T> {
    /// The buffer's stream waits for every use, then the block is freed on
    /// it; failing the wait, the context is synchronised; failing that, the
    /// block is leaked (and logged) rather than reused under running work.
    fn drop(&mut self) {
        let Some(buffer) = self.buffer.take() else {
            return;
        };
        if let Err(e) = self.join_uses() {
            tracing::warn!(error = %e, "queueing the wait before a free failed; synchronising the context");
            if let Err(e) = self.stream.context().synchronize() {
                tracing::error!(error = %e, ptr = buffer.ptr(), "cannot order the free after the buffer's uses: leaking it");
                std::mem::forget(buffer);
            }
        }
    }
}
