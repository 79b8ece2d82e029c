//! Kernels: the registration calls nvcc's host code makes when a library
//! loads, and launches. The double cannot run a kernel: a launch is checked
//! (a registered function, a valid configuration) and queued on its stream
//! as work of unknown memory footprint that computes nothing
//! (`quiltDoubleLaunchOpaqueWork`): it keeps the stream busy until the
//! double runs it, as any queued work, and a capture records it.

#![allow(non_snake_case)] // the runtime's names
#![allow(missing_docs)] // each is the runtime function of the same name
#![allow(clippy::missing_safety_doc)] // the CUDA runtime reference's contract

use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::{Mutex, PoisonError};

use crate::device::bind;
use crate::driver::{self, Opaque};
use crate::errors::{check, done, CudaError, Rt, INVALID_CONFIGURATION, INVALID_DEVICE_FUNCTION};
use crate::memory::out;

/// `dim3`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Dim3 {
    pub x: c_uint,
    pub y: c_uint,
    pub z: c_uint,
}

/// The host stubs of registered kernels.
static FUNCTIONS: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

thread_local! {
    /// `__cudaPushCallConfiguration`'s stack (the `<<<...>>>` syntax).
    static CONFIGURATIONS: RefCell<Vec<(Dim3, Dim3, usize, usize)>> = const { RefCell::new(Vec::new()) };
}

fn registered(func: *const c_void) -> bool {
    FUNCTIONS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .is_some_and(|f| f.contains(&(func as usize)))
}

#[no_mangle]
pub unsafe extern "C" fn __cudaRegisterFatBinary(fat_cubin: *mut c_void) -> *mut *mut c_void {
    // A handle for the module's later registrations; it lives for the process.
    Box::leak(Box::new(fat_cubin))
}

#[no_mangle]
pub unsafe extern "C" fn __cudaRegisterFatBinaryEnd(_handle: *mut *mut c_void) {}

#[no_mangle]
pub unsafe extern "C" fn __cudaUnregisterFatBinary(_handle: *mut *mut c_void) {}

#[no_mangle]
#[allow(clippy::too_many_arguments)] // nvcc's signature
pub unsafe extern "C" fn __cudaRegisterFunction(
    _handle: *mut *mut c_void,
    host_fun: *const c_char,
    _device_fun: *mut c_char,
    _device_name: *const c_char,
    _thread_limit: c_int,
    _tid: *mut c_void,
    _bid: *mut c_void,
    _block: *mut c_void,
    _grid: *mut c_void,
    _warp_size: *mut c_int,
) {
    FUNCTIONS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashSet::new)
        .insert(host_fun as usize);
}

/// Device variables are not modelled: `cudaGetSymbolAddress` and
/// `cudaMemcpyToSymbol` answer "not supported".
#[no_mangle]
#[allow(clippy::too_many_arguments)] // nvcc's signature
pub unsafe extern "C" fn __cudaRegisterVar(
    _handle: *mut *mut c_void,
    _host_var: *mut c_char,
    _device_address: *mut c_char,
    _device_name: *const c_char,
    _ext: c_int,
    _size: usize,
    _constant: c_int,
    _global: c_int,
) {
}

#[no_mangle]
pub unsafe extern "C" fn __cudaPushCallConfiguration(
    grid: Dim3,
    block: Dim3,
    shared: usize,
    stream: *mut c_void,
) -> c_uint {
    CONFIGURATIONS.with(|c| c.borrow_mut().push((grid, block, shared, stream as usize)));
    0
}

#[no_mangle]
pub unsafe extern "C" fn __cudaPopCallConfiguration(
    grid: *mut Dim3,
    block: *mut Dim3,
    shared: *mut usize,
    stream: *mut *mut c_void,
) -> CudaError {
    let Some((g, b, s, st)) = CONFIGURATIONS.with(|c| c.borrow_mut().pop()) else {
        return done(Err(INVALID_CONFIGURATION));
    };
    // SAFETY: nvcc's stub passes four valid out-pointers.
    done(unsafe {
        out(grid, g)
            .and_then(|()| out(block, b))
            .and_then(|()| out(shared, s))
            .and_then(|()| out(stream, st as *mut c_void))
    })
}

/// Checks and queues one launch.
fn launch(func: *const c_void, grid: Dim3, block: Dim3, stream: Opaque) -> Rt<()> {
    bind()?;
    if !registered(func) {
        return Err(INVALID_DEVICE_FUNCTION);
    }
    let threads = u64::from(block.x) * u64::from(block.y) * u64::from(block.z);
    let blocks = u64::from(grid.x) * u64::from(grid.y) * u64::from(grid.z);
    if threads == 0
        || threads > 1024
        || blocks == 0
        || block.z > 64
        || grid.y > 65535
        || grid.z > 65535
    {
        return Err(INVALID_CONFIGURATION);
    }
    let d = driver::get().map_err(|e| e as CudaError)?;
    // SAFETY: the double checks the stream handle.
    check(unsafe { (d.quiltDoubleLaunchOpaqueWork)(stream) })
}

#[no_mangle]
pub unsafe extern "C" fn cudaLaunchKernel(
    func: *const c_void,
    grid: Dim3,
    block: Dim3,
    _args: *mut *mut c_void,
    _shared: usize,
    stream: Opaque,
) -> CudaError {
    done(launch(func, grid, block, stream))
}

#[no_mangle]
pub unsafe extern "C" fn cudaLaunchCooperativeKernel(
    func: *const c_void,
    grid: Dim3,
    block: Dim3,
    _args: *mut *mut c_void,
    _shared: usize,
    stream: Opaque,
) -> CudaError {
    done(launch(func, grid, block, stream))
}

/// CUDA 13's launch path: nvcc's stubs turn the host stub into a
/// `cudaKernel_t` once (`__cudaGetKernel`; here the stub itself) and
/// launch through `__cudaLaunchKernel`.
#[no_mangle]
pub unsafe extern "C" fn __cudaGetKernel(
    kernel: *mut *const c_void,
    func: *const c_void,
) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(unsafe { out(kernel, func) })
}

#[no_mangle]
pub unsafe extern "C" fn __cudaLaunchKernel(
    kernel: *const c_void,
    grid: Dim3,
    block: Dim3,
    _args: *mut *mut c_void,
    _shared: usize,
    stream: Opaque,
) -> CudaError {
    done(launch(kernel, grid, block, stream))
}

/// The head of `cudaLaunchConfig_t`.
#[repr(C)]
pub struct LaunchConfig {
    grid: Dim3,
    block: Dim3,
    shared: usize,
    stream: Opaque,
}

#[no_mangle]
pub unsafe extern "C" fn cudaLaunchKernelExC(
    config: *const LaunchConfig,
    func: *const c_void,
    _args: *mut *mut c_void,
) -> CudaError {
    // SAFETY: the client's pointer to a cudaLaunchConfig_t, or null.
    let Some(c) = (unsafe { config.as_ref() }) else {
        return done(Err(crate::errors::INVALID_VALUE));
    };
    done(launch(func, c.grid, c.block, c.stream))
}

/// `struct cudaFuncAttributes` (CUDA 13).
#[repr(C)]
pub struct FuncAttributes {
    pub shared_size_bytes: usize,
    pub const_size_bytes: usize,
    pub local_size_bytes: usize,
    pub max_threads_per_block: c_int,
    pub num_regs: c_int,
    pub ptx_version: c_int,
    pub binary_version: c_int,
    pub cache_mode_ca: c_int,
    pub max_dynamic_shared_size_bytes: c_int,
    pub preferred_shmem_carveout: c_int,
    pub cluster_dim_must_be_set: c_int,
    pub required_cluster: [c_int; 3],
    pub cluster_scheduling_policy_preference: c_int,
    pub non_portable_cluster_size_allowed: c_int,
    pub reserved0: c_int,
    pub reserved: [c_int; 15],
}

/// `cudaFuncGetAttributes`: the figures of a small kernel compiled for
/// compute capability 9.0 (the double's kernels have none of their own).
#[no_mangle]
pub unsafe extern "C" fn cudaFuncGetAttributes(
    attr: *mut FuncAttributes,
    func: *const c_void,
) -> CudaError {
    done((|| {
        bind()?;
        if !registered(func) {
            return Err(INVALID_DEVICE_FUNCTION);
        }
        let a = FuncAttributes {
            shared_size_bytes: 0,
            const_size_bytes: 0,
            local_size_bytes: 0,
            max_threads_per_block: 1024,
            num_regs: 32,
            ptx_version: 90,
            binary_version: 90,
            cache_mode_ca: 0,
            max_dynamic_shared_size_bytes: 48 << 10,
            preferred_shmem_carveout: -1,
            cluster_dim_must_be_set: 0,
            required_cluster: [0; 3],
            cluster_scheduling_policy_preference: 0,
            non_portable_cluster_size_allowed: 0,
            reserved0: 0,
            reserved: [0; 15],
        };
        // SAFETY: the client's out-pointer.
        unsafe { out(attr, a) }
    })())
}

/// `cudaFuncSetAttribute`: accepted for a registered kernel (a launch
/// configuration hint; the double's kernels compute nothing).
#[no_mangle]
pub unsafe extern "C" fn cudaFuncSetAttribute(
    func: *const c_void,
    _attr: c_int,
    _value: c_int,
) -> CudaError {
    done(if registered(func) {
        Ok(())
    } else {
        Err(INVALID_DEVICE_FUNCTION)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cudaKernelSetAttributeForDevice(
    kernel: *const c_void,
    attr: c_int,
    value: c_int,
    _device: c_int,
) -> CudaError {
    // SAFETY: the same contract.
    unsafe { cudaFuncSetAttribute(kernel, attr, value) }
}

/// Blocks of `block_size` threads that fit one multiprocessor of 2048
/// threads and 32 blocks.
fn occupancy(func: *const c_void, block_size: c_int) -> Rt<c_int> {
    if !registered(func) {
        return Err(INVALID_DEVICE_FUNCTION);
    }
    if block_size <= 0 || block_size > 1024 {
        return Err(INVALID_CONFIGURATION);
    }
    Ok((2048 / block_size).clamp(1, 32))
}

#[no_mangle]
pub unsafe extern "C" fn cudaOccupancyMaxActiveBlocksPerMultiprocessor(
    blocks: *mut c_int,
    func: *const c_void,
    block_size: c_int,
    _shared: usize,
) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(occupancy(func, block_size).and_then(|n| unsafe { out(blocks, n) }))
}

#[no_mangle]
pub unsafe extern "C" fn cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(
    blocks: *mut c_int,
    func: *const c_void,
    block_size: c_int,
    _shared: usize,
    _flags: c_uint,
) -> CudaError {
    // SAFETY: the client's out-pointer.
    done(occupancy(func, block_size).and_then(|n| unsafe { out(blocks, n) }))
}
