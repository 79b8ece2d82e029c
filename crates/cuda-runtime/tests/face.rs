//! The face's calls over the double, without torch: each test runs in a
//! child process over the double (`quilt_cuda_double::harness`), loads the
//! face by its path and calls it as a C program would.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use quilt_cuda_double::harness::rerun_over_double_with;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// The face's function `name` as `F` (the runtime's signature).
unsafe fn f<F: Copy>(name: &CStr) -> F {
    static FACE: OnceLock<usize> = OnceLock::new();
    let lib = *FACE.get_or_init(|| {
        let path = std::ffi::CString::new(common::face().to_str().unwrap()).unwrap();
        let h = unsafe { dlopen(path.as_ptr(), 2) };
        assert!(!h.is_null(), "dlopen {path:?}");
        h as usize
    });
    let p = unsafe { dlsym(lib as *mut c_void, name.as_ptr()) };
    assert!(!p.is_null(), "the face has no {name:?}");
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

type Stream = *mut c_void;
const H2D: c_int = 1;
const D2H: c_int = 2;
const D2D: c_int = 3;

fn over_double() -> bool {
    rerun_over_double_with(&[("QUILT_CUDA_DOUBLE_DEVICES", "2")])
}

unsafe fn malloc(n: usize) -> *mut c_void {
    let m: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int = unsafe { f(c"cudaMalloc") };
    let mut p = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut p, n) }, 0);
    p
}

unsafe fn memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
    s: Stream,
) -> c_int {
    let m: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> c_int =
        unsafe { f(c"cudaMemcpyAsync") };
    unsafe { m(dst, src, n, kind, s) }
}

unsafe fn sync(s: Stream) -> c_int {
    let m: unsafe extern "C" fn(Stream) -> c_int = unsafe { f(c"cudaStreamSynchronize") };
    unsafe { m(s) }
}

unsafe fn stream() -> Stream {
    let m: unsafe extern "C" fn(*mut Stream, c_uint) -> c_int =
        unsafe { f(c"cudaStreamCreateWithFlags") };
    let mut s = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut s, 1) }, 0);
    s
}

unsafe fn error_string(e: c_int) -> String {
    let m: unsafe extern "C" fn(c_int) -> *const c_char = unsafe { f(c"cudaGetErrorString") };
    unsafe { CStr::from_ptr(m(e)) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn device_count_and_properties_are_the_doubles() {
    if !over_double() {
        return;
    }
    unsafe {
        let count: unsafe extern "C" fn(*mut c_int) -> c_int = f(c"cudaGetDeviceCount");
        let mut n = 0;
        assert_eq!(count(&mut n), 0);
        assert_eq!(n, 2);
        let set: unsafe extern "C" fn(c_int) -> c_int = f(c"cudaSetDevice");
        let get: unsafe extern "C" fn(*mut c_int) -> c_int = f(c"cudaGetDevice");
        assert_eq!(set(1), 0);
        let mut d = -1;
        assert_eq!(get(&mut d), 0);
        assert_eq!(d, 1);
        assert_eq!(set(2), 101, "cudaErrorInvalidDevice");
        let props: unsafe extern "C" fn(*mut u8, c_int) -> c_int = f(c"cudaGetDeviceProperties");
        let mut buf = vec![0u8; 1008];
        assert_eq!(props(buf.as_mut_ptr(), 0), 0);
        let name = CStr::from_bytes_until_nul(&buf[..256]).unwrap();
        assert_eq!(name.to_str().unwrap(), "Quilt CUDA double 0");
        let total = u64::from_ne_bytes(buf[288..296].try_into().unwrap());
        assert_eq!(total, 16 << 30, "totalGlobalMem at offset 288");
        let sms = i32::from_ne_bytes(buf[384..388].try_into().unwrap());
        assert_eq!(sms, 132, "multiProcessorCount at offset 384");
        let version: unsafe extern "C" fn(*mut c_int) -> c_int = f(c"cudaRuntimeGetVersion");
        let mut v = 0;
        assert_eq!(version(&mut v), 0);
        assert_eq!(v, 13020);
    }
}

#[test]
fn copies_and_memsets_keep_bytes_on_streams() {
    if !over_double() {
        return;
    }
    unsafe {
        let n = 3 << 20;
        let host: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        let a = malloc(n);
        let b = malloc(n);
        let s = stream();
        assert_eq!(memcpy_async(a, host.as_ptr().cast(), n, H2D, s), 0);
        assert_eq!(memcpy_async(b, a, n, D2D, s), 0);
        let memset: unsafe extern "C" fn(*mut c_void, c_int, usize, Stream) -> c_int =
            f(c"cudaMemsetAsync");
        assert_eq!(memset(b, 7, 4096, s), 0);
        let mut back = vec![0u8; n];
        assert_eq!(memcpy_async(back.as_mut_ptr().cast(), b, n, D2H, s), 0);
        assert_eq!(sync(s), 0);
        assert!(back[..4096].iter().all(|&x| x == 7));
        assert_eq!(back[4096..], host[4096..]);
        let free: unsafe extern "C" fn(*mut c_void) -> c_int = f(c"cudaFree");
        assert_eq!(free(a), 0);
        assert_eq!(free(b), 0);
        assert_eq!(free(b), 1, "a second free is cudaErrorInvalidValue");
    }
}

#[test]
fn graph_capture_replays_copies() {
    if !over_double() {
        return;
    }
    unsafe {
        let n = 1 << 20;
        let (src, dst) = (malloc(n), malloc(n));
        let s = stream();
        let begin: unsafe extern "C" fn(Stream, c_int) -> c_int = f(c"cudaStreamBeginCapture");
        let end: unsafe extern "C" fn(Stream, *mut *mut c_void) -> c_int =
            f(c"cudaStreamEndCapture");
        let inst: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u64) -> c_int =
            f(c"cudaGraphInstantiateWithFlags");
        let launch: unsafe extern "C" fn(*mut c_void, Stream) -> c_int = f(c"cudaGraphLaunch");
        assert_eq!(begin(s, 0), 0);
        assert_eq!(memcpy_async(dst, src, n, D2D, s), 0);
        let (mut g, mut e) = (std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(end(s, &mut g), 0);
        assert_eq!(inst(&mut e, g, 1), 0);
        for round in 0..2u8 {
            let host = vec![round + 1; n];
            assert_eq!(memcpy_async(src, host.as_ptr().cast(), n, H2D, s), 0);
            assert_eq!(launch(e, s), 0);
            let mut back = vec![0u8; n];
            assert_eq!(memcpy_async(back.as_mut_ptr().cast(), dst, n, D2H, s), 0);
            assert_eq!(sync(s), 0);
            assert_eq!(back, host, "round {round}");
        }
        // The double's capture rules hold through the face: a cudaMalloc in
        // a global-mode capture is refused and invalidates it.
        assert_eq!(begin(s, 0), 0);
        let m: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int = f(c"cudaMalloc");
        let mut p = std::ptr::null_mut();
        assert_eq!(m(&mut p, 4096), 900, "cudaErrorStreamCaptureUnsupported");
        assert_eq!(end(s, &mut g), 901, "cudaErrorStreamCaptureInvalidated");
    }
}

#[test]
fn launches_queue_work_that_keeps_the_stream_busy() {
    if !over_double() {
        return;
    }
    unsafe {
        let register: unsafe extern "C" fn(
            *mut *mut c_void,
            *const c_char,
            *mut c_char,
            *const c_char,
            c_int,
            *mut c_void,
            *mut c_void,
            *mut c_void,
            *mut c_void,
            *mut c_int,
        ) = f(c"__cudaRegisterFunction");
        let fat: unsafe extern "C" fn(*mut c_void) -> *mut *mut c_void =
            f(c"__cudaRegisterFatBinary");
        #[repr(C)]
        #[derive(Clone, Copy)]
        struct Dim3(c_uint, c_uint, c_uint);
        let launch: unsafe extern "C" fn(
            *const c_void,
            Dim3,
            Dim3,
            *mut *mut c_void,
            usize,
            Stream,
        ) -> c_int = f(c"cudaLaunchKernel");
        let query: unsafe extern "C" fn(Stream) -> c_int = f(c"cudaStreamQuery");
        static STUB: u8 = 0;
        let stub = &STUB as *const u8 as *const c_void;
        let s = stream();
        let one = Dim3(1, 1, 1);
        let args = std::ptr::null_mut();
        assert_eq!(
            launch(stub, one, one, args, 0, s),
            98,
            "unregistered: cudaErrorInvalidDeviceFunction"
        );
        let h = fat(std::ptr::null_mut());
        let null: *mut c_void = std::ptr::null_mut();
        register(
            h,
            stub.cast(),
            null.cast(),
            c"k".as_ptr(),
            -1,
            null,
            null,
            null,
            null,
            null.cast(),
        );
        assert_eq!(
            launch(stub, Dim3(0, 1, 1), one, args, 0, s),
            9,
            "cudaErrorInvalidConfiguration"
        );
        assert_eq!(launch(stub, one, one, args, 0, s), 0);
        assert_eq!(query(s), 600, "the launch is queued: cudaErrorNotReady");
        assert_eq!(sync(s), 0);
        assert_eq!(query(s), 0);
        let destroy: unsafe extern "C" fn(Stream) -> c_int = f(c"cudaStreamDestroy");
        assert_eq!(destroy(s), 0);
        assert_eq!(
            launch(stub, one, one, args, 0, s),
            400,
            "a destroyed stream: cudaErrorInvalidResourceHandle"
        );
    }
}

#[test]
fn unimplemented_calls_fail_and_name_themselves() {
    if !over_double() {
        return;
    }
    unsafe {
        let ipc: unsafe extern "C" fn() -> c_int = f(c"cudaIpcGetMemHandle");
        assert_eq!(ipc(), 801, "cudaErrorNotSupported");
        let text = error_string(801);
        assert!(text.contains("cudaIpcGetMemHandle"), "{text}");
        let last: unsafe extern "C" fn() -> c_int = f(c"cudaGetLastError");
        assert_eq!(last(), 801);
        assert_eq!(last(), 0, "cudaGetLastError resets");
    }
}

#[test]
fn driver_entry_points_are_the_doubles_functions() {
    if !over_double() {
        return;
    }
    unsafe {
        let entry: unsafe extern "C" fn(
            *const c_char,
            *mut *mut c_void,
            c_uint,
            u64,
            *mut c_int,
        ) -> c_int = f(c"cudaGetDriverEntryPointByVersion");
        let mut p = std::ptr::null_mut();
        let mut status = -1;
        assert_eq!(
            entry(c"cuMemCreate".as_ptr(), &mut p, 12000, 0, &mut status),
            0
        );
        assert_eq!(status, 0);
        let direct = quilt_cuda_double::harness::driver::symbol(c"cuMemCreate").unwrap();
        assert_eq!(p, direct, "the double's own cuMemCreate");
        assert_eq!(
            entry(c"cuMemGetInfo".as_ptr(), &mut p, 12000, 0, &mut status),
            0
        );
        let v2 = quilt_cuda_double::harness::driver::symbol(c"cuMemGetInfo_v2").unwrap();
        assert_eq!(p, v2, "cuMemGetInfo means cuMemGetInfo_v2");
        assert_eq!(
            entry(c"cuNoSuchCall".as_ptr(), &mut p, 12000, 0, &mut status),
            0
        );
        assert_eq!((p, status), (std::ptr::null_mut(), 1), "symbol not found");
    }
}

#[test]
fn unmap_under_queued_work_faults_through_the_face() {
    if !over_double() {
        return;
    }
    unsafe {
        let n = 2 << 20;
        let (src, dst) = (malloc(n), malloc(n));
        let s = stream();
        assert_eq!(memcpy_async(dst, src, n, D2D, s), 0);
        // Unmap dst's memory through the driver while the copy is queued:
        // accepted (the double does not wait, as the reference allows) ...
        type Range = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_uint;
        type Unmap = unsafe extern "C" fn(u64, usize) -> c_uint;
        let range: Range = quilt_cuda_double::harness::driver::function(c"cuMemGetAddressRange_v2");
        let unmap: Unmap = quilt_cuda_double::harness::driver::function(c"cuMemUnmap");
        let (mut base, mut size) = (0u64, 0usize);
        assert_eq!(range(&mut base, &mut size, dst as u64), 0);
        assert_eq!(unmap(base, size), 0);
        // ... and the copy faults when it runs: the context is poisoned.
        assert_eq!(sync(s), 700, "cudaErrorIllegalAddress");
        assert_eq!(
            error_string(700),
            "an illegal memory access was encountered"
        );
    }
}
