//! An owning handle of a growable buffer: released when dropped.

use std::sync::Arc;

use quilt_vmm::{DevicePtr, StreamId};

use super::allocator::QuiltAllocator;
use super::growable::{GrowableId, GrowableInfo};
use crate::error::AllocError;

/// A growable buffer owned by the value, as [`crate::Buffer`] owns a block:
/// it knows its allocator, id and fixed address, and is released when
/// dropped (a failure there is logged) or, with its error, by
/// [`GrowableBuffer::release`].
///
/// ```
/// use std::sync::Arc;
/// use quilt_alloc::quilt::{GrowableBuffer, QuiltAllocator, QuiltConfig};
/// use quilt_alloc::DeviceAllocator;
/// use quilt_vmm::{sim::SimVmm, StreamId, Vmm};
///
/// let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
/// let alloc = Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
/// {
///     let kv = GrowableBuffer::new(alloc.clone(), 512 << 20, StreamId::DEFAULT)?;
///     kv.grow_to(10 << 20)?;
///     kv.grow_to(40 << 20)?;            // same address: nothing copied
///     assert_eq!(kv.len()?, 40 << 20);
///     kv.shrink_to(0)?;
/// } // released here
/// assert_eq!(alloc.stats().allocated_bytes.current, 0);
/// alloc.check_invariants()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GrowableBuffer {
    alloc: Arc<QuiltAllocator>,
    id: GrowableId,
    ptr: DevicePtr,
    max_len: u64,
    /// False once released (by `release`), so that drop does nothing.
    live: bool,
}

impl GrowableBuffer {
    /// A buffer of at most `max_bytes` (rounded up to pages) on `stream`,
    /// empty (see [`QuiltAllocator::create_growable`]).
    pub fn new(
        alloc: Arc<QuiltAllocator>,
        max_bytes: u64,
        stream: StreamId,
    ) -> Result<GrowableBuffer, AllocError> {
        let id = alloc.create_growable(max_bytes, stream)?;
        Self::adopt(alloc, id)
    }

    /// The same, carrying `tag` (it sleeps and wakes with the tag).
    pub fn new_tagged(
        alloc: Arc<QuiltAllocator>,
        max_bytes: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<GrowableBuffer, AllocError> {
        let id = alloc.create_growable_tagged(max_bytes, stream, tag)?;
        Self::adopt(alloc, id)
    }

    fn adopt(alloc: Arc<QuiltAllocator>, id: GrowableId) -> Result<GrowableBuffer, AllocError> {
        match alloc.growable_info(id) {
            Ok(info) => Ok(GrowableBuffer {
                alloc,
                id,
                ptr: info.ptr,
                max_len: info.max_len,
                live: true,
            }),
            Err(e) => {
                let _ = alloc.release_growable(id);
                Err(e)
            }
        }
    }

    /// Its id in the allocator.
    pub fn id(&self) -> GrowableId {
        self.id
    }

    /// The device address of its first byte: fixed for its life.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Its maximum length in bytes.
    pub fn max_len(&self) -> u64 {
        self.max_len
    }

    /// Its length in bytes now.
    pub fn len(&self) -> Result<u64, AllocError> {
        Ok(self.alloc.growable_info(self.id)?.len)
    }

    /// True when its length is 0.
    pub fn is_empty(&self) -> Result<bool, AllocError> {
        Ok(self.len()? == 0)
    }

    /// Everything about it now.
    pub fn info(&self) -> Result<GrowableInfo, AllocError> {
        self.alloc.growable_info(self.id)
    }

    /// See [`QuiltAllocator::grow_to`].
    pub fn grow_to(&self, bytes: u64) -> Result<(), AllocError> {
        self.alloc.grow_to(self.id, bytes)
    }

    /// See [`QuiltAllocator::shrink_to`].
    pub fn shrink_to(&self, bytes: u64) -> Result<(), AllocError> {
        self.alloc.shrink_to(self.id, bytes)
    }

    /// See [`QuiltAllocator::record_growable_stream`].
    pub fn record_stream(&self, stream: StreamId) -> Result<(), AllocError> {
        self.alloc.record_growable_stream(self.id, stream)
    }

    /// The allocator it came from.
    pub fn allocator(&self) -> &Arc<QuiltAllocator> {
        &self.alloc
    }

    /// Release it now, with the allocator's error if it refuses (a sleeping
    /// tag's buffer is refused: it stays, and is released at the allocator's drop).
    pub fn release(mut self) -> Result<(), AllocError> {
        self.live = false;
        self.alloc.release_growable(self.id)
    }
}

impl std::fmt::Debug for GrowableBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrowableBuffer")
            .field("id", &self.id.0)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("max_len", &self.max_len)
            .finish()
    }
}

impl Drop for GrowableBuffer {
    fn drop(&mut self) {
        if self.live {
            if let Err(e) = self.alloc.release_growable(self.id) {
                tracing::warn!(error = %e, id = self.id.0, "releasing a dropped growable buffer failed");
            }
        }
    }
}
