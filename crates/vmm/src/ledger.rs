//! The driver layer's rules and bookkeeping, shared by every backend (CUDA,
//! host and simulated): every rule of the [`crate::Vmm`] trait, checked *before*
//! any system or driver call.
//!
//! Every `Vmm` call of every backend goes through one method per call here
//! ([`Ledger::reserve`], [`Ledger::map`], ...) that runs the sequence once:
//! the `check_*` rule first, the backend's system or driver call (a closure;
//! the simulated backend passes a no-op) only when it returns `Ok`, then the
//! commit (the matching `add_*` / `remove_*` / `mark_*` method). A failed
//! check changes nothing. Because bad input is stopped here, no address outside a
//! live reservation ever reaches `mmap`, `mprotect` or the driver: this is what
//! makes the host backend's `unsafe` sound.
//!
//! The map rule ([`MapRule`], [`Ledger::set_map_rule`]) is the ledger's one
//! setting: by default ([`MapRule::WholeHandle`], CUDA's documented rule) a
//! `map` must name offset 0 and the handle's whole size; [`MapRule::AnyOffset`]
//! accepts any granule-aligned part of a handle, for what-if experiments on the
//! simulated and host backends. The CUDA backend never relaxes it.
//!
//! Every look-up is a `BTreeMap` interval query: O(log n) per call, plus
//! O(k log n) for an unmap or set-access covering k mappings.
//!
//! Invariants (hold between any two calls; [`Ledger::check_invariants`] checks them):
//! - reservations are non-empty multiples of the granularity and do not overlap
//!   one another; `reserved` is the sum of their sizes;
//! - every mapping lies inside exactly one reservation, and mappings do not
//!   overlap; `mapped` is the sum of their sizes;
//! - every mapping names a handle present in `handles`, with
//!   `offset + size <= handle.size` (under [`MapRule::WholeHandle`]: `offset == 0`
//!   and `size == handle.size`), and `handle.mappings` counts them exactly;
//! - a handle is in `handles` while it is unreleased or still mapped; a released
//!   handle with no mapping left is removed at once;
//! - `used` is the sum of the sizes of the handles in `handles`, and never
//!   exceeds `capacity`.

use std::collections::BTreeMap;

use crate::error::{Result, VmmError};
use crate::leak::LeakReport;
use crate::share::{CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, HandleTypes};
use crate::types::{CallKind, DevicePtr, MapRule, MemInfo, PhysHandle};

/// The rule a non-zero `offset` breaks under [`MapRule::WholeHandle`].
pub(crate) const OFFSET_MUST_BE_ZERO: &str = "must be zero: cuMemMap's offset \"currently must be zero\" \
     (CUDA driver API reference; map rule whole-handle, MapRule::AnyOffset relaxes it for experiments)";

/// The rule a partial mapping breaks under [`MapRule::WholeHandle`].
pub(crate) const SIZE_MUST_BE_WHOLE_HANDLE: &str =
    "must equal the handle's size: a mapping covers its \
     handle whole, at offset 0 (map rule whole-handle, CUDA's documented rule; \
     MapRule::AnyOffset relaxes it for experiments)";

/// One piece of physical memory, with the backend's own payload (the memfd on
/// the host, the driver's handle on CUDA, nothing on the simulated backend).
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
    /// The handle types it can be exported as (requested at create, or the
    /// kind it was imported from).
    pub handle_types: HandleTypes,
}

/// Which granules of a mapping `set_access` has covered.
///
/// Invariant: `Partial` holds one flag per granule of its mapping, at least
/// one of them true and at least one false.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Access {
    /// No granule yet (a fresh mapping).
    None,
    /// Every granule (the common case: one set-access over whole mappings).
    All,
    /// Some granules, flagged one by one.
    Partial(Vec<bool>),
}

impl Access {
    /// Marks granules `first..last` of a mapping of `granules` granules.
    fn mark(&mut self, first: usize, last: usize, granules: usize) {
        if matches!(self, Access::All) || last <= first {
            return;
        }
        if first == 0 && last >= granules {
            *self = Access::All;
            return;
        }
        if matches!(self, Access::None) {
            *self = Access::Partial(vec![false; granules]);
        }
        if let Access::Partial(flags) = self {
            for flag in &mut flags[first..last.min(granules)] {
                *flag = true;
            }
            if flags.iter().all(|f| *f) {
                *self = Access::All;
            }
        }
    }

    /// True when every granule of `first..last` is marked.
    fn covers(&self, first: usize, last: usize) -> bool {
        match self {
            Access::None => last <= first,
            Access::All => true,
            Access::Partial(flags) => flags[first..last].iter().all(|f| *f),
        }
    }

    /// True when any granule is marked.
    pub fn any(&self) -> bool {
        !matches!(self, Access::None)
    }
}

/// One mapping: `size` bytes of `handle` from `offset`, at the key address.
#[derive(Debug, Clone)]
pub(crate) struct MappingEntry {
    /// Bytes mapped.
    pub size: u64,
    /// The handle mapped.
    pub handle: u64,
    /// Where in the handle the mapping starts.
    pub offset: u64,
    /// Which granules `set_access` has covered since the mapping was made.
    pub access: Access,
    /// The same for other devices (`set_access_for` naming them), by ordinal;
    /// empty unless peers were named.
    pub peers: Vec<(DeviceOrdinal, Access)>,
}

/// Everything still alive, taken out of a ledger so its owner can tear it down.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend tears down this way
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
    map_rule: MapRule,
    capacity: u64,
    used: u64,
    reserved: u64,
    mapped: u64,
    next_handle: u64,
    reservations: BTreeMap<DevicePtr, u64>,
    handles: BTreeMap<u64, HandleEntry<P>>,
    mappings: BTreeMap<DevicePtr, MappingEntry>,
    /// What the device supports for sharing (a lone device sharing nothing
    /// until [`Ledger::set_caps`]).
    caps: DeviceCaps,
    /// Ranges a copy is reading or writing now, as (start, length), one
    /// entry per copy in flight: an unmap that touches one is refused
    /// ([`Ledger::pin`]).
    pins: Vec<(DevicePtr, u64)>,
}

/// An `InvalidArgument` error.
pub(crate) fn invalid(
    call: CallKind,
    argument: &'static str,
    value: u64,
    rule: &'static str,
) -> VmmError {
    VmmError::InvalidArgument {
        call,
        argument,
        value,
        rule,
    }
}

impl<P> Ledger<P> {
    /// An empty ledger under [`MapRule::WholeHandle`]. `granularity` must be a
    /// power of two (the backends check it); `capacity` limits the bytes of
    /// live handles (`u64::MAX`: no limit).
    pub fn new(granularity: u64, capacity: u64) -> Self {
        Ledger {
            granularity,
            map_rule: MapRule::WholeHandle,
            capacity,
            used: 0,
            reserved: 0,
            mapped: 0,
            next_handle: 1,
            reservations: BTreeMap::new(),
            handles: BTreeMap::new(),
            mappings: BTreeMap::new(),
            caps: DeviceCaps::single(granularity),
            pins: Vec::new(),
        }
    }

    /// Sets what the device supports for sharing (backends call it once, at
    /// construction): the handle types `create_with` may request, the RDMA
    /// flag, and the devices `set_access_for` may name.
    pub fn set_caps(&mut self, caps: DeviceCaps) {
        self.caps = caps;
    }

    /// What the device supports for sharing.
    pub fn caps(&self) -> DeviceCaps {
        self.caps
    }

    /// Sets the map rule. Backends call it once, before the first `map`
    /// (mappings made under a looser rule would break the stricter invariant).
    pub fn set_map_rule(&mut self, rule: MapRule) {
        self.map_rule = rule;
    }

    /// The map rule in force.
    pub fn map_rule(&self) -> MapRule {
        self.map_rule
    }

    /// Bytes of physical memory behind live handles (unreleased, or released
    /// but still mapped).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Bytes of address space in live reservations.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped
    }

    /// The capacity as total, and what live handles leave of it as free.
    pub fn mem_info(&self) -> MemInfo {
        MemInfo {
            total: self.capacity,
            free: self.capacity.saturating_sub(self.used),
        }
    }

    /// Live reservations as (start, size), by address.
    pub fn reservations(&self) -> impl Iterator<Item = (DevicePtr, u64)> + '_ {
        self.reservations.iter().map(|(p, s)| (*p, *s))
    }

    fn aligned(&self, value: u64) -> bool {
        value.is_multiple_of(self.granularity)
    }

    fn check_aligned(&self, call: CallKind, argument: &'static str, value: u64) -> Result<()> {
        if !self.aligned(value) {
            return Err(invalid(
                call,
                argument,
                value,
                "must be a multiple of the granularity",
            ));
        }
        Ok(())
    }

    fn check_size(&self, call: CallKind, size: u64) -> Result<()> {
        if size == 0 {
            return Err(invalid(call, "size", size, "must be non-zero"));
        }
        self.check_aligned(call, "size", size)
    }

    fn end_of(call: CallKind, ptr: DevicePtr, size: u64) -> Result<u64> {
        ptr.checked_add(size)
            .ok_or_else(|| invalid(call, "size", size, "ptr + size overflows the address space"))
    }

    /// The mapping that contains `addr`, if any, as (start, entry).
    pub fn mapping_containing(&self, addr: DevicePtr) -> Option<(DevicePtr, &MappingEntry)> {
        self.mappings
            .range(..=addr)
            .next_back()
            .filter(|(start, m)| addr < start.saturating_add(m.size))
            .map(|(start, m)| (*start, m))
    }

    /// True when some mapping overlaps `[start, end)`. Mappings never overlap,
    /// so the last one starting before `end` is the only one that can reach in.
    fn overlaps_mapping(&self, start: DevicePtr, end: DevicePtr) -> bool {
        self.mappings
            .range(..end)
            .next_back()
            .is_some_and(|(s, m)| s.saturating_add(m.size) > start)
    }

    /// The reservation that wholly contains `[start, end)`, if any.
    fn reservation_containing(&self, start: DevicePtr, end: DevicePtr) -> Option<DevicePtr> {
        self.reservations
            .range(..=start)
            .next_back()
            .filter(|(s, size)| end <= s.saturating_add(**size))
            .map(|(s, _)| *s)
    }

    // ---- reserve / address_free ----

    /// Checks a `reserve(size, alignment)`; returns the effective alignment
    /// (the granularity when `alignment` is 0).
    pub fn check_reserve(&self, size: u64, alignment: u64) -> Result<u64> {
        let call = CallKind::Reserve;
        self.check_size(call, size)?;
        let alignment = if alignment == 0 {
            self.granularity
        } else {
            alignment
        };
        if !alignment.is_power_of_two() {
            return Err(invalid(
                call,
                "alignment",
                alignment,
                "must be 0 or a power of two",
            ));
        }
        self.check_aligned(call, "alignment", alignment)?;
        Ok(alignment)
    }

    /// Records a reservation the backend has made.
    pub fn add_reservation(&mut self, ptr: DevicePtr, size: u64) {
        if self.reservations.insert(ptr, size).is_none() {
            self.reserved += size;
        }
    }

    /// Checks an `address_free(ptr, size)`: a whole live reservation with no mapping left.
    pub fn check_address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::AddressFree;
        let Some(&reserved) = self.reservations.get(&ptr) else {
            return Err(VmmError::NotMapped { call, ptr, size });
        };
        if reserved != size {
            return Err(invalid(
                call,
                "size",
                size,
                "must equal the size of the reservation",
            ));
        }
        let end = ptr.saturating_add(size);
        if self.mappings.range(ptr..end).next().is_some() {
            return Err(VmmError::StillMapped {
                call,
                ptr,
                size,
                mappings: self.mappings.range(ptr..end).count(),
            });
        }
        Ok(())
    }

    /// Forgets a reservation the backend has freed.
    pub fn remove_reservation(&mut self, ptr: DevicePtr) {
        if let Some(size) = self.reservations.remove(&ptr) {
            self.reserved -= size;
        }
    }

    // ---- create / release ----

    /// Checks a `create(size)`: size rule, then capacity.
    pub fn check_create(&self, size: u64) -> Result<()> {
        self.check_size(CallKind::Create, size)?;
        let available = self.capacity.saturating_sub(self.used);
        if size > available {
            return Err(VmmError::OutOfMemory {
                call: CallKind::Create,
                requested: size,
                available,
            });
        }
        Ok(())
    }

    /// Records a handle the backend has created (requesting no shareable
    /// handle type); returns its id.
    #[cfg(test)]
    pub fn add_handle(&mut self, size: u64, payload: P) -> PhysHandle {
        self.add_handle_of(size, payload, HandleTypes::NONE)
    }

    /// Records a handle the backend has created or imported with
    /// `handle_types`; returns its id. One map insertion: `create` runs it
    /// once per page.
    fn add_handle_of(&mut self, size: u64, payload: P, handle_types: HandleTypes) -> PhysHandle {
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
                handle_types,
            },
        );
        PhysHandle(id)
    }

    /// The entry of a live (unreleased) handle.
    pub fn live_handle(&self, call: CallKind, handle: PhysHandle) -> Result<&HandleEntry<P>> {
        match self.handles.get(&handle.0) {
            Some(entry) if !entry.released => Ok(entry),
            Some(_) => Err(invalid(
                call,
                "handle",
                handle.0,
                "was released already (its memory lives on while still mapped)",
            )),
            None => Err(invalid(
                call,
                "handle",
                handle.0,
                "is not a live handle (never created, or released and unmapped)",
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
    ///
    /// In order: `ptr` non-zero and aligned, `size` non-zero and aligned,
    /// `offset` aligned, a live handle, `offset + size` inside it (argument
    /// `offset`), then the map rule (under [`MapRule::WholeHandle`]: `offset`
    /// zero, then `size` equal to the handle's), then one live reservation
    /// holding the range (`ptr`), then no overlap (`AlreadyMapped`).
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
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        self.check_aligned(call, "offset", offset)?;
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
        if self.map_rule == MapRule::WholeHandle {
            if offset != 0 {
                return Err(invalid(call, "offset", offset, OFFSET_MUST_BE_ZERO));
            }
            if size != entry.size {
                return Err(invalid(call, "size", size, SIZE_MUST_BE_WHOLE_HANDLE));
            }
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
    pub fn add_mapping(&mut self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) {
        if let Some(entry) = self.handles.get_mut(&handle.0) {
            entry.mappings += 1;
        }
        self.mapped += size;
        self.mappings.insert(
            ptr,
            MappingEntry {
                size,
                handle: handle.0,
                offset,
                access: Access::None,
                peers: Vec::new(),
            },
        );
    }

    /// Checks an `unmap(ptr, size)`: the range must be exactly a run of whole,
    /// neighbouring mappings. Returns their start addresses.
    pub fn check_unmap(&self, ptr: DevicePtr, size: u64) -> Result<Vec<DevicePtr>> {
        let call = CallKind::Unmap;
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        if let Some((start, _)) = self.mapping_containing(ptr) {
            if start != ptr {
                return Err(invalid(
                    call,
                    "ptr",
                    ptr,
                    "the range starts inside a mapping; unmap must cover whole mappings",
                ));
            }
        }
        let mut starts = Vec::new();
        let mut cursor = ptr;
        for (&start, m) in self.mappings.range(ptr..end) {
            if start != cursor {
                break;
            }
            starts.push(start);
            cursor = start.saturating_add(m.size);
        }
        if cursor < end {
            return Err(VmmError::NotMapped { call, ptr, size });
        }
        if cursor > end {
            return Err(invalid(
                call,
                "size",
                size,
                "the range ends inside a mapping; unmap must cover whole mappings",
            ));
        }
        if self
            .pins
            .iter()
            .any(|&(p, len)| p < end && ptr < p.saturating_add(len))
        {
            return Err(invalid(
                call,
                "ptr",
                ptr,
                "a copy between host and device is reading or writing the range now",
            ));
        }
        Ok(starts)
    }

    /// Pins `[ptr, ptr + len)` for a copy that runs without the ledger's
    /// lock: until [`Ledger::unpin`], an unmap touching it is refused, so
    /// the copy never meets an unmapped range. Call it after
    /// [`Ledger::check_accessible`] succeeded; pins of one range stack.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend copies without the lock
    pub fn pin(&mut self, ptr: DevicePtr, len: u64) {
        self.pins.push((ptr, len));
    }

    /// Takes back one pin of exactly `[ptr, ptr + len)` (nothing when none).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend copies without the lock
    pub fn unpin(&mut self, ptr: DevicePtr, len: u64) {
        if let Some(i) = self.pins.iter().position(|&p| p == (ptr, len)) {
            self.pins.swap_remove(i);
        }
    }

    /// Forgets mappings the backend has unmapped. Returns the payloads of the
    /// released handles whose last mapping this was, for the caller to free.
    pub fn remove_mappings(&mut self, starts: &[DevicePtr]) -> Vec<P> {
        let mut freed = Vec::new();
        for start in starts {
            let Some(m) = self.mappings.remove(start) else {
                continue;
            };
            self.mapped -= m.size;
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

    /// The granules `first..last` of a mapping of `size` bytes at `start`
    /// that `[from, to)` covers (the two overlap).
    fn granules(
        granularity: u64,
        start: DevicePtr,
        size: u64,
        from: DevicePtr,
        to: DevicePtr,
    ) -> (usize, usize) {
        let stop = to.min(start + size);
        let first = (from.max(start) - start) / granularity;
        let last = (stop - start).div_ceil(granularity);
        (first as usize, last as usize)
    }

    /// Walks `[ptr, end)` mapping by mapping; calls `visit` with each mapping
    /// and the granule range of it the walk covers. Fails with
    /// `NotMapped { call: hole_call }` at the first byte no mapping covers.
    fn walk(
        &self,
        hole_call: CallKind,
        ptr: DevicePtr,
        end: DevicePtr,
        mut visit: impl FnMut(&MappingEntry, usize, usize) -> Result<()>,
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
            let (first, last) = Self::granules(self.granularity, start, m.size, cursor, end);
            visit(m, first, last)?;
            cursor = end.min(start + m.size);
        }
        Ok(())
    }

    /// Checks a `set_access(ptr, size)`: aligned, non-empty, and wholly mapped.
    pub fn check_set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::SetAccess;
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        self.walk(call, ptr, end, |_, _, _| Ok(()))
    }

    /// Marks `[ptr, ptr + size)` accessible (checked by [`Ledger::check_set_access`]);
    /// the backends mark through [`Ledger::set_access`].
    #[cfg(test)]
    pub fn mark_accessible(&mut self, ptr: DevicePtr, size: u64) {
        let own = self.caps.ordinal;
        self.mark_accessible_for(ptr, size, &[own]);
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
        self.walk(CallKind::Map, ptr, end, |m, first, last| {
            if m.access.covers(first, last) {
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

    // ---- sharing: handle types, export, import, access for several devices ----

    /// Checks a `create_with(size, props)`: [`Ledger::check_create`], then
    /// every requested handle type and the RDMA flag against the device's
    /// capabilities (CUDA refuses a type the device does not support).
    pub fn check_create_with(&self, size: u64, props: CreateProps) -> Result<()> {
        self.check_create(size)?;
        let supported = self.caps.handle_types;
        if !props.handle_types.is_subset_of(supported) {
            return Err(invalid(
                CallKind::Create,
                "requestedHandleTypes",
                handle_type_bits(props.handle_types),
                "requests a handle type the device does not support (DeviceCaps::handle_types)",
            ));
        }
        if props.gpu_direct_rdma && !self.caps.gpu_direct_rdma_with_vmm {
            return Err(invalid(
                CallKind::Create,
                "allocFlags.gpuDirectRDMACapable",
                1,
                "the device does not report GPUDirect RDMA with VMM support",
            ));
        }
        Ok(())
    }

    /// Checks an `export_handle(handle, kind)`: a live (unreleased) handle
    /// created requesting `kind`. Returns its entry.
    pub fn check_export(&self, handle: PhysHandle, kind: HandleKind) -> Result<&HandleEntry<P>> {
        let entry = self.live_handle(CallKind::ExportHandle, handle)?;
        if !entry.handle_types.contains(kind) {
            return Err(invalid(
                CallKind::ExportHandle,
                "handleType",
                handle_kind_bits(kind),
                "the handle was not created with this handle type in requestedHandleTypes",
            ));
        }
        Ok(entry)
    }

    /// Checks an `import_handle` of `size` bytes of `kind`: a kind the device
    /// supports, a non-zero multiple of the granularity, within capacity
    /// (an imported handle counts as memory this backend holds).
    pub fn check_import(&self, size: u64, kind: HandleKind) -> Result<()> {
        let call = CallKind::ImportHandle;
        if !self.caps.handle_types.contains(kind) {
            return Err(invalid(
                call,
                "shHandleType",
                handle_kind_bits(kind),
                "the device does not support this handle type",
            ));
        }
        self.check_size(call, size)?;
        let available = self.capacity.saturating_sub(self.used);
        if size > available {
            return Err(VmmError::OutOfMemory {
                call,
                requested: size,
                available,
            });
        }
        Ok(())
    }

    /// Checks a `set_access_for(ptr, size, devices)`: the rules of
    /// [`Ledger::check_set_access`], and `devices` non-empty, without
    /// repeats, every ordinal a device of this process.
    pub fn check_set_access_for(
        &self,
        ptr: DevicePtr,
        size: u64,
        devices: &[DeviceOrdinal],
    ) -> Result<()> {
        let call = CallKind::SetAccess;
        if devices.is_empty() {
            return Err(invalid(call, "count", 0, "must name at least one device"));
        }
        for (i, d) in devices.iter().enumerate() {
            if *d >= self.caps.device_count {
                return Err(invalid(
                    call,
                    "location.id",
                    u64::from(*d),
                    "is not a device of this process (ordinal >= device count)",
                ));
            }
            if devices[..i].contains(d) {
                return Err(invalid(
                    call,
                    "location.id",
                    u64::from(*d),
                    "names the same device twice",
                ));
            }
        }
        self.check_set_access(ptr, size)
    }

    /// Marks `[ptr, ptr + size)` accessible from every device of `devices`
    /// (checked by [`Ledger::check_set_access_for`]).
    pub fn mark_accessible_for(&mut self, ptr: DevicePtr, size: u64, devices: &[DeviceOrdinal]) {
        let own = self.caps.ordinal;
        let end = ptr.saturating_add(size);
        let granularity = self.granularity;
        // Backwards from the last mapping starting before `end`, down to the
        // one containing `ptr`: one tree search for the whole walk.
        for (&start, m) in self.mappings.range_mut(..end).rev() {
            if start.saturating_add(m.size) <= ptr {
                break;
            }
            let (first, last) = Self::granules(granularity, start, m.size, ptr, end);
            let granules = (m.size / granularity) as usize;
            for d in devices {
                let access = if *d == own {
                    &mut m.access
                } else {
                    let at = match m.peers.iter().position(|(p, _)| p == d) {
                        Some(at) => at,
                        None => {
                            m.peers.push((*d, Access::None));
                            m.peers.len() - 1
                        }
                    };
                    &mut m.peers[at].1
                };
                access.mark(first, last, granules);
            }
        }
    }

    /// The devices from which the whole mapping containing `addr` is
    /// accessible (this device first when it is one of them), or `None`
    /// when `addr` is not mapped.
    pub fn devices_with_access(&self, addr: DevicePtr) -> Option<Vec<DeviceOrdinal>> {
        let (_, m) = self.mapping_containing(addr)?;
        let granules = (m.size / self.granularity) as usize;
        let mut out = Vec::new();
        if m.access.covers(0, granules) {
            out.push(self.caps.ordinal);
        }
        let mut peers: Vec<DeviceOrdinal> = m
            .peers
            .iter()
            .filter(|(_, a)| a.covers(0, granules))
            .map(|(d, _)| *d)
            .collect();
        peers.sort_unstable();
        out.extend(peers);
        Some(out)
    }

    // ---- one driver call: check, call, commit ----
    //
    // Each method below is the whole sequence of one `Vmm` call for every
    // backend: the ledger's check, then the backend's own system or driver
    // call (`call`, which the simulated backend passes as a no-op), then the
    // ledger's commit. A failed check or call commits nothing (an unmap
    // commits the mappings its call did unmap before failing). Locking and
    // logging are the backend's: it runs these under its lock, inside its log.

    /// `cuMemAddressReserve`: [`Ledger::check_reserve`], then `call` with the
    /// effective alignment (it picks and reserves the range), then the record.
    pub fn reserve(
        &mut self,
        size: u64,
        alignment: u64,
        call: impl FnOnce(u64) -> Result<DevicePtr>,
    ) -> Result<DevicePtr> {
        let alignment = self.check_reserve(size, alignment)?;
        let ptr = call(alignment)?;
        self.add_reservation(ptr, size);
        Ok(ptr)
    }

    /// `cuMemAddressFree`: [`Ledger::check_address_free`], `call`, then forget it.
    pub fn address_free(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.check_address_free(ptr, size)?;
        call()?;
        self.remove_reservation(ptr);
        Ok(())
    }

    /// `cuMemCreate` (plain when `props` is the default):
    /// [`Ledger::check_create_with`], then `call` (seeing the ledger, for
    /// figures of an error) makes the backend's object, then the record.
    pub fn create(
        &mut self,
        size: u64,
        props: CreateProps,
        call: impl FnOnce(&Self) -> Result<P>,
    ) -> Result<PhysHandle> {
        self.check_create_with(size, props)?;
        let payload = call(self)?;
        Ok(self.add_handle_of(size, payload, props.handle_types))
    }

    /// `cuMemRelease`: a live handle, `call` on its payload, then marked
    /// released (its payload dropped here once no mapping names it).
    /// Returns the handle's size.
    pub fn release_with(
        &mut self,
        handle: PhysHandle,
        call: impl FnOnce(&P) -> Result<()>,
    ) -> Result<u64> {
        let entry = self.live_handle(CallKind::Release, handle)?;
        let size = entry.size;
        call(&entry.payload)?;
        drop(self.release(handle));
        Ok(size)
    }

    /// `cuMemMap`: [`Ledger::check_map`], `call` on the handle's payload,
    /// then the record.
    pub fn map(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
        call: impl FnOnce(&P) -> Result<()>,
    ) -> Result<()> {
        let entry = self.check_map(ptr, size, handle, offset)?;
        call(&entry.payload)?;
        self.add_mapping(ptr, size, handle, offset);
        Ok(())
    }

    /// `cuMemUnmap`: [`Ledger::check_unmap`], then `call` with the mappings
    /// the range covers, as (start, size) in address order; it answers how
    /// many of them, from the first, it unmapped, and how it ended. Those
    /// are forgotten either way (payloads of released handles unmapped for
    /// the last time are dropped here).
    pub fn unmap(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        call: impl FnOnce(&[(DevicePtr, u64)]) -> (usize, Result<()>),
    ) -> Result<()> {
        let starts = self.check_unmap(ptr, size)?;
        let spans: Vec<(DevicePtr, u64)> = starts
            .iter()
            .map(|s| (*s, self.mappings.get(s).map_or(0, |m| m.size)))
            .collect();
        let (done, outcome) = call(&spans);
        drop(self.remove_mappings(&starts[..done.min(starts.len())]));
        outcome
    }

    /// `cuMemSetAccess` for `devices` (this device alone: the plain
    /// `set_access`): [`Ledger::check_set_access_for`], `call`, then the marks.
    pub fn set_access(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        devices: &[DeviceOrdinal],
        call: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.check_set_access_for(ptr, size, devices)?;
        call()?;
        self.mark_accessible_for(ptr, size, devices);
        Ok(())
    }

    /// `cuMemExportToShareableHandle`: [`Ledger::check_export`], then `call`
    /// on the handle's entry (nothing to commit).
    pub fn export<T>(
        &self,
        handle: PhysHandle,
        kind: HandleKind,
        call: impl FnOnce(&HandleEntry<P>) -> Result<T>,
    ) -> Result<T> {
        call(self.check_export(handle, kind)?)
    }

    /// `cuMemImportFromShareableHandle`: [`Ledger::check_import`], `call`
    /// makes the backend's object, then [`Ledger::add_imported`].
    pub fn import(
        &mut self,
        size: u64,
        kind: HandleKind,
        call: impl FnOnce() -> Result<P>,
    ) -> Result<PhysHandle> {
        self.check_import(size, kind)?;
        let payload = call()?;
        Ok(self.add_imported(size, kind, payload))
    }

    /// Records a handle imported as `kind` (checked by [`Ledger::check_import`]).
    pub fn add_imported(&mut self, size: u64, kind: HandleKind, payload: P) -> PhysHandle {
        let types = HandleTypes {
            posix_fd: kind == HandleKind::PosixFd,
            fabric: kind == HandleKind::Fabric,
        };
        self.add_handle_of(size, payload, types)
    }

    // ---- reports, checks and teardown ----

    /// Live handles (unreleased or still mapped), reservations and mappings.
    pub fn counts(&self) -> (usize, usize, usize) {
        (
            self.handles.len(),
            self.reservations.len(),
            self.mappings.len(),
        )
    }

    /// What is alive now (`events` left at 0 for the backend to fill).
    pub fn leak_report(&self) -> LeakReport {
        LeakReport {
            handles: self
                .handles
                .iter()
                .map(|(&id, h)| (PhysHandle(id), h.size))
                .collect(),
            released_but_mapped: self.handles.values().filter(|h| h.released).count(),
            reservations: self.reservations().collect(),
            mappings: self.mappings.iter().map(|(&p, m)| (p, m.size)).collect(),
            events: 0,
        }
    }

    /// Checks every invariant listed in the module documentation and says
    /// which one broke (O(n) in what is alive: meant for tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut reserved = 0u64;
        let mut last_end: Option<u64> = None;
        for (start, size) in self.reservations() {
            if size == 0 || !self.aligned(start) || !self.aligned(size) {
                return Err(format!("reservation {start:#x}+{size:#x} misaligned"));
            }
            if last_end.is_some_and(|e| e > start) {
                return Err(format!("reservation {start:#x} overlaps its predecessor"));
            }
            last_end = Some(start + size);
            reserved += size;
        }
        if reserved != self.reserved {
            return Err(format!("reserved {reserved} != counter {}", self.reserved));
        }
        let mut mapped = 0u64;
        let mut per_handle: BTreeMap<u64, usize> = BTreeMap::new();
        let mut last_end: Option<u64> = None;
        for (&start, m) in &self.mappings {
            let end = start + m.size;
            if last_end.is_some_and(|e| e > start) {
                return Err(format!("mapping {start:#x} overlaps its predecessor"));
            }
            last_end = Some(end);
            if self.reservation_containing(start, end).is_none() {
                return Err(format!(
                    "mapping {start:#x}+{:#x} outside every reservation",
                    m.size
                ));
            }
            match self.handles.get(&m.handle) {
                Some(h) if m.offset + m.size <= h.size => {
                    if self.map_rule == MapRule::WholeHandle && (m.offset, m.size) != (0, h.size) {
                        return Err(format!(
                            "mapping {start:#x} covers part of handle {} under the whole-handle rule",
                            m.handle
                        ));
                    }
                }
                _ => {
                    return Err(format!(
                        "mapping {start:#x} names handle {} that is dead or too small",
                        m.handle
                    ))
                }
            }
            if let Access::Partial(flags) = &m.access {
                if flags.len() as u64 != m.size / self.granularity {
                    return Err(format!("mapping {start:#x} has a wrong access map"));
                }
            }
            *per_handle.entry(m.handle).or_default() += 1;
            mapped += m.size;
        }
        if mapped != self.mapped {
            return Err(format!("mapped {mapped} != counter {}", self.mapped));
        }
        let mut used = 0u64;
        for (&id, h) in &self.handles {
            let count = per_handle.get(&id).copied().unwrap_or(0);
            if h.mappings != count {
                return Err(format!(
                    "handle {id} counts {} mappings, has {count}",
                    h.mappings
                ));
            }
            if h.released && count == 0 {
                return Err(format!("handle {id} released and unmapped but still alive"));
            }
            used += h.size;
        }
        if used != self.used || used > self.capacity {
            return Err(format!(
                "physical {used} != counter {} (capacity {})",
                self.used, self.capacity
            ));
        }
        Ok(())
    }

    /// Takes everything out, leaving the ledger empty.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend tears down this way
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
        self.reserved = 0;
        self.mapped = 0;
        Drained {
            mappings,
            handles,
            reservations,
        }
    }
}

/// `requestedHandleTypes` as CUDA's bit set (POSIX fd 1, FABRIC 8), for errors.
fn handle_type_bits(types: HandleTypes) -> u64 {
    u64::from(types.posix_fd) | (u64::from(types.fabric) << 3)
}

/// One handle type as CUDA's value, for errors.
fn handle_kind_bits(kind: HandleKind) -> u64 {
    match kind {
        HandleKind::PosixFd => 1,
        HandleKind::Fabric => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 4096;

    /// A ledger of 16 granules with one reservation of 8 at `16 * G`, under
    /// CUDA's rule.
    fn ledger() -> Ledger<()> {
        let mut l = Ledger::new(G, 16 * G);
        l.add_reservation(16 * G, 8 * G);
        l
    }

    /// The same under the relaxed rule.
    fn relaxed() -> Ledger<()> {
        let mut l = ledger();
        l.set_map_rule(MapRule::AnyOffset);
        l
    }

    #[track_caller]
    fn assert_invalid<T: std::fmt::Debug>(result: Result<T>, argument: &str) {
        match result {
            Err(VmmError::InvalidArgument { argument: a, .. }) if a == argument => {}
            other => panic!("expected InvalidArgument {{ argument: {argument:?} }}, got {other:?}"),
        }
    }

    #[test]
    fn a_pinned_range_cannot_be_unmapped_until_unpinned() {
        const G: u64 = 2 << 20;
        let mut l: Ledger<()> = Ledger::new(G, u64::MAX);
        let va = 0x7000_0000_0000;
        l.add_reservation(va, 4 * G);
        for i in 0..2 {
            let h = l.add_handle(G, ());
            l.check_map(va + i * G, G, h, 0).unwrap();
            l.add_mapping(va + i * G, G, h, 0);
        }
        l.mark_accessible(va, 2 * G);
        l.check_accessible(va + G - 10, 20).unwrap();
        l.pin(va + G - 10, 20);
        l.pin(va + G - 10, 20);
        for (ptr, size) in [(va, G), (va + G, G), (va, 2 * G)] {
            assert!(
                matches!(
                    l.check_unmap(ptr, size),
                    Err(VmmError::InvalidArgument { .. })
                ),
                "{ptr:#x}+{size:#x} is being copied"
            );
        }
        l.unpin(va + G - 10, 20);
        assert!(l.check_unmap(va, G).is_err(), "the second pin remains");
        l.unpin(va + G - 10, 20);
        assert_eq!(l.check_unmap(va, 2 * G).unwrap(), vec![va, va + G]);
        l.unpin(va, 1); // no such pin: nothing happens
    }

    #[test]
    fn whole_handle_rule_is_the_default_and_names_itself() {
        let mut l = ledger();
        assert_eq!(l.map_rule(), MapRule::WholeHandle);
        let h = l.add_handle(2 * G, ());
        // One granule in: the offset rule, quoting CUDA's reference.
        match l.check_map(16 * G, G, h, G) {
            Err(VmmError::InvalidArgument {
                call: CallKind::Map,
                argument: "offset",
                value,
                rule,
            }) => {
                assert_eq!(value, G);
                assert!(rule.contains("currently must be zero"), "{rule}");
            }
            other => panic!("expected the offset rule, got {other:?}"),
        }
        // A prefix: the whole-handle rule.
        match l.check_map(16 * G, G, h, 0) {
            Err(VmmError::InvalidArgument {
                call: CallKind::Map,
                argument: "size",
                value,
                rule,
            }) => {
                assert_eq!(value, G);
                assert!(rule.contains("covers its handle whole"), "{rule}");
            }
            other => panic!("expected the whole-handle rule, got {other:?}"),
        }
        // Past the handle's end is still the general rule (argument `offset`).
        assert_invalid(l.check_map(16 * G, 3 * G, h, 0), "offset");
        assert!(l.check_map(16 * G, 2 * G, h, 0).is_ok());
        l.add_mapping(16 * G, 2 * G, h, 0);
        l.check_invariants().unwrap();
        // A mapping that only the relaxed rule allows breaks the strict invariant.
        l.add_mapping(20 * G, G, h, G);
        assert!(l.check_invariants().unwrap_err().contains("whole-handle"));
    }

    #[test]
    fn any_offset_rule_maps_parts_of_a_handle() {
        let mut l = relaxed();
        assert_eq!(l.map_rule(), MapRule::AnyOffset);
        let h = l.add_handle(2 * G, ());
        assert!(l.check_map(16 * G, G, h, G).is_ok());
        assert!(l.check_map(16 * G, G, h, 0).is_ok());
        assert_invalid(l.check_map(16 * G, 2 * G, h, G), "offset");
        l.add_mapping(16 * G, G, h, G);
        l.add_mapping(17 * G, G, h, 0);
        l.check_invariants().unwrap();
    }

    #[test]
    fn map_rules_in_order() {
        let mut l = relaxed();
        let h = l.add_handle(4 * G, ());
        assert!(l.check_map(16 * G, 2 * G, h, 0).is_ok());
        assert_invalid(l.check_map(16 * G + 1, G, h, 0), "ptr");
        assert_invalid(l.check_map(16 * G, 0, h, 0), "size");
        assert_invalid(l.check_map(16 * G, G, h, 4 * G), "offset");
        assert_invalid(l.check_map(22 * G, 4 * G, h, 0), "ptr");
        l.add_mapping(16 * G, 2 * G, h, 0);
        assert!(matches!(
            l.check_map(17 * G, 2 * G, h, 0),
            Err(VmmError::AlreadyMapped { .. })
        ));
        assert!(l.check_map(18 * G, 2 * G, h, 0).is_ok());
        l.check_invariants().unwrap();
        // The same order under the whole-handle rule, with a whole handle.
        let mut l = ledger();
        let h = l.add_handle(4 * G, ());
        assert_invalid(l.check_map(16 * G + 1, 4 * G, h, 0), "ptr");
        assert_invalid(l.check_map(16 * G, 0, h, 0), "size");
        assert_invalid(l.check_map(22 * G, 4 * G, h, 0), "ptr");
        l.add_mapping(16 * G, 4 * G, h, 0);
        assert!(matches!(
            l.check_map(18 * G, 4 * G, h, 0),
            Err(VmmError::AlreadyMapped { .. })
        ));
        assert!(l.check_map(20 * G, 4 * G, h, 0).is_ok());
        l.check_invariants().unwrap();
    }

    #[test]
    fn unmap_needs_whole_neighbouring_mappings() {
        let mut l = ledger();
        let h1 = l.add_handle(2 * G, ());
        let h2 = l.add_handle(G, ());
        l.add_mapping(16 * G, 2 * G, h1, 0);
        l.add_mapping(18 * G, G, h2, 0);
        assert_eq!(l.check_unmap(16 * G, 3 * G).unwrap(), vec![16 * G, 18 * G]);
        assert_invalid(l.check_unmap(17 * G, G), "ptr");
        assert_invalid(l.check_unmap(16 * G, G), "size");
        assert!(matches!(
            l.check_unmap(16 * G, 4 * G),
            Err(VmmError::NotMapped { .. })
        ));
        assert!(matches!(
            l.check_unmap(20 * G, G),
            Err(VmmError::NotMapped { .. })
        ));
        assert_eq!(l.mapped_bytes(), 3 * G);
        l.check_invariants().unwrap();
    }

    #[test]
    fn released_handle_lives_until_last_unmap() {
        let mut l = ledger();
        let h = l.add_handle(G, ());
        // One handle at two addresses.
        l.add_mapping(16 * G, G, h, 0);
        l.add_mapping(18 * G, G, h, 0);
        assert!(l.release(h).is_none());
        assert_eq!(l.used(), G);
        assert_invalid(l.live_handle(CallKind::Map, h), "handle");
        assert_eq!(l.leak_report().released_but_mapped, 1);
        l.check_invariants().unwrap();
        assert!(l.remove_mappings(&[16 * G]).is_empty());
        assert_eq!(l.remove_mappings(&[18 * G]).len(), 1);
        assert_eq!(l.used(), 0);
        let live = l.leak_report();
        assert_eq!(
            (
                live.handles.len(),
                live.released_but_mapped,
                live.mappings.len()
            ),
            (0, 0, 0)
        );
        assert_eq!(live.reservations, vec![(16 * G, 8 * G)]);
        l.check_invariants().unwrap();
    }

    #[test]
    fn access_is_tracked_per_granule() {
        let mut l = ledger();
        let h = l.add_handle(4 * G, ());
        l.add_mapping(16 * G, 4 * G, h, 0);
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
        assert!(l.mapping_containing(16 * G).unwrap().1.access.any());
        l.check_invariants().unwrap();
        l.mark_accessible(16 * G, 4 * G);
        assert_eq!(l.mapping_containing(16 * G).unwrap().1.access, Access::All);
        assert!(matches!(
            l.check_accessible(19 * G, 2 * G),
            Err(VmmError::NotMapped { .. })
        ));
        assert!(l.check_set_access(16 * G, 5 * G).is_err());
        // Partial marks that add up to the whole mapping make it `All`.
        let h2 = l.add_handle(2 * G, ());
        l.add_mapping(21 * G, 2 * G, h2, 0);
        l.mark_accessible(21 * G, G);
        l.mark_accessible(22 * G, G);
        assert_eq!(l.mapping_containing(22 * G).unwrap().1.access, Access::All);
        l.check_invariants().unwrap();
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
        l.add_mapping(16 * G, G, h, 0);
        assert!(matches!(
            l.check_address_free(16 * G, 8 * G),
            Err(VmmError::StillMapped { mappings: 1, .. })
        ));
        assert_invalid(l.check_address_free(16 * G, 4 * G), "size");
        assert!(matches!(
            l.check_address_free(32 * G, 8 * G),
            Err(VmmError::NotMapped { .. })
        ));
        assert_eq!(l.mem_info().free, 15 * G);
        assert_eq!(l.reserved_bytes(), 8 * G);
    }
}
