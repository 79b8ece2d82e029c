//! Bookkeeping shared by the real backends (host and CUDA): every rule of the
//! [`crate::Vmm`] trait, checked *before* any system or driver call.
//!
//! The real backends call `check_*` first, make the system or driver call only
//! when it returns `Ok`, then commit the change with the matching `add_*` /
//! `remove_*` method. Because bad input is stopped here, no address outside a
//! live reservation ever reaches `mmap`, `mprotect` or the driver: this is what
//! makes the host backend's `unsafe` sound.
//!
//! Invariants (hold between any two calls):
//! - reservations do not overlap one another;
//! - every mapping lies inside exactly one reservation, and mappings do not overlap;
//! - every mapping names a handle present in `handles`, with
//!   `offset + size <= handle.size`, and `handle.mappings` counts them exactly;
//! - a handle is in `handles` while it is unreleased or still mapped; a released
//!   handle with no mapping left is removed at once;
//! - `used` is the sum of the sizes of the handles in `handles`, and never
//!   exceeds `capacity` where there is one.

use std::collections::BTreeMap;

use crate::error::{Result, VmmError};
use crate::types::{CallKind, DevicePtr, PhysHandle};

/// One piece of physical memory, with the backend's own payload (the memfd on
/// the host, the driver's handle on CUDA).
#[derive(Debug)]
pub(crate) struct HandleEntry<P> {
    /// Bytes of physical memory.
    pub size: u64,
    /// True once `release` was called; the entry lives on until its last unmap.
    pub released: bool,
    /// Mappings that name this handle.
    pub mappings: usize,
    /// The backend's object behind the handle.
    pub payload: P,
}

/// One mapping: `size` bytes of `handle`, at the key address.
#[derive(Debug, Clone)]
pub(crate) struct MappingEntry {
    /// Bytes mapped.
    pub size: u64,
    /// The handle mapped.
    pub handle: u64,
    /// One flag per granule of the mapping: true once `set_access` covered it.
    pub accessible: Vec<bool>,
}

/// What a real backend still holds: handles, reservations, mappings and
/// events that were never given back. All zero ([`LeakReport::is_clean`]) once
/// every `create` was released, every `reserve` freed, every `map` unmapped and
/// every event destroyed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Handles not yet released.
    pub handles: usize,
    /// Handles released but still mapped (their memory lives until the last unmap).
    pub released_but_mapped: usize,
    /// Address reservations not yet freed.
    pub reservations: usize,
    /// Mappings not yet unmapped.
    pub mappings: usize,
    /// Events not yet destroyed.
    pub events: usize,
    /// Bytes of physical memory behind the live handles.
    pub bytes: u64,
}

impl LeakReport {
    /// True when nothing is left alive.
    pub fn is_clean(&self) -> bool {
        *self == LeakReport::default()
    }
}

impl std::fmt::Display for LeakReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} handle(s) ({} bytes, {} released but still mapped), {} reservation(s), {} mapping(s), {} event(s) alive",
            self.handles + self.released_but_mapped,
            self.bytes,
            self.released_but_mapped,
            self.reservations,
            self.mappings,
            self.events
        )
    }
}

/// Everything still alive, taken out of a ledger so its owner can tear it down.
pub(crate) struct Drained<P> {
    /// Mappings as (address, size).
    pub mappings: Vec<(DevicePtr, u64)>,
    /// Handles as (released already?, payload).
    pub handles: Vec<(bool, P)>,
    /// Reservations as (address, size).
    pub reservations: Vec<(DevicePtr, u64)>,
}

/// The rules and the state of one backend's reservations, handles and mappings.
#[derive(Debug)]
pub(crate) struct Ledger<P> {
    granularity: u64,
    capacity: Option<u64>,
    used: u64,
    next_handle: u64,
    reservations: BTreeMap<DevicePtr, u64>,
    handles: BTreeMap<u64, HandleEntry<P>>,
    mappings: BTreeMap<DevicePtr, MappingEntry>,
}

fn invalid(call: CallKind, argument: &'static str, value: u64, rule: &'static str) -> VmmError {
    VmmError::InvalidArgument {
        call,
        argument,
        value,
        rule,
    }
}

impl<P> Ledger<P> {
    /// An empty ledger. `granularity` must be a power of two (the backends check
    /// it); `capacity` limits the bytes of live handles where it is `Some`.
    pub fn new(granularity: u64, capacity: Option<u64>) -> Self {
        Ledger {
            granularity,
            capacity,
            used: 0,
            next_handle: 1,
            reservations: BTreeMap::new(),
            handles: BTreeMap::new(),
            mappings: BTreeMap::new(),
        }
    }

    /// Bytes of physical memory behind live handles.
    pub fn used(&self) -> u64 {
        self.used
    }

    fn aligned(&self, value: u64) -> bool {
        value.is_multiple_of(self.granularity)
    }

    fn check_size(&self, call: CallKind, size: u64) -> Result<()> {
        if size == 0 || !self.aligned(size) {
            return Err(invalid(
                call,
                "size",
                size,
                "must be a non-zero multiple of the granularity",
            ));
        }
        Ok(())
    }

    fn check_ptr(&self, call: CallKind, ptr: DevicePtr) -> Result<()> {
        if !self.aligned(ptr) {
            return Err(invalid(
                call,
                "ptr",
                ptr,
                "must be a multiple of the granularity",
            ));
        }
        Ok(())
    }

    fn end_of(call: CallKind, ptr: DevicePtr, size: u64) -> Result<u64> {
        ptr.checked_add(size)
            .ok_or_else(|| invalid(call, "size", size, "ptr + size overflows the address space"))
    }

    /// The mapping that contains `addr`, if any, as (start, entry).
    fn mapping_containing(&self, addr: DevicePtr) -> Option<(DevicePtr, &MappingEntry)> {
        self.mappings
            .range(..=addr)
            .next_back()
            .filter(|(start, m)| addr < *start + m.size)
            .map(|(start, m)| (*start, m))
    }

    /// True when some mapping overlaps `[start, end)`.
    fn overlaps_mapping(&self, start: DevicePtr, end: DevicePtr) -> bool {
        self.mappings
            .range(..end)
            .next_back()
            .is_some_and(|(s, m)| s + m.size > start)
    }

    /// The reservation that wholly contains `[start, end)`, if any.
    fn reservation_containing(&self, start: DevicePtr, end: DevicePtr) -> Option<DevicePtr> {
        self.reservations
            .range(..=start)
            .next_back()
            .filter(|(s, size)| end <= *s + *size)
            .map(|(s, _)| *s)
    }

    // ---- reserve / address_free ----

    /// Checks a `reserve(size, alignment)`; returns the effective alignment
    /// (the granularity when `alignment` is 0).
    pub fn check_reserve(&self, size: u64, alignment: u64) -> Result<u64> {
        self.check_size(CallKind::Reserve, size)?;
        let alignment = if alignment == 0 {
            self.granularity
        } else {
            alignment
        };
        if !alignment.is_power_of_two() || !self.aligned(alignment) {
            return Err(invalid(
                CallKind::Reserve,
                "alignment",
                alignment,
                "must be 0 or a power-of-two multiple of the granularity",
            ));
        }
        Ok(alignment)
    }

    /// Records a reservation the backend has made.
    pub fn add_reservation(&mut self, ptr: DevicePtr, size: u64) {
        self.reservations.insert(ptr, size);
    }

    /// Checks an `address_free(ptr, size)`: a whole live reservation with no mapping left.
    pub fn check_address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let Some(&reserved) = self.reservations.get(&ptr) else {
            return Err(VmmError::NotMapped {
                call: CallKind::AddressFree,
                ptr,
                size,
            });
        };
        if reserved != size {
            return Err(invalid(
                CallKind::AddressFree,
                "size",
                size,
                "must equal the size of the reservation",
            ));
        }
        let mappings = self.mappings.range(ptr..ptr + size).count();
        if mappings > 0 {
            return Err(VmmError::StillMapped {
                call: CallKind::AddressFree,
                ptr,
                size,
                mappings,
            });
        }
        Ok(())
    }

    /// Forgets a reservation the backend has freed.
    pub fn remove_reservation(&mut self, ptr: DevicePtr) {
        self.reservations.remove(&ptr);
    }

    // ---- create / release ----

    /// Checks a `create(size)`: size rule, then capacity.
    pub fn check_create(&self, size: u64) -> Result<()> {
        self.check_size(CallKind::Create, size)?;
        if let Some(capacity) = self.capacity {
            let available = capacity.saturating_sub(self.used);
            if size > available {
                return Err(VmmError::OutOfMemory {
                    call: CallKind::Create,
                    requested: size,
                    available,
                });
            }
        }
        Ok(())
    }

    /// Records a handle the backend has created; returns its id.
    pub fn add_handle(&mut self, size: u64, payload: P) -> PhysHandle {
        let id = self.next_handle;
        self.next_handle += 1;
        self.used += size;
        self.handles.insert(
            id,
            HandleEntry {
                size,
                released: false,
                mappings: 0,
                payload,
            },
        );
        PhysHandle(id)
    }

    /// The payload of a live (unreleased) handle.
    pub fn live_handle(&self, call: CallKind, handle: PhysHandle) -> Result<&HandleEntry<P>> {
        match self.handles.get(&handle.0) {
            Some(entry) if !entry.released => Ok(entry),
            _ => Err(invalid(
                call,
                "handle",
                handle.0,
                "is not a live handle (never created, or already released)",
            )),
        }
    }

    /// Marks a live handle released (check it first with [`Ledger::live_handle`]).
    /// Returns its payload when no mapping names it any more, so the caller can
    /// free it; `None` while mappings keep it alive.
    pub fn release(&mut self, handle: PhysHandle) -> Option<P> {
        let entry = self.handles.get_mut(&handle.0)?;
        entry.released = true;
        if entry.mappings == 0 {
            self.take_handle(handle.0)
        } else {
            None
        }
    }

    fn take_handle(&mut self, id: u64) -> Option<P> {
        let entry = self.handles.remove(&id)?;
        self.used -= entry.size;
        Some(entry.payload)
    }

    // ---- map / unmap ----

    /// Checks a `map(ptr, size, handle, offset)` against every rule; returns the handle's entry.
    pub fn check_map(
        &self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> Result<&HandleEntry<P>> {
        let call = CallKind::Map;
        if ptr == 0 {
            return Err(invalid(call, "ptr", ptr, "must be non-zero"));
        }
        self.check_ptr(call, ptr)?;
        self.check_size(call, size)?;
        if !self.aligned(offset) {
            return Err(invalid(
                call,
                "offset",
                offset,
                "must be a multiple of the granularity",
            ));
        }
        let end = Self::end_of(call, ptr, size)?;
        let entry = self.live_handle(call, handle)?;
        if offset.checked_add(size).is_none_or(|end| end > entry.size) {
            return Err(invalid(
                call,
                "offset",
                offset,
                "offset + size must lie inside the handle",
            ));
        }
        if self.reservation_containing(ptr, end).is_none() {
            return Err(invalid(
                call,
                "ptr",
                ptr,
                "ptr..ptr+size must lie inside one live reservation",
            ));
        }
        if self.overlaps_mapping(ptr, end) {
            return Err(VmmError::AlreadyMapped { call, ptr, size });
        }
        Ok(entry)
    }

    /// Records a mapping the backend has made (checked by [`Ledger::check_map`]).
    pub fn add_mapping(&mut self, ptr: DevicePtr, size: u64, handle: PhysHandle) {
        if let Some(entry) = self.handles.get_mut(&handle.0) {
            entry.mappings += 1;
        }
        let granules = (size / self.granularity) as usize;
        self.mappings.insert(
            ptr,
            MappingEntry {
                size,
                handle: handle.0,
                accessible: vec![false; granules],
            },
        );
    }

    /// Checks an `unmap(ptr, size)`: the range must be exactly a run of whole,
    /// neighbouring mappings. Returns their start addresses.
    pub fn check_unmap(&self, ptr: DevicePtr, size: u64) -> Result<Vec<DevicePtr>> {
        let call = CallKind::Unmap;
        self.check_ptr(call, ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        if let Some((start, _)) = self.mapping_containing(ptr) {
            if start != ptr {
                return Err(invalid(
                    call,
                    "ptr",
                    ptr,
                    "must be the start of a mapping (unmap whole mappings only)",
                ));
            }
        }
        let mut starts = Vec::new();
        let mut cursor = ptr;
        while cursor < end {
            let Some(m) = self.mappings.get(&cursor) else {
                return Err(VmmError::NotMapped { call, ptr, size });
            };
            let next = cursor + m.size;
            if next > end {
                return Err(invalid(
                    call,
                    "size",
                    size,
                    "must end at the end of a mapping (unmap whole mappings only)",
                ));
            }
            starts.push(cursor);
            cursor = next;
        }
        Ok(starts)
    }

    /// Forgets mappings the backend has unmapped. Returns the payloads of the
    /// released handles whose last mapping this was, for the caller to free.
    pub fn remove_mappings(&mut self, starts: &[DevicePtr]) -> Vec<P> {
        let mut freed = Vec::new();
        for start in starts {
            let Some(m) = self.mappings.remove(start) else {
                continue;
            };
            let last_of_released = match self.handles.get_mut(&m.handle) {
                Some(entry) => {
                    entry.mappings = entry.mappings.saturating_sub(1);
                    entry.released && entry.mappings == 0
                }
                None => false,
            };
            if last_of_released {
                if let Some(payload) = self.take_handle(m.handle) {
                    freed.push(payload);
                }
            }
        }
        freed
    }

    // ---- access ----

    /// Walks `[ptr, end)` mapping by mapping; calls `visit` with each mapping's
    /// start and the granule range of it that the walk covers. Fails with
    /// `NotMapped { call: hole_call }` at the first byte no mapping covers.
    fn walk<'a>(
        &'a self,
        hole_call: CallKind,
        ptr: DevicePtr,
        end: DevicePtr,
        mut visit: impl FnMut(DevicePtr, &'a MappingEntry, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let mut cursor = ptr;
        while cursor < end {
            let Some((start, m)) = self.mapping_containing(cursor) else {
                return Err(VmmError::NotMapped {
                    call: hole_call,
                    ptr,
                    size: end - ptr,
                });
            };
            let stop = end.min(start + m.size);
            let first = ((cursor - start) / self.granularity) as usize;
            let last = (stop - start).div_ceil(self.granularity) as usize;
            visit(start, m, first, last)?;
            cursor = stop;
        }
        Ok(())
    }

    /// Checks a `set_access(ptr, size)`: aligned, non-empty, and wholly mapped.
    pub fn check_set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::SetAccess;
        self.check_ptr(call, ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        self.walk(call, ptr, end, |_, _, _, _| Ok(()))
    }

    /// Marks `[ptr, ptr + size)` accessible (checked by [`Ledger::check_set_access`]).
    pub fn mark_accessible(&mut self, ptr: DevicePtr, size: u64) {
        let end = ptr.saturating_add(size);
        let mut spans = Vec::new();
        let _ = self.walk(CallKind::SetAccess, ptr, end, |start, _, first, last| {
            spans.push((start, first, last));
            Ok(())
        });
        for (start, first, last) in spans {
            if let Some(m) = self.mappings.get_mut(&start) {
                for flag in &mut m.accessible[first..last] {
                    *flag = true;
                }
            }
        }
    }

    /// Checks that every byte of `[ptr, ptr + len)` is mapped (else `NotMapped`
    /// naming [`CallKind::Map`]) and made accessible (else `InvalidArgument`
    /// naming [`CallKind::SetAccess`]). `len == 0` is always fine.
    pub fn check_accessible(&self, ptr: DevicePtr, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let end = ptr.checked_add(len).ok_or_else(|| {
            invalid(
                CallKind::Map,
                "len",
                len,
                "ptr + len overflows the address space",
            )
        })?;
        self.walk(CallKind::Map, ptr, end, |_, m, first, last| {
            if m.accessible[first..last].iter().all(|a| *a) {
                Ok(())
            } else {
                Err(invalid(
                    CallKind::SetAccess,
                    "ptr",
                    ptr,
                    "the range is mapped but its access was never set",
                ))
            }
        })
    }

    // ---- reports and teardown ----

    /// Counts of what is alive now (`events` left at 0 for the backend to fill).
    pub fn live_counts(&self) -> LeakReport {
        LeakReport {
            handles: self.handles.values().filter(|h| !h.released).count(),
            released_but_mapped: self.handles.values().filter(|h| h.released).count(),
            reservations: self.reservations.len(),
            mappings: self.mappings.len(),
            events: 0,
            bytes: self.used,
        }
    }

    /// Takes everything out, leaving the ledger empty.
    pub fn drain(&mut self) -> Drained<P> {
        let mappings = std::mem::take(&mut self.mappings)
            .into_iter()
            .map(|(p, m)| (p, m.size))
            .collect();
        let handles = std::mem::take(&mut self.handles)
            .into_values()
            .map(|h| (h.released, h.payload))
            .collect();
        let reservations = std::mem::take(&mut self.reservations).into_iter().collect();
        self.used = 0;
        Drained {
            mappings,
            handles,
            reservations,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    fn ledger() -> Ledger<()> {
        let mut l = Ledger::new(G, Some(16 * G));
        l.add_reservation(16 * G, 8 * G);
        l
    }

    #[test]
    fn map_rules_in_order() {
        let mut l = ledger();
        let h = l.add_handle(4 * G, ());
        assert!(l.check_map(16 * G, 2 * G, h, 0).is_ok());
        assert!(matches!(
            l.check_map(16 * G + 1, G, h, 0),
            Err(VmmError::InvalidArgument {
                argument: "ptr",
                ..
            })
        ));
        assert!(matches!(
            l.check_map(16 * G, 0, h, 0),
            Err(VmmError::InvalidArgument {
                argument: "size",
                ..
            })
        ));
        assert!(matches!(
            l.check_map(16 * G, G, h, 4 * G),
            Err(VmmError::InvalidArgument {
                argument: "offset",
                ..
            })
        ));
        assert!(matches!(
            l.check_map(22 * G, 4 * G, h, 0),
            Err(VmmError::InvalidArgument {
                argument: "ptr",
                ..
            })
        ));
        l.add_mapping(16 * G, 2 * G, h);
        assert!(matches!(
            l.check_map(17 * G, 2 * G, h, 0),
            Err(VmmError::AlreadyMapped { .. })
        ));
        assert!(l.check_map(18 * G, 2 * G, h, 0).is_ok());
    }

    #[test]
    fn unmap_needs_whole_neighbouring_mappings() {
        let mut l = ledger();
        let h = l.add_handle(4 * G, ());
        l.add_mapping(16 * G, 2 * G, h);
        l.add_mapping(18 * G, G, h);
        assert_eq!(l.check_unmap(16 * G, 3 * G).unwrap(), vec![16 * G, 18 * G]);
        assert!(matches!(
            l.check_unmap(17 * G, G),
            Err(VmmError::InvalidArgument {
                argument: "ptr",
                ..
            })
        ));
        assert!(matches!(
            l.check_unmap(16 * G, G),
            Err(VmmError::InvalidArgument {
                argument: "size",
                ..
            })
        ));
        assert!(matches!(
            l.check_unmap(16 * G, 4 * G),
            Err(VmmError::NotMapped { .. })
        ));
        assert!(matches!(
            l.check_unmap(20 * G, G),
            Err(VmmError::NotMapped { .. })
        ));
    }

    #[test]
    fn released_handle_lives_until_last_unmap() {
        let mut l = ledger();
        let h = l.add_handle(2 * G, ());
        l.add_mapping(16 * G, G, h);
        l.add_mapping(18 * G, G, h);
        assert!(l.release(h).is_none());
        assert_eq!(l.used(), 2 * G);
        assert!(l.live_handle(CallKind::Map, h).is_err());
        assert!(l.remove_mappings(&[16 * G]).is_empty());
        assert_eq!(l.remove_mappings(&[18 * G]).len(), 1);
        assert_eq!(l.used(), 0);
        let live = l.live_counts();
        assert_eq!(
            (live.handles, live.released_but_mapped, live.mappings),
            (0, 0, 0)
        );
        assert_eq!(live.reservations, 1);
    }

    #[test]
    fn access_is_tracked_per_granule() {
        let mut l = ledger();
        let h = l.add_handle(4 * G, ());
        l.add_mapping(16 * G, 4 * G, h);
        l.mark_accessible(17 * G, G);
        assert!(l.check_accessible(17 * G + 5, 100).is_ok());
        assert!(matches!(
            l.check_accessible(16 * G, 2 * G),
            Err(VmmError::InvalidArgument {
                call: CallKind::SetAccess,
                ..
            })
        ));
        assert!(matches!(
            l.check_accessible(19 * G, 2 * G),
            Err(VmmError::InvalidArgument { .. })
        ));
        l.mark_accessible(16 * G, 4 * G);
        assert!(matches!(
            l.check_accessible(19 * G, 2 * G),
            Err(VmmError::NotMapped { .. })
        ));
        assert!(l.check_set_access(16 * G, 5 * G).is_err());
    }

    #[test]
    fn capacity_and_address_free() {
        let mut l = ledger();
        assert!(matches!(
            l.check_create(17 * G),
            Err(VmmError::OutOfMemory {
                requested,
                available,
                ..
            }) if requested == 17 * G && available == 16 * G
        ));
        let h = l.add_handle(G, ());
        l.add_mapping(16 * G, G, h);
        assert!(matches!(
            l.check_address_free(16 * G, 8 * G),
            Err(VmmError::StillMapped { mappings: 1, .. })
        ));
        assert!(matches!(
            l.check_address_free(16 * G, 4 * G),
            Err(VmmError::InvalidArgument {
                argument: "size",
                ..
            })
        ));
        assert!(matches!(
            l.check_address_free(32 * G, 8 * G),
            Err(VmmError::NotMapped { .. })
        ));
    }
}
