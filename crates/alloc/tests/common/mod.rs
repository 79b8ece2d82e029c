//! Helpers shared by this crate's integration tests: a test file that needs
//! them declares `mod common;`.
#![allow(dead_code)] // each test file uses a part

use std::sync::Arc;

use quilt_alloc::quilt::{GrowthPolicy, MapAhead, MemoryLimit, QuiltAllocator, QuiltConfig};
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::Vmm;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// The host backend (real bytes) with `granularity` and `capacity`.
///
/// It exists on every 64-bit Linux machine, where these tests run (CI
/// included), so a machine without it fails the calling test with the
/// reason: a test that cannot run is never reported as passed.
pub fn host(granularity: u64, capacity: u64) -> Arc<HostVmm> {
    match HostVmm::new(HostConfig {
        granularity,
        capacity,
    }) {
        Ok(h) => Arc::new(h),
        Err(e) => panic!(
            "the host backend is unavailable: {e} (it exists on 64-bit Linux, where this test is meant to run; it fails here rather than passing without running)"
        ),
    }
}

/// `len` bytes at `ptr` on the host backend.
pub fn read(h: &HostVmm, ptr: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    h.read_bytes(ptr, &mut out).unwrap();
    out
}

/// Quilt with `limit` bytes, one page per handle (exact growth, no growth
/// margin), nothing mapped ahead: each test sets its own policy.
pub fn quilt_exact(vmm: Arc<dyn Vmm>, limit: u64) -> Arc<QuiltAllocator> {
    let mut config = QuiltConfig::default().with_limit(MemoryLimit::Bytes(limit));
    config.pool.growth = GrowthPolicy::exact();
    let a = Arc::new(QuiltAllocator::new(vmm, config).unwrap());
    a.set_map_ahead(MapAhead::OFF).unwrap();
    a
}
