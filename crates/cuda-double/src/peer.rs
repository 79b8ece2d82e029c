//! Peer access and copies between devices.
//!
//! Every device of the double has unified addressing, under which CUDA
//! copies between the memory of two devices whether peer access is enabled
//! or not, staging the bytes itself where it must:
//!
//! - `cuMemcpy`, `cuMemcpyAsync` and the typed copies reach device memory
//!   through the device of the stream they are queued on where it has the
//!   access the copy needs; memory of a `cuMemAlloc` allocation of another
//!   device (whose context the driver knows from the address) is reached
//!   through that device;
//! - `cuMemcpyPeer` and `cuMemcpyPeerAsync` name each side's context, and
//!   reach each side through that context's device.
//!
//! Memory mapped with `cuMemMap` belongs to no context: a plain copy reaches
//! it only where the stream's device has access to it (`cuMemSetAccess`),
//! and otherwise is refused (`CUDA_ERROR_INVALID_VALUE`); `cuMemcpyPeer`
//! reaches it through the context named. (torch copies its expandable
//! segments between devices with `cudaMemcpyPeerAsync` unless it made them
//! accessible to the peer, for that reason.) Each device side of a queued
//! copy keeps the device it is reached through, and is checked against that
//! device's access again when the copy runs: a fault where it lost it.
//!
//! Peer access (`cuCtxEnablePeerAccess`) lets kernels of one context reach
//! the `cuMemAlloc` memory of a peer context. It changes no copy's outcome,
//! and kernels touch no memory on the double, so the double only keeps which
//! pairs are enabled, for the errors the reference gives: a second enable
//! (`CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED`), a disable of a pair never
//! enabled (`CUDA_ERROR_PEER_ACCESS_NOT_ENABLED`), a context with itself
//! (`CUDA_ERROR_INVALID_CONTEXT`) or with another context of its own device
//! (`CUDA_ERROR_PEER_ACCESS_UNSUPPORTED`, as `cuDeviceCanAccessPeer` says).

#![allow(non_snake_case)] // cuda.h's names
#![allow(missing_docs)] // each export is the driver function of the same name
#![allow(clippy::missing_safety_doc)] // the safety contract is the CUDA driver reference's

use std::ffi::{c_int, c_uint};

use crate::abi::*;
use crate::counters::count;
use crate::state::{with_driver, Call, Driver};
use crate::work::Op;

impl Driver {
    /// The device of stream `s`'s context (an internal stream handle).
    pub fn stream_device(&self, s: u64) -> CuDevice {
        self.streams
            .get(&s)
            .and_then(|st| self.contexts.get(&st.context))
            .map_or(0, |c| c.device)
    }

    /// The device through which a copy queued on stream `s` reaches
    /// `[ptr, ptr + len)` with `need` access: the stream's device where it
    /// has that access, else the device of the `cuMemAlloc` allocation
    /// holding the range where that device has it (the driver stages the
    /// copy). `CUDA_ERROR_INVALID_VALUE` for any other range.
    pub fn reach(&self, s: u64, ptr: u64, len: u64, need: c_int) -> Call<CuDevice> {
        let own = self.stream_device(s);
        if self.memory.accessible(ptr, len, own, need) {
            return Ok(own);
        }
        match self.memory.alloc_device(ptr, len) {
            Some(d) if self.memory.accessible(ptr, len, d, need) => Ok(d),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// The device of context `ctx`, which must be live.
    fn device_of_context(&self, ctx: u64) -> Call<CuDevice> {
        self.live_context(ctx)?;
        Ok(self.contexts[&ctx].device)
    }

    /// `cuCtxEnablePeerAccess`: from the current context to `peer`.
    pub fn enable_peer(&mut self, peer: u64, flags: c_uint) -> Call<()> {
        let ctx = self.context()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let peer_device = self
            .device_of_context(peer)
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        if peer == ctx {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if peer_device == self.contexts[&ctx].device {
            return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        }
        if !self.peers.insert((ctx, peer)) {
            return Err(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
        }
        Ok(())
    }

    /// `cuCtxDisablePeerAccess`: from the current context to `peer`.
    pub fn disable_peer(&mut self, peer: u64) -> Call<()> {
        let ctx = self.context()?;
        self.device_of_context(peer)
            .map_err(|_| CUDA_ERROR_INVALID_CONTEXT)?;
        if !self.peers.remove(&(ctx, peer)) {
            return Err(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED);
        }
        Ok(())
    }

    /// Queues a copy of `len` bytes from `src` in context `src_ctx` to `dst`
    /// in context `dst_ctx` on stream `stream` (`cuMemcpyPeerAsync`): each
    /// side must be mapped with the access it needs for its context's
    /// device. Returns the internal stream and the copy's position (none
    /// for no bytes).
    pub fn queue_peer_copy(
        &mut self,
        stream: u64,
        (dst, dst_ctx): (u64, u64),
        (src, src_ctx): (u64, u64),
        len: u64,
    ) -> Call<Option<(u64, u64)>> {
        let dst_device = self.device_of_context(dst_ctx)?;
        let src_device = self.device_of_context(src_ctx)?;
        let s = self.stream(stream)?;
        if len == 0 {
            return Ok(None);
        }
        self.check_device_range(dst, len, dst_device, ACCESS_READWRITE)?;
        self.check_device_range(src, len, src_device, ACCESS_READ)?;
        let op = Op::Copy {
            dst,
            dst_device: Some(dst_device),
            src,
            src_device: Some(src_device),
            len,
        };
        let seq = self.enqueue(s, op)?;
        Ok(Some((s, seq)))
    }

    /// `cuMemcpyPeer`: serialised with all work of the current context and
    /// both sides' contexts, queued before and after. The double waits for
    /// that work, queues the copy on `stream` (the current context's legacy
    /// or per-thread stream) and waits for the copy: the call returns when
    /// the bytes are there (the reference lets it return earlier).
    pub fn peer_copy(
        &mut self,
        stream: u64,
        dst: (u64, u64),
        src: (u64, u64),
        len: u64,
    ) -> Call<()> {
        let ctx = self.context()?;
        self.device_of_context(dst.1)?;
        self.device_of_context(src.1)?;
        self.synchronize_contexts(&[ctx, dst.1, src.1])?;
        match self.queue_peer_copy(stream, dst, src, len)? {
            Some((s, seq)) => self.synchronize_up_to(s, seq),
            None => Ok(()),
        }
    }
}

fn code(r: Call<()>) -> CuResult {
    r.err().unwrap_or(CUDA_SUCCESS)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxEnablePeerAccess(peer: Opaque, flags: c_uint) -> CuResult {
    count!("cuCtxEnablePeerAccess");
    code(with_driver(|d| d.enable_peer(peer as usize as u64, flags)))
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxDisablePeerAccess(peer: Opaque) -> CuResult {
    count!("cuCtxDisablePeerAccess");
    code(with_driver(|d| d.disable_peer(peer as usize as u64)))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync(
    dst: CuDevicePtr,
    dst_ctx: Opaque,
    src: CuDevicePtr,
    src_ctx: Opaque,
    len: usize,
    stream: Opaque,
) -> CuResult {
    count!("cuMemcpyPeerAsync");
    code(with_driver(|d| {
        d.queue_peer_copy(
            stream as usize as u64,
            (dst, dst_ctx as usize as u64),
            (src, src_ctx as usize as u64),
            len as u64,
        )
        .map(|_| ())
    }))
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeer(
    dst: CuDevicePtr,
    dst_ctx: Opaque,
    src: CuDevicePtr,
    src_ctx: Opaque,
    len: usize,
) -> CuResult {
    count!("cuMemcpyPeer");
    code(with_driver(|d| {
        d.peer_copy(
            0,
            (dst, dst_ctx as usize as u64),
            (src, src_ctx as usize as u64),
            len as u64,
        )
    }))
}

/// `cuMemcpyPeerAsync` where the null stream is the per-thread stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeerAsync_ptsz(
    dst: CuDevicePtr,
    dst_ctx: Opaque,
    src: CuDevicePtr,
    src_ctx: Opaque,
    len: usize,
    stream: Opaque,
) -> CuResult {
    let stream = if stream.is_null() {
        STREAM_PER_THREAD as usize as Opaque
    } else {
        stream
    };
    // SAFETY: the same contract.
    unsafe { cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, len, stream) }
}

/// `cuMemcpyPeer` on the per-thread stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyPeer_ptds(
    dst: CuDevicePtr,
    dst_ctx: Opaque,
    src: CuDevicePtr,
    src_ctx: Opaque,
    len: usize,
) -> CuResult {
    count!("cuMemcpyPeer_ptds");
    code(with_driver(|d| {
        d.peer_copy(
            STREAM_PER_THREAD,
            (dst, dst_ctx as usize as u64),
            (src, src_ctx as usize as u64),
            len as u64,
        )
    }))
}
