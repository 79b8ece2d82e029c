//! Concurrency stress: every allocator of the registry, on the simulated and
//! the host backends, driven by 8 threads on 4 streams with random operations
//! (allocate, free, free of another thread's allocation, `record_stream`,
//! `empty_cache`, statistics and snapshots read while others work).
//!
//! - Every `ROUND` operations per thread, all threads meet at a barrier; at that
//!   quiescent point one thread checks the allocator's invariants (and the
//!   simulated driver's) and completes the simulated streams' events.
//! - On the host backend every live allocation is filled with its own byte and
//!   checked before it is freed: two allocations that share a byte they should
//!   not would show up here.
//! - The only errors accepted are out-of-memory ones (the host device is
//!   256 MiB); they are counted.
//! - A watchdog fails the test if a run does not finish within its deadline
//!   (a deadlock then fails CI instead of hanging it).
//! - After every run, everything is freed and the allocator dropped: the
//!   driver's leak report must be empty.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::Duration;

use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_bench::allocators::{self, RegistryError, ALLOCATOR_NAMES};
use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId, Vmm};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

const THREADS: usize = 8;
const STREAMS: u64 = 4;
/// Operations per thread between two quiescent points.
const ROUND: usize = 500;
/// How long one run (one allocator on one backend) may take before the
/// watchdog calls it a hang. Generous: the machine is shared and noisy.
const DEADLINE: Duration = Duration::from_secs(300);

/// The backend a run uses, with what the checks need of it.
#[derive(Clone)]
enum Backend {
    Sim(Arc<SimVmm>),
    Host(Arc<HostVmm>),
}

impl Backend {
    fn vmm(&self) -> Arc<dyn Vmm> {
        match self {
            Backend::Sim(s) => s.clone(),
            Backend::Host(h) => h.clone(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Backend::Sim(_) => "sim",
            Backend::Host(_) => "host",
        }
    }

    /// Fill the checked windows of an allocation with `byte` (host only).
    fn fill(&self, ptr: DevicePtr, size: u64, byte: u8) {
        if let Backend::Host(h) = self {
            for (off, len) in windows(size) {
                h.fill(ptr + off, len, byte).unwrap();
            }
        }
    }

    /// Check the windows still hold `byte` (host only).
    fn check(&self, ptr: DevicePtr, size: u64, byte: u8, ctx: &str) {
        if let Backend::Host(h) = self {
            for (off, len) in windows(size) {
                let ok = h.check_filled(ptr + off, len, byte).unwrap();
                assert!(
                    ok,
                    "{ctx}: allocation {ptr:#x}+{size} lost its byte {byte:#x} in {off}+{len}: \
                     another allocation wrote over it"
                );
            }
        }
    }

    fn quiescent_check(&self, alloc: &dyn DeviceAllocator, ctx: &str) {
        alloc
            .check_invariants()
            .unwrap_or_else(|v| panic!("{ctx}: {v}"));
        if let Backend::Sim(s) = self {
            s.check_invariants()
                .unwrap_or_else(|v| panic!("{ctx}: driver: {v}"));
            s.complete_all();
        }
    }

    fn leak_report(&self) -> String {
        let r = match self {
            Backend::Sim(s) => s.leak_report(),
            Backend::Host(h) => h.leak_report(),
        };
        if r.is_empty() {
            String::new()
        } else {
            r.to_string()
        }
    }
}

/// The byte ranges of an allocation of `size` bytes that are filled and
/// checked: all of it up to 256 KiB, else its first, middle and last 64 KiB.
fn windows(size: u64) -> Vec<(u64, u64)> {
    if size <= 256 * KIB {
        vec![(0, size)]
    } else {
        let w = 64 * KIB;
        vec![(0, w), (size / 2 - w / 2, w), (size - w, w)]
    }
}

/// A small, fast, seeded generator (SplitMix64): the test needs no crate for it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// A request size: mostly small, some medium, a few large (up to 6 MiB) and
/// rare huge ones (up to 40 MiB: on the 256 MiB host device these make memory
/// run short, so reclaim and out-of-memory paths run concurrently too).
fn draw_size(rng: &mut Rng) -> u64 {
    match rng.below(1000) {
        0..=589 => 1 + rng.below(64 * KIB),
        590..=889 => 64 * KIB + rng.below(MIB),
        890..=979 => MIB + rng.below(5 * MIB),
        _ => 8 * MIB + rng.below(32 * MIB),
    }
}

/// A live allocation and the byte it was filled with.
#[derive(Clone, Copy, Debug)]
struct Live {
    ptr: DevicePtr,
    size: u64,
    byte: u8,
}

/// Counters of one run, shared by its threads.
#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
    cross_thread_frees: AtomicU64,
    records: AtomicU64,
    ooms: AtomicU64,
    empty_caches: AtomicU64,
    checkpoints: AtomicU64,
}

fn is_oom(e: &AllocError) -> bool {
    match e {
        AllocError::OutOfMemory(_) => true,
        AllocError::Driver(v) => v.is_out_of_memory(),
        _ => false,
    }
}

/// One run: `ops_per_thread` operations on each of `THREADS` threads.
fn stress_run(
    alloc: Arc<dyn DeviceAllocator>,
    backend: Backend,
    ops_per_thread: usize,
    seed: u64,
) -> Arc<Counters> {
    let ctx = format!("{} on {}", alloc.name(), backend.name());
    let rounds = ops_per_thread.div_ceil(ROUND);
    let barrier = Arc::new(Barrier::new(THREADS));
    let mailbox: Arc<Mutex<Vec<Live>>> = Arc::new(Mutex::new(Vec::new()));
    let counters = Arc::new(Counters::default());
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let alloc = alloc.clone();
        let backend = backend.clone();
        let barrier = barrier.clone();
        let mailbox = mailbox.clone();
        let counters = counters.clone();
        let ctx = format!("{ctx}, thread {t}");
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(seed ^ (t as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
            let stream = StreamId(t as u64 % STREAMS);
            let mut mine: Vec<Live> = Vec::new();
            let mut serial = 0u64;
            for round in 0..rounds {
                for _ in 0..ROUND {
                    counters.ops.fetch_add(1, Ordering::Relaxed);
                    let dice = rng.below(1000);
                    if dice < 450 && mine.len() < 12 {
                        let size = draw_size(&mut rng);
                        match alloc.allocate(size, stream) {
                            Ok(a) => {
                                assert!(a.size >= size && a.ptr != 0, "{ctx}: {a:?} for {size}");
                                serial += 1;
                                let byte = (t as u64 * 31 + serial) as u8 | 1;
                                backend.fill(a.ptr, size, byte);
                                mine.push(Live {
                                    ptr: a.ptr,
                                    size,
                                    byte,
                                });
                                counters.allocs.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) if is_oom(&e) => {
                                counters.ooms.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{ctx}: allocate({size}): {e}"),
                        }
                    } else if dice < 850 && !mine.is_empty() {
                        let l = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        backend.check(l.ptr, l.size, l.byte, &ctx);
                        alloc
                            .free(l.ptr)
                            .unwrap_or_else(|e| panic!("{ctx}: free: {e}"));
                        counters.frees.fetch_add(1, Ordering::Relaxed);
                    } else if dice < 900 && !mine.is_empty() {
                        // Hand one over to whichever thread comes next.
                        let l = mine.swap_remove(rng.below(mine.len() as u64) as usize);
                        mailbox.lock().unwrap().push(l);
                    } else if dice < 950 {
                        // Free one another thread handed over.
                        let got = mailbox.lock().unwrap().pop();
                        if let Some(l) = got {
                            backend.check(l.ptr, l.size, l.byte, &ctx);
                            alloc
                                .free(l.ptr)
                                .unwrap_or_else(|e| panic!("{ctx}: cross free: {e}"));
                            counters.cross_thread_frees.fetch_add(1, Ordering::Relaxed);
                        }
                    } else if dice < 985 && !mine.is_empty() {
                        let l = mine[rng.below(mine.len() as u64) as usize];
                        let other = StreamId(rng.below(STREAMS));
                        alloc
                            .record_stream(l.ptr, other)
                            .unwrap_or_else(|e| panic!("{ctx}: record_stream: {e}"));
                        counters.records.fetch_add(1, Ordering::Relaxed);
                    } else if dice < 990 {
                        match alloc.empty_cache() {
                            Ok(()) => {}
                            Err(e) if is_oom(&e) => {}
                            Err(e) => panic!("{ctx}: empty_cache: {e}"),
                        }
                        counters.empty_caches.fetch_add(1, Ordering::Relaxed);
                    } else {
                        // Readers racing the writers.
                        let s = alloc.stats();
                        assert!(s.allocated_bytes.peak >= s.allocated_bytes.current, "{ctx}");
                        let _ = alloc.snapshot();
                    }
                }
                // Quiescent point: everyone stops, one checks.
                if barrier.wait().is_leader() {
                    backend.quiescent_check(alloc.as_ref(), &format!("{ctx}, round {round}"));
                    counters.checkpoints.fetch_add(1, Ordering::Relaxed);
                }
                barrier.wait();
            }
            for l in mine {
                backend.check(l.ptr, l.size, l.byte, &ctx);
                alloc
                    .free(l.ptr)
                    .unwrap_or_else(|e| panic!("{ctx}: final free: {e}"));
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    for l in mailbox.lock().unwrap().drain(..) {
        backend.check(l.ptr, l.size, l.byte, &ctx);
        alloc.free(l.ptr).unwrap();
    }
    backend.quiescent_check(alloc.as_ref(), &format!("{ctx}, end"));
    let s = alloc.stats();
    assert_eq!(s.allocation.current, 0, "{ctx}: allocations left");
    assert_eq!(s.allocated_bytes.current, 0, "{ctx}: bytes left");
    counters
}

/// Run `f` on a thread and fail if it has not finished within `DEADLINE`.
fn with_watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let out = f();
        let _ = tx.send(());
        out
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(()) => worker.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            // The worker panicked: re-raise its panic here.
            match worker.join() {
                Ok(out) => out,
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!(
                "{what}: not finished after {DEADLINE:?}: a deadlock, or a worker that \
                 panicked (see above) while the others wait at a barrier"
            )
        }
    }
}

fn stress_backend(make: fn() -> Backend, ops_per_thread: usize) {
    let mut total_ops = 0;
    for (i, name) in ALLOCATOR_NAMES.into_iter().enumerate() {
        let backend = make();
        let alloc: Arc<dyn DeviceAllocator> = match allocators::build(name, backend.vmm()) {
            Ok(a) => Arc::from(a),
            Err(RegistryError::Construct { source, .. }) => panic!("{name}: {source}"),
            Err(other) => {
                eprintln!("stress: {other}: skipped");
                continue;
            }
        };
        let what = format!("{name} on {}", backend.name());
        let b = backend.clone();
        let counters = with_watchdog(&what, move || {
            let c = stress_run(alloc.clone(), b, ops_per_thread, 0x5EED + i as u64);
            alloc.empty_cache().unwrap();
            alloc.check_invariants().unwrap();
            drop(alloc);
            c
        });
        let leaks = backend.leak_report();
        assert!(leaks.is_empty(), "{what}: after drop: {leaks}");
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        eprintln!(
            "stress: {what:<18} {THREADS} threads, {STREAMS} streams: {} ops ({} allocs, {} frees, \
             {} cross-thread frees, {} record_stream, {} empty_cache, {} OOMs), {} quiescent checks",
            get(&counters.ops),
            get(&counters.allocs),
            get(&counters.frees),
            get(&counters.cross_thread_frees),
            get(&counters.records),
            get(&counters.empty_caches),
            get(&counters.ooms),
            get(&counters.checkpoints),
        );
        assert!(
            get(&counters.allocs) > 0,
            "{what}: nothing was ever allocated"
        );
        total_ops += get(&counters.ops);
    }
    eprintln!("stress: {total_ops} operations in all");
}

#[test]
fn stress_every_allocator_on_the_simulated_backend() {
    stress_backend(
        || Backend::Sim(Arc::new(SimVmm::with_capacity(256 * MIB).unwrap())),
        12_500,
    );
}

#[test]
fn stress_every_allocator_on_the_host_backend() {
    stress_backend(
        || {
            Backend::Host(Arc::new(
                HostVmm::new(HostConfig {
                    capacity: 256 * MIB,
                    ..HostConfig::default()
                })
                .unwrap(),
            ))
        },
        5_000,
    );
}
