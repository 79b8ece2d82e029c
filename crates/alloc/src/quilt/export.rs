//! Exporting a live Quilt block to another process ([`crate::ipc`]).
//!
//! A block is backed by pool pages, one physical handle each, mapped one per
//! page wherever the pool had them (stitched): its export is one piece per
//! page under it, whole pages (a block shares its first and last pages with
//! its neighbours, so the descriptor says where in them it lies). While any
//! export of it is outstanding the block is *pinned*: a `free` of it is
//! deferred (the block stays live, its pages mapped and counted, so no
//! reclaim, no sleep and no other block can take them) until the last
//! `QuiltAllocator::end_export`, which frees it then. Blocks of a tag are
//! refused: a sleep would unmap their pages under the importer.
//!
//! The pins live under the allocator's one lock, beside the core.

use quilt_vmm::{DevicePtr, HandleKind};

use super::stitch::{Core, Ctx, Kind};
use crate::error::AllocError;
#[cfg(feature = "invariants")]
use crate::error::InvariantViolation;
use crate::export_pins::{ExportPins, OnEnd, OnFree};
use crate::ipc::{ExportedAllocation, SharedDescriptor, SharedPiece, MAX_PIECES};

/// The pinned blocks ([`ExportPins`], the type `comm` uses too).
#[derive(Debug, Default)]
pub(crate) struct Exports {
    pins: ExportPins,
}

impl Exports {
    /// A `free` of `ptr`: true when it is pinned (the free waits for the
    /// last export's end); a second free of a pinned block is a double free.
    pub(crate) fn defers_free(&mut self, ptr: DevicePtr) -> Result<bool, AllocError> {
        if self.pins.is_empty() {
            return Ok(false);
        }
        Ok(self.pins.on_free(ptr)? == OnFree::Deferred)
    }

    /// An error when `ptr` is pinned and its owner freed it already.
    pub(crate) fn check_not_freed(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        self.pins.check_usable(ptr)
    }

    /// Exports outstanding, over all blocks.
    pub(crate) fn outstanding(&self) -> u64 {
        self.pins.outstanding()
    }

    /// Export the live block at `ptr` (`tag_name` names a tag for the
    /// refusal of a tagged block).
    pub(crate) fn export(
        &mut self,
        core: &Core,
        ctx: &Ctx<'_>,
        ptr: DevicePtr,
        kind: HandleKind,
        tag_name: impl Fn(u32) -> String,
    ) -> Result<ExportedAllocation, AllocError> {
        self.check_not_freed(ptr)?;
        let b = core
            .blocks
            .get(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        if let Some((_, Kind::Isolated(t))) = core.arena_meta.get(b.arena) {
            return Err(AllocError::Sharing {
                reason: format!(
                    "block {ptr:#x} carries tag {:?}: a sleep would unmap its pages under the importer; export untagged blocks",
                    tag_name(*t)
                ),
            });
        }
        let arena = &core.arenas[b.arena];
        let page = ctx.page;
        let (first, last) = arena.page_span(b.off, b.size);
        let pages = last - first + 1;
        if pages > MAX_PIECES as u64 {
            return Err(AllocError::Sharing {
                reason: format!(
                    "block {ptr:#x} lies on {pages} pages; one export carries at most {MAX_PIECES}"
                ),
            });
        }
        let mut handles = Vec::with_capacity(pages as usize);
        let mut pieces = Vec::with_capacity(pages as usize);
        for (i, p) in (first..=last).enumerate() {
            let Some(phys) = arena.slot(p).phys else {
                return Err(AllocError::Internal(format!(
                    "page {p} under live block {ptr:#x} is not mapped"
                )));
            };
            handles.push(ctx.vmm.export_handle(phys.handle, kind)?);
            pieces.push(SharedPiece {
                offset: i as u64 * page,
                size: page,
            });
        }
        let descriptor = SharedDescriptor {
            id: ptr,
            size: pages * page,
            pieces,
            start: b.off - first * page,
            len: b.size,
        };
        descriptor.validate()?;
        self.pins.pin(ptr);
        Ok(ExportedAllocation {
            descriptor,
            handles,
        })
    }

    /// End one export of `ptr`; the last carries out a deferred free (a
    /// failure leaves the export outstanding, to be ended again).
    pub(crate) fn end_export(
        &mut self,
        core: &mut Core,
        ctx: &Ctx<'_>,
        ptr: DevicePtr,
    ) -> Result<(), AllocError> {
        if self.pins.end(ptr)? == OnEnd::FreeNow {
            core.free(ctx, ptr)?;
            self.pins.unpin_freed(ptr);
        }
        Ok(())
    }

    /// Every pinned block is live, untagged, and exported at least once.
    #[cfg(feature = "invariants")]
    pub(crate) fn check(&self, core: &Core) -> Result<(), InvariantViolation> {
        for (ptr, exports, _) in self.pins.iter() {
            let Some(b) = core.blocks.get(&ptr) else {
                return Err(InvariantViolation(format!(
                    "exported block {ptr:#x} is not live"
                )));
            };
            if matches!(
                core.arena_meta.get(b.arena),
                Some((_, Kind::Isolated(_))) | None
            ) {
                return Err(InvariantViolation(format!(
                    "exported block {ptr:#x} is in a tag's arena"
                )));
            }
            if exports == 0 {
                return Err(InvariantViolation(format!(
                    "block {ptr:#x} pinned without an export"
                )));
            }
        }
        Ok(())
    }
}
