//! The cuBLAS and cuBLASLt faces without torch: each test runs in a child
//! process over the double (`quilt_cuda_double::harness`, two devices),
//! loads the runtime face, the cuBLASLt face and the cuBLAS face by their
//! paths (the faces then find each other by soname) and calls them as a C
//! program would. Work queued by a GEMM is seen as a busy stream
//! (`cudaStreamQuery` answers `cudaErrorNotReady` until the stream is
//! synchronised), and a capture records it as a graph node.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
#![allow(clippy::too_many_arguments)] // cuBLAS's signatures

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

use quilt_cuda_double::harness::rerun_over_double_with;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

const RTLD_NOW_GLOBAL: c_int = 2 | 0x100;
const INVALID_VALUE: u32 = 7;
const NOT_INITIALIZED: u32 = 1;
const NOT_SUPPORTED: u32 = 15;
const NOT_READY: c_int = 600;

type Ptr = *mut c_void;

/// A library cargo built for this test: beside the test binary or one up.
fn built(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let here = exe.parent().unwrap();
    [here.join(name), here.join("..").join(name)]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("{name} is not built beside {}", here.display()))
}

/// The three faces, loaded once, in the order the dynamic loader would.
fn libraries() -> [usize; 3] {
    static LIBS: OnceLock<[usize; 3]> = OnceLock::new();
    *LIBS.get_or_init(|| {
        [
            "libquilt_cuda_runtime.so",
            "libquilt_cublas_lt.so",
            "libquilt_cublas.so",
        ]
        .map(|n| {
            let path = CString::new(built(n).to_str().unwrap()).unwrap();
            let h = unsafe { dlopen(path.as_ptr(), RTLD_NOW_GLOBAL) };
            assert!(!h.is_null(), "dlopen {path:?}");
            h as usize
        })
    })
}

/// Function `name` of library `which` (0 runtime, 1 cuBLASLt, 2 cuBLAS) as `F`.
unsafe fn f<F: Copy>(which: usize, name: &CStr) -> F {
    let p = unsafe { dlsym(libraries()[which] as Ptr, name.as_ptr()) };
    assert!(!p.is_null(), "no {name:?}");
    unsafe { std::mem::transmute_copy::<Ptr, F>(&p) }
}

fn over_double() -> bool {
    rerun_over_double_with(&[("QUILT_CUDA_DOUBLE_DEVICES", "2")])
}

unsafe fn rt_malloc(n: usize) -> Ptr {
    let m: unsafe extern "C" fn(*mut Ptr, usize) -> c_int = unsafe { f(0, c"cudaMalloc") };
    let mut p = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut p, n) }, 0);
    p
}

unsafe fn rt_stream() -> Ptr {
    let m: unsafe extern "C" fn(*mut Ptr, u32) -> c_int =
        unsafe { f(0, c"cudaStreamCreateWithFlags") };
    let mut s = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut s, 1) }, 0);
    s
}

unsafe fn query(s: Ptr) -> c_int {
    let m: unsafe extern "C" fn(Ptr) -> c_int = unsafe { f(0, c"cudaStreamQuery") };
    unsafe { m(s) }
}

unsafe fn sync(s: Ptr) {
    let m: unsafe extern "C" fn(Ptr) -> c_int = unsafe { f(0, c"cudaStreamSynchronize") };
    assert_eq!(unsafe { m(s) }, 0);
}

unsafe fn set_device(d: c_int) {
    let m: unsafe extern "C" fn(c_int) -> c_int = unsafe { f(0, c"cudaSetDevice") };
    assert_eq!(unsafe { m(d) }, 0);
}

unsafe fn create() -> Ptr {
    let m: unsafe extern "C" fn(*mut Ptr) -> u32 = unsafe { f(2, c"cublasCreate_v2") };
    let mut h = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut h) }, 0);
    assert!(!h.is_null());
    h
}

unsafe fn set_stream(h: Ptr, s: Ptr) -> u32 {
    let m: unsafe extern "C" fn(Ptr, Ptr) -> u32 = unsafe { f(2, c"cublasSetStream_v2") };
    unsafe { m(h, s) }
}

type Sgemm = unsafe extern "C" fn(
    Ptr,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const f32,
    Ptr,
    c_int,
    Ptr,
    c_int,
    *const f32,
    Ptr,
    c_int,
) -> u32;

/// `cublasSgemm_v2` with no transposes on buffers big enough for `m,n,k`.
unsafe fn sgemm(
    h: Ptr,
    m: c_int,
    n: c_int,
    k: c_int,
    lda: c_int,
    ldb: c_int,
    ldc: c_int,
    buf: Ptr,
) -> u32 {
    let g: Sgemm = unsafe { f(2, c"cublasSgemm_v2") };
    let (one, zero) = (1.0f32, 0.0f32);
    unsafe { g(h, 0, 0, m, n, k, &one, buf, lda, buf, ldb, &zero, buf, ldc) }
}

#[test]
fn handles_are_made_checked_and_destroyed_once() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create();
        let destroy: unsafe extern "C" fn(Ptr) -> u32 = f(2, c"cublasDestroy_v2");
        let get_mode: unsafe extern "C" fn(Ptr, *mut c_int) -> u32 = f(2, c"cublasGetMathMode");
        let set_mode: unsafe extern "C" fn(Ptr, c_int) -> u32 = f(2, c"cublasSetMathMode");
        let set_ptr_mode: unsafe extern "C" fn(Ptr, c_int) -> u32 =
            f(2, c"cublasSetPointerMode_v2");
        let set_ws: unsafe extern "C" fn(Ptr, Ptr, usize) -> u32 = f(2, c"cublasSetWorkspace_v2");
        let mut mode = -1;
        assert_eq!(get_mode(h, &mut mode), 0);
        assert_eq!(mode, 0, "CUBLAS_DEFAULT_MATH");
        assert_eq!(set_mode(h, 3), 0, "TF32 tensor-op math");
        assert_eq!(get_mode(h, &mut mode), 0);
        assert_eq!(mode, 3);
        assert_eq!(
            set_mode(h, 3 | 16),
            0,
            "with DISALLOW_REDUCED_PRECISION_REDUCTION"
        );
        assert_eq!(set_mode(h, 5), INVALID_VALUE);
        assert_eq!(set_ptr_mode(h, 2), INVALID_VALUE);
        let ws = rt_malloc(4 << 20);
        assert_eq!(set_ws(h, ws, 4 << 20), 0);
        assert_eq!(
            set_ws(h, ws.cast::<u8>().add(8).cast(), 1 << 20),
            INVALID_VALUE,
            "unaligned"
        );
        assert_eq!(set_ws(h, std::ptr::null_mut(), 1 << 20), INVALID_VALUE);
        // A cuBLAS handle is a cuBLASLt handle (torch passes it to cublasLtMatmul).
        let lt_pref: unsafe extern "C" fn(*mut Ptr) -> u32 =
            f(1, c"cublasLtMatmulPreferenceCreate");
        let mut pref = std::ptr::null_mut();
        assert_eq!(lt_pref(&mut pref), 0);
        assert_eq!(destroy(h), 0);
        assert_eq!(destroy(h), NOT_INITIALIZED, "a second destroy");
        assert_eq!(
            get_mode(h, &mut mode),
            NOT_INITIALIZED,
            "a destroyed handle"
        );
        let bogus = Box::into_raw(Box::new(0u64)).cast::<c_void>();
        assert_eq!(
            set_mode(bogus, 0),
            NOT_INITIALIZED,
            "a pointer never made a handle"
        );
        assert_eq!(sgemm(bogus, 1, 1, 1, 1, 1, 1, ws), NOT_INITIALIZED);
        let name: unsafe extern "C" fn(u32) -> *const c_char = f(2, c"cublasGetStatusName");
        assert_eq!(
            CStr::from_ptr(name(INVALID_VALUE)).to_str().unwrap(),
            "CUBLAS_STATUS_INVALID_VALUE"
        );
    }
}

#[test]
fn a_gemm_is_queued_on_the_handles_stream_and_checked_first() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create();
        let s = rt_stream();
        assert_eq!(set_stream(h, s), 0);
        let buf = rt_malloc(1 << 20);
        sync(s);
        assert_eq!(query(s), 0);
        // Refused arguments queue nothing.
        assert_eq!(
            sgemm(h, 64, 64, 64, 63, 64, 64, buf),
            INVALID_VALUE,
            "lda < m"
        );
        assert_eq!(
            sgemm(h, 64, 64, 64, 64, 63, 64, buf),
            INVALID_VALUE,
            "ldb < k"
        );
        assert_eq!(
            sgemm(h, 64, 64, 64, 64, 64, 0, buf),
            INVALID_VALUE,
            "ldc < m"
        );
        assert_eq!(
            sgemm(h, -1, 64, 64, 64, 64, 64, buf),
            INVALID_VALUE,
            "m < 0"
        );
        let g: Sgemm = f(2, c"cublasSgemm_v2");
        let one = 1.0f32;
        assert_eq!(
            g(h, 3, 0, 8, 8, 8, &one, buf, 8, buf, 8, &one, buf, 8),
            INVALID_VALUE,
            "transa 3"
        );
        assert_eq!(
            g(
                h,
                0,
                0,
                8,
                8,
                8,
                std::ptr::null(),
                buf,
                8,
                buf,
                8,
                &one,
                buf,
                8
            ),
            INVALID_VALUE
        );
        assert_eq!(query(s), 0, "a refused call queued work");
        // An empty problem launches nothing.
        assert_eq!(sgemm(h, 0, 64, 64, 1, 64, 1, buf), 0);
        assert_eq!(query(s), 0, "an empty GEMM queued work");
        // A valid one keeps the stream busy until it runs.
        assert_eq!(sgemm(h, 64, 64, 64, 64, 64, 64, buf), 0);
        assert_eq!(
            query(s),
            NOT_READY,
            "the GEMM is not on the handle's stream"
        );
        sync(s);
        assert_eq!(query(s), 0);
        // The handle's stream follows cublasSetStream.
        let other = rt_stream();
        assert_eq!(set_stream(h, other), 0);
        assert_eq!(sgemm(h, 64, 64, 64, 64, 64, 64, buf), 0);
        assert_eq!(query(other), NOT_READY);
        assert_eq!(query(s), 0);
        sync(other);
    }
}

#[test]
fn a_handle_refuses_a_stream_of_another_device() {
    if !over_double() {
        return;
    }
    unsafe {
        set_device(0);
        let h = create();
        let buf = rt_malloc(1 << 20);
        set_device(1);
        let s1 = rt_stream();
        assert_eq!(set_stream(h, s1), 0, "cublasSetStream does not check");
        assert_eq!(sgemm(h, 8, 8, 8, 8, 8, 8, buf), INVALID_VALUE);
        assert_eq!(query(s1), 0);
        set_device(0);
    }
}

#[test]
fn host_results_wait_for_the_stream() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create();
        let s = rt_stream();
        assert_eq!(set_stream(h, s), 0);
        let buf = rt_malloc(1 << 20);
        assert_eq!(sgemm(h, 64, 64, 64, 64, 64, 64, buf), 0);
        assert_eq!(query(s), NOT_READY);
        let dot: unsafe extern "C" fn(Ptr, c_int, Ptr, c_int, Ptr, c_int, *mut f32) -> u32 =
            f(2, c"cublasSdot_v2");
        let mut result = 0.0f32;
        assert_eq!(dot(h, 16, buf, 1, buf, 1, &mut result), 0);
        assert_eq!(
            query(s),
            0,
            "a dot product into host memory returned before its stream's work"
        );
        assert_eq!(
            dot(h, 16, buf, 0, buf, 1, &mut result),
            INVALID_VALUE,
            "incx 0"
        );
        // Device pointer mode: queued, no wait.
        let set_ptr_mode: unsafe extern "C" fn(Ptr, c_int) -> u32 =
            f(2, c"cublasSetPointerMode_v2");
        assert_eq!(set_ptr_mode(h, 1), 0);
        assert_eq!(dot(h, 16, buf, 1, buf, 1, buf.cast()), 0);
        assert_eq!(query(s), NOT_READY);
        sync(s);
        // The batched solvers report their arguments' check in host `info`.
        let getrs: unsafe extern "C" fn(
            Ptr,
            c_int,
            c_int,
            c_int,
            *const Ptr,
            c_int,
            *const c_int,
            *const Ptr,
            c_int,
            *mut c_int,
            c_int,
        ) -> u32 = f(2, c"cublasSgetrsBatched");
        let arrays = [buf];
        let mut info = 99;
        assert_eq!(
            getrs(
                h,
                0,
                4,
                1,
                arrays.as_ptr(),
                2,
                buf.cast(),
                arrays.as_ptr(),
                4,
                &mut info,
                1
            ),
            INVALID_VALUE
        );
        assert_eq!(info, -5, "lda < n is the fifth argument");
        assert_eq!(
            getrs(
                h,
                0,
                4,
                1,
                arrays.as_ptr(),
                4,
                buf.cast(),
                arrays.as_ptr(),
                4,
                &mut info,
                1
            ),
            0
        );
        assert_eq!(info, 0);
        sync(s);
        // A call only torch.linalg makes is refused by name.
        let axpy: unsafe extern "C" fn() -> u32 = f(2, c"cublasSaxpy_v2");
        assert_eq!(axpy(), NOT_SUPPORTED);
    }
}

/// A cuBLASLt matmul of D (m x n) = op(A) op(B), A and B as stored.
struct Lt {
    desc: Ptr,
    a: Ptr,
    b: Ptr,
    d: Ptr,
    pref: Ptr,
}

unsafe fn layout(rows: u64, cols: u64, ld: i64) -> Ptr {
    let m: unsafe extern "C" fn(*mut Ptr, c_int, u64, u64, i64) -> u32 =
        unsafe { f(1, c"cublasLtMatrixLayoutCreate") };
    let mut p = std::ptr::null_mut();
    assert_eq!(unsafe { m(&mut p, 0, rows, cols, ld) }, 0);
    p
}

unsafe fn set_desc(desc: Ptr, attr: u32, v: &[u8]) -> u32 {
    let m: unsafe extern "C" fn(Ptr, u32, *const c_void, usize) -> u32 =
        unsafe { f(1, c"cublasLtMatmulDescSetAttribute") };
    unsafe { m(desc, attr, v.as_ptr().cast(), v.len()) }
}

unsafe fn lt_problem(m: u64, n: u64, k: u64, transa: bool) -> Lt {
    unsafe {
        let create: unsafe extern "C" fn(*mut Ptr, c_int, c_int) -> u32 =
            f(1, c"cublasLtMatmulDescCreate");
        let mut desc = std::ptr::null_mut();
        assert_eq!(
            create(&mut desc, 68, 0),
            0,
            "CUBLAS_COMPUTE_32F, CUDA_R_32F"
        );
        let a = if transa {
            assert_eq!(set_desc(desc, 3, &1i32.to_le_bytes()), 0);
            layout(k, m, k as i64)
        } else {
            layout(m, k, m as i64)
        };
        let pref_create: unsafe extern "C" fn(*mut Ptr) -> u32 =
            f(1, c"cublasLtMatmulPreferenceCreate");
        let mut pref = std::ptr::null_mut();
        assert_eq!(pref_create(&mut pref), 0);
        Lt {
            desc,
            a,
            b: layout(k, n, k as i64),
            d: layout(m, n, m as i64),
            pref,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Heuristic {
    algo: [u64; 8],
    workspace: usize,
    state: u32,
    waves: f32,
    reserved: [i32; 4],
}

type Matmul = unsafe extern "C" fn(
    Ptr,
    Ptr,
    *const c_void,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    *const c_void,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    *const [u64; 8],
    Ptr,
    usize,
    Ptr,
) -> u32;
type GetHeuristic = unsafe extern "C" fn(
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    Ptr,
    c_int,
    *mut Heuristic,
    *mut c_int,
) -> u32;

#[test]
fn a_cublaslt_matmul_is_chosen_checked_and_queued() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create(); // a cuBLAS handle, used as a cuBLASLt handle
        let s = rt_stream();
        let buf = rt_malloc(8 << 20);
        let p = lt_problem(32, 16, 8, true);
        let heuristic: GetHeuristic = f(1, c"cublasLtMatmulAlgoGetHeuristic");
        let mut results = [Heuristic {
            algo: [0; 8],
            workspace: 1,
            state: 9,
            waves: 0.0,
            reserved: [0; 4],
        }; 2];
        let mut returned = 0;
        assert_eq!(
            heuristic(
                h,
                p.desc,
                p.a,
                p.b,
                p.d,
                p.d,
                p.pref,
                2,
                results.as_mut_ptr(),
                &mut returned
            ),
            0
        );
        assert_eq!(returned, 1);
        assert_eq!((results[0].state, results[0].workspace), (0, 0));
        assert_eq!(
            heuristic(
                h,
                p.desc,
                p.a,
                p.b,
                p.d,
                p.d,
                p.pref,
                0,
                results.as_mut_ptr(),
                &mut returned
            ),
            INVALID_VALUE
        );
        // A with the wrong inner dimension: refused by the heuristic and the matmul.
        let wrong = lt_problem(32, 16, 8, false);
        assert_eq!(
            heuristic(
                h,
                p.desc,
                wrong.a,
                p.b,
                p.d,
                p.d,
                p.pref,
                1,
                results.as_mut_ptr(),
                &mut returned
            ),
            INVALID_VALUE
        );
        let matmul: Matmul = f(1, c"cublasLtMatmul");
        let one = 1.0f32;
        let algo = results[0].algo;
        let run = |a: Ptr, algo: *const [u64; 8], ws: usize| {
            matmul(
                h,
                p.desc,
                (&one as *const f32).cast(),
                buf,
                a,
                buf,
                p.b,
                (&one as *const f32).cast(),
                buf,
                p.d,
                buf,
                p.d,
                algo,
                buf,
                ws,
                s,
            )
        };
        sync(s);
        assert_eq!(run(wrong.a, &algo, 0), INVALID_VALUE);
        let zeros = [0u64; 8];
        assert_eq!(
            run(p.a, &zeros, 0),
            INVALID_VALUE,
            "an algorithm nobody initialised"
        );
        assert_eq!(query(s), 0, "a refused matmul queued work");
        assert_eq!(run(p.a, &algo, 1 << 20), 0);
        assert_eq!(query(s), NOT_READY, "the matmul is not on its stream");
        sync(s);
        assert_eq!(
            run(p.a, std::ptr::null(), 0),
            0,
            "no algorithm: cuBLASLt chooses"
        );
        sync(s);
        // An epilogue with a bias needs the bias pointer.
        assert_eq!(
            set_desc(p.desc, 7, &4u32.to_le_bytes()),
            0,
            "CUBLASLT_EPILOGUE_BIAS"
        );
        assert_eq!(run(p.a, &algo, 0), INVALID_VALUE);
        assert_eq!(set_desc(p.desc, 8, &(buf as u64).to_le_bytes()), 0);
        assert_eq!(run(p.a, &algo, 0), 0);
        sync(s);
        // Attribute sizes are checked as cuBLASLt checks them.
        assert_eq!(
            set_desc(p.desc, 3, &1u64.to_le_bytes()),
            INVALID_VALUE,
            "TRANSA is 4 bytes"
        );
        assert_eq!(
            set_desc(p.desc, 9999, &1u32.to_le_bytes()),
            INVALID_VALUE,
            "unknown attribute"
        );
        let get: unsafe extern "C" fn(Ptr, u32, *mut c_void, usize, *mut usize) -> u32 =
            f(1, c"cublasLtMatmulDescGetAttribute");
        let mut written = 0usize;
        assert_eq!(get(p.desc, 8, std::ptr::null_mut(), 0, &mut written), 0);
        assert_eq!(written, 8, "the size a pointer attribute needs");
        let mut epilogue = 0u32;
        assert_eq!(
            get(
                p.desc,
                7,
                (&mut epilogue as *mut u32).cast(),
                4,
                &mut written
            ),
            0
        );
        assert_eq!(epilogue, 4);
        // Destroyed descriptors are refused.
        let destroy: unsafe extern "C" fn(Ptr) -> u32 = f(1, c"cublasLtMatrixLayoutDestroy");
        assert_eq!(destroy(wrong.a), 0);
        assert_eq!(destroy(wrong.a), INVALID_VALUE);
        assert_eq!(
            heuristic(
                h,
                p.desc,
                wrong.a,
                p.b,
                p.d,
                p.d,
                p.pref,
                1,
                results.as_mut_ptr(),
                &mut returned
            ),
            INVALID_VALUE
        );
    }
}

#[test]
fn algorithms_are_initialised_and_configured() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create();
        let init: unsafe extern "C" fn(
            Ptr,
            c_int,
            c_int,
            c_int,
            c_int,
            c_int,
            c_int,
            c_int,
            *mut [u64; 8],
        ) -> u32 = f(1, c"cublasLtMatmulAlgoInit");
        let set: unsafe extern "C" fn(*mut [u64; 8], u32, *const c_void, usize) -> u32 =
            f(1, c"cublasLtMatmulAlgoConfigSetAttribute");
        let get: unsafe extern "C" fn(*const [u64; 8], u32, *mut c_void, usize, *mut usize) -> u32 =
            f(1, c"cublasLtMatmulAlgoConfigGetAttribute");
        let mut algo = [0u64; 8];
        assert_eq!(init(h, 68, 0, 0, 0, 0, 0, 6, &mut algo), 0);
        assert_eq!(init(h, 68, 0, 0, 0, 0, 0, -1, &mut algo), INVALID_VALUE);
        let (mut id, mut splitk, mut written) = (0i32, 0i32, 0usize);
        assert_eq!(
            get(&algo, 0, (&mut id as *mut i32).cast(), 4, &mut written),
            0
        );
        assert_eq!(id, 6);
        assert_eq!(
            get(&algo, 2, (&mut splitk as *mut i32).cast(), 4, &mut written),
            0
        );
        assert_eq!(splitk, 1, "SPLITK_NUM's default");
        assert_eq!(set(&mut algo, 2, (&4i32 as *const i32).cast(), 4), 0);
        assert_eq!(
            get(&algo, 2, (&mut splitk as *mut i32).cast(), 4, &mut written),
            0
        );
        assert_eq!(splitk, 4);
        assert_eq!(
            set(&mut algo, 0, (&1i32 as *const i32).cast(), 4),
            INVALID_VALUE,
            "the id is read-only"
        );
        let blank = [0u64; 8];
        assert_eq!(
            get(&blank, 2, (&mut splitk as *mut i32).cast(), 4, &mut written),
            INVALID_VALUE
        );
        let version: unsafe extern "C" fn() -> usize = f(1, c"cublasLtGetVersion");
        assert_eq!(version(), 130_401);
    }
}

#[test]
fn a_capture_records_gemms_and_a_replay_queues_them() {
    if !over_double() {
        return;
    }
    unsafe {
        let h = create();
        let s = rt_stream();
        assert_eq!(set_stream(h, s), 0);
        let buf = rt_malloc(1 << 20);
        sync(s);
        let begin: unsafe extern "C" fn(Ptr, c_int) -> c_int = f(0, c"cudaStreamBeginCapture");
        let end: unsafe extern "C" fn(Ptr, *mut Ptr) -> c_int = f(0, c"cudaStreamEndCapture");
        let nodes: unsafe extern "C" fn(Ptr, *mut Ptr, *mut usize) -> c_int =
            f(0, c"cudaGraphGetNodes");
        let instantiate: unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> c_int =
            f(0, c"cudaGraphInstantiateWithFlags");
        let launch: unsafe extern "C" fn(Ptr, Ptr) -> c_int = f(0, c"cudaGraphLaunch");
        assert_eq!(begin(s, 0), 0, "global mode");
        assert_eq!(sgemm(h, 64, 64, 64, 64, 64, 64, buf), 0);
        assert_eq!(sgemm(h, 32, 32, 32, 32, 32, 32, buf), 0);
        let mut graph = std::ptr::null_mut();
        assert_eq!(end(s, &mut graph), 0);
        let mut count = 0usize;
        assert_eq!(nodes(graph, std::ptr::null_mut(), &mut count), 0);
        assert_eq!(count, 2, "the capture did not record both GEMMs");
        let mut exec = std::ptr::null_mut();
        assert_eq!(instantiate(&mut exec, graph, 0), 0);
        assert_eq!(query(s), 0);
        assert_eq!(launch(exec, s), 0);
        assert_eq!(query(s), NOT_READY);
        sync(s);
    }
}
