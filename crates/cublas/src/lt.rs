//! The cuBLASLt face (`libcublasLt.so.13`, which NVIDIA's `libcublas.so.13`
//! also depends on): it makes the handles (a `cublasHandle_t` is a
//! `cublasLtHandle_t`, as torch relies on) and queues their work
//! (`quiltCublasLtEnqueue`). Looked up once with `libloading`.

use std::ffi::c_void;
use std::sync::OnceLock;

use libloading::Library;

/// `cublasStatus_t`.
pub type Status = u32;
/// `CUBLAS_STATUS_NOT_INITIALIZED`.
pub const NOT_INITIALIZED: Status = 1;

/// The cuBLASLt functions this face calls.
pub struct Lt {
    /// `cublasLtCreate`.
    pub create: unsafe extern "C" fn(*mut *mut c_void) -> Status,
    /// `cublasLtDestroy`.
    pub destroy: unsafe extern "C" fn(*mut c_void) -> Status,
    /// `quiltCublasLtEnqueue`: one operation's work on a stream.
    pub enqueue: unsafe extern "C" fn(*const c_void, *mut c_void) -> Status,
    /// `quiltCublasLtSynchronize`: waits for a stream's work.
    pub synchronize: unsafe extern "C" fn(*const c_void, *mut c_void) -> Status,
    /// `cublasLtGetStatusName`.
    pub status_name: unsafe extern "C" fn(Status) -> *const std::ffi::c_char,
    /// `cublasLtGetStatusString`.
    pub status_string: unsafe extern "C" fn(Status) -> *const std::ffi::c_char,
    _library: Library,
}

/// # Safety
/// `T` is the function type the cuBLASLt face exports under `name`.
unsafe fn symbol<T: Copy>(lib: &Library, name: &[u8]) -> Result<T, String> {
    // SAFETY: the caller's contract on `T`.
    unsafe { lib.get::<T>(name) }
        .map(|s| *s)
        .map_err(|e| format!("{}: {e}", String::from_utf8_lossy(name)))
}

fn load() -> Result<Lt, String> {
    // SAFETY: loading the cuBLASLt face runs no code of its own at load.
    let lib = unsafe { Library::new("libcublasLt.so.13") }.map_err(|e| e.to_string())?;
    // SAFETY: each type is the one the cuBLASLt face declares.
    unsafe {
        Ok(Lt {
            create: symbol(&lib, b"cublasLtCreate\0")?,
            destroy: symbol(&lib, b"cublasLtDestroy\0")?,
            enqueue: symbol(&lib, b"quiltCublasLtEnqueue\0")?,
            synchronize: symbol(&lib, b"quiltCublasLtSynchronize\0")?,
            status_name: symbol(&lib, b"cublasLtGetStatusName\0")?,
            status_string: symbol(&lib, b"cublasLtGetStatusString\0")?,
            _library: lib,
        })
    }
}

/// The cuBLASLt face; `NOT_INITIALIZED` (and one line on standard error)
/// where `libcublasLt.so.13` is not the face.
pub fn get() -> Result<&'static Lt, Status> {
    static LT: OnceLock<Result<Lt, String>> = OnceLock::new();
    match LT.get_or_init(|| {
        load().inspect_err(|e| {
            eprintln!("quilt cuBLAS face: needs the cuBLASLt face as libcublasLt.so.13: {e}");
        })
    }) {
        Ok(lt) => Ok(lt),
        Err(_) => Err(NOT_INITIALIZED),
    }
}
