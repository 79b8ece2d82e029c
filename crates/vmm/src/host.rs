//! Host backend: CUDA's VMM semantics on real host memory (64-bit Linux).
//!
//! | CUDA call | host emulation |
//! |---|---|
//! | `cuMemCreate` | `memfd_create` + `ftruncate` (zeroed, allocated lazily) |
//! | `cuMemAddressReserve` | `mmap(ptr, PROT_NONE, PRIVATE \| FIXED \| NORESERVE)` at the next free address of the backend's address arena |
//! | `cuMemMap` | `mmap(ptr, PROT_NONE, SHARED \| FIXED, memfd, offset)` |
//! | `cuMemSetAccess` | `mprotect(READ \| WRITE)` |
//! | `cuMemUnmap` | `mmap(ptr, PROT_NONE, PRIVATE \| FIXED \| NORESERVE)`: the hole stays reserved |
//! | `cuMemRelease` | drop the memfd once no mapping names it |
//! | `cuMemAddressFree` | `mmap(ptr, PROT_NONE, PRIVATE \| FIXED \| NORESERVE)`: back to the arena, never reused |
//!
//! A mapping is inaccessible until [`crate::Vmm::set_access`], as on CUDA. Bytes
//! written through any mapping really land in the memfd's pages, so one handle
//! mapped at two addresses shows the same bytes, and a range stitched from pages
//! of several handles reads back what each handle holds: tests check data with
//! [`HostVmm::write_bytes`] and [`HostVmm::read_bytes`].
//!
//! Address arena: at construction the backend takes one large `PROT_NONE`,
//! `NORESERVE` range from the kernel (`mmap` + trim to a 1 GiB boundary; it
//! costs no memory), and hands reservations out of it exactly as the simulated
//! backend does: from a bump pointer, never reusing an address, with a
//! one-granule gap after each reservation so two are never adjacent. The same
//! workload therefore meets the same rules at the same relative addresses on
//! both backends, and a stale address can never reach a newer reservation.
//! The arena is `munmap`ped at drop; a reservation past its end fails with
//! `AddressSpaceExhausted { call: Reserve }`. Its size is 16 × the capacity, at least
//! 64 GiB and at most 8 TiB; where the system refuses that much address space
//! (a limit on it, or valgrind), the size is halved until it fits, down to 1 GiB.
//!
//! Soundness: every call is checked against the backend's ledger (the same
//! rules as the simulated backend) before any system call, so no address
//! outside a live reservation of this backend ever reaches `mmap`, `mprotect`
//! or `munmap`, and bytes are only read or written where a mapping with access
//! set covers them, under the ledger's lock (no unmap can race a copy).
//!
//! Map rule: [`HostVmm::new`] enforces CUDA's documented rule
//! ([`MapRule::WholeHandle`]: a mapping covers its handle whole, at offset 0);
//! [`HostVmm::with_map_rule`] with [`MapRule::AnyOffset`] maps any
//! granule-aligned part of a memfd instead, for what-if experiments (reported
//! by [`Vmm::map_rule`]).
//!
//! Events: the host is synchronous, so an event is complete when recorded;
//! event ids are still checked. Streams are not tracked: any [`StreamId`] is accepted.

mod os;

use std::fmt;
use std::sync::Mutex;

use crate::call_log::{lock, CallLog};
use crate::driver::Vmm;
use crate::error::{Result, Unavailability, VmmError};
use crate::events::EventBook;
use crate::leak::LeakReport;
use crate::ledger::{invalid, Ledger};
use crate::types::{
    CallKind, DevicePtr, DriverStats, EventId, MapRule, MemInfo, PhysHandle, StreamId,
};

use crate::share::{
    CreateProps, DeviceCaps, DeviceOrdinal, HandleKind, HandleTypes, ShareableHandle,
};
use std::os::fd::{AsFd, AsRawFd};

use os::OsError;

/// Settings of a [`HostVmm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostConfig {
    /// The allocation granularity in bytes: a power of two, at least the OS
    /// page size. Default 2 MiB, as on NVIDIA data-centre GPUs.
    pub granularity: u64,
    /// Bytes of physical memory (sum of live handles) the backend allows;
    /// `create` beyond it fails with `OutOfMemory`. Default 256 MiB. Memfd
    /// pages are allocated only when touched, so a large capacity costs nothing
    /// until written.
    pub capacity: u64,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            granularity: 2 << 20,
            capacity: 256 << 20,
        }
    }
}

/// The ledger and the arena's bump pointer.
#[derive(Debug)]
struct HostState {
    ledger: Ledger<os::Memory>,
    /// The next free address of the arena (addresses below it are never reused).
    next_va: u64,
}

/// Smallest address arena, in bytes.
const ARENA_MIN: u64 = 64 << 30;
/// Smallest arena tried when the system refuses the preferred size, in bytes.
const ARENA_FLOOR: u64 = 1 << 30;
/// Largest address arena, in bytes.
const ARENA_MAX: u64 = 8 << 40;
/// Alignment of the arena's start.
const ARENA_ALIGN: u64 = 1 << 30;

/// The host backend. `Send + Sync`: all state sits behind mutexes and atomics.
pub struct HostVmm {
    config: HostConfig,
    /// Start of the address arena (a multiple of 1 GiB).
    arena_base: u64,
    /// Size of the address arena in bytes.
    arena_size: u64,
    state: Mutex<HostState>,
    /// Live events (the host completes every event at once).
    events: Mutex<EventBook<()>>,
    log: CallLog,
}

impl fmt::Debug for HostVmm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostVmm")
            .field("config", &self.config)
            .field("map_rule", &self.map_rule())
            .field("arena_base", &self.arena_base)
            .field("arena_size", &self.arena_size)
            .field("live", &self.leak_report())
            .finish()
    }
}

fn os_failure(call: CallKind, size: u64, e: OsError) -> VmmError {
    if e.out_of_memory {
        VmmError::OutOfMemory {
            call,
            requested: size,
            available: 0,
        }
    } else {
        VmmError::Driver {
            call,
            code: e.errno.unsigned_abs(),
            name: e.name,
            text: e.text,
        }
    }
}

impl HostVmm {
    /// A host backend with `config`, under CUDA's documented map rule
    /// ([`MapRule::WholeHandle`]).
    ///
    /// Errors: `Unavailable` off 64-bit Linux or when the address arena cannot
    /// be had; `InvalidArgument` when the granularity is not a power of two at
    /// least the OS page size.
    ///
    /// ```
    /// use quilt_vmm::host::{HostConfig, HostVmm};
    /// use quilt_vmm::Vmm;
    ///
    /// let host = HostVmm::new(HostConfig::default())?;
    /// let g = host.granularity();
    /// let (va, h) = (host.reserve(g, 0)?, host.create(g)?);
    /// host.map(va, g, h, 0)?;
    /// host.set_access(va, g)?;
    /// // The mapping is real memory of this process.
    /// assert_eq!(host.backend_name(), "host");
    /// host.unmap(va, g)?;
    /// host.release(h)?;
    /// host.address_free(va, g)?;
    /// # Ok::<(), quilt_vmm::VmmError>(())
    /// ```
    pub fn new(config: HostConfig) -> Result<HostVmm> {
        HostVmm::with_map_rule(config, MapRule::WholeHandle)
    }

    /// A host backend with `config` and the map rule `map_rule`
    /// ([`MapRule::AnyOffset`]: an experiment that maps any granule-aligned
    /// part of a handle). Errors as [`HostVmm::new`].
    pub fn with_map_rule(config: HostConfig, map_rule: MapRule) -> Result<HostVmm> {
        if !os::SUPPORTED {
            return Err(VmmError::Unavailable {
                reason: Unavailability::Platform,
            });
        }
        let page = os::page_size();
        if !config.granularity.is_power_of_two() || config.granularity < page {
            return Err(VmmError::InvalidArgument {
                call: CallKind::Create,
                argument: "granularity",
                value: config.granularity,
                rule: "must be a power of two multiple of the OS page size",
            });
        }
        // The arena: as large as asked, halved while the system refuses (an
        // address-space limit, or a tool such as valgrind), down to ARENA_FLOOR.
        let mut arena_size = config
            .capacity
            .saturating_mul(16)
            .clamp(ARENA_MIN, ARENA_MAX)
            .next_multiple_of(config.granularity);
        let arena_base = loop {
            match os::reserve_anywhere(arena_size, ARENA_ALIGN.max(config.granularity)) {
                Ok(base) => break base,
                Err(e) if arena_size / 2 < ARENA_FLOOR.max(config.granularity) => {
                    return Err(VmmError::Unavailable {
                        reason: Unavailability::Arena {
                            size: arena_size,
                            name: e.name,
                            text: e.text,
                        },
                    });
                }
                Err(_) => arena_size = (arena_size / 2).next_multiple_of(config.granularity),
            }
        };
        let mut ledger = Ledger::new(config.granularity, config.capacity);
        ledger.set_map_rule(map_rule);
        // One device, POSIX file descriptors (the memfd), no fabric, no RDMA.
        ledger.set_caps(DeviceCaps {
            handle_types: HandleTypes::POSIX_FD,
            ..DeviceCaps::single(config.granularity)
        });
        Ok(HostVmm {
            config,
            arena_base,
            arena_size,
            state: Mutex::new(HostState {
                ledger,
                next_va: arena_base,
            }),
            events: Mutex::new(EventBook::default()),
            log: CallLog::new("host"),
        })
    }

    /// The settings this backend was made with.
    pub fn config(&self) -> HostConfig {
        self.config
    }

    /// Runs `op` once the ledger has confirmed that every byte of
    /// `[ptr, ptr + len)` is mapped with access set (so mapped READ|WRITE),
    /// holding the ledger's lock so that no unmap can race it. For `len == 0`,
    /// `op` is not run and `empty` is the answer.
    fn with_accessible<T>(
        &self,
        ptr: DevicePtr,
        len: u64,
        empty: T,
        op: impl FnOnce() -> T,
    ) -> Result<T> {
        let state = lock(&self.state);
        state.ledger.check_accessible(ptr, len)?;
        Ok(if len == 0 { empty } else { op() })
    }

    /// Copies `data` to `ptr`. The whole range must be mapped (else `NotMapped`)
    /// and made accessible with `set_access` (else `InvalidArgument`); it may
    /// span several neighbouring mappings. Empty data always succeeds.
    pub fn write_bytes(&self, ptr: DevicePtr, data: &[u8]) -> Result<()> {
        self.with_accessible(ptr, data.len() as u64, (), || {
            // SAFETY: `with_accessible` confirmed every byte is mapped
            // READ|WRITE and holds the lock that keeps it so during the copy.
            unsafe { os::copy_in(ptr, data) }
        })
    }

    /// Copies `out.len()` bytes from `ptr` into `out`; same rules as [`HostVmm::write_bytes`].
    pub fn read_bytes(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<()> {
        self.with_accessible(ptr, out.len() as u64, (), || {
            // SAFETY: as in `write_bytes`, for reads.
            unsafe { os::copy_out(ptr, out) }
        })
    }

    /// Sets `len` bytes at `ptr` to `byte`; same rules as [`HostVmm::write_bytes`].
    pub fn fill(&self, ptr: DevicePtr, len: u64, byte: u8) -> Result<()> {
        self.with_accessible(ptr, len, (), || {
            // SAFETY: as in `write_bytes`, for `len` bytes of writes.
            unsafe { os::fill(ptr, len, byte) }
        })
    }

    /// True when all `len` bytes at `ptr` equal `byte`; same rules as [`HostVmm::write_bytes`].
    pub fn check_filled(&self, ptr: DevicePtr, len: u64, byte: u8) -> Result<bool> {
        self.with_accessible(ptr, len, true, || {
            // SAFETY: as in `write_bytes`, for `len` bytes of reads; the lock
            // keeps every writer out while the bytes are compared.
            unsafe { os::all_equal(ptr, len, byte) }
        })
    }

    /// Handles, reservations, mappings and events still alive.
    pub fn leak_report(&self) -> LeakReport {
        LeakReport {
            events: lock(&self.events).len(),
            ..lock(&self.state).ledger.leak_report()
        }
    }

    /// Runs `op` on the state, under its lock, as one timed and counted call.
    fn call<T>(
        &self,
        kind: CallKind,
        size: u64,
        op: impl FnOnce(&mut HostState) -> Result<T>,
    ) -> Result<T> {
        self.log.locked(kind, size, &self.state, op)
    }

    /// Runs `op` on the event book, under its lock, as one timed and counted call.
    fn event_call<T>(
        &self,
        kind: CallKind,
        op: impl FnOnce(&mut EventBook<()>) -> Result<T>,
    ) -> Result<T> {
        self.log.locked(kind, 0, &self.events, op)
    }
}

impl Vmm for HostVmm {
    fn backend_name(&self) -> &'static str {
        "host"
    }

    fn granularity(&self) -> u64 {
        self.config.granularity
    }

    fn reserve(&self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let call = CallKind::Reserve;
        self.call(call, size, |HostState { ledger, next_va }| {
            ledger.reserve(size, alignment, |alignment| {
                let arena_end = self.arena_base + self.arena_size;
                let out_of_space = VmmError::AddressSpaceExhausted {
                    call,
                    requested: size,
                    available: arena_end.saturating_sub(*next_va),
                };
                let Some(ptr) = next_va.checked_next_multiple_of(alignment) else {
                    return Err(out_of_space);
                };
                let end = match ptr.checked_add(size) {
                    Some(end) if end <= arena_end => end,
                    _ => return Err(out_of_space),
                };
                // SAFETY: `ptr..end` lies inside our arena above the bump pointer,
                // where nothing was ever mapped and nothing refers.
                unsafe { os::reset_to_reserved(ptr, size) }
                    .map_err(|e| os_failure(call, size, e))?;
                // One granule of gap (it may fall past the arena's end: it is never
                // handed out either way).
                *next_va = end.saturating_add(self.config.granularity);
                Ok(ptr)
            })
        })
    }

    fn address_free(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::AddressFree;
        self.call(call, size, |state| {
            state.ledger.address_free(ptr, size, || {
                // SAFETY: the ledger confirmed `ptr..ptr+size` is exactly one of our
                // reservations (inside the arena) with no mapping left; data copies
                // hold the lock we hold, so no reference points into it. The range
                // goes back to plain arena space and is never handed out again.
                unsafe { os::reset_to_reserved(ptr, size) }.map_err(|e| os_failure(call, size, e))
            })
        })
    }

    fn create(&self, size: u64) -> Result<PhysHandle> {
        self.create_with(size, CreateProps::default())
    }

    fn release(&self, handle: PhysHandle) -> Result<()> {
        self.log.time_sized(CallKind::Release, || {
            // Dropping the memfd (if no mapping names it any more) closes it.
            lock(&self.state).ledger.release_with(handle, |_| Ok(()))
        })
    }

    fn map(&self, ptr: DevicePtr, size: u64, handle: PhysHandle, offset: u64) -> Result<()> {
        let call = CallKind::Map;
        self.call(call, size, |state| {
            state.ledger.map(ptr, size, handle, offset, |memory| {
                // SAFETY: the ledger confirmed `ptr..ptr+size` lies inside one of our
                // reservations with no mapping in it, that both are multiples of
                // the granularity (itself a page multiple), and that
                // `offset + size` is inside the memfd.
                unsafe { os::map_fixed(ptr, size, memory, offset) }
                    .map_err(|e| os_failure(call, size, e))
            })
        })
    }

    fn unmap(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::Unmap;
        self.call(call, size, |state| {
            // Memfds of released handles unmapped for the last time close
            // as the ledger forgets the mappings.
            state.ledger.unmap(ptr, size, |mappings| {
                // SAFETY: the ledger confirmed `ptr..ptr+size` is exactly a run of
                // our mappings, all inside our reservations; no reference points
                // into it while we hold the lock.
                match unsafe { os::reset_to_reserved(ptr, size) } {
                    Ok(()) => (mappings.len(), Ok(())),
                    Err(e) => (0, Err(os_failure(call, size, e))),
                }
            })
        })
    }

    fn set_access(&self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.set_access_for(ptr, size, &[self.caps().ordinal])
    }

    fn mem_info(&self) -> Result<MemInfo> {
        self.call(CallKind::MemInfo, 0, |state| Ok(state.ledger.mem_info()))
    }

    fn event_record(&self, _stream: StreamId) -> Result<EventId> {
        self.event_call(CallKind::EventRecord, |book| Ok(book.record(())))
    }

    fn event_record_on(&self, event: EventId, _stream: StreamId) -> Result<()> {
        self.event_call(CallKind::EventRecord, |book| {
            book.get(CallKind::EventRecord, event).map(drop)
        })
    }

    fn event_query(&self, event: EventId) -> Result<bool> {
        self.event_call(CallKind::EventQuery, |book| {
            book.get(CallKind::EventQuery, event).map(|_| true)
        })
    }

    fn event_destroy(&self, event: EventId) -> Result<()> {
        self.event_call(CallKind::EventDestroy, |book| {
            book.remove(CallKind::EventDestroy, event)
        })
    }

    fn stream_wait_event(&self, _stream: StreamId, event: EventId) -> Result<()> {
        self.event_call(CallKind::StreamWaitEvent, |book| {
            book.get(CallKind::StreamWaitEvent, event).map(drop)
        })
    }

    fn stream_synchronize(&self, _stream: StreamId) -> Result<()> {
        self.log.time(CallKind::StreamSynchronize, 0, || Ok(()))
    }

    /// Nothing to wait for (the host completes work at once); counted as one
    /// `cuStreamSynchronize`, as the trait says.
    fn device_synchronize(&self) -> Result<()> {
        self.log.time(CallKind::StreamSynchronize, 0, || Ok(()))
    }

    /// [`HostVmm::read_bytes`], counted as one `cuMemcpyDtoH`.
    fn copy_to_host(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let len = dst.len() as u64;
        self.log
            .time(CallKind::MemcpyDtoH, len, || self.read_bytes(src, dst))
    }

    /// [`HostVmm::write_bytes`], counted as one `cuMemcpyHtoD`.
    fn copy_from_host(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let len = src.len() as u64;
        self.log
            .time(CallKind::MemcpyHtoD, len, || self.write_bytes(dst, src))
    }

    fn driver_stats(&self) -> DriverStats {
        self.log.stats()
    }

    fn map_rule(&self) -> MapRule {
        lock(&self.state).ledger.map_rule()
    }

    fn caps(&self) -> DeviceCaps {
        lock(&self.state).ledger.caps()
    }

    /// A memfd of `size` bytes; out of memory (`ENOMEM`) reports what the
    /// capacity leaves.
    fn create_with(&self, size: u64, props: CreateProps) -> Result<PhysHandle> {
        let call = CallKind::Create;
        self.call(call, size, |state| {
            state.ledger.create(size, props, |ledger| {
                os::create_memory(size).map_err(|e| {
                    let mut err = os_failure(call, size, e);
                    if let VmmError::OutOfMemory { available, .. } = &mut err {
                        *available = ledger.mem_info().free;
                    }
                    err
                })
            })
        })
    }

    /// The memfd itself, duplicated: another process that receives it (over a
    /// Unix socket) and imports it maps the same pages.
    fn export_handle(&self, handle: PhysHandle, kind: HandleKind) -> Result<ShareableHandle> {
        let call = CallKind::ExportHandle;
        self.call(call, 0, |state| {
            state.ledger.export(handle, kind, |entry| {
                let fd = os::share_memory(&entry.payload).map_err(|e| os_failure(call, 0, e))?;
                Ok(ShareableHandle::PosixFd(fd))
            })
        })
    }

    /// Accepts a memfd of exactly `size` bytes (any other descriptor, or
    /// another size, is `InvalidArgument`); keeps a duplicate of it.
    fn import_handle(&self, shared: &ShareableHandle, size: u64) -> Result<PhysHandle> {
        let call = CallKind::ImportHandle;
        let ShareableHandle::PosixFd(fd) = shared else {
            return self.call(call, size, |_| {
                Err(invalid(
                    call,
                    "shHandleType",
                    0,
                    "the host backend imports POSIX file descriptors only",
                ))
            });
        };
        self.call(call, size, |state| {
            state.ledger.import(size, HandleKind::PosixFd, || {
                let raw = u64::try_from(fd.as_raw_fd()).unwrap_or(u64::MAX);
                match os::memory_size(fd.as_fd()) {
                    None => Err(invalid(
                        call,
                        "osHandle",
                        raw,
                        "is not a memory file descriptor (memfd) exported by a host backend",
                    )),
                    Some(actual) if actual != size => Err(invalid(
                        call,
                        "size",
                        size,
                        "differs from the size of the memory the descriptor holds",
                    )),
                    Some(_) => os::share_memory(fd).map_err(|e| os_failure(call, size, e)),
                }
            })
        })
    }

    fn set_access_for(&self, ptr: DevicePtr, size: u64, devices: &[DeviceOrdinal]) -> Result<()> {
        let call = CallKind::SetAccess;
        self.call(call, size, |state| {
            state.ledger.set_access(ptr, size, devices, || {
                // SAFETY: the ledger confirmed `ptr..ptr+size` is wholly covered by
                // our memfd mappings (and the one device, 0, is named).
                unsafe { os::protect_read_write(ptr, size) }.map_err(|e| os_failure(call, size, e))
            })
        })
    }
}

impl Drop for HostVmm {
    fn drop(&mut self) {
        let report = self.leak_report();
        if !report.is_clean() {
            tracing::debug!(%report, "host backend dropped with memory still held; freeing it");
        }
        // SAFETY: the arena is exactly the range `reserve_anywhere` made in
        // `new`; every reservation and mapping of this backend lies inside it
        // and goes with it; `&mut self` means no copy is in flight.
        if let Err(e) = unsafe { os::unreserve(self.arena_base, self.arena_size) } {
            tracing::warn!(error = %e.text, "munmap of the address arena failed at drop");
        }
        // The memfds close as the ledger drops with the backend.
    }
}

// The backend exists on 64-bit Linux only (elsewhere `new` is `Unavailable`).
#[cfg(test)]
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn small() -> HostVmm {
        HostVmm::new(HostConfig {
            granularity: 64 * 1024,
            capacity: 4 * MIB,
        })
        .unwrap()
    }

    #[test]
    fn granularity_must_be_a_power_of_two_page_multiple() {
        for g in [0, 1000, 3 * 4096, 1] {
            let err = HostVmm::new(HostConfig {
                granularity: g,
                capacity: MIB,
            })
            .unwrap_err();
            assert!(
                matches!(err, VmmError::InvalidArgument { argument: "granularity", value, .. } if value == g),
                "{g}: {err}"
            );
        }
        assert!(HostVmm::new(HostConfig::default()).is_ok());
    }

    #[test]
    fn reservations_are_aligned_as_asked() {
        let vmm = small();
        let g = vmm.granularity();
        for align in [0, g, 4 * g, 32 * g] {
            let ptr = vmm.reserve(3 * g, align).unwrap();
            assert_eq!(ptr % align.max(g), 0, "alignment {align}");
            vmm.address_free(ptr, 3 * g).unwrap();
        }
        assert!(vmm.leak_report().is_clean());
    }

    #[test]
    fn fresh_memory_reads_zero_and_capacity_is_enforced() {
        let vmm = small();
        let g = vmm.granularity();
        let ptr = vmm.reserve(4 * g, 0).unwrap();
        let h = vmm.create(2 * g).unwrap();
        vmm.map(ptr, 2 * g, h, 0).unwrap();
        vmm.set_access(ptr, 2 * g).unwrap();
        assert!(vmm.check_filled(ptr, 2 * g, 0).unwrap());
        let err = vmm.create(4 * MIB).unwrap_err();
        assert_eq!(
            err,
            VmmError::OutOfMemory {
                call: CallKind::Create,
                requested: 4 * MIB,
                available: 4 * MIB - 2 * g
            }
        );
        assert_eq!(vmm.mem_info().unwrap().free, 4 * MIB - 2 * g);
        vmm.unmap(ptr, 2 * g).unwrap();
        vmm.release(h).unwrap();
        vmm.address_free(ptr, 4 * g).unwrap();
        assert_eq!(vmm.mem_info().unwrap().free, 4 * MIB);
    }

    #[test]
    fn released_handle_stays_readable_until_unmapped() {
        let vmm = small();
        let g = vmm.granularity();
        let ptr = vmm.reserve(g, 0).unwrap();
        let h = vmm.create(g).unwrap();
        vmm.map(ptr, g, h, 0).unwrap();
        vmm.set_access(ptr, g).unwrap();
        vmm.fill(ptr, g, 0x5a).unwrap();
        vmm.release(h).unwrap();
        assert!(vmm.check_filled(ptr, g, 0x5a).unwrap());
        let live = vmm.leak_report();
        assert_eq!(
            (live.unreleased_handles(), live.released_but_mapped),
            (0, 1)
        );
        assert!(matches!(
            vmm.release(h),
            Err(VmmError::InvalidArgument {
                argument: "handle",
                ..
            })
        ));
        vmm.unmap(ptr, g).unwrap();
        assert_eq!(vmm.leak_report().released_but_mapped, 0);
        assert_eq!(vmm.mem_info().unwrap().free, 4 * MIB);
        vmm.address_free(ptr, g).unwrap();
    }

    #[test]
    fn unmap_takes_away_access() {
        let vmm = small();
        let g = vmm.granularity();
        let ptr = vmm.reserve(g, 0).unwrap();
        let h = vmm.create(g).unwrap();
        vmm.map(ptr, g, h, 0).unwrap();
        vmm.set_access(ptr, g).unwrap();
        vmm.unmap(ptr, g).unwrap();
        vmm.map(ptr, g, h, 0).unwrap();
        assert!(matches!(
            vmm.write_bytes(ptr, &[1]),
            Err(VmmError::InvalidArgument {
                call: CallKind::SetAccess,
                ..
            })
        ));
        vmm.unmap(ptr, g).unwrap();
        vmm.release(h).unwrap();
        vmm.address_free(ptr, g).unwrap();
    }

    #[test]
    fn events_complete_at_once_and_ids_are_checked() {
        let vmm = small();
        let e = vmm.event_record(StreamId(7)).unwrap();
        assert!(vmm.event_query(e).unwrap());
        vmm.stream_wait_event(StreamId::DEFAULT, e).unwrap();
        vmm.stream_synchronize(StreamId(7)).unwrap();
        assert_eq!(vmm.leak_report().events, 1);
        vmm.event_destroy(e).unwrap();
        assert!(vmm.event_query(e).is_err());
        assert!(vmm.event_destroy(e).is_err());
        assert!(vmm.stream_wait_event(StreamId::DEFAULT, e).is_err());
        let stats = vmm.driver_stats();
        assert_eq!(stats.count(CallKind::EventQuery), 2);
        assert_eq!(stats.failed[CallKind::EventQuery.index()], 1);
        assert_eq!(stats.failed[CallKind::EventDestroy.index()], 1);
    }

    #[test]
    fn an_event_can_be_recorded_again_while_live() {
        let vmm = small();
        let e = vmm.event_record(StreamId(7)).unwrap();
        assert!(vmm.event_query(e).unwrap());
        // Again, on its stream and on another: complete at once each time.
        vmm.event_record_on(e, StreamId(7)).unwrap();
        assert!(vmm.event_query(e).unwrap());
        vmm.event_record_on(e, StreamId(8)).unwrap();
        assert!(vmm.event_query(e).unwrap());
        vmm.stream_wait_event(StreamId::DEFAULT, e).unwrap();
        assert_eq!(vmm.leak_report().events, 1, "the same event throughout");
        // Unknown or destroyed: the typed error, and nothing changes.
        let gone = vmm.event_record(StreamId(7)).unwrap();
        vmm.event_destroy(gone).unwrap();
        for bad in [gone, EventId(99)] {
            assert!(matches!(
                vmm.event_record_on(bad, StreamId(7)),
                Err(VmmError::InvalidArgument {
                    call: CallKind::EventRecord,
                    argument: "event",
                    ..
                })
            ));
            assert!(vmm.event_query(bad).is_err());
        }
        assert_eq!(vmm.leak_report().events, 1);
        let stats = vmm.driver_stats();
        assert_eq!(stats.count(CallKind::EventRecord), 6);
        assert_eq!(stats.failed[CallKind::EventRecord.index()], 2);
        vmm.event_destroy(e).unwrap();
        assert!(vmm.leak_report().is_empty());
    }

    #[test]
    fn stats_count_calls_failures_and_created_bytes() {
        let vmm = small();
        let g = vmm.granularity();
        let h = vmm.create(g).unwrap();
        let _ = vmm.create(0);
        let ptr = vmm.reserve(g, 0).unwrap();
        vmm.map(ptr, g, h, 0).unwrap();
        vmm.unmap(ptr, g).unwrap();
        vmm.release(h).unwrap();
        vmm.address_free(ptr, g).unwrap();
        let s = vmm.driver_stats();
        assert_eq!(s.count(CallKind::Create), 2);
        assert_eq!(s.failed[CallKind::Create.index()], 1);
        assert_eq!(s.created_bytes, g);
        assert_eq!(s.vmm_calls(), 7);
        assert!(s.measured_ns > 0);
        assert_eq!(s.modelled_ns, 0);
    }

    #[test]
    fn drop_frees_what_is_left() {
        let vmm = small();
        let g = vmm.granularity();
        let ptr = vmm.reserve(2 * g, 0).unwrap();
        let h = vmm.create(g).unwrap();
        vmm.map(ptr, g, h, 0).unwrap();
        let live = vmm.leak_report();
        assert!(!live.is_clean());
        assert_eq!(
            (
                live.handles.len(),
                live.reservations.len(),
                live.mappings.len()
            ),
            (1, 1, 1)
        );
        drop(vmm);
    }

    #[test]
    fn is_send_sync_debug() {
        fn check<T: Send + Sync + std::fmt::Debug>() {}
        check::<HostVmm>();
        assert!(format!("{:?}", small()).contains("HostVmm"));
    }
}
