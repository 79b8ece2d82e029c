//! Export pins: the exports of an allocator's allocations that other
//! processes still hold ([`crate::ipc`]), and the owner's frees they defer.
//!
//! Contract: [`ExportPins::pin`] counts one export of a live pointer; a free
//! of a pinned pointer is deferred ([`OnFree::Deferred`]) until the end of
//! its last export ([`OnEnd::FreeNow`]), and a pointer freed while pinned
//! refuses a second free and every other use ([`ExportPins::check_usable`]).
//! It holds no lock: it lives inside its allocator's state lock.
//!
//! What "deferred" means is the allocator's: the comm allocator keeps a freed
//! buffer out of its cache, Quilt keeps the block live, pages mapped.

use std::collections::BTreeMap;

use quilt_vmm::DevicePtr;

use crate::error::AllocError;

/// One pinned pointer: exports outstanding (at least one), and whether its
/// owner freed it meanwhile.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pin {
    exports: u32,
    freed: bool,
}

/// The pinned pointers of one allocator (see the module documentation).
#[derive(Debug, Default)]
pub struct ExportPins {
    pins: BTreeMap<DevicePtr, Pin>,
}

/// What [`ExportPins::on_free`] decides about a free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFree {
    /// Not pinned: free it now.
    Now,
    /// Pinned: the free waits for the end of its last export.
    Deferred,
}

/// What [`ExportPins::end`] leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnEnd {
    /// Other exports of it are outstanding: still pinned.
    Pinned,
    /// That was the last export, and the owner has not freed it: unpinned.
    Unpinned,
    /// That was the last export of a pointer its owner freed: the caller
    /// does the deferred free now, then [`ExportPins::unpin_freed`]. Until
    /// then the export stays outstanding (a failed free is ended again).
    FreeNow,
}

impl ExportPins {
    /// No export is outstanding (a free can skip the lookup).
    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    /// At least one export of `ptr` is outstanding.
    pub fn is_pinned(&self, ptr: DevicePtr) -> bool {
        self.pins.contains_key(&ptr)
    }

    /// Count one more export of the live, usable pointer `ptr`.
    pub fn pin(&mut self, ptr: DevicePtr) {
        self.pins
            .entry(ptr)
            .or_insert(Pin {
                exports: 0,
                freed: false,
            })
            .exports += 1;
    }

    /// The owner frees `ptr`: [`OnFree::Deferred`] while it is pinned (and
    /// from then on it refuses other uses), [`AllocError::DoubleFree`] when
    /// it was freed while pinned already.
    pub fn on_free(&mut self, ptr: DevicePtr) -> Result<OnFree, AllocError> {
        match self.pins.get_mut(&ptr) {
            None => Ok(OnFree::Now),
            Some(pin) if pin.freed => Err(AllocError::DoubleFree { ptr }),
            Some(pin) => {
                pin.freed = true;
                Ok(OnFree::Deferred)
            }
        }
    }

    /// [`AllocError::UnknownPointer`] when `ptr` was freed by its owner and
    /// waits for its importers: nothing but the end of its exports may
    /// touch it then.
    pub fn check_usable(&self, ptr: DevicePtr) -> Result<(), AllocError> {
        match self.pins.get(&ptr) {
            Some(pin) if pin.freed => Err(AllocError::UnknownPointer { ptr }),
            _ => Ok(()),
        }
    }

    /// One export of `ptr` has ended (its importer's release, or its
    /// process gone). [`AllocError::Sharing`] when none is outstanding.
    pub fn end(&mut self, ptr: DevicePtr) -> Result<OnEnd, AllocError> {
        let Some(pin) = self.pins.get_mut(&ptr) else {
            return Err(AllocError::Sharing {
                reason: format!("no export of {ptr:#x} is outstanding"),
            });
        };
        if pin.exports > 1 {
            pin.exports -= 1;
            Ok(OnEnd::Pinned)
        } else if pin.freed {
            Ok(OnEnd::FreeNow)
        } else {
            self.pins.remove(&ptr);
            Ok(OnEnd::Unpinned)
        }
    }

    /// The deferred free that [`OnEnd::FreeNow`] asked for is done: forget
    /// `ptr`.
    pub fn unpin_freed(&mut self, ptr: DevicePtr) {
        self.pins.remove(&ptr);
    }

    /// Exports outstanding, over every pointer.
    pub fn outstanding(&self) -> u64 {
        self.pins.values().map(|p| u64::from(p.exports)).sum()
    }

    /// Every pinned pointer with its exports outstanding and whether its
    /// owner freed it, in address order.
    pub fn iter(&self) -> impl Iterator<Item = (DevicePtr, u32, bool)> + '_ {
        self.pins
            .iter()
            .map(|(&p, pin)| (p, pin.exports, pin.freed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_free_of_a_pinned_pointer_waits_for_its_last_export() {
        let mut pins = ExportPins::default();
        assert_eq!(pins.on_free(0x1000).unwrap(), OnFree::Now);
        pins.pin(0x1000);
        pins.pin(0x1000);
        assert_eq!(pins.outstanding(), 2);
        assert!(pins.check_usable(0x1000).is_ok());
        assert_eq!(pins.on_free(0x1000).unwrap(), OnFree::Deferred);
        assert_eq!(
            pins.on_free(0x1000),
            Err(AllocError::DoubleFree { ptr: 0x1000 })
        );
        assert_eq!(
            pins.check_usable(0x1000),
            Err(AllocError::UnknownPointer { ptr: 0x1000 })
        );
        assert_eq!(pins.end(0x1000).unwrap(), OnEnd::Pinned);
        assert_eq!(pins.end(0x1000).unwrap(), OnEnd::FreeNow);
        assert!(pins.is_pinned(0x1000), "pinned until the free is done");
        pins.unpin_freed(0x1000);
        assert!(pins.is_empty());
        assert!(matches!(pins.end(0x1000), Err(AllocError::Sharing { .. })));
    }

    #[test]
    fn the_last_end_of_a_live_pointer_unpins_it() {
        let mut pins = ExportPins::default();
        pins.pin(0x2000);
        assert_eq!(pins.iter().collect::<Vec<_>>(), [(0x2000, 1, false)]);
        assert_eq!(pins.end(0x2000).unwrap(), OnEnd::Unpinned);
        assert!(pins.is_empty());
        assert_eq!(pins.on_free(0x2000).unwrap(), OnFree::Now);
    }
}
