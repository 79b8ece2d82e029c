//! The double's own tests: one per rule it enforces (issue 22, "Strict by
//! default"), each driving `libquilt_cuda_double.so` as a client would,
//! through cudarc's raw bindings (`cudarc::driver::sys`, which load it as
//! `libcuda`), in a child process over the double
//! ([`harness::rerun_over_double`]). Device memory is host memory there, so
//! the tests read and write device addresses directly to check bytes.
//!
//! Each test asserts the exact `CUresult` of every call and the bytes the
//! calls leave, so a double that accepts what the reference forbids, runs
//! queued work early, or loses bytes fails it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr;

use cudarc::driver::sys::{self, cudaError_enum::*, CUresult};
use quilt_cuda_double::harness;

const MIB: usize = 1 << 20;
/// The double's default granularity.
const G: usize = 2 * MIB;

// --- Running over the double ---------------------------------------------------

/// [`harness::rerun_over_double_with`], except that these tests check the
/// double itself, so they run over it even where `QUILT_CUDA_TESTS=real`
/// sends the rest of the workspace's CUDA tests to a GPU (there they would
/// read device memory as host memory).
fn over_double(vars: &[(&str, &str)]) -> bool {
    if harness::active() || !harness::real_driver() {
        return harness::rerun_over_double_with(vars);
    }
    let current = std::thread::current();
    let test = current.name().expect("called from a #[test]");
    let exe = std::env::current_exe().unwrap();
    let mut cmd = harness::command(&exe).unwrap();
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env_remove(harness::REAL_ENV)
        .envs(vars.iter().copied());
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{test} failed over the CUDA double");
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{test} did not run"
    );
    false
}

// --- A thin client ------------------------------------------------------------

/// `Ok` for `CUDA_SUCCESS`, else the code.
fn res(r: CUresult) -> Result<(), CUresult> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

/// `cuInit`, device 0's primary context retained and made current; the
/// context (as a number, to hand to other threads).
fn setup() -> usize {
    let mut dev: sys::CUdevice = -1;
    let mut ctx: sys::CUcontext = ptr::null_mut();
    // SAFETY: plain driver calls with valid out-pointers to locals.
    unsafe {
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), CUDA_SUCCESS);
        assert_eq!(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    }
    assert_eq!(dev, 0);
    assert!(!ctx.is_null());
    ctx.addr()
}

/// Makes `ctx` (from [`setup`]) current on the calling thread.
fn make_current(ctx: usize) {
    // SAFETY: a context handle the double made; it never dereferences it.
    let r = unsafe { sys::cuCtxSetCurrent(ptr::without_provenance_mut(ctx)) };
    assert_eq!(r, CUDA_SUCCESS);
}

/// Pinned device memory on device 0, with a POSIX file-descriptor handle
/// type where `posix`.
fn prop(posix: bool) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if posix {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        },
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        win32HandleMetaData: ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn granularity(posix: bool, recommended: bool) -> Result<usize, CUresult> {
    let p = prop(posix);
    let option = if recommended {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    let mut g = 0usize;
    // SAFETY: valid pointers to locals.
    res(unsafe { sys::cuMemGetAllocationGranularity(&mut g, &p, option) })?;
    Ok(g)
}

fn reserve_aligned(size: usize, alignment: usize) -> Result<u64, CUresult> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer to a local.
    res(unsafe { sys::cuMemAddressReserve(&mut p, size, alignment, 0, 0) })?;
    Ok(p)
}

fn reserve(size: usize) -> u64 {
    reserve_aligned(size, 0).unwrap()
}

fn address_free(ptr: u64, size: usize) -> Result<(), CUresult> {
    // SAFETY: address arguments only; the double checks them.
    res(unsafe { sys::cuMemAddressFree(ptr, size) })
}

fn create_with(size: usize, posix: bool) -> Result<u64, CUresult> {
    let p = prop(posix);
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid pointers to locals.
    res(unsafe { sys::cuMemCreate(&mut h, size, &p, 0) })?;
    Ok(h)
}

fn create(size: usize) -> u64 {
    create_with(size, false).unwrap()
}

fn release(h: u64) -> Result<(), CUresult> {
    // SAFETY: a handle argument only; the double checks it.
    res(unsafe { sys::cuMemRelease(h) })
}

fn map_at(ptr: u64, size: usize, offset: usize, h: u64) -> Result<(), CUresult> {
    // SAFETY: address and handle arguments only; the double checks them.
    res(unsafe { sys::cuMemMap(ptr, size, offset, h, 0) })
}

fn unmap(ptr: u64, size: usize) -> Result<(), CUresult> {
    // SAFETY: address arguments only; the double checks them.
    res(unsafe { sys::cuMemUnmap(ptr, size) })
}

fn set_access(ptr: u64, size: usize, flags: sys::CUmemAccess_flags) -> Result<(), CUresult> {
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: 0,
        },
        flags,
    };
    // SAFETY: one valid descriptor.
    res(unsafe { sys::cuMemSetAccess(ptr, size, &desc, 1) })
}

const RW: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
const READ: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ;
const NONE: sys::CUmemAccess_flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;

/// A fresh reservation of `size` with one handle of `size` mapped
/// read-write over it: (address, handle).
fn mapped(size: usize) -> (u64, u64) {
    let p = reserve(size);
    let h = create(size);
    map_at(p, size, 0, h).unwrap();
    set_access(p, size, RW).unwrap();
    (p, h)
}

/// Unmaps, releases and frees what [`mapped`] made.
fn unmapped(p: u64, h: u64, size: usize) {
    unmap(p, size).unwrap();
    release(h).unwrap();
    address_free(p, size).unwrap();
}

/// Reads device memory directly (it is host memory in the double).
fn peek(ptr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: the tests peek only ranges the double has mapped with read
    // access (a host mapping); otherwise the child faults and the test fails.
    unsafe { ptr::copy_nonoverlapping(ptr as usize as *const u8, out.as_mut_ptr(), len) };
    out
}

/// Writes device memory directly.
fn poke(ptr: u64, bytes: &[u8]) {
    // SAFETY: the tests poke only ranges the double has mapped read-write.
    unsafe { ptr::copy_nonoverlapping(bytes.as_ptr(), ptr as usize as *mut u8, bytes.len()) };
}

fn all(bytes: &[u8], value: u8) -> bool {
    bytes.iter().all(|b| *b == value)
}

/// `CU_STREAM_LEGACY` and `CU_STREAM_PER_THREAD`: not pointers, handles.
fn special(value: usize) -> sys::CUstream {
    ptr::without_provenance_mut(value)
}
const NULL_STREAM: sys::CUstream = ptr::null_mut();
fn legacy() -> sys::CUstream {
    special(0x1)
}
fn per_thread() -> sys::CUstream {
    special(0x2)
}

fn stream(flags: u32) -> sys::CUstream {
    let mut s: sys::CUstream = ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(unsafe { sys::cuStreamCreate(&mut s, flags) }, CUDA_SUCCESS);
    assert!(!s.is_null());
    s
}

fn destroy_stream(s: sys::CUstream) -> Result<(), CUresult> {
    // SAFETY: a handle argument only; the double checks it.
    res(unsafe { sys::cuStreamDestroy_v2(s) })
}

fn sync(s: sys::CUstream) -> Result<(), CUresult> {
    // SAFETY: a handle argument only.
    res(unsafe { sys::cuStreamSynchronize(s) })
}

fn query(s: sys::CUstream) -> Result<(), CUresult> {
    // SAFETY: a handle argument only.
    res(unsafe { sys::cuStreamQuery(s) })
}

fn ctx_sync() -> Result<(), CUresult> {
    // SAFETY: no arguments.
    res(unsafe { sys::cuCtxSynchronize() })
}

fn memset(ptr: u64, value: u8, len: usize, s: sys::CUstream) -> Result<(), CUresult> {
    // SAFETY: device address and stream arguments; the double checks them.
    res(unsafe { sys::cuMemsetD8Async(ptr, value, len, s) })
}

fn htod(ptr: u64, bytes: &[u8]) -> Result<(), CUresult> {
    // SAFETY: `bytes` is readable for its length.
    res(unsafe { sys::cuMemcpyHtoD_v2(ptr, bytes.as_ptr().cast(), bytes.len()) })
}

fn dtoh(out: &mut [u8], ptr: u64) -> Result<(), CUresult> {
    // SAFETY: `out` is writable for its length.
    res(unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, out.len()) })
}

fn event() -> sys::CUevent {
    let mut e: sys::CUevent = ptr::null_mut();
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(unsafe { sys::cuEventCreate(&mut e, 0) }, CUDA_SUCCESS);
    e
}

fn record(e: sys::CUevent, s: sys::CUstream) -> Result<(), CUresult> {
    // SAFETY: handle arguments only.
    res(unsafe { sys::cuEventRecord(e, s) })
}

fn event_query(e: sys::CUevent) -> Result<(), CUresult> {
    // SAFETY: a handle argument only.
    res(unsafe { sys::cuEventQuery(e) })
}

fn event_sync(e: sys::CUevent) -> Result<(), CUresult> {
    // SAFETY: a handle argument only.
    res(unsafe { sys::cuEventSynchronize(e) })
}

fn mem_info() -> Result<(usize, usize), CUresult> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers to locals.
    res(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free, total))
}

fn mem_alloc(bytes: usize) -> Result<u64, CUresult> {
    let mut p: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer to a local.
    res(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) })?;
    Ok(p)
}

fn address_range(ptr: u64) -> Result<(u64, usize), CUresult> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers to locals.
    res(unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) })?;
    Ok((base, size))
}

fn capture_mode(mode: sys::CUstreamCaptureMode) -> sys::CUstreamCaptureMode {
    let mut m = mode;
    // SAFETY: a valid in-out pointer to a local.
    let r = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) };
    assert_eq!(r, CUDA_SUCCESS);
    m
}

fn begin_capture(s: sys::CUstream, mode: sys::CUstreamCaptureMode) -> Result<(), CUresult> {
    // SAFETY: handle and enum arguments only.
    res(unsafe { sys::cuStreamBeginCapture_v2(s, mode) })
}

/// `cuStreamEndCapture`: the graph (destroyed here) or the code; the graph
/// out-value must be null where the capture failed.
fn end_capture(s: sys::CUstream) -> Result<(), CUresult> {
    let mut g: sys::CUgraph = ptr::without_provenance_mut(0xdead);
    // SAFETY: a valid out-pointer to a local.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
    if r != CUDA_SUCCESS {
        assert!(g.is_null(), "a failed capture leaves no graph");
        return Err(r);
    }
    assert!(!g.is_null());
    // SAFETY: the graph just made.
    assert_eq!(unsafe { sys::cuGraphDestroy(g) }, CUDA_SUCCESS);
    Ok(())
}

fn capture_status(s: sys::CUstream) -> sys::CUstreamCaptureStatus {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(
        unsafe { sys::cuStreamIsCapturing(s, &mut status) },
        CUDA_SUCCESS
    );
    status
}

use sys::CUstreamCaptureMode::{
    CU_STREAM_CAPTURE_MODE_GLOBAL as GLOBAL, CU_STREAM_CAPTURE_MODE_RELAXED as RELAXED,
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL as THREAD_LOCAL,
};
use sys::CUstreamCaptureStatus::{
    CU_STREAM_CAPTURE_STATUS_ACTIVE as ACTIVE, CU_STREAM_CAPTURE_STATUS_INVALIDATED as INVALIDATED,
    CU_STREAM_CAPTURE_STATUS_NONE as NOT_CAPTURING,
};

const NON_BLOCKING: u32 = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;

// --- Mapping rules ----------------------------------------------------------------

#[test]
fn a_non_zero_map_offset_is_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let p = reserve(4 * G);
    let h = create(2 * G);
    assert_eq!(map_at(p, G, G, h), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(p + G as u64, G, G, h), Err(CUDA_ERROR_INVALID_VALUE));
    // Nothing was mapped by the refused calls: the whole handle maps there.
    assert_eq!(address_range(p), Err(CUDA_ERROR_NOT_FOUND));
    map_at(p, 2 * G, 0, h).unwrap();
    assert_eq!(address_range(p + 1), Ok((p, 2 * G)));
    unmap(p, 2 * G).unwrap();
    release(h).unwrap();
    address_free(p, 4 * G).unwrap();
}

#[test]
fn a_non_zero_map_offset_is_accepted_with_relax_map_offset() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_RELAX", "map_offset")]) {
        return;
    }
    setup();
    let (a, h) = mapped(2 * G);
    poke(a, &[0x11; 64]);
    poke(a + G as u64, &[0x5a; 64]);
    let b = reserve(2 * G);
    // The handle's second granule first, then its first.
    map_at(b, G, G, h).unwrap();
    map_at(b + G as u64, G, 0, h).unwrap();
    set_access(b, 2 * G, RW).unwrap();
    assert!(all(&peek(b, 64), 0x5a));
    assert!(all(&peek(b + G as u64, 64), 0x11));
    // Still refused: an offset off the granularity, a range past the handle.
    let c = reserve(2 * G);
    assert_eq!(map_at(c, G, 4096, h), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(c, 2 * G, G, h), Err(CUDA_ERROR_INVALID_VALUE));
    unmap(b, G).unwrap();
    unmap(b + G as u64, G).unwrap();
    unmapped(a, h, 2 * G);
    address_free(b, 2 * G).unwrap();
    address_free(c, 2 * G).unwrap();
}

#[test]
fn a_mapping_smaller_than_its_handle_is_refused_unless_relaxed() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let p = reserve(2 * G);
    let h = create(2 * G);
    assert_eq!(map_at(p, G, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    map_at(p, 2 * G, 0, h).unwrap();
    unmap(p, 2 * G).unwrap();
    release(h).unwrap();
    address_free(p, 2 * G).unwrap();
}

#[test]
fn a_mapping_smaller_than_its_handle_is_accepted_with_relax_partial_map() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_RELAX", "partial_map")]) {
        return;
    }
    setup();
    let p = reserve(2 * G);
    let h = create(2 * G);
    map_at(p, G, 0, h).unwrap();
    set_access(p, G, RW).unwrap();
    poke(p, &[3; 16]);
    assert!(all(&peek(p, 16), 3));
    // partial_map alone does not allow an offset.
    assert_eq!(map_at(p + G as u64, G, G, h), Err(CUDA_ERROR_INVALID_VALUE));
    unmap(p, G).unwrap();
    release(h).unwrap();
    address_free(p, 2 * G).unwrap();
}

#[test]
fn unaligned_addresses_and_sizes_are_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    assert_eq!(granularity(false, false), Ok(G));
    // Reservations.
    assert_eq!(reserve_aligned(G + 4096, 0), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(reserve_aligned(0, 0), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(
        reserve_aligned(2 * G, 3 * MIB),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    // Handles.
    assert_eq!(create_with(G + 4096, false), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(create_with(G / 2, false), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(create_with(0, false), Err(CUDA_ERROR_INVALID_VALUE));
    // Maps.
    let p = reserve(4 * G);
    let h = create(G);
    assert_eq!(map_at(p + 4096, G, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(
        map_at(p + MIB as u64, G, 0, h),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(map_at(p, G + 4096, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(p, G - 4096, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    map_at(p, G, 0, h).unwrap();
    // Access.
    assert_eq!(
        set_access(p + 4096, G - 4096, RW),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(set_access(p, 4096, RW), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(set_access(p, 0, RW), Err(CUDA_ERROR_INVALID_VALUE));
    set_access(p, G, RW).unwrap();
    // Unmaps and frees.
    assert_eq!(unmap(p, 4096), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(unmap(p + 4096, G - 4096), Err(CUDA_ERROR_INVALID_VALUE));
    poke(p, &[9; 8]); // still mapped with access
    unmap(p, G).unwrap();
    assert_eq!(
        address_free(p + 4096, 4 * G - 4096),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    release(h).unwrap();
    address_free(p, 4 * G).unwrap();
}

#[test]
fn maps_outside_a_live_reservation_or_over_a_mapping_are_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let p = reserve(2 * G);
    let (h1, h2, h3) = (create(G), create(G), create(2 * G));
    // Past the end, across the end, in a freed reservation, a made-up handle.
    assert_eq!(
        map_at(p + 2 * G as u64, G, 0, h1),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        map_at(p + G as u64, 2 * G, 0, h3),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    let gone = reserve(2 * G);
    address_free(gone, 2 * G).unwrap();
    assert_eq!(map_at(gone, G, 0, h1), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(p, G, 0, 0xdead_0000), Err(CUDA_ERROR_INVALID_VALUE));
    // Over a mapping, exactly or in part: refused, the mapping untouched.
    map_at(p, G, 0, h1).unwrap();
    set_access(p, G, RW).unwrap();
    poke(p, &[0x77; 128]);
    assert_eq!(map_at(p, G, 0, h2), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(p, 2 * G, 0, h3), Err(CUDA_ERROR_INVALID_VALUE));
    assert!(all(&peek(p, 128), 0x77));
    assert_eq!(address_range(p), Ok((p, G)));
    // The free neighbour still takes a mapping.
    map_at(p + G as u64, G, 0, h2).unwrap();
    unmap(p, G).unwrap();
    unmap(p + G as u64, G).unwrap();
    for h in [h1, h2, h3] {
        release(h).unwrap();
    }
    // A released, unmapped handle is gone.
    assert_eq!(map_at(p, G, 0, h1), Err(CUDA_ERROR_INVALID_VALUE));
    address_free(p, 2 * G).unwrap();
}

#[test]
fn unmapping_part_of_a_mapping_is_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let p = reserve(4 * G);
    let h = create(2 * G);
    map_at(p, 2 * G, 0, h).unwrap();
    set_access(p, 2 * G, RW).unwrap();
    poke(p + G as u64, &[0x42; 256]);
    assert_eq!(unmap(p, G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(unmap(p + G as u64, G), Err(CUDA_ERROR_INVALID_VALUE));
    // The mapping and a hole after it; nothing mapped at all.
    assert_eq!(unmap(p, 4 * G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(
        unmap(p + 2 * G as u64, 2 * G),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    // Untouched by the refusals.
    assert!(all(&peek(p + G as u64, 256), 0x42));
    assert_eq!(address_range(p + G as u64), Ok((p, 2 * G)));
    unmap(p, 2 * G).unwrap();
    assert_eq!(unmap(p, 2 * G), Err(CUDA_ERROR_INVALID_VALUE));
    release(h).unwrap();
    address_free(p, 4 * G).unwrap();
}

/// Two handles mapped side by side at the start of a fresh reservation.
fn two_neighbours() -> (u64, u64, u64) {
    let p = reserve(2 * G);
    let (h1, h2) = (create(G), create(G));
    map_at(p, G, 0, h1).unwrap();
    map_at(p + G as u64, G, 0, h2).unwrap();
    (p, h1, h2)
}

#[test]
fn one_unmap_over_two_adjacent_mappings_is_refused_by_default() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h1, h2) = two_neighbours();
    assert_eq!(unmap(p, 2 * G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(address_range(p), Ok((p, G)));
    assert_eq!(address_range(p + G as u64), Ok((p + G as u64, G)));
    unmap(p, G).unwrap();
    unmap(p + G as u64, G).unwrap();
    release(h1).unwrap();
    release(h2).unwrap();
    address_free(p, 2 * G).unwrap();
}

#[test]
fn one_unmap_over_two_adjacent_mappings_is_accepted_with_relax_unmap_spans() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_RELAX", "unmap_spans")]) {
        return;
    }
    setup();
    let (p, h1, h2) = two_neighbours();
    unmap(p, 2 * G).unwrap();
    assert_eq!(address_range(p), Err(CUDA_ERROR_NOT_FOUND));
    assert_eq!(address_range(p + G as u64), Err(CUDA_ERROR_NOT_FOUND));
    // Both gone: the space maps again, swapped.
    map_at(p, G, 0, h2).unwrap();
    map_at(p + G as u64, G, 0, h1).unwrap();
    // Spans still end on mapping boundaries.
    assert_eq!(unmap(p, G + G / 2), Err(CUDA_ERROR_INVALID_VALUE));
    unmap(p, 2 * G).unwrap();
    release(h1).unwrap();
    release(h2).unwrap();
    address_free(p, 2 * G).unwrap();
}

#[test]
fn freeing_a_reservation_with_the_wrong_size_is_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let p = reserve(4 * G);
    assert_eq!(address_free(p, 2 * G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(address_free(p, 8 * G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(
        address_free(p + G as u64, 3 * G),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    // Still live after the refusals: it takes a mapping at its end.
    let h = create(G);
    map_at(p + 3 * G as u64, G, 0, h).unwrap();
    // Not while a mapping is left inside.
    assert_eq!(address_free(p, 4 * G), Err(CUDA_ERROR_INVALID_VALUE));
    unmap(p + 3 * G as u64, G).unwrap();
    address_free(p, 4 * G).unwrap();
    assert_eq!(address_free(p, 4 * G), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(map_at(p, G, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    release(h).unwrap();
}

// --- Copies ----------------------------------------------------------------------

#[test]
fn copies_to_memory_not_mapped_with_access_are_refused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    // [no access | read only | read-write | unmapped]
    let p = reserve(4 * G);
    let (none, read, rw, hole) = (p, p + G as u64, p + 2 * G as u64, p + 3 * G as u64);
    let hs = [create(G), create(G), create(G)];
    for (at, h) in [none, read, rw].into_iter().zip(hs) {
        map_at(at, G, 0, h).unwrap();
    }
    set_access(read, G, READ).unwrap();
    set_access(rw, G, RW).unwrap();
    let src = [7u8; 256];
    let mut dst = [0xffu8; 256];
    let invalid = Err(CUDA_ERROR_INVALID_VALUE);
    // Host to device.
    assert_eq!(htod(none, &src), invalid);
    assert_eq!(htod(read, &src), invalid);
    assert_eq!(htod(hole, &src), invalid);
    assert_eq!(htod(hole - 128, &src), invalid); // runs off the end
    assert_eq!(htod(src.as_ptr() as usize as u64, &src), invalid); // host memory
                                                                   // SAFETY: `src` is readable for its length.
    let r = unsafe { sys::cuMemcpyHtoDAsync_v2(none, src.as_ptr().cast(), 256, NULL_STREAM) };
    assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
    // Fills.
    assert_eq!(memset(read, 1, 64, NULL_STREAM), invalid);
    assert_eq!(memset(hole, 1, 64, NULL_STREAM), invalid);
    // SAFETY: a device address argument only.
    assert_eq!(
        unsafe { sys::cuMemsetD8_v2(none, 1, 64) },
        CUDA_ERROR_INVALID_VALUE
    );
    // Device to host, device to device.
    assert_eq!(dtoh(&mut dst, none), invalid);
    assert_eq!(dtoh(&mut dst, hole), invalid);
    // SAFETY: device address arguments only.
    unsafe {
        assert_eq!(
            sys::cuMemcpyDtoD_v2(read, rw, 256),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemcpyDtoD_v2(rw, none, 256),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            sys::cuMemcpyDtoD_v2(rw, hole, 256),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    assert_eq!(dst, [0xff; 256], "a refused copy wrote nothing");
    // What access allows.
    htod(rw, &src).unwrap();
    dtoh(&mut dst, read).unwrap();
    assert_eq!(dst, [0; 256]);
    // SAFETY: device address arguments only.
    assert_eq!(
        unsafe { sys::cuMemcpyDtoD_v2(rw + 4096, rw, 256) },
        CUDA_SUCCESS
    );
    ctx_sync().unwrap();
    assert!(all(&peek(rw, 256), 7));
    assert!(all(&peek(rw + 4096, 256), 7));
    // Access taken away: refused again.
    set_access(rw, G, NONE).unwrap();
    assert_eq!(htod(rw, &src), invalid);
    assert_eq!(dtoh(&mut dst, rw), invalid);
    ctx_sync().unwrap(); // no refusal poisoned the context
    for (at, h) in [none, read, rw].into_iter().zip(hs) {
        unmap(at, G).unwrap();
        release(h).unwrap();
    }
    address_free(p, 4 * G).unwrap();
}

// --- Streams and events ----------------------------------------------------------

#[test]
fn calls_on_destroyed_streams_and_events_are_invalid_handles() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let bad = Err(CUDA_ERROR_INVALID_HANDLE);
    let s = stream(0);
    let e = event();
    let live = event();
    destroy_stream(s).unwrap();
    assert_eq!(sync(s), bad);
    assert_eq!(query(s), bad);
    assert_eq!(memset(p, 1, 64, s), bad);
    assert_eq!(record(live, s), bad);
    assert_eq!(begin_capture(s, GLOBAL), bad);
    assert_eq!(destroy_stream(s), bad);
    let src = [1u8; 64];
    let mut flags = 0u32;
    // SAFETY: valid pointers; the stream handle is checked by the double.
    unsafe {
        assert_eq!(
            sys::cuStreamWaitEvent(s, live, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            sys::cuStreamGetFlags(s, &mut flags),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            sys::cuMemcpyHtoDAsync_v2(p, src.as_ptr().cast(), 64, s),
            CUDA_ERROR_INVALID_HANDLE
        );
    }
    // SAFETY: a handle argument only.
    assert_eq!(unsafe { sys::cuEventDestroy_v2(e) }, CUDA_SUCCESS);
    assert_eq!(event_query(e), bad);
    assert_eq!(event_sync(e), bad);
    assert_eq!(record(e, NULL_STREAM), bad);
    let mut ms = 0f32;
    // SAFETY: valid pointers; the event handles are checked by the double.
    unsafe {
        assert_eq!(
            sys::cuStreamWaitEvent(NULL_STREAM, e, 0),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            sys::cuEventElapsedTime(&mut ms, e, live),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(sys::cuEventDestroy_v2(e), CUDA_ERROR_INVALID_HANDLE);
    }
    // The default streams cannot be destroyed.
    for special in [NULL_STREAM, legacy(), per_thread()] {
        assert_eq!(destroy_stream(special), bad);
    }
    // Nothing was queued by the refused calls.
    ctx_sync().unwrap();
    assert!(all(&peek(p, 64), 0));
    // Destroyed with its work still queued: the handle is dead at once,
    // the work still runs.
    let busy = stream(0);
    memset(p, 0x3d, 64, busy).unwrap();
    destroy_stream(busy).unwrap();
    assert_eq!(sync(busy), bad);
    assert_eq!(query(busy), bad);
    assert_eq!(memset(p + 64, 1, 64, busy), bad);
    assert_eq!(record(live, busy), bad);
    assert_eq!(destroy_stream(busy), bad);
    assert!(all(&peek(p, 64), 0));
    ctx_sync().unwrap();
    assert!(all(&peek(p, 64), 0x3d));
    assert!(all(&peek(p + 64, 64), 0));
    unmapped(p, h, G);
}

#[test]
fn a_destroyed_streams_handle_is_never_reused() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let mut seen = HashSet::new();
    let mut dead = Vec::new();
    for i in 0..200 {
        let s = stream(if i % 2 == 0 { 0 } else { NON_BLOCKING });
        assert!(seen.insert(s.addr()), "stream handle {s:?} given twice");
        destroy_stream(s).unwrap();
        dead.push(s);
        let e = event();
        assert!(seen.insert(e.addr()), "event handle {e:?} reuses a handle");
        // SAFETY: a handle argument only.
        assert_eq!(unsafe { sys::cuEventDestroy_v2(e) }, CUDA_SUCCESS);
    }
    for s in dead {
        assert_eq!(query(s), Err(CUDA_ERROR_INVALID_HANDLE));
    }
    // A destroyed stream's queued work still runs.
    let s = stream(0);
    memset(p, 0x99, 64, s).unwrap();
    destroy_stream(s).unwrap();
    let fresh = stream(0);
    assert!(!seen.contains(&fresh.addr()) && fresh != s);
    assert!(all(&peek(p, 64), 0));
    ctx_sync().unwrap();
    assert!(all(&peek(p, 64), 0x99));
    assert_eq!(sync(s), Err(CUDA_ERROR_INVALID_HANDLE));
    destroy_stream(fresh).unwrap();
    unmapped(p, h, G);
}

// --- Release while mapped --------------------------------------------------------

#[test]
fn releasing_a_mapped_handle_keeps_its_bytes_until_the_last_unmap() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (free0, total) = mem_info().unwrap();
    assert_eq!(free0, total);
    let h = create(G);
    let (a, b) = (reserve(G), reserve(G));
    for at in [a, b] {
        map_at(at, G, 0, h).unwrap();
        set_access(at, G, RW).unwrap();
    }
    let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 1) as u8).collect();
    poke(a, &pattern);
    assert_eq!(peek(b, 4096), pattern, "both mappings show one memory");
    release(h).unwrap();
    assert_eq!(
        release(h),
        Err(CUDA_ERROR_INVALID_VALUE),
        "no reference left"
    );
    let c = reserve(G);
    assert_eq!(map_at(c, G, 0, h), Err(CUDA_ERROR_INVALID_VALUE));
    assert_eq!(peek(a, 4096), pattern);
    assert_eq!(
        mem_info().unwrap().0,
        free0 - G,
        "still held by its mappings"
    );
    unmap(a, G).unwrap();
    assert_eq!(peek(b, 4096), pattern);
    assert_eq!(mem_info().unwrap().0, free0 - G);
    // Still usable memory: a copy into it runs.
    htod(b, &[0xc3; 64]).unwrap();
    ctx_sync().unwrap();
    assert!(all(&peek(b, 64), 0xc3));
    assert_eq!(peek(b + 64, 4096 - 64), pattern[64..]);
    unmap(b, G).unwrap();
    assert_eq!(mem_info().unwrap().0, free0, "the last unmap frees it");
    for at in [a, b, c] {
        address_free(at, G).unwrap();
    }
}

// --- Late-running work -----------------------------------------------------------

#[test]
fn queued_work_runs_only_when_waited_for() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(0);
    let e = event();
    // Stream synchronisation.
    memset(p, 0xab, 4096, s).unwrap();
    assert!(all(&peek(p, 4096), 0), "ran inside the call that queued it");
    record(e, s).unwrap();
    assert_eq!(query(s), Err(CUDA_ERROR_NOT_READY));
    assert_eq!(event_query(e), Err(CUDA_ERROR_NOT_READY));
    assert!(all(&peek(p, 4096), 0), "a query made it run");
    sync(s).unwrap();
    assert!(all(&peek(p, 4096), 0xab));
    assert_eq!(query(s), Ok(()));
    assert_eq!(event_query(e), Ok(()));
    // Event synchronisation runs the work up to the record only.
    memset(p, 0xcd, 64, s).unwrap();
    record(e, s).unwrap();
    memset(p + 64, 0xce, 64, s).unwrap();
    assert!(all(&peek(p, 64), 0xab));
    event_sync(e).unwrap();
    assert!(all(&peek(p, 64), 0xcd));
    assert!(all(&peek(p + 64, 64), 0xab));
    // Context synchronisation.
    ctx_sync().unwrap();
    assert!(all(&peek(p + 64, 64), 0xce));
    // A synchronous copy to pageable host memory waits for its stream.
    memset(p, 0xef, 128, NULL_STREAM).unwrap();
    assert!(all(&peek(p, 64), 0xcd));
    let mut out = [0u8; 128];
    dtoh(&mut out, p).unwrap();
    assert_eq!(out, [0xef; 128]);
    // A stream waiting for an event runs the recorded work when it runs.
    let t = stream(0);
    memset(p, 0x10, 64, s).unwrap();
    record(e, s).unwrap();
    // SAFETY: handle arguments only.
    assert_eq!(unsafe { sys::cuStreamWaitEvent(t, e, 0) }, CUDA_SUCCESS);
    memset(p + 64, 0x20, 64, t).unwrap();
    assert!(all(&peek(p, 64), 0xef));
    sync(t).unwrap();
    assert!(all(&peek(p, 64), 0x10));
    assert!(all(&peek(p + 64, 64), 0x20));
    destroy_stream(s).unwrap();
    destroy_stream(t).unwrap();
    unmapped(p, h, G);
}

#[test]
fn queued_work_runs_by_itself_after_the_lag() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_LAG", "8")]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(0);
    memset(p, 0x42, 4096, s).unwrap();
    let mut dev = -1;
    for call in 1..8 {
        assert!(
            all(&peek(p, 4096), 0),
            "ran {call} calls after it was queued"
        );
        // SAFETY: a valid out-pointer to a local.
        assert_eq!(unsafe { sys::cuCtxGetDevice(&mut dev) }, CUDA_SUCCESS);
    }
    assert!(all(&peek(p, 4096), 0), "ran 7 calls after it was queued");
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(unsafe { sys::cuCtxGetDevice(&mut dev) }, CUDA_SUCCESS);
    assert!(
        all(&peek(p, 4096), 0x42),
        "not run 8 calls after it was queued"
    );
    assert_eq!(query(s), Ok(()));
    destroy_stream(s).unwrap();
    unmapped(p, h, G);
}

#[test]
fn unmapping_under_queued_work_poisons_the_context() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(0);
    memset(p, 1, G, s).unwrap();
    unmap(p, G).unwrap(); // does not wait: the fill runs later, and faults
    let dead = Err(CUDA_ERROR_ILLEGAL_ADDRESS);
    assert_eq!(sync(s), dead);
    // Sticky: every later call that needs the context.
    assert_eq!(sync(s), dead);
    assert_eq!(query(s), dead);
    assert_eq!(ctx_sync(), dead);
    assert_eq!(mem_info().err(), Some(CUDA_ERROR_ILLEGAL_ADDRESS));
    assert_eq!(mem_alloc(4096).err(), Some(CUDA_ERROR_ILLEGAL_ADDRESS));
    let mut t: sys::CUstream = ptr::null_mut();
    let mut e: sys::CUevent = ptr::null_mut();
    // SAFETY: valid out-pointers to locals.
    unsafe {
        assert_eq!(sys::cuStreamCreate(&mut t, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(sys::cuEventCreate(&mut e, 0), CUDA_ERROR_ILLEGAL_ADDRESS);
    }
    assert_eq!(memset(p, 1, 64, NULL_STREAM), dead);
    release(h).unwrap();
}

#[test]
fn unmapping_under_queued_work_is_safe_with_relax_unmap_waits() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_RELAX", "unmap_waits")]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(0);
    memset(p, 0x3c, G, s).unwrap();
    unmap(p, G).unwrap(); // runs the fill first
    assert_eq!(sync(s), Ok(()));
    assert_eq!(ctx_sync(), Ok(()));
    // The fill landed in the handle's memory before the unmap.
    map_at(p, G, 0, h).unwrap();
    set_access(p, G, RW).unwrap();
    assert!(all(&peek(p, G), 0x3c));
    destroy_stream(s).unwrap();
    unmapped(p, h, G);
}

#[test]
fn the_legacy_stream_orders_with_blocking_streams_only() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let at = |i: u64| p + i * 4096;
    let b = stream(0);
    let n = stream(NON_BLOCKING);
    // Blocking stream's work, then the legacy stream's: the legacy waits.
    memset(at(0), 0x01, 64, b).unwrap();
    memset(at(1), 0x02, 64, NULL_STREAM).unwrap();
    sync(NULL_STREAM).unwrap();
    assert!(all(&peek(at(0), 64), 0x01));
    assert!(all(&peek(at(1), 64), 0x02));
    assert_eq!(query(b), Ok(()));
    // The legacy stream's work, then a blocking stream's: that one waits.
    memset(at(2), 0x03, 64, legacy()).unwrap();
    memset(at(3), 0x04, 64, b).unwrap();
    sync(b).unwrap();
    assert!(all(&peek(at(2), 64), 0x03));
    assert!(all(&peek(at(3), 64), 0x04));
    // NULL and CU_STREAM_LEGACY are one stream.
    memset(at(4), 0x05, 64, NULL_STREAM).unwrap();
    assert_eq!(query(legacy()), Err(CUDA_ERROR_NOT_READY));
    sync(legacy()).unwrap();
    assert!(all(&peek(at(4), 64), 0x05));
    // A non-blocking stream's work is not waited for by the legacy stream...
    memset(at(5), 0x06, 64, n).unwrap();
    memset(at(6), 0x07, 64, NULL_STREAM).unwrap();
    sync(NULL_STREAM).unwrap();
    assert!(all(&peek(at(6), 64), 0x07));
    assert!(
        all(&peek(at(5), 64), 0),
        "the legacy stream waited for a non-blocking one"
    );
    assert_eq!(query(n), Err(CUDA_ERROR_NOT_READY));
    // ...nor does it wait for the legacy stream's.
    memset(at(7), 0x08, 64, legacy()).unwrap();
    memset(at(8), 0x09, 64, n).unwrap();
    sync(n).unwrap();
    assert!(all(&peek(at(5), 64), 0x06));
    assert!(all(&peek(at(8), 64), 0x09));
    assert!(
        all(&peek(at(7), 64), 0),
        "a non-blocking stream waited for the legacy one"
    );
    ctx_sync().unwrap();
    assert!(all(&peek(at(7), 64), 0x08));
    // Flags as made.
    let mut flags = 7u32;
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(
        unsafe { sys::cuStreamGetFlags(n, &mut flags) },
        CUDA_SUCCESS
    );
    assert_eq!(flags, NON_BLOCKING);
    destroy_stream(b).unwrap();
    destroy_stream(n).unwrap();
    unmapped(p, h, G);
}

#[test]
fn the_per_thread_stream_is_the_calling_threads_own() {
    if !over_double(&[]) {
        return;
    }
    let ctx = setup();
    let (p, h) = mapped(G);
    memset(p, 0xa1, 64, per_thread()).unwrap();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                make_current(ctx);
                // This thread's own 0x2: empty, so its sync runs nothing of ours.
                sync(per_thread()).unwrap();
                memset(p + 4096, 0xb2, 64, per_thread()).unwrap();
                assert_eq!(query(per_thread()), Err(CUDA_ERROR_NOT_READY));
            })
            .join()
            .unwrap();
    });
    assert!(
        all(&peek(p, 64), 0),
        "another thread's 0x2 sync ran this thread's work"
    );
    assert!(all(&peek(p + 4096, 64), 0));
    sync(per_thread()).unwrap();
    assert!(all(&peek(p, 64), 0xa1));
    assert!(
        all(&peek(p + 4096, 64), 0),
        "this thread's 0x2 sync ran another's work"
    );
    ctx_sync().unwrap();
    assert!(all(&peek(p + 4096, 64), 0xb2));
    // Each thread's own stream is a blocking stream: the legacy stream's
    // work waits for another thread's.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                make_current(ctx);
                memset(p + 8192, 0xc4, 64, per_thread()).unwrap();
            })
            .join()
            .unwrap();
    });
    memset(p + 12288, 0xd5, 64, NULL_STREAM).unwrap();
    sync(NULL_STREAM).unwrap();
    assert!(all(&peek(p + 12288, 64), 0xd5));
    assert!(
        all(&peek(p + 8192, 64), 0xc4),
        "the legacy stream did not wait"
    );
    unmapped(p, h, G);
}

// --- Capture ----------------------------------------------------------------------

#[test]
fn an_event_recorded_during_capture_cannot_be_queried_even_in_relaxed_mode() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let s = stream(0);
    let e = event();
    assert_eq!(capture_mode(RELAXED), GLOBAL);
    begin_capture(s, RELAXED).unwrap();
    record(e, s).unwrap();
    let captured = Err(CUDA_ERROR_CAPTURED_EVENT);
    assert_eq!(event_query(e), captured);
    assert_eq!(event_sync(e), captured);
    end_capture(s).unwrap();
    // Still a captured event after the capture, until recorded again.
    assert_eq!(event_query(e), captured);
    record(e, s).unwrap();
    event_sync(e).unwrap();
    assert_eq!(event_query(e), Ok(()));
    assert_eq!(capture_mode(GLOBAL), RELAXED);
    destroy_stream(s).unwrap();
}

#[test]
fn synchronising_a_capturing_stream_fails_and_invalidates_the_capture() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(0);
    begin_capture(s, GLOBAL).unwrap();
    memset(p, 0x77, 64, s).unwrap(); // captured, never run
    assert_eq!(sync(s), Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(capture_status(s), INVALIDATED);
    assert_eq!(
        memset(p, 0x78, 64, s),
        Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    );
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    assert_eq!(capture_status(s), NOT_CAPTURING);
    sync(s).unwrap();
    assert!(all(&peek(p, 64), 0), "captured work ran");
    // Even where the capture's mode allows potentially unsafe calls.
    begin_capture(s, RELAXED).unwrap();
    assert_eq!(sync(s), Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(capture_status(s), INVALIDATED);
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    // The context's synchronisation and the stream's query, likewise.
    begin_capture(s, GLOBAL).unwrap();
    assert_eq!(ctx_sync(), Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    begin_capture(s, GLOBAL).unwrap();
    assert_eq!(query(s), Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    ctx_sync().unwrap();
    destroy_stream(s).unwrap();
    unmapped(p, h, G);
}

#[test]
fn under_global_capture_unsafe_calls_from_another_thread_fail_unless_relaxed() {
    if !over_double(&[]) {
        return;
    }
    let ctx = setup();
    let s = stream(NON_BLOCKING);
    let on_thread = |mode: Option<sys::CUstreamCaptureMode>| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    make_current(ctx);
                    if let Some(m) = mode {
                        assert_eq!(capture_mode(m), GLOBAL);
                    }
                    (create_with(G, false), mem_alloc(4096))
                })
                .join()
                .unwrap()
        })
    };
    begin_capture(s, GLOBAL).unwrap();
    // Relaxed: allowed, and the capture is not harmed.
    let (h, d) = on_thread(Some(RELAXED));
    let (h, d) = (h.unwrap(), d.unwrap());
    assert_eq!(capture_status(s), ACTIVE);
    // Global: refused, and the capture is invalidated.
    let (h2, late) = on_thread(None);
    assert_eq!(h2, Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    if let Ok(late) = late {
        // SAFETY: an allocation made above (after the capture was invalidated).
        assert_eq!(unsafe { sys::cuMemFree_v2(late) }, CUDA_SUCCESS);
    }
    assert_eq!(capture_status(s), INVALIDATED);
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    begin_capture(s, GLOBAL).unwrap();
    let (_, d2) = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                make_current(ctx);
                (Ok::<(), CUresult>(()), mem_alloc(4096))
            })
            .join()
            .unwrap()
    });
    assert_eq!(d2, Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED));
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    // A thread-local capture forbids only its own thread's unsafe calls.
    begin_capture(s, THREAD_LOCAL).unwrap();
    let (h3, d3) = on_thread(None);
    let (h3, d3) = (h3.unwrap(), d3.unwrap());
    assert_eq!(capture_status(s), ACTIVE);
    assert_eq!(
        create_with(G, false),
        Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    );
    assert_eq!(end_capture(s), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    // No capture: allowed in any mode.
    let (h4, d4) = on_thread(None);
    for handle in [h, h3, h4.unwrap()] {
        release(handle).unwrap();
    }
    for ptr in [d, d3, d4.unwrap()] {
        // SAFETY: an allocation made above.
        assert_eq!(unsafe { sys::cuMemFree_v2(ptr) }, CUDA_SUCCESS);
    }
    destroy_stream(s).unwrap();
}

#[test]
fn stream_is_capturing_reports_the_capture_status() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let s = stream(NON_BLOCKING);
    let t = stream(NON_BLOCKING);
    let e = event();
    assert_eq!(capture_status(s), NOT_CAPTURING);
    assert_eq!(capture_status(NULL_STREAM), NOT_CAPTURING);
    begin_capture(s, GLOBAL).unwrap();
    assert_eq!(capture_status(s), ACTIVE);
    assert_eq!(capture_status(t), NOT_CAPTURING);
    assert_eq!(begin_capture(s, GLOBAL), Err(CUDA_ERROR_ILLEGAL_STATE));
    let (mut status, mut id) = (NOT_CAPTURING, 0u64);
    // SAFETY: valid out-pointers to locals.
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v2(
            s,
            &mut status,
            &mut id,
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
        )
    };
    assert_eq!((r, status), (CUDA_SUCCESS, ACTIVE));
    assert_ne!(id, 0);
    // A stream that waits for a captured event joins the capture.
    memset(p, 0x55, 64, s).unwrap();
    record(e, s).unwrap();
    // SAFETY: handle arguments only.
    assert_eq!(unsafe { sys::cuStreamWaitEvent(t, e, 0) }, CUDA_SUCCESS);
    let (mut status_t, mut id_t) = (NOT_CAPTURING, 0u64);
    // SAFETY: valid out-pointers to locals.
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v2(
            t,
            &mut status_t,
            &mut id_t,
            ptr::null_mut(),
            ptr::null_mut(),
            ptr::null_mut(),
        )
    };
    assert_eq!((r, status_t, id_t), (CUDA_SUCCESS, ACTIVE, id));
    memset(p + 64, 0x56, 64, t).unwrap();
    // Ended where it began only.
    assert_eq!(end_capture(t), Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED));
    end_capture(s).unwrap();
    assert_eq!(capture_status(s), NOT_CAPTURING);
    assert_eq!(capture_status(t), NOT_CAPTURING);
    sync(s).unwrap();
    sync(t).unwrap();
    assert!(all(&peek(p, 128), 0), "captured work ran");
    destroy_stream(s).unwrap();
    destroy_stream(t).unwrap();
    unmapped(p, h, G);
}

#[test]
fn a_capture_ends_on_its_own_thread_unless_relaxed_and_never_on_the_legacy_stream() {
    if !over_double(&[]) {
        return;
    }
    let ctx = setup();
    let s = stream(NON_BLOCKING);
    let handle = s.addr(); // a raw pointer does not cross threads; its value does
    let end_elsewhere = || {
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    make_current(ctx);
                    end_capture(ptr::without_provenance_mut(handle))
                })
                .join()
                .unwrap()
        })
    };
    for mode in [GLOBAL, THREAD_LOCAL] {
        begin_capture(s, mode).unwrap();
        assert_eq!(end_elsewhere(), Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD));
        assert_eq!(capture_status(s), ACTIVE);
        end_capture(s).unwrap();
    }
    begin_capture(s, RELAXED).unwrap();
    assert_eq!(end_elsewhere(), Ok(()));
    assert_eq!(capture_status(s), NOT_CAPTURING);
    // Not capturing: nothing to end.
    assert_eq!(end_capture(s), Err(CUDA_ERROR_ILLEGAL_STATE));
    // The legacy stream cannot capture.
    for legacy in [NULL_STREAM, legacy()] {
        assert_eq!(
            begin_capture(legacy, GLOBAL),
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        );
    }
    destroy_stream(s).unwrap();
}

#[test]
fn the_legacy_stream_cannot_be_used_while_a_blocking_stream_captures() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let (p, h) = mapped(G);
    let b = stream(0);
    let n = stream(NON_BLOCKING);
    begin_capture(b, GLOBAL).unwrap();
    // Asked whether it captures: CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, and the
    // capture is not invalidated (the reference's cuStreamIsCapturing).
    for legacy in [NULL_STREAM, legacy()] {
        let mut status = NOT_CAPTURING;
        // SAFETY: a valid out-pointer to a local.
        let r = unsafe { sys::cuStreamIsCapturing(legacy, &mut status) };
        assert_eq!(r, CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    }
    assert_eq!(capture_status(b), ACTIVE);
    assert_eq!(
        memset(p, 1, 64, NULL_STREAM),
        Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    );
    assert_eq!(capture_status(b), INVALIDATED);
    assert_eq!(end_capture(b), Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
    // Nor synchronised or queried, where the capture's mode allows
    // potentially unsafe calls too: it would synchronise the capture.
    for capturing in [b, per_thread()] {
        begin_capture(capturing, RELAXED).unwrap();
        assert_eq!(sync(NULL_STREAM), Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT));
        assert_eq!(capture_status(capturing), INVALIDATED);
        assert_eq!(
            end_capture(capturing),
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        );
        begin_capture(capturing, RELAXED).unwrap();
        assert_eq!(query(legacy()), Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT));
        assert_eq!(
            end_capture(capturing),
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        );
    }
    // A non-blocking stream's capture leaves the legacy stream usable.
    begin_capture(n, RELAXED).unwrap();
    assert_eq!(capture_status(NULL_STREAM), NOT_CAPTURING);
    memset(p, 2, 64, NULL_STREAM).unwrap();
    sync(NULL_STREAM).unwrap();
    end_capture(n).unwrap();
    sync(NULL_STREAM).unwrap();
    assert!(all(&peek(p, 64), 2));
    destroy_stream(b).unwrap();
    destroy_stream(n).unwrap();
    unmapped(p, h, G);
}

// --- Sharing ----------------------------------------------------------------------

#[test]
fn an_exported_posix_fd_imports_as_the_same_memory_with_its_real_size() {
    if !over_double(&[]) {
        return;
    }
    setup();
    let size = 2 * granularity(true, false).unwrap();
    let a = reserve(size);
    let h = create_with(size, true).unwrap();
    map_at(a, size, 0, h).unwrap();
    set_access(a, size, RW).unwrap();
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    poke(a + G as u64, &pattern);
    let (free_before, _) = mem_info().unwrap();
    let posix = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    let mut fd: c_int = -1;
    // SAFETY: for a POSIX handle the out-value is an int.
    let r = unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut c_int).cast::<c_void>(), h, posix, 0)
    };
    assert_eq!(r, CUDA_SUCCESS);
    assert!(fd >= 0);
    // SAFETY: the exporter gave the descriptor to us.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut imported: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: a POSIX descriptor passes as the pointer-sized handle value.
    let r = unsafe {
        sys::cuMemImportFromShareableHandle(
            &mut imported,
            ptr::without_provenance_mut(std::os::fd::AsRawFd::as_raw_fd(&fd) as usize),
            posix,
        )
    };
    assert_eq!(r, CUDA_SUCCESS);
    drop(fd); // the double keeps its own reference
    assert_ne!(imported, h);
    assert_eq!(
        mem_info().unwrap().0,
        free_before,
        "an import allocates nothing"
    );
    // Its real size: only a whole mapping of `size` is accepted.
    let b = reserve(2 * size);
    assert_eq!(
        map_at(b, size / 2, 0, imported),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    assert_eq!(
        map_at(b, 2 * size, 0, imported),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    map_at(b, size, 0, imported).unwrap();
    set_access(b, size, RW).unwrap();
    assert_eq!(peek(b + G as u64, pattern.len()), pattern);
    // One memory: writes through either show through the other, and it
    // outlives the exporter's handle.
    poke(b, &[0xee; 32]);
    assert!(all(&peek(a, 32), 0xee));
    unmap(a, size).unwrap();
    release(h).unwrap();
    assert!(all(&peek(b, 32), 0xee));
    assert_eq!(peek(b + G as u64, pattern.len()), pattern);
    unmap(b, size).unwrap();
    release(imported).unwrap();
    address_free(a, size).unwrap();
    address_free(b, 2 * size).unwrap();
    // Only handles made for it export.
    let plain = create(G);
    let mut fd2: c_int = -1;
    // SAFETY: as above.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd2 as *mut c_int).cast::<c_void>(),
            plain,
            posix,
            0,
        )
    };
    assert_eq!(r, CUDA_ERROR_INVALID_VALUE);
    release(plain).unwrap();
}

// --- Limits -----------------------------------------------------------------------

#[test]
fn creates_beyond_the_configured_memory_are_out_of_memory() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_MEMORY", "8MiB")]) {
        return;
    }
    setup();
    assert_eq!(mem_info(), Ok((8 * MIB, 8 * MIB)));
    let mut total = 0usize;
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(
        unsafe { sys::cuDeviceTotalMem_v2(&mut total, 0) },
        CUDA_SUCCESS
    );
    assert_eq!(total, 8 * MIB);
    assert_eq!(create_with(10 * MIB, false), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let hs: Vec<u64> = (0..4).map(|_| create(G)).collect();
    assert_eq!(mem_info(), Ok((0, 8 * MIB)));
    assert_eq!(create_with(G, false), Err(CUDA_ERROR_OUT_OF_MEMORY));
    assert_eq!(mem_alloc(1), Err(CUDA_ERROR_OUT_OF_MEMORY));
    release(hs[0]).unwrap();
    assert_eq!(mem_info(), Ok((G, 8 * MIB)));
    let d = mem_alloc(1).unwrap();
    assert_eq!(create_with(G, false), Err(CUDA_ERROR_OUT_OF_MEMORY));
    // SAFETY: the allocation just made.
    assert_eq!(unsafe { sys::cuMemFree_v2(d) }, CUDA_SUCCESS);
    let h = create(G);
    for h in hs[1..].iter().chain([&h]) {
        release(*h).unwrap();
    }
    assert_eq!(mem_info(), Ok((8 * MIB, 8 * MIB)));
}

#[test]
fn reserving_beyond_the_address_space_is_out_of_memory() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_ADDRESS_SPACE", "8MiB")]) {
        return;
    }
    setup();
    assert_eq!(reserve_aligned(16 * MIB, 0), Err(CUDA_ERROR_OUT_OF_MEMORY));
    let p = reserve(8 * MIB);
    assert_eq!(reserve_aligned(G, 0), Err(CUDA_ERROR_OUT_OF_MEMORY));
    address_free(p, 8 * MIB).unwrap();
    let q = reserve(G);
    let r = reserve(6 * MIB);
    assert_eq!(reserve_aligned(G, 0), Err(CUDA_ERROR_OUT_OF_MEMORY));
    address_free(q, G).unwrap();
    address_free(r, 6 * MIB).unwrap();
}

#[test]
fn the_granularity_query_honours_the_shareable_granularity() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_SHAREABLE_GRANULARITY", "8MiB")]) {
        return;
    }
    setup();
    assert_eq!(granularity(false, false), Ok(G));
    assert_eq!(granularity(false, true), Ok(G));
    assert_eq!(granularity(true, false), Ok(8 * MIB));
    assert_eq!(granularity(true, true), Ok(8 * MIB));
    // Creates and maps of shareable handles follow it.
    assert_eq!(create_with(G, true), Err(CUDA_ERROR_INVALID_VALUE));
    let h = create_with(8 * MIB, true).unwrap();
    let p = reserve_aligned(16 * MIB, 8 * MIB).unwrap();
    assert_eq!(p % (8 * MIB) as u64, 0);
    assert_eq!(
        map_at(p + G as u64, 8 * MIB, 0, h),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    map_at(p + 8 * MIB as u64, 8 * MIB, 0, h).unwrap();
    set_access(p + 8 * MIB as u64, 8 * MIB, RW).unwrap();
    // Plain handles keep the plain granularity beside it.
    let plain = create(G);
    map_at(p + G as u64, G, 0, plain).unwrap();
    unmap(p + G as u64, G).unwrap();
    unmap(p + 8 * MIB as u64, 8 * MIB).unwrap();
    release(h).unwrap();
    release(plain).unwrap();
    address_free(p, 16 * MIB).unwrap();
}

#[test]
fn the_recommended_granularity_is_configurable() {
    if !over_double(&[
        ("QUILT_CUDA_DOUBLE_GRANULARITY", "64KiB"),
        ("QUILT_CUDA_DOUBLE_RECOMMENDED", "4MiB"),
    ]) {
        return;
    }
    setup();
    let k64 = 64 << 10;
    assert_eq!(granularity(false, false), Ok(k64));
    assert_eq!(granularity(false, true), Ok(4 * MIB));
    assert_eq!(granularity(true, false), Ok(k64));
    assert_eq!(granularity(true, true), Ok(4 * MIB));
    // The minimum is what creates, reservations and maps must honour.
    let p = reserve(2 * k64);
    let h = create_with(k64, false).unwrap();
    map_at(p + k64 as u64, k64, 0, h).unwrap();
    set_access(p + k64 as u64, k64, RW).unwrap();
    poke(p + k64 as u64, &[1; 16]);
    assert_eq!(
        create_with(k64 + 4096, false),
        Err(CUDA_ERROR_INVALID_VALUE)
    );
    unmap(p + k64 as u64, k64).unwrap();
    release(h).unwrap();
    address_free(p, 2 * k64).unwrap();
}

#[test]
fn without_posix_handles_a_shareable_granularity_query_is_not_supported() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_POSIX_FD", "0")]) {
        return;
    }
    setup();
    assert_eq!(granularity(false, false), Ok(G));
    assert_eq!(granularity(true, false), Err(CUDA_ERROR_NOT_SUPPORTED));
    assert_eq!(create_with(G, true), Err(CUDA_ERROR_NOT_SUPPORTED));
}

// --- Error names ------------------------------------------------------------------

/// `cuGetErrorName` or `cuGetErrorString` of a raw code, through the
/// library's symbol (a code cudarc's enum may not hold cannot pass through
/// its typed binding).
fn error_text(code: u32, name: bool) -> (u32, Option<String>) {
    type Text = unsafe extern "C" fn(u32, *mut *const c_char) -> u32;
    let symbol: &[u8] = if name {
        b"cuGetErrorName\0"
    } else {
        b"cuGetErrorString\0"
    };
    // SAFETY: the double's export of that name has this C signature.
    let f: Text = unsafe { *sys::culib().get::<Text>(symbol).unwrap() };
    let mut out: *const c_char = c"stale".as_ptr();
    // SAFETY: a valid out-pointer to a local.
    let r = unsafe { f(code, &mut out) };
    // SAFETY: where non-null, a static NUL-terminated string of the double.
    let text = (!out.is_null()).then(|| {
        unsafe { CStr::from_ptr(out) }
            .to_string_lossy()
            .into_owned()
    });
    (r, text)
}

#[test]
fn error_names_and_strings_are_cuda_hs() {
    if !over_double(&[]) {
        return;
    }
    // No cuInit needed.
    let mut p: *const c_char = ptr::null();
    // SAFETY: a valid out-pointer to a local.
    assert_eq!(
        unsafe { sys::cuGetErrorName(CUDA_ERROR_ILLEGAL_ADDRESS, &mut p) },
        CUDA_SUCCESS
    );
    // SAFETY: the double's static string.
    assert_eq!(unsafe { CStr::from_ptr(p) }, c"CUDA_ERROR_ILLEGAL_ADDRESS");
    // SAFETY: as above.
    assert_eq!(
        unsafe { sys::cuGetErrorString(CUDA_ERROR_ILLEGAL_ADDRESS, &mut p) },
        CUDA_SUCCESS
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { CStr::from_ptr(p) },
        c"an illegal memory access was encountered"
    );
    let cases: [(u32, &str, &str); 6] = [
        (0, "CUDA_SUCCESS", "no error"),
        (1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"),
        (2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
        (400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
        (600, "CUDA_ERROR_NOT_READY", "device not ready"),
        (
            907,
            "CUDA_ERROR_CAPTURED_EVENT",
            "operation not permitted on an event last recorded in a capturing stream",
        ),
    ];
    for (code, name, text) in cases {
        assert_eq!(error_text(code, true), (0, Some(name.to_owned())));
        assert_eq!(error_text(code, false), (0, Some(text.to_owned())));
    }
    // A code that is none of cuda.h's: CUDA_ERROR_INVALID_VALUE and NULL.
    assert_eq!(error_text(12345, true), (1, None));
    assert_eq!(error_text(12345, false), (1, None));
    // A null out-pointer.
    // SAFETY: the double checks the pointer.
    assert_eq!(
        unsafe { sys::cuGetErrorName(CUDA_SUCCESS, ptr::null_mut()) },
        CUDA_ERROR_INVALID_VALUE
    );
}

#[test]
fn every_code_the_double_returns_has_its_name_and_string() {
    if !over_double(&[]) {
        return;
    }
    // Every CUresult the double's sources return, with cuda.h's name and
    // the driver's string.
    let codes: &[(u32, &str, &str)] = &[
        (3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
        (
            100,
            "CUDA_ERROR_NO_DEVICE",
            "no CUDA-capable device is detected",
        ),
        (101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
        (201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
        (
            401,
            "CUDA_ERROR_ILLEGAL_STATE",
            "the operation cannot be performed in the present state",
        ),
        (500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"),
        (801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
        (
            900,
            "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
            "operation not permitted when stream is capturing",
        ),
        (
            901,
            "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
            "operation failed due to a previous error during capture",
        ),
        (
            905,
            "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
            "dependency created on uncaptured work in another stream",
        ),
        (
            906,
            "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
            "operation would make the legacy stream depend on a capturing blocking stream",
        ),
        (
            908,
            "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
            "attempt to terminate a thread-local capture sequence from another thread",
        ),
    ];
    for (code, name, text) in codes {
        assert_eq!(
            error_text(*code, true),
            (0, Some((*name).to_owned())),
            "{code}"
        );
        assert_eq!(
            error_text(*code, false),
            (0, Some((*text).to_owned())),
            "{code}"
        );
    }
    // 903's name (its string is not checked: sources differ).
    assert_eq!(
        error_text(903, true),
        (0, Some("CUDA_ERROR_STREAM_CAPTURE_UNMATCHED".to_owned()))
    );
}

// --- The harness ------------------------------------------------------------------

#[test]
fn the_harness_links_name_the_double() {
    let dir = harness::library_dir(&harness::library().unwrap()).unwrap();
    let lib = harness::library().unwrap().canonicalize().unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        assert_eq!(std::fs::canonicalize(dir.join(name)).unwrap(), lib);
    }
}

// --- Configuration -----------------------------------------------------------------

#[test]
fn no_devices_is_no_device_at_init() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_DEVICES", "0")]) {
        return;
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        assert_eq!(sys::cuInit(0), CUDA_ERROR_NO_DEVICE);
        let mut count = -1;
        assert_eq!(
            sys::cuDeviceGetCount(&mut count),
            CUDA_ERROR_NOT_INITIALIZED
        );
    }
}

#[test]
fn a_rule_that_does_not_parse_fails_init() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_RELAX", "map_offset,no_such_rule")]) {
        return;
    }
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        assert_eq!(sys::cuInit(0), CUDA_ERROR_INVALID_VALUE);
        let mut dev = -1;
        assert_eq!(sys::cuDeviceGet(&mut dev, 0), CUDA_ERROR_NOT_INITIALIZED);
    }
}

#[test]
fn the_driver_version_is_configurable_and_needs_no_init() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_DRIVER_VERSION", "12040")]) {
        return;
    }
    let (mut before, mut after) = (0, 0);
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        assert_eq!(sys::cuDriverGetVersion(&mut before), CUDA_SUCCESS);
        assert_eq!(sys::cuInit(0), CUDA_SUCCESS);
        assert_eq!(sys::cuDriverGetVersion(&mut after), CUDA_SUCCESS);
    }
    assert_eq!((before, after), (12040, 12040));
}

/// Plain handles share one arena file per device, so a device holds more
/// handles than the process may open descriptors (80 GiB in 2 MiB pages:
/// 40,960 handles), and each keeps its own bytes.
#[test]
fn plain_handles_do_not_take_a_descriptor_each() {
    if !over_double(&[("QUILT_CUDA_DOUBLE_MEMORY", "80GiB")]) {
        return;
    }
    setup();
    let hs: Vec<u64> = (0..40_960).map(|_| create(G)).collect();
    assert_eq!(mem_info().unwrap().0, 0, "the whole device is in handles");
    assert_eq!(create_with(G, false), Err(CUDA_ERROR_OUT_OF_MEMORY));
    // Two of them mapped side by side hold their own bytes.
    let va = reserve_aligned(2 * G, 0).unwrap();
    for (i, h) in [hs[7], hs[40_000]].iter().enumerate() {
        let at = va + (i * G) as u64;
        // SAFETY: a live handle mapped whole into the reservation.
        unsafe {
            assert_eq!(sys::cuMemMap(at, G, 0, *h, 0), CUDA_SUCCESS);
        }
    }
    set_access(
        va,
        2 * G,
        sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    )
    .unwrap();
    // SAFETY: both pages are mapped with read-write access; on the double
    // device memory is host memory.
    unsafe {
        std::ptr::write_bytes(va as usize as *mut u8, 0x11, G);
        std::ptr::write_bytes((va as usize + G) as *mut u8, 0x22, G);
        assert_eq!(*(va as usize as *const u8), 0x11);
        assert_eq!(*((va as usize + 2 * G - 1) as *const u8), 0x22);
        assert_eq!(sys::cuMemUnmap(va, G), CUDA_SUCCESS);
        assert_eq!(sys::cuMemUnmap(va + G as u64, G), CUDA_SUCCESS);
        assert_eq!(sys::cuMemAddressFree(va, 2 * G), CUDA_SUCCESS);
    }
    for h in hs {
        release(h).unwrap();
    }
    assert_eq!(mem_info().unwrap().0, 80usize << 30);
}
