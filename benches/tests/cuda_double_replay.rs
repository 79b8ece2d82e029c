//! Quilt on the CUDA backend with data in every block (issue 22): a real
//! trace replayed, and a multi-stream offloading workload, over the CUDA
//! double (`quilt-cuda-double`: device memory is host memory, queued work
//! runs late, and work that touches memory unmapped under it poisons the
//! context). Every block gets a pattern derived from its operation and
//! address, written asynchronously on its stream by the driver
//! (`cuMemsetD32Async` over its first and last 4 KiB and one page in the
//! middle), and checked before its free (`cuMemcpyDtoHAsync` into pageable
//! memory on its stream: after the stream's earlier work). Before each
//! free one more write is queued on the block's stream (its last use, still
//! queued when the allocator gets the block back), so an allocator that
//! unmaps a block under queued work poisons the context, and one that hands
//! a block to another stream before that work is done breaks the next
//! owner's pattern.
//!
//! Each test runs in a child process over the double
//! (`quilt_cuda_double::harness`); on a GPU machine `QUILT_CUDA_TESTS=real`
//! runs them on the real driver (they read device memory only through the
//! driver). The trace tests need `../shared/traces/converted` at build time
//! and are ignored without it (they show as ignored, never as passed).
//!
//! The driver functions the tests call themselves are looked up in the
//! loaded `libcuda.so.1` (the double, or the real driver) with `dlsym`:
//! quilt-bench has no direct dependency on cudarc.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use quilt_alloc::baselines::classic::{ClassicAllocator, ClassicConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{StreamId, Vmm};

/// The driver functions the tests call directly, from the loaded library.
mod cu {
    use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
    use std::sync::OnceLock;

    /// `CUresult`.
    pub type CuResult = c_int;
    /// `CUstream`.
    pub type CuStream = *mut c_void;
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: CuResult = 0;

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
        fn dlerror() -> *const c_char;
    }

    const RTLD_NOW: c_int = 2;

    /// The functions, each as cuda.h declares it.
    pub struct Driver {
        pub memset_d32_async: unsafe extern "C" fn(u64, c_uint, usize, CuStream) -> CuResult,
        pub memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, u64, usize, CuStream) -> CuResult,
        pub memcpy_dtod_async: unsafe extern "C" fn(u64, u64, usize, CuStream) -> CuResult,
        pub stream_synchronize: unsafe extern "C" fn(CuStream) -> CuResult,
        pub ctx_synchronize: unsafe extern "C" fn() -> CuResult,
        pub device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
        pub primary_ctx_retain: unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult,
        pub primary_ctx_release: unsafe extern "C" fn(c_int) -> CuResult,
        pub ctx_set_current: unsafe extern "C" fn(*mut c_void) -> CuResult,
        pub get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    }

    /// Looks up `name` in `lib`.
    fn symbol(lib: *mut c_void, name: &CStr) -> *mut c_void {
        // SAFETY: `lib` is a handle from `dlopen`; `name` is NUL-terminated.
        let p = unsafe { dlsym(lib, name.as_ptr()) };
        assert!(!p.is_null(), "libcuda.so.1 has no {name:?}");
        p
    }

    macro_rules! load {
        ($lib:expr, $name:literal) => {{
            let p = symbol($lib, $name);
            // SAFETY: `p` is the driver's function of that name, whose
            // signature (cuda.h's) is the field's type it is assigned to.
            unsafe { std::mem::transmute::<*mut c_void, _>(p) }
        }};
    }

    /// The driver of this process (loaded once; the first call loads it).
    pub fn driver() -> &'static Driver {
        static DRIVER: OnceLock<Driver> = OnceLock::new();
        DRIVER.get_or_init(|| {
            // SAFETY: a NUL-terminated name; loading the driver library runs
            // no code of ours (over the double: the same file cudarc loaded,
            // so the same handle and the same state).
            let lib = unsafe { dlopen(c"libcuda.so.1".as_ptr(), RTLD_NOW) };
            if lib.is_null() {
                // SAFETY: dlerror returns a NUL-terminated message after a
                // failed dlopen.
                let why = unsafe { CStr::from_ptr(dlerror()) };
                panic!("dlopen libcuda.so.1: {why:?}");
            }
            Driver {
                memset_d32_async: load!(lib, c"cuMemsetD32Async"),
                memcpy_dtoh_async: load!(lib, c"cuMemcpyDtoHAsync_v2"),
                memcpy_dtod_async: load!(lib, c"cuMemcpyDtoDAsync_v2"),
                stream_synchronize: load!(lib, c"cuStreamSynchronize"),
                ctx_synchronize: load!(lib, c"cuCtxSynchronize"),
                device_get: load!(lib, c"cuDeviceGet"),
                primary_ctx_retain: load!(lib, c"cuDevicePrimaryCtxRetain"),
                primary_ctx_release: load!(lib, c"cuDevicePrimaryCtxRelease_v2"),
                ctx_set_current: load!(lib, c"cuCtxSetCurrent"),
                get_error_name: load!(lib, c"cuGetErrorName"),
            }
        })
    }

    /// `Ok` for `CUDA_SUCCESS`, else `what` failed with the error's name.
    pub fn check(what: &str, r: CuResult) -> Result<(), String> {
        if r == SUCCESS {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: a valid out-pointer; the driver points it at a static
        // NUL-terminated string when it knows the code.
        let known = unsafe { (driver().get_error_name)(r, &mut name) } == SUCCESS;
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

    /// Makes device 0's primary context current on this thread (retained
    /// until [`release_primary`]), for the raw calls above.
    pub fn bind_primary() {
        let d = driver();
        let mut dev: c_int = 0;
        // SAFETY: a valid out-pointer.
        check("cuDeviceGet", unsafe { (d.device_get)(&mut dev, 0) }).unwrap();
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a device from cuDeviceGet.
        check("cuDevicePrimaryCtxRetain", unsafe {
            (d.primary_ctx_retain)(&mut ctx, dev)
        })
        .unwrap();
        // SAFETY: a context the driver just gave (retained).
        check("cuCtxSetCurrent", unsafe { (d.ctx_set_current)(ctx) }).unwrap();
    }

    /// Releases the primary context [`bind_primary`] retained and leaves
    /// none current.
    pub fn release_primary() {
        let d = driver();
        // SAFETY: no context current: a null context is valid here.
        check("cuCtxSetCurrent", unsafe {
            (d.ctx_set_current)(std::ptr::null_mut())
        })
        .unwrap();
        // SAFETY: device 0, retained by `bind_primary`.
        check("cuDevicePrimaryCtxRelease", unsafe {
            (d.primary_ctx_release)(0)
        })
        .unwrap();
    }

    /// `cuCtxSynchronize` of the current context: its sticky error, if any.
    pub fn ctx_synchronize() -> Result<(), String> {
        // SAFETY: no arguments; a context is current (`bind_primary`).
        check("cuCtxSynchronize", unsafe { (driver().ctx_synchronize)() })
    }

    /// `cuStreamSynchronize`.
    pub fn stream_synchronize(stream: u64) -> Result<(), String> {
        // SAFETY: a live stream of the current context (the caller's).
        check("cuStreamSynchronize", unsafe {
            (driver().stream_synchronize)(stream as usize as CuStream)
        })
    }

    /// Queues a fill of `bytes / 4` words of `value` at `ptr` on `stream`.
    pub fn fill(ptr: u64, bytes: u64, value: u32, stream: u64) -> Result<(), String> {
        // SAFETY: no host pointer; the driver checks the device range.
        check("cuMemsetD32Async", unsafe {
            (driver().memset_d32_async)(ptr, value, (bytes / 4) as usize, stream as usize as CuStream)
        })
    }

    /// Copies `out.len()` bytes at `ptr` into `out` after `stream`'s earlier
    /// work (into pageable memory the copy is done when the call returns).
    pub fn read(ptr: u64, out: &mut [u8], stream: u64) -> Result<(), String> {
        // SAFETY: `out` is valid for `out.len()` writes, and pageable: the
        // driver has finished writing it when the call returns.
        check("cuMemcpyDtoHAsync", unsafe {
            (driver().memcpy_dtoh_async)(
                out.as_mut_ptr().cast::<c_void>(),
                ptr,
                out.len(),
                stream as usize as CuStream,
            )
        })
    }

    /// Queues a device-to-device copy on `stream`.
    pub fn copy(dst: u64, src: u64, bytes: u64, stream: u64) -> Result<(), String> {
        // SAFETY: no host pointer; the driver checks both device ranges.
        check("cuMemcpyDtoDAsync", unsafe {
            (driver().memcpy_dtod_async)(dst, src, bytes as usize, stream as usize as CuStream)
        })
    }
}

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Bytes of each checked region: the first and last 4 KiB and one page in the middle.
const REGION: u64 = 4 * KIB;

/// The checked regions of a block of `len` bytes: `(offset, bytes)`,
/// disjoint (the whole block when it is at most three regions long).
fn regions(len: u64) -> Vec<(u64, u64)> {
    if len <= 3 * REGION {
        return vec![(0, len)];
    }
    let mid = (len / 2) / REGION * REGION;
    vec![(0, REGION), (mid, REGION), (len - REGION, REGION)]
}

/// The word written over region `region` of the block at `ptr` whose
/// content is named `tag` (a mix of the three; never zero, which fresh
/// memory holds).
fn word(tag: u64, ptr: u64, region: usize) -> u32 {
    let mut z = tag
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(ptr.rotate_left(29))
        .wrapping_add((region as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z ^= z >> 31;
    z = z.wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 29;
    (z as u32) | 1
}

/// A live block and the content last queued into it.
#[derive(Clone, Debug)]
struct Block {
    ptr: u64,
    len: u64,
    /// The stream it was allocated on.
    stream: StreamId,
    /// Names its content: the pattern last written ([`word`]).
    tag: u64,
    /// What it is, for messages.
    what: String,
}

impl Block {
    /// Queues the pattern of `tag` into every region, on `stream`.
    fn write(&mut self, tag: u64, stream: StreamId) -> Result<(), String> {
        for (r, (off, bytes)) in regions(self.len).into_iter().enumerate() {
            cu::fill(self.ptr + off, bytes, word(tag, self.ptr, r), stream.0)
                .map_err(|e| format!("{}: writing its pattern: {e}", self.what))?;
        }
        self.tag = tag;
        Ok(())
    }

    /// Reads every region on `stream` (after its earlier work) and
    /// compares it with the pattern last written.
    fn check(&self, stream: StreamId) -> Result<(), String> {
        for (r, (off, bytes)) in regions(self.len).into_iter().enumerate() {
            let mut out = vec![0u8; bytes as usize];
            cu::read(self.ptr + off, &mut out, stream.0)
                .map_err(|e| format!("{}: reading its pattern: {e}", self.what))?;
            let want = word(self.tag, self.ptr, r);
            if let Some((i, got)) = out
                .chunks_exact(4)
                .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
                .enumerate()
                .find(|(_, w)| *w != want)
            {
                return Err(format!(
                    "pattern broken: {} ({} bytes at {:#x}, stream {:#x}): byte {:#x} holds {got:#010x}, expected {want:#010x} (tag {})",
                    self.what,
                    self.len,
                    self.ptr,
                    self.stream.0,
                    off + 4 * i as u64,
                    self.tag
                ));
            }
        }
        Ok(())
    }
}

/// Allocates a block of `size` bytes on `stream` and queues its pattern there.
fn allocate(
    alloc: &dyn DeviceAllocator,
    size: u64,
    stream: StreamId,
    tag: u64,
    what: String,
) -> Result<Block, String> {
    let a = alloc
        .allocate(size, stream)
        .map_err(|e| format!("{what}: allocate({size}) on stream {:#x}: {e}", stream.0))?;
    if a.size < size || a.size % 4 != 0 || a.ptr % 4 != 0 {
        return Err(format!("{what}: allocate({size}) gave {a:?}"));
    }
    let mut b = Block {
        ptr: a.ptr,
        len: a.size,
        stream,
        tag,
        what,
    };
    b.write(tag, stream)?;
    Ok(b)
}

/// Tags of the last-use writes queued before a free (never a pattern tag).
const LAST_USE: u64 = 1 << 62;

/// Checks `b`'s pattern on its stream, queues its last use there, frees it.
fn check_and_free(alloc: &dyn DeviceAllocator, mut b: Block) -> Result<(), String> {
    b.check(b.stream)?;
    let tag = b.tag | LAST_USE;
    b.write(tag, b.stream)?;
    alloc
        .free(b.ptr)
        .map_err(|e| format!("{}: free({:#x}): {e}", b.what, b.ptr))
}

/// The CUDA backend on device 0 (the double, in the child) with device 0's
/// primary context current on this thread for the raw calls.
fn cuda() -> Arc<CudaVmm> {
    let cuda = Arc::new(CudaVmm::new(0).unwrap_or_else(|e| panic!("needs CUDA device 0: {e}")));
    cu::bind_primary();
    cuda
}

/// After everything was freed: the allocator's drop, then the context
/// must not be poisoned (no queued work touched memory unmapped under it),
/// then the streams are destroyed and the backend dropped.
fn finish(alloc: Box<dyn DeviceAllocator>, cuda: Arc<CudaVmm>, streams: Vec<StreamId>) {
    drop(alloc);
    cu::ctx_synchronize()
        .unwrap_or_else(|e| panic!("the context after the allocator's drop: {e}"));
    for s in streams {
        cuda.destroy_stream(s).unwrap();
    }
    let leaks = cuda.leak_report();
    assert!(leaks.is_clean(), "left behind: {leaks:?}");
    cu::ctx_synchronize().unwrap();
    cu::release_primary();
    drop(cuda);
}

// --- 1. A real trace ---------------------------------------------------------

fn traces_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/converted"
    ))
}

/// How the trace is replayed.
#[derive(Clone, Debug)]
struct ReplayPlan {
    /// Trace file in the traces folder.
    trace: &'static str,
    /// Events replayed from its start (then every live block is freed).
    max_events: usize,
    /// Spread allocations round robin over this many streams (by id)
    /// instead of the trace's own stream numbers.
    spread: Option<u64>,
    /// `empty_cache` after every this many events.
    empty_cache_every: Option<usize>,
    /// `check_invariants` after every this many events.
    invariants_every: usize,
}

/// What a replay did.
#[derive(Debug, Default)]
struct Replayed {
    events: usize,
    allocs: usize,
    frees: usize,
    empty_caches: usize,
    invariant_checks: usize,
}

/// Replays `plan` on `alloc` with a pattern in every block (see the module
/// documentation); trace stream `k` is a stream made by `cuda`
/// (`streams`, created on first use). Every live block is freed at the end,
/// then the cache emptied.
fn replay(
    plan: &ReplayPlan,
    alloc: &dyn DeviceAllocator,
    cuda: &CudaVmm,
    streams: &mut BTreeMap<u64, StreamId>,
) -> Result<Replayed, String> {
    use quilt_bench::trace::{load_trace, Event};
    let path = traces_dir().join(plan.trace);
    let trace = load_trace(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut stream = |k: u64| -> Result<StreamId, String> {
        if let Some(s) = streams.get(&k) {
            return Ok(*s);
        }
        let s = cuda
            .create_stream()
            .map_err(|e| format!("create_stream: {e}"))?;
        streams.insert(k, s);
        Ok(s)
    };
    let mut live: HashMap<u64, Block> = HashMap::new();
    let mut done = Replayed::default();
    let invariants = |alloc: &dyn DeviceAllocator, at: &str| {
        alloc
            .check_invariants()
            .map_err(|e| format!("invariants after {at}: {e}"))
    };
    for (i, e) in trace.events.iter().take(plan.max_events).enumerate() {
        match *e {
            Event::Alloc { id, size, stream: k } => {
                let k = plan.spread.map_or(k, |n| id % n);
                let s = stream(k)?;
                let what = format!("event {i}: allocation {id}");
                let b = allocate(alloc, size, s, i as u64, what)?;
                live.insert(id, b);
                done.allocs += 1;
            }
            Event::Free { id } => {
                let b = live
                    .remove(&id)
                    .ok_or_else(|| format!("event {i}: free of {id}, not live"))?;
                check_and_free(alloc, b)?;
                done.frees += 1;
            }
            other => return Err(format!("event {i}: {other:?} is not replayed here")),
        }
        done.events += 1;
        if plan.empty_cache_every.is_some_and(|n| (i + 1) % n == 0) {
            alloc
                .empty_cache()
                .map_err(|e| format!("empty_cache after event {i}: {e}"))?;
            done.empty_caches += 1;
        }
        if (i + 1) % plan.invariants_every == 0 {
            invariants(alloc, &format!("event {i}"))?;
            done.invariant_checks += 1;
        }
    }
    // The blocks still live at the end, oldest first.
    let mut rest: Vec<(u64, Block)> = live.into_iter().collect();
    rest.sort_by_key(|(id, _)| *id);
    for (_, b) in rest {
        check_and_free(alloc, b)?;
        done.frees += 1;
    }
    invariants(alloc, "the final frees")?;
    alloc
        .empty_cache()
        .map_err(|e| format!("the final empty_cache: {e}"))?;
    done.empty_caches += 1;
    invariants(alloc, "the final empty_cache")?;
    done.invariant_checks += 2;
    let stats = alloc.stats();
    if stats.allocated_bytes.current != 0 {
        return Err(format!(
            "{} bytes still allocated after every free",
            stats.allocated_bytes.current
        ));
    }
    Ok(done)
}

/// The memory of the double's device for the trace tests.
const TRACE_MEMORY: (&str, &str) = ("QUILT_CUDA_DOUBLE_MEMORY", "8GiB");

/// Replays `plan` on the allocator `make` builds over the CUDA backend and
/// checks the end state (see [`finish`]).
fn replay_test(plan: ReplayPlan, make: fn(Arc<dyn Vmm>) -> Box<dyn DeviceAllocator>) {
    let started = Instant::now();
    let cuda = cuda();
    let alloc = make(cuda.clone());
    let mut streams = BTreeMap::new();
    let r = replay(&plan, alloc.as_ref(), &cuda, &mut streams);
    let stats = alloc.stats();
    let done = r.unwrap_or_else(|e| panic!("{} on {}: {e}", plan.trace, alloc.name()));
    eprintln!(
        "{} on {} ({} streams): {done:?}; peak reserved {} MiB, {} stream waits, {} s",
        plan.trace,
        alloc.name(),
        streams.len(),
        stats.reserved_bytes.peak / MIB,
        stats.num_stream_waits,
        started.elapsed().as_secs_f64()
    );
    if plan.empty_cache_every.is_some() {
        assert_eq!(stats.reserved_bytes.current, 0, "empty_cache kept segments");
    }
    finish(alloc, cuda, streams.into_values().collect());
}

fn quilt(vmm: Arc<dyn Vmm>) -> Box<dyn DeviceAllocator> {
    Box::new(QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap())
}

fn classic(vmm: Arc<dyn Vmm>) -> Box<dyn DeviceAllocator> {
    Box::new(ClassicAllocator::new(vmm, ClassicConfig::default()).unwrap())
}

/// The trace replayed: BERT-large inference, 3,386 events (1,893
/// allocations, 400 of them still live at its end), peak 2.3 GiB live.
const TRACE: &str = "bert_large_infer.trace";

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn trace_on_quilt_keeps_every_pattern_over_the_double() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[TRACE_MEMORY]) {
        return; // ran over the CUDA double in a child process
    }
    let plan = ReplayPlan {
        trace: TRACE,
        max_events: usize::MAX,
        spread: None,
        empty_cache_every: None,
        invariants_every: 1,
    };
    replay_test(plan, quilt);
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn trace_on_four_streams_on_quilt_keeps_every_pattern_over_the_double() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[TRACE_MEMORY]) {
        return; // ran over the CUDA double in a child process
    }
    let plan = ReplayPlan {
        trace: TRACE,
        max_events: usize::MAX,
        spread: Some(4),
        empty_cache_every: Some(700),
        invariants_every: 1,
    };
    replay_test(plan, quilt);
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn trace_on_classic_with_empty_cache_keeps_every_pattern_over_the_double() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[TRACE_MEMORY]) {
        return; // ran over the CUDA double in a child process
    }
    let plan = ReplayPlan {
        trace: TRACE,
        max_events: usize::MAX,
        spread: None,
        empty_cache_every: Some(700),
        invariants_every: 1,
    };
    replay_test(plan, classic);
}
