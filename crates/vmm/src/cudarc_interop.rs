//! cudarc's streams as the CUDA backend's [`StreamId`]s, so that a program
//! that launches its work with cudarc orders Quilt's allocations on the same
//! streams.

use cudarc::driver::CudaStream;

use crate::cuda::CudaVmm;
use crate::error::{Result, VmmError};
use crate::types::{CallKind, StreamId};

impl CudaVmm {
    /// The [`StreamId`] of a cudarc stream, adopted by this backend
    /// ([`CudaVmm::adopt_stream`]: usable in every stream call, never
    /// destroyed here). cudarc's default stream (the null `CUstream`) is
    /// [`StreamId::DEFAULT`]. No driver call.
    ///
    /// The stream must belong to this backend's context: the primary
    /// context of the same device, which is what `CudaContext::new(ordinal)`
    /// gives. A stream of another device or of a non-primary context is
    /// [`VmmError::InvalidArgument`] (named after `cuEventRecord`, the first
    /// call an allocator makes on a stream). The caller keeps the stream
    /// alive (its `Arc`) for as long as an allocator may order work on it:
    /// while blocks allocated on it or recorded on it are alive or cached.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use cudarc::driver::CudaContext;
    /// use quilt_vmm::{cuda::CudaVmm, StreamId};
    ///
    /// let vmm = Arc::new(CudaVmm::new(0)?);
    /// let ctx = CudaContext::new(0)?;
    /// let stream = ctx.new_stream()?;
    /// let id = vmm.adopt_cudarc_stream(&stream)?;
    /// assert_eq!(id, StreamId(stream.cu_stream() as u64));
    /// assert_eq!(vmm.adopt_cudarc_stream(&ctx.default_stream())?, StreamId::DEFAULT);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn adopt_cudarc_stream(&self, stream: &CudaStream) -> Result<StreamId> {
        let raw = stream.cu_stream() as usize as u64;
        let ctx = stream.context();
        if ctx.ordinal() != self.ordinal() {
            return Err(VmmError::InvalidArgument {
                call: CallKind::EventRecord,
                argument: "hStream",
                value: raw,
                rule: "belongs to another device than this backend's",
            });
        }
        if !ctx.is_primary() {
            return Err(VmmError::InvalidArgument {
                call: CallKind::EventRecord,
                argument: "hStream",
                value: raw,
                rule: "belongs to a non-primary context; this backend works in the device's primary context",
            });
        }
        Ok(self.adopt_stream(raw))
    }
}
