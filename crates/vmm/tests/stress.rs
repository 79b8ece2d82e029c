//! Concurrency stress of the driver layer: 8 threads on 4 streams call the VMM
//! operations of one backend (simulated, host) at once: reserve, create, map,
//! set-access, unmap, release (also while still mapped), address-free, the
//! event and stream calls, and calls that must be refused (mapping over a
//! mapping, unmapping a hole, freeing a reservation that still has mappings,
//! misaligned addresses).
//!
//! - Every `ROUND` operations per thread the threads meet at a barrier; at that
//!   quiescent point one thread checks that the backend's live handles,
//!   reservations and mappings are exactly what the threads hold, and the
//!   simulated backend's own invariants.
//! - On the host backend each mapping gets its own byte, written at the start
//!   of every granule and checked before it is unmapped.
//! - A watchdog fails the test if a run does not finish in time.
//! - At the end every thread gives everything back: the leak report is empty.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::time::Duration;

use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, LeakReport, PhysHandle, StreamId, Vmm, VmmError};

const MIB: u64 = 1 << 20;
const THREADS: usize = 8;
const STREAMS: u64 = 4;
const ROUND: usize = 500;
/// Granules in each thread's reservation.
const SLOTS: u64 = 24;
const DEADLINE: Duration = Duration::from_secs(300);

#[derive(Clone)]
enum Backend {
    Sim(Arc<SimVmm>),
    Host(Arc<HostVmm>),
}

impl Backend {
    fn vmm(&self) -> &dyn Vmm {
        match self {
            Backend::Sim(s) => s.as_ref(),
            Backend::Host(h) => h.as_ref(),
        }
    }

    fn leak_report(&self) -> LeakReport {
        match self {
            Backend::Sim(s) => s.leak_report(),
            Backend::Host(h) => h.leak_report(),
        }
    }

    fn stamp(&self, ptr: DevicePtr, granules: u64, gran: u64, byte: u8) {
        if let Backend::Host(h) = self {
            for g in 0..granules {
                h.fill(ptr + g * gran, 4096, byte).unwrap();
            }
        }
    }

    fn check_stamp(&self, ptr: DevicePtr, granules: u64, gran: u64, byte: u8, ctx: &str) {
        if let Backend::Host(h) = self {
            for g in 0..granules {
                assert!(
                    h.check_filled(ptr + g * gran, 4096, byte).unwrap(),
                    "{ctx}: mapping {ptr:#x} granule {g} lost its byte {byte:#x}"
                );
            }
        }
    }
}

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

/// A mapping a thread holds.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    slot: u64,
    granules: u64,
    handle: PhysHandle,
    /// The handle was released while mapped: its memory goes at the unmap.
    released: bool,
    byte: u8,
}

/// What every thread holds, summed at quiescent points, and the counters.
#[derive(Default)]
struct Shared {
    handles: AtomicI64,
    reservations: AtomicI64,
    mappings: AtomicI64,
    events: AtomicI64,
    ops: AtomicU64,
    maps: AtomicU64,
    ooms: AtomicU64,
    refused: AtomicU64,
    event_calls: AtomicU64,
    checkpoints: AtomicU64,
}

/// One thread's work.
struct Worker {
    backend: Backend,
    shared: Arc<Shared>,
    rng: Rng,
    stream: StreamId,
    gran: u64,
    base: DevicePtr,
    /// Which granule of the reservation each mapping starts at (`None`: free).
    mappings: Vec<Mapping>,
    serial: u8,
    ctx: String,
}

impl Worker {
    fn used(&self, slot: u64) -> bool {
        self.mappings
            .iter()
            .any(|m| m.slot <= slot && slot < m.slot + m.granules)
    }

    /// A free run of `n` granules, if any.
    fn free_run(&mut self, n: u64) -> Option<u64> {
        let start = self.rng.below(SLOTS);
        (0..SLOTS)
            .map(|i| (start + i) % SLOTS)
            .find(|&s| s + n <= SLOTS && (s..s + n).all(|g| !self.used(g)))
    }

    fn map_one(&mut self) {
        let n = 1 + self.rng.below(3);
        let Some(slot) = self.free_run(n) else {
            return;
        };
        let backend = self.backend.clone();
        let vmm = backend.vmm();
        // A handle of n granules, mapped whole (CUDA's rule).
        let handle = match vmm.create(n * self.gran) {
            Ok(h) => h,
            Err(e) if e.is_out_of_memory() => {
                self.shared.ooms.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(e) => panic!("{}: create: {e}", self.ctx),
        };
        let ptr = self.base + slot * self.gran;
        let size = n * self.gran;
        vmm.map(ptr, size, handle, 0)
            .unwrap_or_else(|e| panic!("{}: map: {e}", self.ctx));
        vmm.set_access(ptr, size)
            .unwrap_or_else(|e| panic!("{}: set_access: {e}", self.ctx));
        self.serial = self.serial.wrapping_add(1);
        let byte = self.serial | 1;
        self.backend.stamp(ptr, n, self.gran, byte);
        let released = self.rng.below(3) == 0;
        if released {
            vmm.release(handle).unwrap();
        } else {
            self.shared.handles.fetch_add(1, Ordering::Relaxed);
        }
        self.shared.mappings.fetch_add(1, Ordering::Relaxed);
        self.shared.maps.fetch_add(1, Ordering::Relaxed);
        self.mappings.push(Mapping {
            slot,
            granules: n,
            handle,
            released,
            byte,
        });
    }

    fn unmap_one(&mut self) {
        if self.mappings.is_empty() {
            return;
        }
        let i = self.rng.below(self.mappings.len() as u64) as usize;
        let m = self.mappings.swap_remove(i);
        let ptr = self.base + m.slot * self.gran;
        self.backend
            .check_stamp(ptr, m.granules, self.gran, m.byte, &self.ctx);
        let vmm = self.backend.vmm();
        vmm.unmap(ptr, m.granules * self.gran)
            .unwrap_or_else(|e| panic!("{}: unmap: {e}", self.ctx));
        self.shared.mappings.fetch_sub(1, Ordering::Relaxed);
        if !m.released {
            vmm.release(m.handle).unwrap();
            self.shared.handles.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A call the driver must refuse, with nothing changed.
    fn refused_call(&mut self) {
        let vmm = self.backend.vmm();
        let gran = self.gran;
        let result: Result<(), VmmError> = match self.rng.below(4) {
            0 if !self.mappings.is_empty() => {
                // Map over an existing mapping.
                let m = self.mappings[0];
                let Ok(h) = vmm.create(gran) else {
                    return;
                };
                let r = vmm.map(self.base + m.slot * gran, gran, h, 0);
                vmm.release(h).unwrap();
                r
            }
            1 => {
                // Unmap a granule that no mapping covers.
                match (0..SLOTS).find(|&s| !self.used(s)) {
                    Some(s) => vmm.unmap(self.base + s * gran, gran),
                    None => return,
                }
            }
            2 if !self.mappings.is_empty() => vmm.address_free(self.base, SLOTS * gran),
            _ => vmm.map(self.base + 512, gran, PhysHandle(u64::MAX), 0),
        };
        assert!(result.is_err(), "{}: a bad call succeeded", self.ctx);
        self.shared.refused.fetch_add(1, Ordering::Relaxed);
    }

    fn events(&mut self) {
        let vmm = self.backend.vmm();
        let other = StreamId(self.rng.below(STREAMS));
        let ev = vmm.event_record(self.stream).unwrap();
        let _done: bool = vmm.event_query(ev).unwrap();
        vmm.stream_wait_event(other, ev).unwrap();
        if self.rng.below(4) == 0 {
            vmm.stream_synchronize(self.stream).unwrap();
            assert!(
                vmm.event_query(ev).unwrap(),
                "{}: sync left the event pending",
                self.ctx
            );
        }
        vmm.event_destroy(ev).unwrap();
        let info = vmm.mem_info().unwrap();
        assert!(info.free <= info.total, "{}: {info:?}", self.ctx);
        self.shared.event_calls.fetch_add(1, Ordering::Relaxed);
    }

    fn step(&mut self) {
        self.shared.ops.fetch_add(1, Ordering::Relaxed);
        match self.rng.below(100) {
            0..=44 => self.map_one(),
            45..=84 => self.unmap_one(),
            85..=92 => self.refused_call(),
            _ => self.events(),
        }
    }

    fn finish(mut self) {
        while !self.mappings.is_empty() {
            self.unmap_one();
        }
        self.backend
            .vmm()
            .address_free(self.base, SLOTS * self.gran)
            .unwrap();
        self.shared.reservations.fetch_sub(1, Ordering::Relaxed);
    }
}

fn quiescent_check(backend: &Backend, shared: &Shared, ctx: &str) {
    let report = backend.leak_report();
    let get = |a: &AtomicI64| a.load(Ordering::Relaxed) as usize;
    // Released-but-mapped handles stay alive until their unmap.
    assert!(
        report.handles.len() >= get(&shared.handles),
        "{ctx}: {} live handles, threads hold {}",
        report.handles.len(),
        get(&shared.handles)
    );
    assert!(
        report.handles.len() <= get(&shared.handles) + get(&shared.mappings),
        "{ctx}: {} live handles for {} held and {} mappings",
        report.handles.len(),
        get(&shared.handles),
        get(&shared.mappings)
    );
    assert_eq!(
        report.reservations.len(),
        get(&shared.reservations),
        "{ctx}: reservations"
    );
    assert_eq!(
        report.mappings.len(),
        get(&shared.mappings),
        "{ctx}: mappings"
    );
    assert_eq!(report.events, get(&shared.events), "{ctx}: events");
    if let Backend::Sim(s) = backend {
        s.check_invariants()
            .unwrap_or_else(|v| panic!("{ctx}: {v}"));
    }
}

fn run(backend: Backend, ops_per_thread: usize) -> Arc<Shared> {
    let shared = Arc::new(Shared::default());
    let barrier = Arc::new(Barrier::new(THREADS));
    let gran = backend.vmm().granularity();
    let rounds = ops_per_thread.div_ceil(ROUND);
    let mut threads = Vec::new();
    for t in 0..THREADS {
        let backend = backend.clone();
        let shared = shared.clone();
        let barrier = barrier.clone();
        threads.push(std::thread::spawn(move || {
            let base = backend.vmm().reserve(SLOTS * gran, 0).unwrap();
            shared.reservations.fetch_add(1, Ordering::Relaxed);
            let mut w = Worker {
                backend: backend.clone(),
                shared: shared.clone(),
                rng: Rng(0xC0FFEE ^ (t as u64 + 1).wrapping_mul(0x2545_F491_4F6C_DD1D)),
                stream: StreamId(t as u64 % STREAMS),
                gran,
                base,
                mappings: Vec::new(),
                serial: (t as u8) << 4,
                ctx: format!("{} thread {t}", backend.vmm().backend_name()),
            };
            barrier.wait();
            for round in 0..rounds {
                for _ in 0..ROUND {
                    w.step();
                }
                if barrier.wait().is_leader() {
                    quiescent_check(&backend, &shared, &format!("{}, round {round}", w.ctx));
                    shared.checkpoints.fetch_add(1, Ordering::Relaxed);
                }
                barrier.wait();
            }
            w.finish();
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
    shared
}

fn with_watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let out = f();
        let _ = tx.send(());
        out
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(()) => worker.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Ok(out) => out,
            Err(p) => std::panic::resume_unwind(p),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!(
                "{what}: not finished after {DEADLINE:?}: a deadlock, or a worker that \
                 panicked (see above) while the others wait at a barrier"
            )
        }
    }
}

fn stress(backend: Backend, ops_per_thread: usize) {
    let name = backend.vmm().backend_name();
    let b = backend.clone();
    let shared = with_watchdog(name, move || run(b, ops_per_thread));
    let leaks = backend.leak_report();
    assert!(leaks.is_empty(), "{name}: at the end: {leaks}");
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    eprintln!(
        "vmm stress: {name:<9} {THREADS} threads, {STREAMS} streams: {} ops ({} maps, {} create OOMs, \
         {} refused bad calls, {} event rounds), {} quiescent checks",
        get(&shared.ops),
        get(&shared.maps),
        get(&shared.ooms),
        get(&shared.refused),
        get(&shared.event_calls),
        get(&shared.checkpoints)
    );
    assert!(get(&shared.maps) > 0);
}

#[test]
fn stress_simulated_backend() {
    // 128 MiB: 64 granules for 8 threads of up to 24 each, so creates run out.
    stress(
        Backend::Sim(Arc::new(SimVmm::with_capacity(128 * MIB).unwrap())),
        60_000,
    );
}

#[test]
fn stress_host_backend() {
    stress(
        Backend::Host(Arc::new(
            HostVmm::new(HostConfig {
                capacity: 256 * MIB,
                ..HostConfig::default()
            })
            .unwrap(),
        )),
        20_000,
    );
}
