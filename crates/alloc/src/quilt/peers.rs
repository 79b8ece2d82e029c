//! A peer device given access to the allocator's memory at run time, as
//! PyTorch's expandable segments do when `enablePeerAccess` is called
//! (`addPeerAccess`): every page mapped now gets access for the peer, and
//! every page mapped from then on (the peer joins
//! [`QuiltConfig::peer_access`](super::QuiltConfig::peer_access), which the
//! core's mappings name). Memory mapped with `cuMemMap` is not reached by
//! `cudaDeviceEnablePeerAccess` alone: without this a kernel on the peer
//! that touches it faults.

use quilt_vmm::DeviceOrdinal;

use super::allocator::QuiltAllocator;
use crate::api::DeviceAllocator;
use crate::error::AllocError;

impl QuiltAllocator {
    /// Give device `peer` read-write access to this allocator's memory, now
    /// and from now on: `peer` joins the configuration's `peer_access`
    /// (every later mapping names it), then each run of pages mapped gets
    /// one `cuMemSetAccess` naming this device and every peer (as a mapping
    /// does). A peer that has access already changes nothing (no driver
    /// call). [`AllocError::InvalidConfig`] for this device itself or an
    /// ordinal the driver does not have; a driver failure is
    /// [`AllocError::Driver`] (the peer stays in the configuration: calling
    /// again sets the access of every run again).
    pub fn add_peer_access(&self, peer: DeviceOrdinal) -> Result<(), AllocError> {
        let caps = self.vmm().caps();
        if peer == caps.ordinal {
            return Err(AllocError::InvalidConfig {
                reason: format!("peer access for device {peer}: it is this allocator's own device"),
            });
        }
        if peer >= caps.device_count {
            return Err(AllocError::InvalidConfig {
                reason: format!(
                    "peer access for device {peer}: the driver has {} devices",
                    caps.device_count
                ),
            });
        }
        if self.config().peer_access.contains(peer) {
            return Ok(());
        }
        // First the configuration, so that a page mapped meanwhile names the
        // peer; then every page mapped by then (again, for those).
        self.update_policy(|c| {
            if let Some(with) = c.peer_access.with(peer) {
                c.peer_access = with;
            }
        })?;
        self.with(|l, ctx| {
            let devices = ctx.cfg.peer_access.access_list(caps.ordinal);
            for arena in &l.core.arenas {
                let pages = arena.pages.len();
                let mut p = 0;
                while p < pages {
                    if arena.pages.phys[p].is_none() {
                        p += 1;
                        continue;
                    }
                    let first = p;
                    while p < pages && arena.pages.phys[p].is_some() {
                        p += 1;
                    }
                    let len = (p - first) as u64 * ctx.page;
                    ctx.vmm
                        .set_access_for(arena.page_addr(first as u64), len, &devices)?;
                }
            }
            Ok(())
        })
    }
}
