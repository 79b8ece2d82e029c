//! Running tests over the double.
//!
//! The dynamic loader reads the library path once, at process start, so a
//! test runs over the double in a child: [`rerun_over_double`] starts this
//! test binary again for the calling test alone, with a private directory
//! holding `libcuda.so` and `libcuda.so.1` links to the double first on
//! `LD_LIBRARY_PATH`, and returns `true` in that child (where the test's
//! body runs) and `false` in the parent once the child has passed:
//!
//! ```no_run
//! #[test]
//! fn allocates_on_the_double() {
//!     if !quilt_cuda_double::harness::rerun_over_double() {
//!         return; // the child ran the body and passed
//!     }
//!     // ... CudaVmm::new(0) now opens the double ...
//! }
//! ```
//!
//! [`command`] starts any other program (a Python interpreter, a C client,
//! a second process of a test) over the double the same way.

use std::env;
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Set in a process that runs over the double.
pub const CHILD_ENV: &str = "QUILT_CUDA_DOUBLE_CHILD";

/// Set to `real` on a GPU machine: tests that would run over the double run
/// in their own process against the real driver instead.
pub const REAL_ENV: &str = "QUILT_CUDA_TESTS";

/// Whether this process was started over the double.
pub fn active() -> bool {
    env::var_os(CHILD_ENV).is_some()
}

/// Whether the tests were asked to use the real driver (`QUILT_CUDA_TESTS=real`).
pub fn real_driver() -> bool {
    env::var(REAL_ENV).is_ok_and(|v| v == "real")
}

/// `libquilt_cuda_double.so` as cargo built it for the running test binary:
/// beside it (`deps/`) or one folder up (`target/<profile>/`).
pub fn library() -> Result<PathBuf, String> {
    let exe = env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let here = exe.parent().ok_or("the test binary has no folder")?;
    let candidates = [
        here.join("libquilt_cuda_double.so"),
        here.join("../libquilt_cuda_double.so"),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .ok_or_else(|| {
            format!(
                "libquilt_cuda_double.so is not built beside {} (cargo builds it for packages that dev-depend on quilt-cuda-double; else run `cargo build --release -p quilt-cuda-double`)",
                here.display()
            )
        })
}

/// A private folder holding `libcuda.so` and `libcuda.so.1` links to
/// `lib`, made once per library (beside it).
pub fn library_dir(lib: &Path) -> Result<PathBuf, String> {
    let lib = lib
        .canonicalize()
        .map_err(|e| format!("{}: {e}", lib.display()))?;
    let dir = lib
        .parent()
        .ok_or("the library has no folder")?
        .join("quilt-cuda-double-libcuda");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for name in ["libcuda.so", "libcuda.so.1"] {
        let link = dir.join(name);
        if std::fs::read_link(&link).is_ok_and(|t| t == lib) {
            continue;
        }
        // Made under a unique name and renamed over: tests running at once
        // never see a missing or half-made link.
        static MADE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!("{name}.{}.{n}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&lib, &tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    }
    Ok(dir)
}

/// `program` set up to run over the double: the private folder first on
/// its `LD_LIBRARY_PATH` and [`CHILD_ENV`] set.
pub fn command(program: impl AsRef<std::ffi::OsStr>) -> Result<Command, String> {
    let dir = library_dir(&library()?)?;
    let mut path = OsString::from(dir.as_os_str());
    if let Some(old) = env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let mut cmd = Command::new(program);
    cmd.env("LD_LIBRARY_PATH", path).env(CHILD_ENV, "1");
    Ok(cmd)
}

/// See the module documentation: `true` in the child over the double (and
/// where [`real_driver`] asks for the real driver: the body runs here);
/// in the parent, runs the calling test (named by its thread, as the test
/// harness names it) in a child and returns `false` once it passed, or
/// fails the test with the child's output.
pub fn rerun_over_double() -> bool {
    rerun_over_double_with(&[])
}

/// [`rerun_over_double`] with extra environment variables for the child
/// (the double's rules: `QUILT_CUDA_DOUBLE_*`).
#[allow(clippy::panic)] // a test harness: failing the calling test is its job
pub fn rerun_over_double_with(vars: &[(&str, &str)]) -> bool {
    if active() || real_driver() {
        return true;
    }
    let current = std::thread::current();
    let Some(test) = current.name().filter(|n| *n != "main") else {
        panic!("rerun_over_double: call it from a #[test] (the test thread names the test)");
    };
    let exe = match env::current_exe() {
        Ok(e) => e,
        Err(e) => panic!("rerun_over_double: current_exe: {e}"),
    };
    let mut cmd = match command(&exe) {
        Ok(c) => c,
        Err(e) => panic!("rerun_over_double: {e}"),
    };
    cmd.args([
        test,
        "--exact",
        "--nocapture",
        "--test-threads=1",
        "--include-ignored",
    ]);
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => panic!("rerun_over_double: starting {}: {e}", exe.display()),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::io::stdout().write_all(stdout.as_bytes());
    let _ = std::io::stderr().write_all(stderr.as_bytes());
    assert!(
        out.status.success(),
        "{test} failed over the CUDA double ({})",
        out.status
    );
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{test} did not run in the child over the CUDA double"
    );
    false
}

/// The driver functions a test calls itself, from the `libcuda.so.1` this
/// process loaded (over the double: the same library, so the same state, as
/// cudarc's; with [`real_driver`]: the real driver), looked up with `dlsym`
/// so that the calling test needs no CUDA bindings of its own.
pub mod driver {
    use std::ffi::{c_char, c_int, c_void, CStr};
    use std::sync::OnceLock;

    /// `CUresult`.
    pub type CuResult = c_int;
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: CuResult = 0;

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlerror() -> *const c_char;
    }

    const RTLD_NOW: c_int = 2;

    type Init = unsafe extern "C" fn(u32) -> CuResult;
    type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
    type PrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;
    type PrimaryCtxRelease = unsafe extern "C" fn(c_int) -> CuResult;
    type CtxSetCurrent = unsafe extern "C" fn(*mut c_void) -> CuResult;
    type GetErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

    /// The function `name` of the loaded `libcuda.so.1` (loaded on the
    /// first call), or why there is none.
    pub fn symbol(name: &CStr) -> Result<*mut c_void, String> {
        static LIB: OnceLock<Result<usize, String>> = OnceLock::new();
        let lib = LIB
            .get_or_init(|| {
                // SAFETY: a NUL-terminated name; loading the driver library
                // runs no code of ours.
                let lib = unsafe { dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW) };
                if lib.is_null() {
                    // SAFETY: dlerror returns a NUL-terminated message after
                    // a failed dlopen.
                    let why = unsafe { CStr::from_ptr(dlerror()) };
                    return Err(format!("dlopen libcuda.so.1: {why:?}"));
                }
                Ok(lib as usize)
            })
            .clone()?;
        // SAFETY: `lib` is a handle from `dlopen`; `name` is NUL-terminated.
        let p = unsafe { dlsym(lib as *mut c_void, name.as_ptr()) };
        if p.is_null() {
            return Err(format!("libcuda.so.1 has no {name:?}"));
        }
        Ok(p)
    }

    /// [`symbol`] as the function type `F`.
    ///
    /// # Safety
    /// `F` must be the signature cuda.h declares for `name`.
    #[allow(clippy::panic)] // a test helper: failing the calling test is its job
    pub unsafe fn function<F: Copy>(name: &CStr) -> F {
        assert_eq!(
            size_of::<F>(),
            size_of::<*mut c_void>(),
            "a function pointer"
        );
        let p = symbol(name).unwrap_or_else(|e| panic!("{e}"));
        // SAFETY: `p` is the driver's function `name`, and the caller
        // vouches that `F` is its signature.
        unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
    }

    /// `Ok` for `CUDA_SUCCESS`, else `what` failed with the error's name.
    pub fn check(what: &str, r: CuResult) -> Result<(), String> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: cuGetErrorName's signature as cuda.h declares it.
        let get_error_name: GetErrorName = unsafe { function(c"cuGetErrorName") };
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: a valid out-pointer; the driver points it at a static
        // NUL-terminated string when it knows the code.
        let known = unsafe { get_error_name(r, &mut name) } == SUCCESS;
        let name = if known && !name.is_null() {
            // SAFETY: as above: a static NUL-terminated string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {r}")
        };
        Err(format!("{what} failed: {name} ({r})"))
    }

    #[allow(clippy::panic)] // a test helper: failing the calling test is its job
    fn must(what: &str, r: CuResult) {
        if let Err(e) = check(what, r) {
            panic!("{e}");
        }
    }

    /// Initialises the driver and makes device 0's primary context current
    /// on the calling thread (retained until [`release_primary`]), as cudarc
    /// and PyTorch do before they queue work. Panics with the driver's
    /// error.
    pub fn bind_primary() {
        // SAFETY (all four): each signature as cuda.h declares it.
        let (init, device_get, retain, set_current) = unsafe {
            (
                function::<Init>(c"cuInit"),
                function::<DeviceGet>(c"cuDeviceGet"),
                function::<PrimaryCtxRetain>(c"cuDevicePrimaryCtxRetain"),
                function::<CtxSetCurrent>(c"cuCtxSetCurrent"),
            )
        };
        // SAFETY: no pointers.
        must("cuInit", unsafe { init(0) });
        let mut dev: c_int = 0;
        // SAFETY: a valid out-pointer.
        must("cuDeviceGet", unsafe { device_get(&mut dev, 0) });
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a device from cuDeviceGet.
        must("cuDevicePrimaryCtxRetain", unsafe { retain(&mut ctx, dev) });
        // SAFETY: a context the driver just gave (retained).
        must("cuCtxSetCurrent", unsafe { set_current(ctx) });
    }

    /// Releases the primary context [`bind_primary`] retained and leaves
    /// none current on the calling thread.
    pub fn release_primary() {
        // SAFETY (both): each signature as cuda.h declares it.
        let (set_current, release) = unsafe {
            (
                function::<CtxSetCurrent>(c"cuCtxSetCurrent"),
                function::<PrimaryCtxRelease>(c"cuDevicePrimaryCtxRelease_v2"),
            )
        };
        // SAFETY: a null context is valid: none current.
        must("cuCtxSetCurrent", unsafe {
            set_current(std::ptr::null_mut())
        });
        // SAFETY: device 0, retained by `bind_primary`.
        must("cuDevicePrimaryCtxRelease", unsafe { release(0) });
    }
}
