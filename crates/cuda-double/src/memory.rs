//! Virtual memory management as the driver reference states it: address
//! reservations, physical handles, mappings and access, each checked before
//! anything changes (a refused call changes nothing).

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::os::fd::OwnedFd;

use crate::abi::*;
use crate::os;
use crate::rules::Rules;
use crate::state::{Call, Driver};

/// Where a handle's bytes live: a memory file of its own (shareable and
/// imported handles: the file is what a POSIX descriptor exports), or a
/// range of its device's arena file (every other handle: one descriptor per
/// device, so the process's descriptor limit does not cap device memory).
pub enum Backing {
    /// A memory file of its own.
    Own(OwnedFd),
    /// A range of the device's arena file.
    Arena(offset_allocator::Allocation),
}

impl std::fmt::Debug for Backing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backing::Own(file) => f.debug_tuple("Own").field(file).finish(),
            Backing::Arena(range) => f.debug_tuple("Arena").field(&range.offset).finish(),
        }
    }
}

/// A device's arena file and the ranges of it in use, in granules.
pub struct Arena {
    file: OwnedFd,
    ranges: offset_allocator::Allocator,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

/// A physical allocation (`CUmemGenericAllocationHandle`).
#[derive(Debug)]
pub struct Handle {
    /// Where its bytes live.
    pub backing: Backing,
    /// Its size in bytes.
    pub size: u64,
    /// The device it lives on.
    pub device: CuDevice,
    /// Requested shareable handle types (`CUmemAllocationHandleType` bits).
    pub types: c_int,
    /// `gpuDirectRDMACapable`.
    pub rdma: bool,
    /// Handle references not released yet (`cuMemCreate`, `cuMemImport...`,
    /// `cuMemRetainAllocationHandle` each add one, `cuMemRelease` takes one).
    pub references: u32,
    /// Mappings of it.
    pub mappings: u32,
    /// Imported from a shareable handle (its memory is counted by its exporter).
    pub imported: bool,
}

/// A mapping made by `cuMemMap`.
#[derive(Debug, Clone)]
pub struct Mapping {
    /// Its size.
    pub size: u64,
    /// The handle mapped.
    pub handle: u64,
}

/// A `cuMemAlloc` allocation: a reservation, a handle and a mapping of its own.
#[derive(Debug, Clone, Copy)]
pub struct Alloc {
    /// Its size (the request rounded up to the granularity).
    pub size: u64,
    /// Its handle.
    pub handle: u64,
}

/// All device memory of the process.
#[derive(Debug, Default)]
pub struct Memory {
    /// Reservations: start to size.
    pub reservations: BTreeMap<u64, u64>,
    /// Address space reserved in all.
    pub reserved: u64,
    /// Live handles.
    pub handles: BTreeMap<u64, Handle>,
    /// Mappings: start to mapping.
    pub mappings: BTreeMap<u64, Mapping>,
    /// `cuMemAlloc` allocations by address.
    pub allocs: BTreeMap<u64, Alloc>,
    /// Access granted to each device (`CUmemAccess_flags`), by granule
    /// (`granule`-aligned start) of mapped memory; absent: none.
    pub access: BTreeMap<u64, Vec<c_int>>,
    /// The unit of access and of arena ranges: the smallest granularity.
    pub granule: u64,
    /// Each device's arena file, made at its first plain create.
    pub arenas: BTreeMap<CuDevice, Arena>,
    /// Bytes of physical memory in use on each device.
    pub used: Vec<u64>,
    /// Bytes of memory of each device.
    pub capacity: u64,
}

impl Memory {
    /// No memory in use on any of `rules.devices`.
    pub fn new(rules: &Rules) -> Memory {
        Memory {
            used: vec![0; rules.devices.max(0) as usize],
            capacity: rules.memory,
            granule: rules.granularity.min(rules.shareable_granularity),
            ..Memory::default()
        }
    }

    /// The reservation holding all of `[ptr, ptr + size)`, if one does.
    fn reservation_of(&self, ptr: u64, size: u64) -> Option<(u64, u64)> {
        let (&start, &len) = self.reservations.range(..=ptr).next_back()?;
        let end = ptr.checked_add(size)?;
        (end <= start + len).then_some((start, len))
    }

    /// The mappings that exactly tile `[ptr, ptr + size)`, in order, or
    /// `None` where the range starts or ends inside a mapping or has a hole.
    fn tiling(&self, ptr: u64, size: u64) -> Option<Vec<u64>> {
        let end = ptr.checked_add(size)?;
        let mut at = ptr;
        let mut out = Vec::new();
        for (&start, m) in self.mappings.range(ptr..end) {
            if start != at {
                return None;
            }
            out.push(start);
            at = start + m.size;
        }
        (at == end && !out.is_empty()).then_some(out)
    }

    /// Whether `[ptr, ptr + len)` is mapped throughout with at least
    /// `need` access (`ACCESS_READ` or `ACCESS_READWRITE`) for `device`.
    pub fn accessible(&self, ptr: u64, len: u64, device: CuDevice, need: c_int) -> bool {
        let Some(end) = ptr.checked_add(len) else {
            return false;
        };
        let mut at = ptr - ptr % self.granule;
        while at < end {
            let grant = self
                .access
                .get(&at)
                .and_then(|a| a.get(device as usize).copied())
                .unwrap_or(ACCESS_NONE);
            if grant & need != need {
                return false;
            }
            at += self.granule;
        }
        true
    }

    /// The device of the `cuMemAlloc` allocation holding all of
    /// `[ptr, ptr + len)`, if one does.
    pub fn alloc_device(&self, ptr: u64, len: u64) -> Option<CuDevice> {
        let (&start, a) = self.allocs.range(..=ptr).next_back()?;
        let end = ptr.checked_add(len)?;
        if end > start + a.size {
            return None;
        }
        self.handles.get(&a.handle).map(|h| h.device)
    }

    /// The device whose memory is mapped at `ptr`, if any is.
    pub fn device_at(&self, ptr: u64) -> Option<CuDevice> {
        let (&start, m) = self.mappings.range(..=ptr).next_back()?;
        if ptr >= start + m.size {
            return None;
        }
        self.handles.get(&m.handle).map(|h| h.device)
    }

    /// Whether `[ptr, ptr + size)` is mapped throughout (mappings may
    /// start before it and end after it).
    fn fully_mapped(&self, ptr: u64, size: u64) -> bool {
        let Some(end) = ptr.checked_add(size) else {
            return false;
        };
        let mut at = ptr;
        let mut cursor = self.mappings.range(..=ptr).next_back();
        while at < end {
            match cursor {
                Some((&start, m)) if start <= at && at < start + m.size => {
                    at = start + m.size;
                    cursor = self.mappings.range(at..).next();
                }
                _ => return false,
            }
        }
        true
    }

    /// Bytes for a new handle of `size` on `device`: a file of its own for a
    /// shareable handle, else a range of the device's arena (a file of its
    /// own where the arena has no room left in one piece).
    fn back(&mut self, size: u64, device: CuDevice, shareable: bool) -> Call<Backing> {
        let own = || {
            os::backing(size)
                .map(Backing::Own)
                .ok_or(CUDA_ERROR_OUT_OF_MEMORY)
        };
        if shareable {
            return own();
        }
        let granule = self.granule;
        let Ok(units) = u32::try_from(size / granule) else {
            return own();
        };
        if !self.arenas.contains_key(&device) {
            // Twice the device's memory, sparse: room for its ranges to
            // fragment without refusing what the device still has.
            let span = self.capacity.saturating_mul(2);
            let Ok(total) = u32::try_from(span / granule) else {
                return own();
            };
            let Some(file) = os::backing(total as u64 * granule) else {
                return own();
            };
            self.arenas.insert(
                device,
                Arena {
                    file,
                    ranges: offset_allocator::Allocator::new(total),
                },
            );
        }
        match self
            .arenas
            .get_mut(&device)
            .and_then(|a| a.ranges.allocate(units))
        {
            Some(range) => Ok(Backing::Arena(range)),
            None => own(),
        }
    }

    /// The file holding a handle's bytes and where they start in it (an
    /// arena is never removed, so an arena handle always finds its file).
    fn file_of<'a>(&'a self, h: &'a Handle) -> Option<(&'a OwnedFd, u64)> {
        match &h.backing {
            Backing::Own(file) => Some((file, 0)),
            Backing::Arena(range) => self
                .arenas
                .get(&h.device)
                .map(|a| (&a.file, u64::from(range.offset) * self.granule)),
        }
    }

    /// A handle with a reference not released yet (`CUDA_ERROR_INVALID_VALUE`
    /// for any other: unknown, or released while still mapped).
    fn live_handle(&self, handle: u64) -> Call<&Handle> {
        self.handles
            .get(&handle)
            .filter(|h| h.references > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Frees a handle whose last reference and last mapping are gone.
    fn settle(&mut self, handle: u64) {
        if let Some(h) = self.handles.get(&handle) {
            if h.references == 0 && h.mappings == 0 {
                if !h.imported {
                    if let Some(u) = self.used.get_mut(h.device as usize) {
                        *u -= h.size;
                    }
                }
                if let Some(Handle {
                    backing: Backing::Arena(range),
                    device,
                    size,
                    ..
                }) = self.handles.remove(&handle)
                {
                    if let Some(a) = self.arenas.get_mut(&device) {
                        // The bytes go back to the system, as a freed
                        // allocation's do.
                        os::discard(&a.file, u64::from(range.offset) * self.granule, size);
                        a.ranges.free(range);
                    }
                }
            }
        }
    }
}

impl Driver {
    /// The granularity for allocations of `types` (`minimum` or recommended).
    fn granularity_for(&self, types: c_int, minimum: bool) -> u64 {
        let min = if types != 0 {
            self.rules.shareable_granularity
        } else {
            self.rules.granularity
        };
        if minimum {
            min
        } else {
            self.rules.recommended.max(min)
        }
    }

    /// Checks a `CUmemAllocationProp` as `cuMemCreate` and
    /// `cuMemGetAllocationGranularity` do: pinned device memory on a device
    /// that exists, handle types this device supports.
    pub fn check_prop(&self, prop: &MemAllocationProp) -> Call<()> {
        if prop.type_ != ALLOCATION_TYPE_PINNED || prop.location.type_ != LOCATION_DEVICE {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.device(prop.location.id)
            .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        let types = prop.requested_handle_types;
        let known =
            HANDLE_TYPE_POSIX_FD | HANDLE_TYPE_WIN32 | HANDLE_TYPE_WIN32_KMT | HANDLE_TYPE_FABRIC;
        if types & !known != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if types & !HANDLE_TYPE_POSIX_FD != 0
            || (types & HANDLE_TYPE_POSIX_FD != 0 && !self.rules.posix_fd)
        {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if prop.alloc_flags.gpu_direct_rdma_capable != 0 && !self.rules.rdma {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        Ok(())
    }

    /// `cuMemGetAllocationGranularity`.
    pub fn allocation_granularity(&self, prop: &MemAllocationProp, option: c_int) -> Call<u64> {
        self.check_prop(prop)?;
        match option {
            GRANULARITY_MINIMUM => Ok(self.granularity_for(prop.requested_handle_types, true)),
            GRANULARITY_RECOMMENDED => Ok(self.granularity_for(prop.requested_handle_types, false)),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// `cuMemAddressReserve` (alignment 0 or a power of two). Running out of address space is
    /// `CUDA_ERROR_OUT_OF_MEMORY`, as on the driver.
    pub fn reserve(&mut self, size: u64, alignment: u64, flags: u64) -> Call<u64> {
        self.forbidden_under_capture()?;
        let g = self.rules.granularity;
        // The reference states no rule for an alignment below the
        // granularity: any power of two is taken, and the granularity is
        // the least alignment given.
        if flags != 0
            || size == 0
            || !size.is_multiple_of(g)
            || (alignment != 0 && !alignment.is_power_of_two())
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let alignment = alignment.max(g);
        let total = self.memory.reserved.checked_add(size);
        if total.is_none_or(|t| t > self.rules.address_space) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let ptr = os::reserve(size, alignment).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        self.memory.reservations.insert(ptr, size);
        self.memory.reserved += size;
        Ok(ptr)
    }

    /// `cuMemAddressFree`: a whole reservation, with no mapping left in it.
    pub fn address_free(&mut self, ptr: u64, size: u64) -> Call<()> {
        self.forbidden_under_capture()?;
        if self.memory.reservations.get(&ptr) != Some(&size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.memory.mappings.range(ptr..ptr + size).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        os::free(ptr, size);
        self.memory.reservations.remove(&ptr);
        self.memory.reserved -= size;
        Ok(())
    }

    /// `cuMemCreate`.
    pub fn create(&mut self, size: u64, prop: &MemAllocationProp, flags: u64) -> Call<u64> {
        self.forbidden_under_capture()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.check_prop(prop)?;
        let types = prop.requested_handle_types;
        if size == 0 || !size.is_multiple_of(self.granularity_for(types, true)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let device = prop.location.id;
        let used = self.memory.used[device as usize];
        if used.checked_add(size).is_none_or(|u| u > self.rules.memory) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let backing = self.memory.back(size, device, types != 0)?;
        let id = self.new_handle();
        self.memory.handles.insert(
            id,
            Handle {
                backing,
                size,
                device,
                types,
                rdma: prop.alloc_flags.gpu_direct_rdma_capable != 0,
                references: 1,
                mappings: 0,
                imported: false,
            },
        );
        self.memory.used[device as usize] += size;
        Ok(id)
    }

    /// `cuMemRelease`: the memory lives on until its last mapping goes.
    pub fn release(&mut self, handle: u64) -> Call<()> {
        self.forbidden_under_capture()?;
        let h = self
            .memory
            .handles
            .get_mut(&handle)
            .filter(|h| h.references > 0)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        h.references -= 1;
        self.memory.settle(handle);
        Ok(())
    }

    /// `cuMemMap`.
    pub fn map(&mut self, ptr: u64, size: u64, offset: u64, handle: u64, flags: u64) -> Call<()> {
        self.forbidden_under_capture()?;
        let h = self.memory.live_handle(handle)?;
        let g = self.granularity_for(h.types, true);
        let fits = offset.checked_add(size).is_some_and(|e| e <= h.size);
        let whole = offset == 0 && size == h.size;
        if flags != 0
            || size == 0
            || !ptr.is_multiple_of(g)
            || !size.is_multiple_of(g)
            || !offset.is_multiple_of(g)
            || !fits
            || (offset != 0 && !self.rules.map_offset)
            || !(whole || self.rules.partial_map || self.rules.map_offset)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.memory.reservation_of(ptr, size).is_none() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let overlaps = self
            .memory
            .mappings
            .range(..ptr + size)
            .next_back()
            .is_some_and(|(s, m)| s + m.size > ptr);
        if overlaps {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (file, base) = self.memory.file_of(h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if !os::map(ptr, size, file, base + offset) {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        if let Some(h) = self.memory.handles.get_mut(&handle) {
            h.mappings += 1;
        }
        self.memory.mappings.insert(ptr, Mapping { size, handle });
        Ok(())
    }

    /// `cuMemUnmap`: whole mappings only, one unless `unmap_spans` is relaxed.
    /// Work still queued on the range is not waited for (unless
    /// `unmap_waits` is relaxed): when it runs, it faults.
    pub fn unmap(&mut self, ptr: u64, size: u64) -> Call<()> {
        self.forbidden_under_capture()?;
        let starts = self
            .memory
            .tiling(ptr, size)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if starts.len() > 1 && !self.rules.unmap_spans {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.rules.unmap_waits {
            self.run_all();
        }
        for start in starts {
            if let Some(m) = self.memory.mappings.remove(&start) {
                os::unmap(start, m.size);
                let granules: Vec<u64> = self
                    .memory
                    .access
                    .range(start..start + m.size)
                    .map(|(g, _)| *g)
                    .collect();
                for g in granules {
                    self.memory.access.remove(&g);
                }
                if let Some(h) = self.memory.handles.get_mut(&m.handle) {
                    h.mappings -= 1;
                }
                self.memory.settle(m.handle);
            }
        }
        Ok(())
    }

    /// `cuMemSetAccess`: a fully mapped, granularity-aligned range (whole
    /// mappings or parts of them), a valid device and flags per entry.
    pub fn set_access(&mut self, ptr: u64, size: u64, descs: &[MemAccessDesc]) -> Call<()> {
        self.forbidden_under_capture()?;
        if descs.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for d in descs {
            if d.location.type_ != LOCATION_DEVICE
                || !matches!(d.flags, ACCESS_NONE | ACCESS_READ | ACCESS_READWRITE)
            {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            self.device(d.location.id)?;
        }
        let g = self.memory.granule;
        if size == 0
            || !ptr.is_multiple_of(g)
            || !size.is_multiple_of(g)
            || !self.memory.fully_mapped(ptr, size)
        {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let devices = self.rules.devices as usize;
        let mut at = ptr;
        while at < ptr + size {
            let flags = self
                .memory
                .access
                .entry(at)
                .or_insert_with(|| vec![ACCESS_NONE; devices]);
            for d in descs {
                flags[d.location.id as usize] = d.flags;
            }
            let any = flags.iter().fold(0, |a, f| a | f);
            os::protect(at, g, any & ACCESS_READ != 0, any == ACCESS_READWRITE);
            at += g;
        }
        Ok(())
    }

    /// `cuMemGetAccess`: the flags of `device` at `ptr`.
    pub fn get_access(&self, device: CuDevice, ptr: u64) -> Call<c_int> {
        self.device(device)?;
        if !self.memory.fully_mapped(ptr, 1) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let granule = ptr - ptr % self.memory.granule;
        Ok(self
            .memory
            .access
            .get(&granule)
            .map_or(ACCESS_NONE, |a| a[device as usize]))
    }

    /// `cuMemExportToShareableHandle` as a POSIX file descriptor (the only
    /// shareable type the double has); the handle must have asked for it.
    pub fn export(&self, handle: u64, kind: c_int, flags: u64) -> Call<OwnedFd> {
        let h = self.memory.live_handle(handle)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if kind != HANDLE_TYPE_POSIX_FD {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        if h.types & HANDLE_TYPE_POSIX_FD == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        match &h.backing {
            Backing::Own(file) => file.try_clone().map_err(|_| CUDA_ERROR_OUT_OF_MEMORY),
            Backing::Arena(_) => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }

    /// `cuMemImportFromShareableHandle` of a POSIX file descriptor (kept:
    /// the caller still owns `file`'s original). Its size is the file's.
    pub fn import(&mut self, file: OwnedFd, device: CuDevice) -> Call<u64> {
        let size = os::backing_size(&file).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if size == 0 || size % self.rules.shareable_granularity != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = self.new_handle();
        self.memory.handles.insert(
            id,
            Handle {
                backing: Backing::Own(file),
                size,
                device,
                types: HANDLE_TYPE_POSIX_FD,
                rdma: false,
                references: 1,
                mappings: 0,
                imported: true,
            },
        );
        Ok(id)
    }

    /// `cuMemRetainAllocationHandle`: the handle mapped at `ptr`, with one
    /// more reference for the caller to release.
    pub fn retain_handle(&mut self, ptr: u64) -> Call<u64> {
        let handle = self
            .memory
            .mappings
            .range(..=ptr)
            .next_back()
            .filter(|(s, m)| ptr < *s + m.size)
            .map(|(_, m)| m.handle)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some(h) = self.memory.handles.get_mut(&handle) {
            h.references += 1;
        }
        Ok(handle)
    }

    /// `cuMemGetAllocationPropertiesFromHandle`.
    pub fn handle_prop(&self, handle: u64) -> Call<MemAllocationProp> {
        let h = self.memory.live_handle(handle)?;
        Ok(MemAllocationProp {
            type_: ALLOCATION_TYPE_PINNED,
            requested_handle_types: h.types,
            location: MemLocation {
                type_: LOCATION_DEVICE,
                id: h.device,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: AllocFlags {
                compression_type: 0,
                gpu_direct_rdma_capable: u8::from(h.rdma),
                usage: 0,
                reserved: [0; 4],
            },
        })
    }

    /// `cuMemGetAddressRange`: the mapping holding `ptr`.
    pub fn address_range(&self, ptr: u64) -> Call<(u64, u64)> {
        self.memory
            .mappings
            .range(..=ptr)
            .next_back()
            .filter(|(s, m)| ptr < *s + m.size)
            .map(|(s, m)| (*s, m.size))
            .ok_or(CUDA_ERROR_NOT_FOUND)
    }

    /// `cuMemGetInfo` for the current context's device: (free, total).
    pub fn mem_info(&self) -> Call<(u64, u64)> {
        let device = self.context_device()?;
        let used = self.memory.used[device as usize];
        Ok((self.rules.memory.saturating_sub(used), self.rules.memory))
    }

    /// `cuMemAlloc`: a reservation, a handle and a mapping of its own, with
    /// access for the current context's device.
    pub fn mem_alloc(&mut self, bytes: u64) -> Call<u64> {
        self.forbidden_under_capture()?;
        let device = self.context_device()?;
        let g = self.rules.granularity;
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let size = bytes
            .checked_next_multiple_of(g)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        let prop = MemAllocationProp {
            type_: ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: MemLocation {
                type_: LOCATION_DEVICE,
                id: device,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: AllocFlags {
                compression_type: 0,
                gpu_direct_rdma_capable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        };
        let handle = self.create(size, &prop, 0)?;
        let ptr = match self.reserve(size, 0, 0) {
            Ok(p) => p,
            Err(e) => {
                let _ = self.release(handle);
                return Err(e);
            }
        };
        let access = [MemAccessDesc {
            location: prop.location,
            flags: ACCESS_READWRITE,
        }];
        if let Err(e) = self
            .map(ptr, size, 0, handle, 0)
            .and_then(|()| self.set_access(ptr, size, &access))
        {
            let _ = self.unmap(ptr, size);
            let _ = self.release(handle);
            let _ = self.address_free(ptr, size);
            return Err(e);
        }
        self.memory.allocs.insert(ptr, Alloc { size, handle });
        Ok(ptr)
    }

    /// `cuMemFree`: synchronises the device first (as `cudaFree` does).
    pub fn mem_free(&mut self, ptr: u64) -> Call<()> {
        self.forbidden_under_capture()?;
        let a = *self
            .memory
            .allocs
            .get(&ptr)
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        self.run_all();
        self.memory.allocs.remove(&ptr);
        self.unmap(ptr, a.size)?;
        self.release(a.handle)?;
        self.address_free(ptr, a.size)
    }
}
