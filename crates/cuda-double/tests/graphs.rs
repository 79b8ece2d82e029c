//! The double's graphs and queued launches (issue 37, for the CUDA runtime
//! face): stream capture records the captured copies, fills and launches;
//! `cuGraphInstantiateWithFlags` and `cuGraphLaunch` replay them on a
//! stream, where they compute, late, as any queued work, and fault on memory
//! unmapped by then; `quiltDoubleLaunchOpaqueWork` queues work of unknown
//! footprint that keeps its stream busy; `cuStreamWriteValue32` is a queued
//! 4-byte write. Each test runs in a child over the double and calls it
//! through `harness::driver` (the functions of the `libcuda.so.1` loaded).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::ffi::{c_int, c_uint, c_void, CStr};

use quilt_cuda_double::harness::{self, driver};

type R = c_int;
type P = *mut c_void;

const NOT_READY: R = 600;
const ILLEGAL_ADDRESS: R = 700;
const NOT_SUPPORTED: R = 801;
const INVALID_VALUE: R = 1;
const MIB: usize = 1 << 20;

/// The driver function `name` with the signature `F` (cuda.h's).
fn f<F: Copy>(name: &CStr) -> F {
    // SAFETY: each call site names F as cuda.h declares the function.
    unsafe { driver::function::<F>(name) }
}

fn ok(what: &str, r: R) {
    driver::check(what, r).unwrap();
}

fn alloc(n: usize) -> u64 {
    let mut p = 0u64;
    ok("cuMemAlloc", unsafe {
        f::<unsafe extern "C" fn(*mut u64, usize) -> R>(c"cuMemAlloc_v2")(&mut p, n)
    });
    p
}

fn stream() -> P {
    let mut s: P = std::ptr::null_mut();
    ok("cuStreamCreate", unsafe {
        f::<unsafe extern "C" fn(*mut P, c_uint) -> R>(c"cuStreamCreate")(&mut s, 1)
    });
    s
}

fn sync(s: P) -> R {
    unsafe { f::<unsafe extern "C" fn(P) -> R>(c"cuStreamSynchronize")(s) }
}

fn query(s: P) -> R {
    unsafe { f::<unsafe extern "C" fn(P) -> R>(c"cuStreamQuery")(s) }
}

fn copy(dst: u64, src: u64, n: usize, s: P) {
    ok("cuMemcpyDtoDAsync", unsafe {
        f::<unsafe extern "C" fn(u64, u64, usize, P) -> R>(c"cuMemcpyDtoDAsync_v2")(dst, src, n, s)
    });
}

fn fill(dst: u64, v: u8, n: usize, s: P) {
    ok("cuMemsetD8Async", unsafe {
        f::<unsafe extern "C" fn(u64, u8, usize, P) -> R>(c"cuMemsetD8Async")(dst, v, n, s)
    });
}

/// Device memory is host memory on the double: its bytes, read directly.
fn bytes(p: u64, n: usize) -> Vec<u8> {
    // SAFETY: a live mapping of at least `n` bytes with read access, and
    // no queued work on it (the callers synchronise first).
    unsafe { std::slice::from_raw_parts(p as usize as *const u8, n) }.to_vec()
}

fn set(p: u64, v: &[u8]) {
    // SAFETY: as for `bytes`, with write access.
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p as usize as *mut u8, v.len()) }
}

fn capture(s: P, record: impl FnOnce()) -> P {
    ok("cuStreamBeginCapture", unsafe {
        f::<unsafe extern "C" fn(P, c_int) -> R>(c"cuStreamBeginCapture_v2")(s, 0)
    });
    record();
    let mut g: P = std::ptr::null_mut();
    ok("cuStreamEndCapture", unsafe {
        f::<unsafe extern "C" fn(P, *mut P) -> R>(c"cuStreamEndCapture")(s, &mut g)
    });
    g
}

fn instantiate(g: P, flags: u64) -> Result<P, R> {
    let mut e: P = std::ptr::null_mut();
    let r = unsafe {
        f::<unsafe extern "C" fn(*mut P, P, u64) -> R>(c"cuGraphInstantiateWithFlags")(
            &mut e, g, flags,
        )
    };
    if r == 0 {
        Ok(e)
    } else {
        Err(r)
    }
}

fn launch(e: P, s: P) -> R {
    unsafe { f::<unsafe extern "C" fn(P, P) -> R>(c"cuGraphLaunch")(e, s) }
}

#[test]
fn captured_copies_and_fills_replay_when_the_graph_is_launched() {
    if !harness::rerun_over_double() {
        return;
    }
    driver::bind_primary();
    let n = 2 * MIB;
    let (src, dst) = (alloc(n), alloc(n));
    set(src, &vec![1; n]);
    set(dst, &vec![0; n]);
    let s = stream();
    let g = capture(s, || {
        fill(dst, 0xab, 4096, s);
        copy(dst + 4096, src + 4096, n - 4096, s);
    });
    assert_eq!(sync(s), 0);
    assert_eq!(bytes(dst, n), vec![0; n], "captured work never runs");
    let mut count = 0usize;
    ok("cuGraphGetNodes", unsafe {
        f::<unsafe extern "C" fn(P, *mut P, *mut usize) -> R>(c"cuGraphGetNodes")(
            g,
            std::ptr::null_mut(),
            &mut count,
        )
    });
    assert_eq!(count, 2);
    let e = instantiate(g, 1).unwrap();
    for round in 2u8..4 {
        set(src, &vec![round; n]);
        assert_eq!(launch(e, s), 0);
        assert_eq!(query(s), NOT_READY, "the replay is queued, not run");
        assert_eq!(sync(s), 0);
        let got = bytes(dst, n);
        assert!(got[..4096].iter().all(|&b| b == 0xab));
        assert!(got[4096..].iter().all(|&b| b == round), "round {round}");
    }
    assert_eq!(
        instantiate(g, 2),
        Err(NOT_SUPPORTED),
        "upload is not modelled"
    );
    ok("cuGraphExecDestroy", unsafe {
        f::<unsafe extern "C" fn(P) -> R>(c"cuGraphExecDestroy")(e)
    });
    assert_eq!(launch(e, s), INVALID_VALUE, "a destroyed executable graph");
    ok("cuGraphDestroy", unsafe {
        f::<unsafe extern "C" fn(P) -> R>(c"cuGraphDestroy")(g)
    });
    assert_eq!(instantiate(g, 0), Err(INVALID_VALUE), "a destroyed graph");
}

#[test]
fn a_replay_onto_unmapped_memory_faults() {
    if !harness::rerun_over_double() {
        return;
    }
    driver::bind_primary();
    let n = 2 * MIB;
    let (src, dst) = (alloc(n), alloc(n));
    let s = stream();
    let g = capture(s, || copy(dst, src, n, s));
    let e = instantiate(g, 0).unwrap();
    ok("cuMemFree", unsafe {
        f::<unsafe extern "C" fn(u64) -> R>(c"cuMemFree_v2")(dst)
    });
    assert_eq!(
        launch(e, s),
        0,
        "queued: the memory is checked when it runs"
    );
    assert_eq!(sync(s), ILLEGAL_ADDRESS);
}

#[test]
fn opaque_launches_keep_the_stream_busy_and_are_captured() {
    if !harness::rerun_over_double() {
        return;
    }
    driver::bind_primary();
    let launch_opaque = f::<unsafe extern "C" fn(P) -> R>(c"quiltDoubleLaunchOpaqueWork");
    let s = stream();
    ok("quiltDoubleLaunchOpaqueWork", unsafe { launch_opaque(s) });
    assert_eq!(query(s), NOT_READY);
    assert_eq!(sync(s), 0);
    assert_eq!(query(s), 0);
    let g = capture(s, || ok("launch", unsafe { launch_opaque(s) }));
    assert_eq!(query(s), 0, "captured, not queued");
    let e = instantiate(g, 0).unwrap();
    assert_eq!(launch(e, s), 0);
    assert_eq!(query(s), NOT_READY, "the replayed launch is queued");
    assert_eq!(sync(s), 0);
    let destroy = f::<unsafe extern "C" fn(P) -> R>(c"cuStreamDestroy_v2");
    ok("cuStreamDestroy", unsafe { destroy(s) });
    assert_eq!(unsafe { launch_opaque(s) }, 400, "a destroyed stream");
}

#[test]
fn stream_write_value_is_a_queued_write() {
    if !harness::rerun_over_double() {
        return;
    }
    driver::bind_primary();
    let p = alloc(2 * MIB);
    set(p, &[0; 8]);
    let s = stream();
    let write = f::<unsafe extern "C" fn(P, u64, c_uint, c_uint) -> R>(c"cuStreamWriteValue32_v2");
    ok("cuStreamWriteValue32", unsafe {
        write(s, p + 4, 0x0102_0304, 0)
    });
    assert_eq!(bytes(p, 8), vec![0; 8], "not yet run");
    assert_eq!(sync(s), 0);
    assert_eq!(bytes(p + 4, 4), 0x0102_0304u32.to_ne_bytes());
    assert_eq!(unsafe { write(s, p, 1, 2) }, INVALID_VALUE, "unknown flags");
}
