//! Matmul descriptors, matrix layouts and heuristic preferences: made,
//! destroyed, and their attributes set and read, as cuBLASLt does
//! (`attributes.rs` holds the tables).

#![allow(non_snake_case)] // cuBLAS's names
#![allow(clippy::missing_safety_doc)] // cuBLAS's reference is the contract

use std::ffi::c_void;

use crate::attributes::{Values, MATMUL_DESC, MATMUL_PREFERENCE, MATRIX_LAYOUT};
use crate::registry::Registry;
use crate::status::{out, require, status, Answer, Status, INVALID_VALUE};

/// Live matmul descriptors.
pub static MATMUL_DESCS: Registry<Values> = Registry::new();
/// Live matrix layouts.
pub static LAYOUTS: Registry<Values> = Registry::new();
/// Live preferences.
pub static PREFERENCES: Registry<Values> = Registry::new();

/// `cudaDataType_t` values cuBLASLt takes for matrices and scales
/// (`library_types.h`: real and complex 16F, 16BF, 32F, 64F, the integer
/// types, FP8, FP6 and FP4).
pub fn known_data_type(t: i32) -> bool {
    (0..=33).contains(&t)
}

/// `cublasComputeType_t` values (`cublas_api.h`).
pub fn known_compute_type(t: i32) -> bool {
    matches!(t, 64 | 65 | 68 | 69 | 70..=79)
}

/// `f` on a copy of the values of the live object at `p` of `registry`.
pub fn read<R>(
    registry: &Registry<Values>,
    p: *const c_void,
    f: impl FnOnce(&Values) -> R,
) -> Answer<R> {
    registry.get(p, |v| f(v)).ok_or(INVALID_VALUE)
}

/// Makes an object with `values` and writes its pointer through `p`.
///
/// # Safety
/// `p` is null or writable.
unsafe fn create(registry: &Registry<Values>, p: *mut *mut c_void, values: Values) -> Status {
    if p.is_null() {
        return INVALID_VALUE;
    }
    let made = registry.insert(values);
    // SAFETY: non-null; the caller's contract.
    status(unsafe { out(p, made) })
}

fn destroy(registry: &Registry<Values>, p: *mut c_void) -> Status {
    // cuBLASLt's destroy functions take NULL as a no-op.
    if p.is_null() {
        return 0;
    }
    status(registry.remove(p).map(|_| ()).ok_or(INVALID_VALUE))
}

/// # Safety
/// `buf` is null or readable for `size` bytes.
unsafe fn set(
    registry: &Registry<Values>,
    p: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> Status {
    // SAFETY: the caller's contract on `buf`.
    status(
        registry
            .get(p, |v| unsafe { v.set_from(attr, buf, size) })
            .unwrap_or(Err(INVALID_VALUE)),
    )
}

/// # Safety
/// `buf` is null or writable for `size` bytes; `written` null or writable.
unsafe fn get(
    registry: &Registry<Values>,
    p: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    // SAFETY: the caller's contract on `buf` and `written`.
    status(
        registry
            .get(p, |v| unsafe { v.get_into(attr, buf, size, written) })
            .unwrap_or(Err(INVALID_VALUE)),
    )
}

fn matmul_desc(compute: i32, scale: i32) -> Answer<Values> {
    require(known_compute_type(compute) && known_data_type(scale))?;
    let mut v = Values::new(MATMUL_DESC);
    v.put(0, compute as u32 as u64);
    v.put(1, scale as u32 as u64);
    Ok(v)
}

fn layout(data_type: i32, rows: u64, cols: u64, ld: i64) -> Answer<Values> {
    require(known_data_type(data_type))?;
    let mut v = Values::new(MATRIX_LAYOUT);
    v.put(0, data_type as u32 as u64);
    v.put(2, rows);
    v.put(3, cols);
    v.put(4, ld as u64);
    Ok(v)
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescCreate(
    desc: *mut *mut c_void,
    compute: i32,
    scale: i32,
) -> Status {
    match matmul_desc(compute, scale) {
        // SAFETY: the client's out-pointer.
        Ok(v) => unsafe { create(&MATMUL_DESCS, desc, v) },
        Err(s) => s,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescDestroy(desc: *mut c_void) -> Status {
    destroy(&MATMUL_DESCS, desc)
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescSetAttribute(
    desc: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> Status {
    // SAFETY: the client's buffer of `size` bytes.
    unsafe { set(&MATMUL_DESCS, desc, attr, buf, size) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulDescGetAttribute(
    desc: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    // SAFETY: the client's buffer and out-pointer.
    unsafe { get(&MATMUL_DESCS, desc, attr, buf, size, written) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutCreate(
    layout_out: *mut *mut c_void,
    data_type: i32,
    rows: u64,
    cols: u64,
    ld: i64,
) -> Status {
    match layout(data_type, rows, cols, ld) {
        // SAFETY: the client's out-pointer.
        Ok(v) => unsafe { create(&LAYOUTS, layout_out, v) },
        Err(s) => s,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutDestroy(layout: *mut c_void) -> Status {
    destroy(&LAYOUTS, layout)
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutSetAttribute(
    layout: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> Status {
    // SAFETY: the client's buffer of `size` bytes.
    unsafe { set(&LAYOUTS, layout, attr, buf, size) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatrixLayoutGetAttribute(
    layout: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    // SAFETY: the client's buffer and out-pointer.
    unsafe { get(&LAYOUTS, layout, attr, buf, size, written) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceCreate(pref: *mut *mut c_void) -> Status {
    // SAFETY: the client's out-pointer.
    unsafe { create(&PREFERENCES, pref, Values::new(MATMUL_PREFERENCE)) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceDestroy(pref: *mut c_void) -> Status {
    destroy(&PREFERENCES, pref)
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceSetAttribute(
    pref: *mut c_void,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> Status {
    // SAFETY: the client's buffer of `size` bytes.
    unsafe { set(&PREFERENCES, pref, attr, buf, size) }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulPreferenceGetAttribute(
    pref: *mut c_void,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    // SAFETY: the client's buffer and out-pointer.
    unsafe { get(&PREFERENCES, pref, attr, buf, size, written) }
}
