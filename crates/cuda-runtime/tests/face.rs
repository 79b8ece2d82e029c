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

const DEFAULT: c_int = 4;

unsafe fn set_device(d: c_int) {
    let m: unsafe extern "C" fn(c_int) -> c_int = unsafe { f(c"cudaSetDevice") };
    assert_eq!(unsafe { m(d) }, 0);
}

unsafe fn peer_async(
    dst: *mut c_void,
    dst_device: c_int,
    src: *const c_void,
    src_device: c_int,
    n: usize,
    s: Stream,
) -> c_int {
    type PeerAsync =
        unsafe extern "C" fn(*mut c_void, c_int, *const c_void, c_int, usize, Stream) -> c_int;
    let m: PeerAsync = unsafe { f(c"cudaMemcpyPeerAsync") };
    unsafe { m(dst, dst_device, src, src_device, n, s) }
}

unsafe fn enable_peer(peer: c_int) -> c_int {
    let m: unsafe extern "C" fn(c_int, c_uint) -> c_int =
        unsafe { f(c"cudaDeviceEnablePeerAccess") };
    unsafe { m(peer, 0) }
}

unsafe fn disable_peer(peer: c_int) -> c_int {
    let m: unsafe extern "C" fn(c_int) -> c_int = unsafe { f(c"cudaDeviceDisablePeerAccess") };
    unsafe { m(peer) }
}

/// The bytes at device address `p` (a synchronous copy on the legacy stream).
unsafe fn read_back(p: *const c_void, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    assert_eq!(
        unsafe { memcpy_async(out.as_mut_ptr().cast(), p, n, D2H, std::ptr::null_mut()) },
        0
    );
    assert_eq!(unsafe { sync(std::ptr::null_mut()) }, 0);
    out
}

/// Copies between device 0's and device 1's memory, each way, by every call
/// that copies between devices, all queued on a stream (or the legacy
/// stream) and checked by their bytes; `peer` says whether peer access is
/// enabled both ways (it changes nothing for copies: unified addressing).
unsafe fn copies_between_devices(peer: bool) {
    unsafe {
        let n = (2 << 20) + 4099; // past one granule
        let host: Vec<u8> = (0..n).map(|i| (i * 7 % 253) as u8).collect();
        set_device(0);
        let a0 = malloc(n);
        let c0 = malloc(n);
        let s0 = stream();
        set_device(1);
        let b1 = malloc(n);
        let s1 = stream();
        if peer {
            assert_eq!(enable_peer(0), 0, "device 1 to device 0");
            set_device(0);
            assert_eq!(enable_peer(1), 0, "device 0 to device 1");
        }
        set_device(0);
        assert_eq!(
            memcpy_async(a0, host.as_ptr().cast(), n, H2D, s0),
            0,
            "peer access {peer}"
        );
        // 0 -> 1, DeviceToDevice on a stream of device 0 (device 0 current).
        assert_eq!(memcpy_async(b1, a0, n, D2D, s0), 0, "peer access {peer}");
        // In stream order: a write into a0 queued after the copy leaves the
        // copied bytes alone, and nothing ran before the stream was waited for.
        let later = vec![0xeeu8; n];
        assert_eq!(memcpy_async(a0, later.as_ptr().cast(), n, H2D, s0), 0);
        let query: unsafe extern "C" fn(Stream) -> c_int = f(c"cudaStreamQuery");
        assert_eq!(query(s0), 600, "the copies are queued: cudaErrorNotReady");
        assert_eq!(sync(s0), 0);
        assert_eq!(read_back(b1, n), host, "0 -> 1 (D2D), peer access {peer}");
        assert_eq!(read_back(a0, n), later);
        // 1 -> 0, cudaMemcpyPeerAsync on a stream of device 1.
        assert_eq!(peer_async(c0, 0, b1, 1, n, s1), 0);
        assert_eq!(query(s1), 600);
        assert_eq!(sync(s1), 0);
        assert_eq!(read_back(c0, n), host, "1 -> 0 (peer), peer access {peer}");
        // 0 -> 1 and 1 -> 0 with kind Default, device 1 current, on the
        // legacy stream of device 1.
        set_device(1);
        assert_eq!(memcpy_async(b1, a0, n, DEFAULT, std::ptr::null_mut()), 0);
        assert_eq!(sync(std::ptr::null_mut()), 0);
        assert_eq!(read_back(b1, n), later, "0 -> 1 (default kind)");
        let memcpy: unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int =
            f(c"cudaMemcpy");
        assert_eq!(memcpy(c0, b1, n, D2D), 0);
        assert_eq!(read_back(c0, n), later, "1 -> 0 (cudaMemcpy)");
        // cudaMemcpyPeer: device 0's bytes to device 1, device 1 current.
        assert_eq!(memcpy_async(a0, host.as_ptr().cast(), n, H2D, s0), 0);
        type Peer = unsafe extern "C" fn(*mut c_void, c_int, *const c_void, c_int, usize) -> c_int;
        let peer_sync: Peer = f(c"cudaMemcpyPeer");
        assert_eq!(peer_sync(b1, 1, a0, 0, n), 0);
        assert_eq!(read_back(b1, n), host, "0 -> 1 (cudaMemcpyPeer)");
        // cudaPointerGetAttributes names the memory's own device.
        let attrs: unsafe extern "C" fn(*mut [c_int; 6], *const c_void) -> c_int =
            f(c"cudaPointerGetAttributes");
        let mut a = [0; 6];
        assert_eq!(attrs(&mut a, a0), 0);
        assert_eq!((a[0], a[1]), (2, 0), "device memory of device 0");
        assert_eq!(attrs(&mut a, b1), 0);
        assert_eq!((a[0], a[1]), (2, 1), "device memory of device 1");
    }
}

#[test]
fn copies_between_devices_without_peer_access() {
    if !over_double() {
        return;
    }
    unsafe { copies_between_devices(false) }
}

#[test]
fn copies_between_devices_with_peer_access() {
    if !over_double() {
        return;
    }
    unsafe {
        copies_between_devices(true);
        // The peer access calls answer as the runtime reference says.
        set_device(0);
        assert_eq!(enable_peer(1), 704, "cudaErrorPeerAccessAlreadyEnabled");
        assert_eq!(enable_peer(0), 101, "itself: cudaErrorInvalidDevice");
        assert_eq!(enable_peer(2), 101, "no device 2: cudaErrorInvalidDevice");
        let enable: unsafe extern "C" fn(c_int, c_uint) -> c_int = f(c"cudaDeviceEnablePeerAccess");
        assert_eq!(disable_peer(1), 0);
        assert_eq!(enable(1, 1), 1, "flags: cudaErrorInvalidValue");
        assert_eq!(disable_peer(1), 705, "cudaErrorPeerAccessNotEnabled");
        assert_eq!(enable_peer(1), 0, "enabled again");
    }
}

#[test]
fn copies_between_devices_refuse_what_cuda_refuses() {
    if !over_double() {
        return;
    }
    unsafe {
        let n = 1 << 20;
        set_device(0);
        let a0 = malloc(n);
        let s0 = stream();
        set_device(1);
        let b1 = malloc(n);
        set_device(0);
        // Bad devices, ranges past an allocation's end, host memory named
        // as device memory.
        assert_eq!(
            peer_async(b1, 2, a0, 0, n, s0),
            101,
            "cudaErrorInvalidDevice"
        );
        assert_eq!(peer_async(b1, 1, a0, -1, n, s0), 101);
        let past = (2 << 20) + 1;
        assert_eq!(
            peer_async(b1, 1, a0, 0, past, s0),
            1,
            "cudaErrorInvalidValue"
        );
        assert_eq!(memcpy_async(b1, a0, past, D2D, s0), 1);
        let mut host = vec![0u8; n];
        assert_eq!(peer_async(host.as_mut_ptr().cast(), 1, a0, 0, n, s0), 1);
        assert_eq!(peer_async(a0, 1, b1, 1, n, s0), 1, "a0 is not device 1's");
        assert_eq!(
            peer_async(b1, 1, a0, 0, 0, s0),
            0,
            "no bytes: nothing to do"
        );

        // Memory mapped with cuMemMap belongs to no context: a plain copy
        // reaches it only where the stream's device has access to it, peer
        // access or not; cudaMemcpyPeerAsync reaches it through its device.
        use quilt_cuda_double::abi::{
            AllocFlags, MemAccessDesc, MemAllocationProp, MemLocation, ACCESS_READWRITE,
            ALLOCATION_TYPE_PINNED, LOCATION_DEVICE,
        };
        type Create =
            unsafe extern "C" fn(*mut u64, usize, *const MemAllocationProp, u64) -> c_uint;
        type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> c_uint;
        type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> c_uint;
        type SetAccess = unsafe extern "C" fn(u64, usize, *const MemAccessDesc, usize) -> c_uint;
        use quilt_cuda_double::harness::driver::function;
        let (create, reserve): (Create, Reserve) =
            (function(c"cuMemCreate"), function(c"cuMemAddressReserve"));
        let (map, set_access): (Map, SetAccess) =
            (function(c"cuMemMap"), function(c"cuMemSetAccess"));
        let size = 2 << 20;
        let on1 = MemLocation {
            type_: LOCATION_DEVICE,
            id: 1,
        };
        let prop = MemAllocationProp {
            type_: ALLOCATION_TYPE_PINNED,
            requested_handle_types: 0,
            location: on1,
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: AllocFlags {
                compression_type: 0,
                gpu_direct_rdma_capable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        };
        let (mut handle, mut vmm) = (0u64, 0u64);
        assert_eq!(create(&mut handle, size, &prop, 0), 0);
        assert_eq!(reserve(&mut vmm, size, 0, 0, 0), 0);
        assert_eq!(map(vmm, size, 0, handle, 0), 0);
        let access = MemAccessDesc {
            location: on1,
            flags: ACCESS_READWRITE,
        };
        assert_eq!(set_access(vmm, size, &access, 1), 0);
        let vmm_ptr = vmm as usize as *mut c_void;
        let bytes: Vec<u8> = (0..n).map(|i| (i % 239) as u8).collect();
        assert_eq!(memcpy_async(a0, bytes.as_ptr().cast(), n, H2D, s0), 0);
        assert_eq!(enable_peer(1), 0);
        assert_eq!(
            memcpy_async(vmm_ptr, a0, n, D2D, s0),
            1,
            "device 0's stream has no access to device 1's cuMemMap memory"
        );
        assert_eq!(memcpy_async(vmm_ptr, a0, n, DEFAULT, s0), 1);
        assert_eq!(peer_async(vmm_ptr, 1, a0, 0, n, s0), 0);
        assert_eq!(sync(s0), 0);
        set_device(1);
        assert_eq!(read_back(vmm_ptr, n), bytes, "the peer copy reached it");
        assert_eq!(peer_async(vmm_ptr, 0, a0, 0, n, s0), 1, "not device 0's");
    }
}

#[test]
fn a_peer_copy_faults_where_its_memory_is_unmapped_before_it_runs() {
    if !over_double() {
        return;
    }
    unsafe {
        let n = 2 << 20;
        set_device(1);
        let b1 = malloc(n);
        set_device(0);
        let a0 = malloc(n);
        let s0 = stream();
        assert_eq!(peer_async(b1, 1, a0, 0, n, s0), 0);
        type Range = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_uint;
        type Unmap = unsafe extern "C" fn(u64, usize) -> c_uint;
        let range: Range = quilt_cuda_double::harness::driver::function(c"cuMemGetAddressRange_v2");
        let unmap: Unmap = quilt_cuda_double::harness::driver::function(c"cuMemUnmap");
        let (mut base, mut size) = (0u64, 0usize);
        assert_eq!(range(&mut base, &mut size, b1 as u64), 0);
        assert_eq!(unmap(base, size), 0);
        assert_eq!(sync(s0), 700, "cudaErrorIllegalAddress");
    }
}
