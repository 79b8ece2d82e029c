//! An owning device buffer: freed when it goes out of scope.

use std::sync::Arc;

use quilt_vmm::{DevicePtr, StreamId};

use crate::api::DeviceAllocator;
use crate::error::AllocError;

/// A block of device memory owned by the value: it knows its allocator,
/// pointer, size and stream, and goes back to the allocator when dropped (a
/// failure there is logged, since `drop` cannot return it) or, with its
/// error, by [`Buffer::free`]. It cannot be freed twice: `free` takes it.
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
/// use quilt_alloc::{Buffer, DeviceAllocator};
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
/// let alloc: Arc<dyn DeviceAllocator> = Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
/// {
///     let buf = Buffer::new(alloc.clone(), 300 << 20, StreamId::DEFAULT)?;
///     assert!(buf.size() >= 300 << 20);
///     buf.record_stream(StreamId(7))?; // also used on stream 7
/// } // freed here
/// assert_eq!(alloc.stats().allocated_bytes.current, 0);
/// let buf = Buffer::new(alloc.clone(), 1 << 20, StreamId::DEFAULT)?;
/// buf.free()?; // or freed explicitly, with its error
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Buffer {
    alloc: Arc<dyn DeviceAllocator>,
    ptr: DevicePtr,
    size: u64,
    stream: StreamId,
    /// False once given back (by `free`), so that drop does nothing.
    live: bool,
}

impl Buffer {
    /// Allocate `size` bytes from `alloc`, ordered on `stream`.
    pub fn new(
        alloc: Arc<dyn DeviceAllocator>,
        size: u64,
        stream: StreamId,
    ) -> Result<Buffer, AllocError> {
        let a = alloc.allocate(size, stream)?;
        Ok(Buffer {
            alloc,
            ptr: a.ptr,
            size: a.size,
            stream,
            live: true,
        })
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Bytes usable (at least what was asked for).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The stream it was allocated on.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<dyn DeviceAllocator> {
        &self.alloc
    }

    /// Note that `stream` uses the buffer too: its memory is reused on
    /// another stream only after that stream's work (`record_stream`).
    pub fn record_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        self.alloc.record_stream(self.ptr, stream)
    }

    /// Give the memory back now, with the allocator's error if it refuses.
    pub fn free(mut self) -> Result<(), AllocError> {
        self.live = false;
        self.alloc.free(self.ptr)
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("allocator", &self.alloc.name())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("stream", &self.stream)
            .finish()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.live {
            if let Err(e) = self.alloc.free(self.ptr) {
                tracing::warn!(error = %e, ptr = self.ptr, "freeing a dropped buffer failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use crate::quilt::{QuiltAllocator, QuiltConfig};
    use quilt_vmm::sim::SimVmm;
    use quilt_vmm::Vmm;

    fn alloc() -> Arc<dyn DeviceAllocator> {
        let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(256 << 20).unwrap());
        Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap())
    }

    #[test]
    fn a_buffer_frees_itself_once() {
        let a = alloc();
        let b = Buffer::new(a.clone(), 5 << 20, StreamId(3)).unwrap();
        assert_eq!((b.stream(), a.stats().allocation.current), (StreamId(3), 1));
        let ptr = b.ptr();
        drop(b);
        assert_eq!(a.stats().allocation.current, 0);
        assert!(matches!(a.free(ptr), Err(AllocError::DoubleFree { .. })));
        let b = Buffer::new(a.clone(), 1, StreamId::DEFAULT).unwrap();
        b.record_stream(StreamId(1)).unwrap();
        b.free().unwrap();
        assert_eq!(a.stats().allocation.current, 0);
        a.check_invariants().unwrap();
        assert!(Buffer::new(a.clone(), 0, StreamId::DEFAULT).is_err());
        assert!(Buffer::new(a, 1 << 40, StreamId::DEFAULT).is_err());
    }
}
