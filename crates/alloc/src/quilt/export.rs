//! Exporting a live Quilt block to another process ([`crate::ipc`]).
//!
//! A block is backed by pool pages, one physical handle each, mapped one per
//! page wherever the pool had them (stitched): its export is one piece per
//! page under it, whole pages (a block shares its first and last pages with
//! its neighbours, so the descriptor says where in them it lies). While any
//! export of it is outstanding the block is *pinned*: a `free` of it is
//! deferred (the block stays live, its pages mapped and counted, so no
//! reclaim, no sleep and no other block can take them) until the last
//! [`QuiltAllocator::end_export`], which frees it then. Blocks of a tag are
//! refused: a sleep would unmap their pages under the importer.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use quilt_vmm::{DevicePtr, HandleKind};

use super::state::{Kind, State};
use super::QuiltAllocator;
use crate::error::{AllocError, InvariantViolation};
use crate::ipc::{ExportedAllocation, SharedDescriptor, SharedPiece, MAX_PIECES};

/// One pinned block: how many exports are outstanding, and whether its
/// owner freed it meanwhile (the free happens when the last export ends).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Pin {
    exports: u32,
    freed: bool,
}

/// The pinned blocks, by address.
#[derive(Debug, Default)]
struct Exports {
    pins: BTreeMap<DevicePtr, Pin>,
}

/// The allocator's pinned blocks. Changed and read under the allocator's
/// state lock (its own lock is taken after that one); `any` lets `free` skip
/// the lookup while nothing is exported.
#[derive(Debug, Default)]
pub(crate) struct ExportRegistry {
    any: AtomicBool,
    exports: Mutex<Exports>,
}

/// What [`Exports::on_free`] decides about a `free`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreeOfPinned {
    /// Not pinned: free it now.
    FreeNow,
    /// Pinned: the free waits for the last export's end.
    Deferred,
}

impl ExportRegistry {
    fn lock(&self) -> Result<MutexGuard<'_, Exports>, AllocError> {
        self.exports.lock().map_err(|_| AllocError::Poisoned)
    }

    /// A `free` of `ptr` (under the state lock): deferred while it is pinned
    /// (a second free of a pinned block is a double free).
    pub(crate) fn on_free(&self, ptr: DevicePtr) -> Result<FreeOfPinned, AllocError> {
        if !self.any.load(Ordering::Relaxed) {
            return Ok(FreeOfPinned::FreeNow);
        }
        self.lock()?.on_free(ptr)
    }

    /// An error when `ptr` was freed by its owner and waits for its
    /// importers (under the state lock).
    pub(crate) fn check_not_freed(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        if !self.any.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.lock()?.check_not_freed(ptr)
    }

    /// Every pin is a live block outside any tag, with at least one export.
    pub(crate) fn check(&self, st: &State) -> Result<(), InvariantViolation> {
        let e = self.lock().map_err(|e| InvariantViolation(e.to_string()))?;
        if self.any.load(Ordering::Relaxed) == e.pins.is_empty() {
            return Err(InvariantViolation(
                "the export registry's flag disagrees with its pins".into(),
            ));
        }
        e.check(st)
    }
}

impl Exports {
    fn on_free(&mut self, ptr: DevicePtr) -> Result<FreeOfPinned, AllocError> {
        match self.pins.get_mut(&ptr) {
            None => Ok(FreeOfPinned::FreeNow),
            Some(pin) if pin.freed => Err(AllocError::DoubleFree { ptr }),
            Some(pin) => {
                pin.freed = true;
                Ok(FreeOfPinned::Deferred)
            }
        }
    }

    /// An error when `ptr` was freed by its owner and waits for its importers
    /// (nothing but `end_export` may touch it then).
    fn check_not_freed(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        match self.pins.get(&ptr) {
            Some(pin) if pin.freed => Err(AllocError::UnknownPointer { ptr }),
            _ => Ok(()),
        }
    }

    /// Exports outstanding, over every block.
    fn outstanding(&self) -> u64 {
        self.pins.values().map(|p| u64::from(p.exports)).sum()
    }

    fn check(&self, st: &State) -> Result<(), InvariantViolation> {
        for (&ptr, pin) in &self.pins {
            let Some(b) = st.blocks.get(&ptr) else {
                return Err(InvariantViolation(format!(
                    "exported block {ptr:#x} is not live"
                )));
            };
            if matches!(
                st.arena_meta.get(b.arena),
                Some((_, Kind::Tagged(_))) | None
            ) {
                return Err(InvariantViolation(format!(
                    "exported block {ptr:#x} is in a tag's arena"
                )));
            }
            if pin.exports == 0 {
                return Err(InvariantViolation(format!(
                    "block {ptr:#x} pinned without an export"
                )));
            }
        }
        Ok(())
    }
}

impl QuiltAllocator {
    /// Export the live block at `ptr` for another process
    /// ([`crate::ipc`]): one shareable handle of `kind` per page under it
    /// (`cuMemExportToShareableHandle` each; the pool must create its pages
    /// with that handle type, [`quilt_pool::PoolConfig::create_props`]), and
    /// the descriptor: the pages as pieces, in address order, and where the
    /// block lies in them. Until as many [`QuiltAllocator::end_export`]s as
    /// exports, the block is pinned: a `free` of it is deferred, so its
    /// pages stay mapped and are neither reclaimed nor reused.
    ///
    /// Errors, nothing changed: [`AllocError::UnknownPointer`] (not a live
    /// block, or one freed and waiting for its importers),
    /// [`AllocError::Sharing`] (a block of a tag, or more pages than one
    /// message carries, [`MAX_PIECES`]), [`AllocError::Driver`] (a handle the
    /// driver cannot export as `kind`).
    pub fn export(
        &self,
        ptr: DevicePtr,
        kind: HandleKind,
    ) -> Result<ExportedAllocation, AllocError> {
        let st = self.lock()?;
        let registry = &self.core.exports;
        let mut exports = registry.lock()?;
        exports.check_not_freed(ptr)?;
        let b = st
            .blocks
            .get(&ptr)
            .ok_or(AllocError::UnknownPointer { ptr })?;
        if let Some((_, Kind::Tagged(t))) = st.arena_meta.get(b.arena) {
            return Err(AllocError::Sharing {
                reason: format!(
                    "block {ptr:#x} carries tag {:?}: a sleep would unmap its pages under the importer; export untagged blocks",
                    st.tags.name(*t)
                ),
            });
        }
        let arena = &st.arenas[b.arena];
        let page = self.core.page;
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
            handles.push(self.core.vmm.export_handle(phys.handle, kind)?);
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
        exports.pins.entry(ptr).or_default().exports += 1;
        registry.any.store(true, Ordering::Relaxed);
        Ok(ExportedAllocation {
            descriptor,
            handles,
        })
    }

    /// One importer of the block exported at `ptr` has released it (its
    /// release message, or its process gone). When none is left, the block
    /// is unpinned, and freed now if its owner freed it meanwhile.
    /// [`AllocError::Sharing`] when no export of `ptr` is outstanding.
    pub fn end_export(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        let ctx = self.ctx();
        let mut st = self.lock()?;
        let registry = &self.core.exports;
        let mut exports = registry.lock()?;
        let Some(pin) = exports.pins.get_mut(&ptr) else {
            return Err(AllocError::Sharing {
                reason: format!("no export of {ptr:#x} is outstanding"),
            });
        };
        if pin.exports > 1 {
            pin.exports -= 1;
            return Ok(());
        }
        // The last export: the owner's deferred free happens now (a failure
        // leaves the export outstanding, to be ended again).
        if pin.freed {
            st.free(&ctx, ptr)?;
        }
        exports.pins.remove(&ptr);
        registry
            .any
            .store(!exports.pins.is_empty(), Ordering::Relaxed);
        Ok(())
    }

    /// Exports outstanding (imports other processes may still hold), in total.
    pub fn exports_outstanding(&self) -> u64 {
        self.core
            .exports
            .lock()
            .map(|e| e.outstanding())
            .unwrap_or(0)
    }
}
