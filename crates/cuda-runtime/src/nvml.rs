//! The few NVML calls torch makes before it maps expandable segments.
//!
//! On CUDA 12.4 and later builds, torch's expandable segments ask NVML
//! whether the device has a fabric (`c10::cuda::get_fabric_access`: it
//! `dlopen`s `libnvidia-ml.so.1` and calls `nvmlInit_v2` and
//! `nvmlDeviceGetHandleByPciBusId_v2` without checking that they were
//! found). `scripts/simulated-gpu.sh` therefore also names this library
//! `libnvidia-ml.so.1`: devices are found by the PCI bus ids the face gives
//! them (`0000:0N:00.0` for device N-1); `nvmlDeviceGetGpuFabricInfoV` is
//! absent, which torch reads as "no fabric"; every other NVML call torch
//! looks up answers `NVML_ERROR_NOT_SUPPORTED`.

#![allow(non_snake_case)] // NVML's names
#![allow(missing_docs)] // each is the NVML function of the same name
#![allow(clippy::missing_safety_doc)] // NVML's contract

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

use crate::device;

/// `nvmlReturn_t`.
type NvmlReturn = c_int;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;

/// A device's `nvmlDevice_t`: its index plus one (never null).
fn handle(index: c_int) -> *mut c_void {
    (index as usize + 1) as *mut c_void
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInit_v2() -> NvmlReturn {
    match device::count() {
        Ok(_) => NVML_SUCCESS,
        Err(_) => 9, // NVML_ERROR_DRIVER_NOT_LOADED
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    // SAFETY: no pointers.
    unsafe { nvmlInit_v2() }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    match device::count() {
        // SAFETY: checked non-null.
        Ok(n) => unsafe {
            count.write(n as c_uint);
            NVML_SUCCESS
        },
        Err(_) => 9,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut *mut c_void,
) -> NvmlReturn {
    if device.is_null() || device::valid(index as c_int).is_err() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null.
    unsafe { device.write(handle(index as c_int)) };
    NVML_SUCCESS
}

/// `nvmlDeviceGetHandleByPciBusId_v2`: `DOMAIN:BUS:DEVICE.FUNCTION` in hex,
/// the bus naming the device (bus N is device N-1).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    device: *mut *mut c_void,
) -> NvmlReturn {
    if pci_bus_id.is_null() || device.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the client's NUL-terminated text.
    let id = unsafe { CStr::from_ptr(pci_bus_id) }.to_string_lossy();
    let bus = id
        .split(':')
        .nth(1)
        .and_then(|b| c_int::from_str_radix(b, 16).ok());
    match bus {
        Some(b) if b >= 1 && device::valid(b - 1).is_ok() => {
            // SAFETY: checked non-null.
            unsafe { device.write(handle(b - 1)) };
            NVML_SUCCESS
        }
        _ => NVML_ERROR_NOT_FOUND,
    }
}

#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> NvmlReturn {
    let mut v = 0;
    // SAFETY: a valid out-pointer (the runtime face's own call).
    if unsafe { crate::api::cudaDriverGetVersion(&mut v) } != 0 || version.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null.
    unsafe { version.write(v) };
    NVML_SUCCESS
}

/// `nvmlDeviceGetComputeRunningProcesses`: none listed (the double does
/// not know which processes use a device).
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    _device: *mut c_void,
    count: *mut c_uint,
    _infos: *mut c_void,
) -> NvmlReturn {
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: checked non-null.
    unsafe { count.write(0) };
    NVML_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: *mut c_void,
    count: *mut c_uint,
    infos: *mut c_void,
) -> NvmlReturn {
    // SAFETY: the same contract.
    unsafe { nvmlDeviceGetComputeRunningProcesses(device, count, infos) }
}

/// NVLink queries: the double's devices have no NVLink.
macro_rules! nvml_not_supported {
    ($($name:ident),* $(,)?) => {
        $(
            #[no_mangle]
            pub unsafe extern "C" fn $name() -> NvmlReturn {
                NVML_ERROR_NOT_SUPPORTED
            }
        )*
    };
}

nvml_not_supported!(
    nvmlDeviceGetNvLinkRemoteDeviceType,
    nvmlDeviceGetNvLinkRemotePciInfo_v2,
);
