//! Devices, the current device and its primary context, versions, device
//! attributes and properties, and the driver entry points torch resolves at
//! run time (`cudaGetDriverEntryPointByVersion`).
//!
//! As NVIDIA's runtime does, the face uses the context current on the
//! calling thread where there is one (so a context Quilt's CUDA backend
//! made current is the face's too), and otherwise makes the primary context
//! of the thread's device (device 0 until `cudaSetDevice`) current. Primary
//! contexts are retained once, on first use, and kept for the process.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::{Mutex, PoisonError};

use crate::driver::{self, CuDevice, Opaque};
use crate::errors::{check, Rt, INVALID_DEVICE, INVALID_VALUE, PEER_ACCESS_UNSUPPORTED};
use crate::props::DeviceProp;

/// The runtime version the face answers: CUDA 13.2, the wheel's.
pub const RUNTIME_VERSION: c_int = 13020;

thread_local! {
    /// The calling thread's device where no context is current.
    static DEVICE: Cell<c_int> = const { Cell::new(0) };
}

/// The number of devices.
pub fn count() -> Rt<c_int> {
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut n = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuDeviceGetCount)(&mut n) })?;
    Ok(n)
}

/// `device` checked against the device count.
pub fn valid(device: c_int) -> Rt<CuDevice> {
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut dev = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuDeviceGet)(&mut dev, device) }).map_err(|_| INVALID_DEVICE)?;
    Ok(dev)
}

/// The primary context of device ordinal `device` (`cudaErrorInvalidDevice`
/// for none), retained once for the process.
pub fn primary_of(device: c_int) -> Rt<Opaque> {
    primary(valid(device)?)
}

/// The primary context of `device`, retained once for the process.
fn primary(device: CuDevice) -> Rt<Opaque> {
    static PRIMARY: Mutex<Vec<(CuDevice, usize)>> = Mutex::new(Vec::new());
    let mut known = PRIMARY.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, c)) = known.iter().find(|(d, _)| *d == device) {
        return Ok(*c as Opaque);
    }
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut ctx: Opaque = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and a device checked by the caller.
    check(unsafe { (d.cuDevicePrimaryCtxRetain)(&mut ctx, device) })?;
    known.push((device, ctx as usize));
    Ok(ctx)
}

/// Makes sure a context is current on the calling thread (the primary
/// context of the thread's device where none is) and returns its device.
pub fn bind() -> Rt<CuDevice> {
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut ctx: Opaque = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuCtxGetCurrent)(&mut ctx) })?;
    if ctx.is_null() {
        let device = valid(DEVICE.with(Cell::get))?;
        let p = primary(device)?;
        // SAFETY: a context the driver gave (retained for the process).
        check(unsafe { (d.cuCtxSetCurrent)(p) })?;
        return Ok(device);
    }
    let mut device = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuCtxGetDevice)(&mut device) })?;
    Ok(device)
}

/// `cudaSetDevice`: the device's primary context becomes current.
pub fn set(device: c_int) -> Rt<()> {
    let dev = valid(device)?;
    let p = primary(dev)?;
    let d = driver::get().map_err(|e| e as c_int)?;
    // SAFETY: a context the driver gave (retained for the process).
    check(unsafe { (d.cuCtxSetCurrent)(p) })?;
    DEVICE.with(|c| c.set(device));
    Ok(())
}

/// `cudaGetDevice`: the device of the current context, else the thread's.
pub fn current() -> Rt<c_int> {
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut ctx: Opaque = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuCtxGetCurrent)(&mut ctx) })?;
    if ctx.is_null() {
        return Ok(DEVICE.with(Cell::get));
    }
    let mut device = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuCtxGetDevice)(&mut device) })?;
    Ok(device)
}

/// `cudaDeviceEnablePeerAccess`: from the current context to `peer`'s
/// primary context. A device that cannot access `peer` (itself) is
/// `cudaErrorInvalidDevice`, as the runtime reference says.
pub fn enable_peer(peer: c_int, flags: c_uint) -> Rt<()> {
    let device = bind()?;
    let p = primary_of(peer)?;
    if peer == device {
        return Err(INVALID_DEVICE);
    }
    let d = driver::get().map_err(|e| e as c_int)?;
    // SAFETY: a context the driver gave.
    check(unsafe { (d.cuCtxEnablePeerAccess)(p, flags) }).map_err(|e| {
        if e == PEER_ACCESS_UNSUPPORTED {
            INVALID_DEVICE
        } else {
            e
        }
    })
}

/// `cudaDeviceDisablePeerAccess`: from the current context to `peer`'s
/// primary context.
pub fn disable_peer(peer: c_int) -> Rt<()> {
    bind()?;
    let p = primary_of(peer)?;
    let d = driver::get().map_err(|e| e as c_int)?;
    // SAFETY: a context the driver gave.
    check(unsafe { (d.cuCtxDisablePeerAccess)(p) })
}

/// What the face answers for the attributes the double leaves at 0 and
/// torch reads, modelled on an H100 (the double's compute capability 9.0
/// and 132 multiprocessors): `cudaDeviceAttr` number and value.
const ATTRIBUTES: &[(c_int, c_int)] = &[
    (2, 1024),        // max block dim x
    (3, 1024),        // max block dim y
    (4, 64),          // max block dim z
    (5, 0x7fff_ffff), // max grid dim x
    (6, 65535),       // max grid dim y
    (7, 65535),       // max grid dim z
    (8, 48 << 10),    // shared memory per block
    (9, 65536),       // total constant memory
    (12, 65536),      // registers per block
    (13, 1_755_000),  // clock rate (kHz)
    (14, 512),        // texture alignment
    (15, 1),          // gpu overlap
    (19, 1),          // can map host memory
    (31, 1),          // concurrent kernels
    (33, 0),          // pci bus id: see `properties`
    (36, 2_619_000),  // memory clock rate (kHz)
    (37, 5120),       // global memory bus width
    (38, 50 << 20),   // L2 cache size
    (39, 2048),       // max threads per multiprocessor
    (40, 2),          // async engine count
    (78, 1),          // stream priorities supported
    (81, 228 << 10),  // shared memory per multiprocessor
    (82, 65536),      // registers per multiprocessor
    (95, 1),          // cooperative launch
    (97, 227 << 10),  // shared memory per block opt-in
    (106, 32),        // max blocks per multiprocessor
];

/// `cudaDeviceGetAttribute`: the face's table, else the double's answer.
pub fn attribute(attr: c_int, device: c_int) -> Rt<c_int> {
    let dev = valid(device)?;
    if attr == 33 {
        return Ok(dev + 1);
    }
    if let Some((_, v)) = ATTRIBUTES.iter().find(|(a, _)| *a == attr) {
        return Ok(*v);
    }
    let d = driver::get().map_err(|e| e as c_int)?;
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuDeviceGetAttribute)(&mut v, attr, dev) })?;
    Ok(v)
}

/// `cudaGetDeviceProperties`: the double's name, memory, compute
/// capability, multiprocessors and warp size, the rest from [`ATTRIBUTES`].
pub fn properties(device: c_int) -> Rt<DeviceProp> {
    let dev = valid(device)?;
    let d = driver::get().map_err(|e| e as c_int)?;
    // SAFETY: `DeviceProp` is plain integers and arrays: all zeros is a
    // valid value of it.
    let mut p: DeviceProp = unsafe { std::mem::zeroed() };
    // SAFETY: 256 writable bytes.
    check(unsafe { (d.cuDeviceGetName)(p.name.as_mut_ptr(), 256, dev) })?;
    // SAFETY: a valid out-pointer of the CUuuid's 16 bytes.
    check(unsafe { (d.cuDeviceGetUuid)(&mut p.uuid, dev) })?;
    let mut total = 0usize;
    // SAFETY: a valid out-pointer.
    check(unsafe { (d.cuDeviceTotalMem_v2)(&mut total, dev) })?;
    p.totalGlobalMem = total;
    let a = |attr| attribute(attr, device);
    p.major = a(75)?;
    p.minor = a(76)?;
    p.multiProcessorCount = a(16)?;
    p.warpSize = a(10)?;
    p.maxThreadsPerBlock = a(1)?;
    p.maxThreadsDim = [a(2)?, a(3)?, a(4)?];
    p.maxGridSize = [a(5)?, a(6)?, a(7)?];
    p.sharedMemPerBlock = a(8)? as usize;
    p.totalConstMem = a(9)? as usize;
    p.regsPerBlock = a(12)?;
    p.memPitch = 0x7fff_ffff;
    p.textureAlignment = a(14)? as usize;
    p.texturePitchAlignment = 32;
    p.canMapHostMemory = 1;
    p.concurrentKernels = 1;
    p.pciBusID = dev + 1;
    p.asyncEngineCount = a(40)?;
    p.unifiedAddressing = a(41)?;
    p.memoryBusWidth = a(37)?;
    p.l2CacheSize = a(38)?;
    p.maxThreadsPerMultiProcessor = a(39)?;
    p.streamPrioritiesSupported = 1;
    p.globalL1CacheSupported = 1;
    p.localL1CacheSupported = 1;
    p.sharedMemPerMultiprocessor = a(81)? as usize;
    p.regsPerMultiprocessor = a(82)?;
    p.cooperativeLaunch = 1;
    p.sharedMemPerBlockOptin = a(97)? as usize;
    p.maxBlocksPerMultiProcessor = a(106)?;
    p.reservedSharedMemPerBlock = 1 << 10;
    p.memoryPoolsSupported = a(115)?;
    p.gpuDirectRDMASupported = a(110)?;
    p.deviceNumaId = -1;
    p.hostNumaId = -1;
    Ok(p)
}

/// `cudaDeviceGetPCIBusId`'s text for `device`.
pub fn pci_bus_id(device: c_int) -> Rt<CString> {
    let dev = valid(device)?;
    CString::new(format!("0000:{:02x}:00.0", dev + 1)).map_err(|_| INVALID_VALUE)
}

/// The driver function `symbol` means for a client built against CUDA
/// `version` (cuda.h's mapping of a name to its newest version up to that
/// CUDA), looked up in the double: `None` where it has none.
pub fn entry_point(symbol: &CStr, version: c_uint) -> Option<*mut c_void> {
    let name = symbol.to_str().ok()?;
    // Names whose newer versions change their signature, with the CUDA
    // version that introduced each.
    const VERSIONED: &[(&str, &str, c_uint)] = &[
        ("cuCtxCreate", "cuCtxCreate_v4", 12050),
        ("cuCtxCreate", "cuCtxCreate_v3", 11040),
        ("cuCtxSynchronize", "cuCtxSynchronize_v2", 13000),
        ("cuCtxGetDevice", "cuCtxGetDevice_v2", 13000),
        ("cuEventElapsedTime", "cuEventElapsedTime_v2", 12080),
        ("cuStreamGetCtx", "cuStreamGetCtx_v2", 12050),
        ("cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_v3", 12030),
        ("cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_v2", 11030),
        ("cuGraphInstantiate", "cuGraphInstantiateWithFlags", 12000),
        ("cuDeviceGetUuid", "cuDeviceGetUuid_v2", 11040),
    ];
    let rules: Vec<&(&str, &str, c_uint)> = VERSIONED
        .iter()
        .filter(|(base, _, _)| *base == name)
        .collect();
    let candidates: Vec<String> = if rules.is_empty() {
        // Every other `_v2` of cuda.h dates from CUDA 3.2 to 11.
        vec![format!("{name}_v2"), name.to_string()]
    } else {
        rules
            .iter()
            .filter(|(_, _, since)| version >= *since)
            .map(|(_, v, _)| v.to_string())
            .chain(std::iter::once(name.to_string()))
            .collect()
    };
    candidates.iter().find_map(|c| {
        let c = CString::new(c.as_str()).ok()?;
        driver::lookup(&c)
    })
}

/// Copies `text` into the client's buffer of `len` bytes, NUL-terminated.
///
/// # Safety
///
/// `out` is valid for `len` bytes (the API's contract).
pub unsafe fn write_text(out: *mut c_char, len: c_int, text: &CStr) -> Rt<()> {
    if out.is_null() || len <= 0 {
        return Err(INVALID_VALUE);
    }
    let bytes = text.to_bytes();
    let n = bytes.len().min(len as usize - 1);
    // SAFETY: the caller's contract; `n + 1 <= len` bytes written.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr().cast::<c_char>(), out, n);
        out.add(n).write(0);
    }
    Ok(())
}
