//! The conformance suite: one set of checks of the [`Vmm`] trait's rules, run
//! against every backend available here.
//!
//! - simulated: always;
//! - host: always on Linux (64 MiB capacity, 2 MiB granularity);
//! - CUDA: device 0, in two tests of their own
//!   (`cuda_backend_passes_the_shared_checks` runs every shared check on it,
//!   `cuda_agrees_with_the_simulated_one` the differential check), over the
//!   CUDA double (`quilt-cuda-double`, in a child process, with the host
//!   backend's capacity and granularity); on a GPU machine
//!   `QUILT_CUDA_TESTS=real` runs them on the real driver
//!   (`scripts/gpu-check.sh` does), where a missing device is a failure.
//!
//! Every check takes a [`Backend`] and uses only the trait, so a backend passes
//! exactly when it follows the same rules with the same typed errors. The
//! shared checks run under CUDA's documented map rule ([`MapRule::WholeHandle`]:
//! a mapping covers its handle whole, at offset 0), the default of every
//! backend; the checks about mapping parts of a handle run on the simulated and
//! host backends built with [`MapRule::AnyOffset`] (`each_relaxed_backend`),
//! never on CUDA, whose reference says the offset "currently must be zero". On CUDA
//! only the default stream is used (stream ids there are raw `CUstream`s), and
//! capacity is never exhausted for real (a request larger than the device is
//! asked for instead). Checks specific to the simulated backend (leak report,
//! fault injection, cost model) follow at the end of the file.

// Test code: a failed expectation is a panic (clippy's test allowance covers
// only `#[test]` functions, not the helpers here).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt::Debug;
use std::sync::Arc;

use quilt_vmm::sim::{CostModel, Fault, FaultTrigger, SimConfig, SimVmm};
use quilt_vmm::{CallKind, DevicePtr, MapRule, PhysHandle, StreamId, Vmm, VmmError};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Capacity of the simulated and host backends in the shared checks.
const SMALL_CAPACITY: u64 = 64 * MIB;

/// Granularity of the simulated and host backends in the shared checks.
const SMALL_GRANULARITY: u64 = 2 * MIB;

/// One backend under test.
struct Backend {
    vmm: Arc<dyn Vmm>,
    /// The capacity, where it is small enough to exhaust in a test.
    exhaustible: Option<u64>,
}

impl Backend {
    fn name(&self) -> &'static str {
        self.vmm.backend_name()
    }
}

/// Proptest's configuration with `cases` cases, unless `PROPTEST_CASES` says
/// otherwise (an explicit case count would override the variable, and the GPU
/// check bounds it); `PROPTEST_MAX_SHRINK_ITERS` and the rest come from the
/// environment as usual.
fn proptest_config(cases: u32) -> proptest::prelude::ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    proptest::prelude::ProptestConfig {
        cases,
        ..proptest::prelude::ProptestConfig::default()
    }
}

fn sim_backend() -> Backend {
    sim_backend_with(MapRule::WholeHandle)
}

fn sim_backend_with(map_rule: MapRule) -> Backend {
    let config = SimConfig {
        capacity: SMALL_CAPACITY,
        granularity: SMALL_GRANULARITY,
        map_rule,
        ..SimConfig::default()
    };
    Backend {
        vmm: Arc::new(SimVmm::new(config).unwrap()),
        exhaustible: Some(SMALL_CAPACITY),
    }
}

fn host_backend() -> Option<Backend> {
    host_backend_with(MapRule::WholeHandle)
}

#[cfg(target_os = "linux")]
fn host_backend_with(map_rule: MapRule) -> Option<Backend> {
    let vmm = quilt_vmm::host::HostVmm::with_map_rule(
        quilt_vmm::host::HostConfig {
            granularity: SMALL_GRANULARITY,
            capacity: SMALL_CAPACITY,
        },
        map_rule,
    )
    .expect("the host backend constructs on Linux");
    Some(Backend {
        vmm: Arc::new(vmm),
        exhaustible: Some(SMALL_CAPACITY),
    })
}

#[cfg(not(target_os = "linux"))]
fn host_backend_with(_map_rule: MapRule) -> Option<Backend> {
    eprintln!("conformance: host backend skipped: not Linux");
    None
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend() -> Backend {
    panic!("the CUDA checks need the `cuda` feature");
}

/// The CUDA backend on device 0: over the CUDA double (a child process the
/// CUDA tests start, with the host backend's capacity and granularity, so
/// exhaustion is exact), or on a real GPU with `QUILT_CUDA_TESTS=real`. A
/// missing device fails the test.
#[cfg(feature = "cuda")]
fn cuda_backend() -> Backend {
    match quilt_vmm::cuda::CudaVmm::new(0) {
        Ok(vmm) => Backend {
            vmm: Arc::new(vmm),
            exhaustible: quilt_cuda_double::harness::active().then_some(SMALL_CAPACITY),
        },
        Err(error) => panic!("the CUDA checks need CUDA device 0: {error}"),
    }
}

thread_local! {
    /// Set by `cuda_backend_passes_the_shared_checks` on its thread:
    /// [`backends`] is then the CUDA backend alone.
    static CUDA_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The backends of the shared checks: simulated and host, or, in the CUDA
/// test, CUDA alone.
fn backends() -> Vec<Backend> {
    if CUDA_ONLY.with(|c| c.get()) {
        return vec![cuda_backend()];
    }
    let mut out = vec![sim_backend()];
    out.extend(host_backend());
    out
}

/// The double's rules for the CUDA tests: the host backend's capacity and
/// granularity.
fn double_rules() -> [(&'static str, String); 2] {
    [
        ("QUILT_CUDA_DOUBLE_MEMORY", SMALL_CAPACITY.to_string()),
        (
            "QUILT_CUDA_DOUBLE_GRANULARITY",
            SMALL_GRANULARITY.to_string(),
        ),
    ]
}

/// Runs the calling test over the CUDA double with [`double_rules`]; true
/// where its body is to run here.
fn over_the_double() -> bool {
    let rules = double_rules();
    let vars: Vec<(&str, &str)> = rules.iter().map(|(k, v)| (*k, v.as_str())).collect();
    quilt_cuda_double::harness::rerun_over_double_with(&vars)
}

/// Every shared check, on CUDA device 0 (over the CUDA double; on a GPU
/// with `QUILT_CUDA_TESTS=real`).
#[test]
fn cuda_backend_passes_the_shared_checks() {
    if !over_the_double() {
        return;
    }
    CUDA_ONLY.with(|c| c.set(true));
    let checks: [(&str, fn()); 19] = [
        (
            "granularity_is_a_power_of_two",
            granularity_is_a_power_of_two,
        ),
        ("mem_info_reports_capacity", mem_info_reports_capacity),
        (
            "reserve_rejects_bad_sizes_and_alignments",
            reserve_rejects_bad_sizes_and_alignments,
        ),
        (
            "reservations_are_aligned_and_disjoint_and_free_whole",
            reservations_are_aligned_and_disjoint_and_free_whole,
        ),
        (
            "address_free_while_mapped_is_rejected",
            address_free_while_mapped_is_rejected,
        ),
        ("create_rejects_bad_sizes", create_rejects_bad_sizes),
        (
            "create_and_release_move_free_memory",
            create_and_release_move_free_memory,
        ),
        (
            "exhausting_capacity_is_out_of_memory_with_the_size_asked",
            exhausting_capacity_is_out_of_memory_with_the_size_asked,
        ),
        ("map_rejects_bad_arguments", map_rejects_bad_arguments),
        (
            "map_refuses_an_offset_or_a_part_of_a_handle_by_default",
            map_refuses_an_offset_or_a_part_of_a_handle_by_default,
        ),
        (
            "map_over_a_mapping_is_already_mapped",
            map_over_a_mapping_is_already_mapped,
        ),
        (
            "stitch_whole_handles_and_unmap_neighbours_together",
            stitch_whole_handles_and_unmap_neighbours_together,
        ),
        (
            "unmap_rejects_bad_arguments_holes_and_partial_mappings",
            unmap_rejects_bad_arguments_holes_and_partial_mappings,
        ),
        (
            "set_access_needs_a_fully_mapped_range",
            set_access_needs_a_fully_mapped_range,
        ),
        (
            "release_while_mapped_keeps_memory_until_the_last_unmap",
            release_while_mapped_keeps_memory_until_the_last_unmap,
        ),
        (
            "events_record_query_synchronize_destroy",
            events_record_query_synchronize_destroy,
        ),
        (
            "events_reject_unknown_and_destroyed_events",
            events_reject_unknown_and_destroyed_events,
        ),
        (
            "every_call_is_counted_and_failures_apart",
            every_call_is_counted_and_failures_apart,
        ),
        ("threads_share_one_backend", threads_share_one_backend),
    ];
    for (name, check) in checks {
        eprintln!("conformance on CUDA: {name}");
        check();
    }
}

/// Runs `check` against every backend (CUDA's map rule), with the backend's
/// trait object and granularity.
fn each_backend(check: impl Fn(&Backend, &dyn Vmm, u64)) {
    for backend in backends() {
        eprintln!("conformance: {}", backend.name());
        assert_eq!(
            backend.vmm.map_rule(),
            MapRule::WholeHandle,
            "{}",
            backend.name()
        );
        check(&backend, &*backend.vmm, backend.vmm.granularity());
    }
}

/// Runs `check` against the simulated and host backends built with the
/// relaxed map rule ([`MapRule::AnyOffset`]; never CUDA).
fn each_relaxed_backend(check: impl Fn(&Backend, &dyn Vmm, u64)) {
    let mut relaxed = vec![sim_backend_with(MapRule::AnyOffset)];
    relaxed.extend(host_backend_with(MapRule::AnyOffset));
    for backend in relaxed {
        eprintln!("conformance: {} (map rule any-offset)", backend.name());
        assert_eq!(
            backend.vmm.map_rule(),
            MapRule::AnyOffset,
            "{}",
            backend.name()
        );
        check(&backend, &*backend.vmm, backend.vmm.granularity());
    }
}

#[track_caller]
fn assert_invalid<T: Debug>(
    backend: &Backend,
    result: quilt_vmm::Result<T>,
    call: CallKind,
    argument: &str,
) {
    match result {
        Err(VmmError::InvalidArgument {
            call: c,
            argument: a,
            ..
        }) if c == call && a == argument => {}
        other => panic!(
            "{}: expected InvalidArgument {{ call: {call:?}, argument: {argument:?} }}, got {other:?}",
            backend.name()
        ),
    }
}

#[track_caller]
fn assert_not_mapped<T: Debug>(backend: &Backend, result: quilt_vmm::Result<T>, call: CallKind) {
    match result {
        Err(VmmError::NotMapped { call: c, .. }) if c == call => {}
        other => panic!(
            "{}: expected NotMapped {{ call: {call:?} }}, got {other:?}",
            backend.name()
        ),
    }
}

#[track_caller]
fn assert_already_mapped<T: Debug>(backend: &Backend, result: quilt_vmm::Result<T>) {
    match result {
        Err(VmmError::AlreadyMapped {
            call: CallKind::Map,
            ..
        }) => {}
        other => panic!(
            "{}: expected AlreadyMapped from cuMemMap, got {other:?}",
            backend.name()
        ),
    }
}

#[track_caller]
fn assert_still_mapped(
    backend: &Backend,
    result: quilt_vmm::Result<()>,
    va: DevicePtr,
    size: u64,
    mappings: usize,
) {
    match result {
        Err(VmmError::StillMapped {
            call: CallKind::AddressFree,
            ptr,
            size: s,
            mappings: m,
        }) if (ptr, s, m) == (va, size, mappings) => {}
        other => panic!(
            "{}: expected StillMapped {{ {va:#x}+{size:#x}, mappings: {mappings} }}, got {other:?}",
            backend.name()
        ),
    }
}

#[track_caller]
fn assert_out_of_memory<T: Debug>(
    backend: &str,
    result: quilt_vmm::Result<T>,
    call: CallKind,
    requested: u64,
    available: u64,
) {
    match result {
        Err(VmmError::OutOfMemory {
            call: c,
            requested: r,
            available: a,
        }) => assert_eq!((c, r, a), (call, requested, available), "{backend}"),
        other => panic!("{backend}: expected OutOfMemory from {call}, got {other:?}"),
    }
}

fn free_bytes(v: &dyn Vmm) -> u64 {
    v.mem_info().unwrap().free
}

/// Reserves `reserve` bytes and creates a handle of `size` bytes.
fn reserve_and_create(v: &dyn Vmm, reserve: u64, size: u64) -> (DevicePtr, PhysHandle) {
    (v.reserve(reserve, 0).unwrap(), v.create(size).unwrap())
}

/// Undoes [`reserve_and_create`] (with nothing left mapped).
fn release_and_free(v: &dyn Vmm, va: DevicePtr, reserve: u64, h: PhysHandle) {
    v.release(h).unwrap();
    v.address_free(va, reserve).unwrap();
}

/// Reserves `reserve` bytes, creates `size` bytes and maps them at the start
/// of the reservation; returns (reservation, handle).
fn mapped(v: &dyn Vmm, reserve: u64, size: u64) -> (DevicePtr, PhysHandle) {
    let (va, h) = reserve_and_create(v, reserve, size);
    v.map(va, size, h, 0).unwrap();
    (va, h)
}

/// Undoes [`mapped`]: unmaps `size` bytes at `va`, releases, frees.
fn unmapped(v: &dyn Vmm, va: DevicePtr, reserve: u64, h: PhysHandle, size: u64) {
    v.unmap(va, size).unwrap();
    release_and_free(v, va, reserve, h);
}

// ---------------------------------------------------------------- properties

#[test]
fn granularity_is_a_power_of_two() {
    each_backend(|b, v, g| {
        assert!(g.is_power_of_two(), "{}: granularity {g:#x}", b.name());
        assert_eq!(v.granularity(), g, "{}: granularity is fixed", b.name());
    });
}

#[test]
fn mem_info_reports_capacity() {
    each_backend(|b, v, _| {
        let info = v.mem_info().unwrap();
        assert!(info.free <= info.total, "{}: {info:?}", b.name());
        assert!(info.total > 0, "{}: {info:?}", b.name());
        if let Some(capacity) = b.exhaustible {
            assert_eq!(info.total, capacity, "{}", b.name());
            assert_eq!(info.free, capacity, "{}: nothing created yet", b.name());
        }
    });
}

// ---------------------------------------------------------------- reserve / free

#[test]
fn reserve_rejects_bad_sizes_and_alignments() {
    each_backend(|b, v, g| {
        assert_invalid(b, v.reserve(0, 0), CallKind::Reserve, "size");
        assert_invalid(b, v.reserve(g / 2, 0), CallKind::Reserve, "size");
        assert_invalid(b, v.reserve(g + 4096, 0), CallKind::Reserve, "size");
        assert_invalid(b, v.reserve(g, g / 2), CallKind::Reserve, "alignment");
        assert_invalid(b, v.reserve(g, g + g / 2), CallKind::Reserve, "alignment");
        assert_invalid(b, v.reserve(g, 4096), CallKind::Reserve, "alignment");
    });
}

#[test]
fn reservations_are_aligned_and_disjoint_and_free_whole() {
    each_backend(|b, v, g| {
        let a = v.reserve(4 * g, 0).unwrap();
        let c = v.reserve(2 * g, 8 * g).unwrap();
        let d = v.reserve(g, 0).unwrap();
        for (p, size) in [(a, 4 * g), (c, 2 * g), (d, g)] {
            assert_ne!(p, 0, "{}", b.name());
            assert_eq!(p % g, 0, "{}: {p:#x} not aligned", b.name());
            for (q, qsize) in [(a, 4 * g), (c, 2 * g), (d, g)] {
                if p != q {
                    assert!(
                        p + size <= q || q + qsize <= p,
                        "{}: {p:#x}+{size:#x} overlaps {q:#x}+{qsize:#x}",
                        b.name()
                    );
                }
            }
        }
        assert_eq!(c % (8 * g), 0, "{}: {c:#x} not 8-granule aligned", b.name());

        // address_free names a whole reservation exactly.
        assert_invalid(b, v.address_free(a, 2 * g), CallKind::AddressFree, "size");
        assert_invalid(b, v.address_free(a, 8 * g), CallKind::AddressFree, "size");
        assert_not_mapped(b, v.address_free(a + g, 3 * g), CallKind::AddressFree);
        assert_not_mapped(b, v.address_free(0, g), CallKind::AddressFree);
        v.address_free(a, 4 * g).unwrap();
        assert_not_mapped(b, v.address_free(a, 4 * g), CallKind::AddressFree);
        v.address_free(c, 2 * g).unwrap();
        v.address_free(d, g).unwrap();
    });
}

#[test]
fn address_free_while_mapped_is_rejected() {
    each_backend(|b, v, g| {
        // One handle at two addresses.
        let (va, h) = reserve_and_create(v, 4 * g, g);
        v.map(va, g, h, 0).unwrap();
        v.map(va + 2 * g, g, h, 0).unwrap();
        assert_still_mapped(b, v.address_free(va, 4 * g), va, 4 * g, 2);
        v.unmap(va, g).unwrap();
        assert_still_mapped(b, v.address_free(va, 4 * g), va, 4 * g, 1);
        v.unmap(va + 2 * g, g).unwrap();
        v.address_free(va, 4 * g).unwrap();
        v.release(h).unwrap();
    });
}

// ---------------------------------------------------------------- create / release

#[test]
fn create_rejects_bad_sizes() {
    each_backend(|b, v, g| {
        assert_invalid(b, v.create(0), CallKind::Create, "size");
        assert_invalid(b, v.create(g / 2), CallKind::Create, "size");
        assert_invalid(b, v.create(3 * g + 512), CallKind::Create, "size");
    });
}

#[test]
fn create_and_release_move_free_memory() {
    each_backend(|b, v, g| {
        let h1 = v.create(g).unwrap();
        let h2 = v.create(3 * g).unwrap();
        assert_ne!(h1, h2, "{}: handles are distinct", b.name());
        if b.exhaustible.is_some() {
            // Exact figures where nothing else shares the device.
            let info = v.mem_info().unwrap();
            assert_eq!(info.total - info.free, 4 * g, "{}", b.name());
            v.release(h2).unwrap();
            assert_eq!(
                v.mem_info().unwrap().total - free_bytes(v),
                g,
                "{}",
                b.name()
            );
            v.release(h1).unwrap();
            assert_eq!(free_bytes(v), info.total, "{}", b.name());
        } else {
            v.release(h2).unwrap();
            v.release(h1).unwrap();
        }
        // Double release, and a handle never created.
        assert_invalid(b, v.release(h1), CallKind::Release, "handle");
        assert_invalid(
            b,
            v.release(PhysHandle(0xdead_beef)),
            CallKind::Release,
            "handle",
        );
    });
}

#[test]
fn exhausting_capacity_is_out_of_memory_with_the_size_asked() {
    each_backend(|b, v, g| {
        match b.exhaustible {
            Some(capacity) => {
                let half = capacity / 2 / g * g;
                let h1 = v.create(half).unwrap();
                let h2 = v.create(capacity - half).unwrap();
                assert_eq!(free_bytes(v), 0, "{}", b.name());
                assert_out_of_memory(b.name(), v.create(2 * g), CallKind::Create, 2 * g, 0);
                v.release(h1).unwrap();
                assert_out_of_memory(
                    b.name(),
                    v.create(capacity),
                    CallKind::Create,
                    capacity,
                    half,
                );
                // The failure changed nothing: what is free can still be created.
                let h3 = v.create(half).unwrap();
                v.release(h3).unwrap();
                v.release(h2).unwrap();
                assert_eq!(free_bytes(v), capacity, "{}", b.name());
            }
            None => {
                let total = v.mem_info().unwrap().total;
                let too_much = (total / g + 1) * g;
                let err = v.create(too_much).unwrap_err();
                assert!(err.is_out_of_memory(), "{}: {err}", b.name());
                if let VmmError::OutOfMemory { requested, .. } = err {
                    assert_eq!(requested, too_much, "{}", b.name());
                }
            }
        }
    });
}

// ---------------------------------------------------------------- map

#[test]
fn map_rejects_bad_arguments() {
    each_backend(|b, v, g| {
        let (va, h) = reserve_and_create(v, 4 * g, 2 * g);
        assert_invalid(b, v.map(0, g, h, 0), CallKind::Map, "ptr");
        assert_invalid(b, v.map(va + 4096, g, h, 0), CallKind::Map, "ptr");
        assert_invalid(b, v.map(va, 0, h, 0), CallKind::Map, "size");
        assert_invalid(b, v.map(va, g / 2, h, 0), CallKind::Map, "size");
        assert_invalid(b, v.map(va, g, h, 4096), CallKind::Map, "offset");
        // offset + size beyond the handle.
        assert_invalid(b, v.map(va, 3 * g, h, 0), CallKind::Map, "offset");
        assert_invalid(b, v.map(va, g, h, 2 * g), CallKind::Map, "offset");
        assert_invalid(b, v.map(va, 2 * g, h, g), CallKind::Map, "offset");
        assert_invalid(
            b,
            v.map(va, g, h, u64::MAX - g + 1),
            CallKind::Map,
            "offset",
        );
        // An unknown handle.
        assert_invalid(
            b,
            v.map(va, g, PhysHandle(0xdead_beef), 0),
            CallKind::Map,
            "handle",
        );
        // Outside the reservation: past its end, straddling its end, before it.
        assert_invalid(b, v.map(va + 4 * g, 2 * g, h, 0), CallKind::Map, "ptr");
        assert_invalid(b, v.map(va + 3 * g, 2 * g, h, 0), CallKind::Map, "ptr");
        assert_invalid(b, v.map(va - g, 2 * g, h, 0), CallKind::Map, "ptr");
        // No failed map left anything behind: the whole range maps now.
        v.map(va, 2 * g, h, 0).unwrap();
        unmapped(v, va, 4 * g, h, 2 * g);
        // Outside any reservation at all (the one just freed).
        let h = v.create(g).unwrap();
        assert_invalid(b, v.map(va, g, h, 0), CallKind::Map, "ptr");
        v.release(h).unwrap();
    });
}

#[test]
fn map_refuses_an_offset_or_a_part_of_a_handle_by_default() {
    each_backend(|b, v, g| {
        let (va, h) = reserve_and_create(v, 4 * g, 2 * g);
        // One granule into a two-granule handle: CUDA's offset rule.
        match v.map(va, g, h, g) {
            Err(VmmError::InvalidArgument {
                call: CallKind::Map,
                argument: "offset",
                value,
                rule,
            }) => {
                assert_eq!(value, g, "{}", b.name());
                assert!(
                    rule.contains("currently must be zero"),
                    "{}: {rule}",
                    b.name()
                );
            }
            other => panic!("{}: expected the offset rule, got {other:?}", b.name()),
        }
        // A prefix (its first granule) of a two-granule handle.
        match v.map(va, g, h, 0) {
            Err(VmmError::InvalidArgument {
                call: CallKind::Map,
                argument: "size",
                value,
                rule,
            }) => {
                assert_eq!(value, g, "{}", b.name());
                assert!(
                    rule.contains("covers its handle whole"),
                    "{}: {rule}",
                    b.name()
                );
            }
            other => panic!(
                "{}: expected the whole-handle rule, got {other:?}",
                b.name()
            ),
        }
        // Its second granule, and the handle whole but at a granule's offset.
        assert_invalid(b, v.map(va + g, g, h, g), CallKind::Map, "offset");
        assert_invalid(b, v.map(va, 2 * g, h, g), CallKind::Map, "offset");
        // Nothing was mapped: the whole handle maps at offset 0.
        v.map(va + 2 * g, 2 * g, h, 0).unwrap();
        v.set_access(va + 2 * g, 2 * g).unwrap();
        v.unmap(va + 2 * g, 2 * g).unwrap();
        release_and_free(v, va, 4 * g, h);
    });
}

#[test]
fn relaxed_rule_maps_any_granule_aligned_part_of_a_handle() {
    each_relaxed_backend(|b, v, g| {
        let (va, h) = reserve_and_create(v, 4 * g, 2 * g);
        // One granule in, and a prefix: both accepted under the relaxed rule.
        v.map(va, g, h, g).unwrap();
        v.map(va + g, g, h, 0).unwrap();
        // The rules every backend keeps still hold.
        assert_invalid(b, v.map(va + 2 * g, g, h, 4096), CallKind::Map, "offset");
        assert_invalid(b, v.map(va + 2 * g, 2 * g, h, g), CallKind::Map, "offset");
        v.set_access(va, 2 * g).unwrap();
        v.unmap(va, 2 * g).unwrap();
        release_and_free(v, va, 4 * g, h);
    });
}

#[test]
fn map_over_a_mapping_is_already_mapped() {
    each_backend(|b, v, g| {
        let va = v.reserve(8 * g, 0).unwrap();
        let (h1, h2, h4) = (
            v.create(g).unwrap(),
            v.create(2 * g).unwrap(),
            v.create(4 * g).unwrap(),
        );
        v.map(va + 2 * g, 2 * g, h2, 0).unwrap();
        // The same range, its start, its end, inside it, around it.
        assert_already_mapped(b, v.map(va + 2 * g, 2 * g, h2, 0));
        assert_already_mapped(b, v.map(va + g, 2 * g, h2, 0));
        assert_already_mapped(b, v.map(va + 3 * g, 2 * g, h2, 0));
        assert_already_mapped(b, v.map(va + 3 * g, g, h1, 0));
        assert_already_mapped(b, v.map(va + g, 4 * g, h4, 0));
        // Right next to it on both sides is fine; the same physical pages may be
        // mapped at several addresses.
        v.map(va + g, g, h1, 0).unwrap();
        v.map(va + 4 * g, 2 * g, h2, 0).unwrap();
        v.unmap(va + g, g).unwrap();
        v.unmap(va + 2 * g, 2 * g).unwrap();
        v.unmap(va + 4 * g, 2 * g).unwrap();
        for h in [h1, h2, h4] {
            v.release(h).unwrap();
        }
        v.address_free(va, 8 * g).unwrap();
    });
}

#[test]
fn stitch_whole_handles_and_unmap_neighbours_together() {
    each_backend(|b, v, g| {
        let va = v.reserve(6 * g, 0).unwrap();
        let h1 = v.create(g).unwrap();
        let h2 = v.create(2 * g).unwrap();
        let h3 = v.create(3 * g).unwrap();
        // Stitch: three handles, each whole, behind one range; one set-access.
        v.map(va, g, h1, 0).unwrap();
        v.map(va + g, 2 * g, h2, 0).unwrap();
        v.map(va + 3 * g, 3 * g, h3, 0).unwrap();
        v.set_access(va, 6 * g).unwrap();
        // Three neighbouring mappings go with one unmap.
        v.unmap(va, 6 * g).unwrap();
        assert_not_mapped(b, v.unmap(va, g), CallKind::Unmap);
        for h in [h1, h2, h3] {
            v.release(h).unwrap();
        }
        v.address_free(va, 6 * g).unwrap();
    });
}

#[test]
fn relaxed_rule_stitches_pages_of_handles_at_offsets() {
    each_relaxed_backend(|b, v, g| {
        let va = v.reserve(6 * g, 0).unwrap();
        let h1 = v.create(4 * g).unwrap();
        let h2 = v.create(2 * g).unwrap();
        // Stitch: pages of two handles, out of order, behind one range.
        v.map(va, g, h1, 3 * g).unwrap();
        v.map(va + g, 2 * g, h2, 0).unwrap();
        v.map(va + 3 * g, 3 * g, h1, 0).unwrap();
        v.set_access(va, 6 * g).unwrap();
        // Three neighbouring mappings go with one unmap.
        v.unmap(va, 6 * g).unwrap();
        assert_not_mapped(b, v.unmap(va, g), CallKind::Unmap);
        v.release(h1).unwrap();
        v.release(h2).unwrap();
        v.address_free(va, 6 * g).unwrap();
    });
}

// ---------------------------------------------------------------- unmap

#[test]
fn unmap_rejects_bad_arguments_holes_and_partial_mappings() {
    each_backend(|b, v, g| {
        // One two-granule handle at two addresses.
        let (va, h) = reserve_and_create(v, 8 * g, 2 * g);
        v.map(va, 2 * g, h, 0).unwrap();
        v.map(va + 4 * g, 2 * g, h, 0).unwrap();

        assert_invalid(b, v.unmap(va + 4096, g), CallKind::Unmap, "ptr");
        assert_invalid(b, v.unmap(va, 0), CallKind::Unmap, "size");
        assert_invalid(b, v.unmap(va, g + 4096), CallKind::Unmap, "size");
        // Part of a mapping: its first half, its second half.
        assert_invalid(b, v.unmap(va, g), CallKind::Unmap, "size");
        assert_invalid(b, v.unmap(va + g, g), CallKind::Unmap, "ptr");
        assert_invalid(b, v.unmap(va + g, 4 * g), CallKind::Unmap, "ptr");
        // A hole: nothing mapped there, or a mapping then a hole then a mapping.
        assert_not_mapped(b, v.unmap(va + 2 * g, 2 * g), CallKind::Unmap);
        assert_not_mapped(b, v.unmap(va, 6 * g), CallKind::Unmap);
        assert_not_mapped(b, v.unmap(va, 3 * g), CallKind::Unmap);
        assert_not_mapped(b, v.unmap(va + 6 * g, 2 * g), CallKind::Unmap);
        // Nothing changed: both mappings still there.
        assert_still_mapped(b, v.address_free(va, 8 * g), va, 8 * g, 2);
        v.unmap(va, 2 * g).unwrap();
        v.unmap(va + 4 * g, 2 * g).unwrap();
        assert_not_mapped(b, v.unmap(va, 2 * g), CallKind::Unmap);
        release_and_free(v, va, 8 * g, h);
    });
}

// ---------------------------------------------------------------- set access

#[test]
fn set_access_needs_a_fully_mapped_range() {
    each_backend(|b, v, g| {
        let (va, h) = reserve_and_create(v, 8 * g, 2 * g);
        let h1 = v.create(g).unwrap();
        assert_not_mapped(b, v.set_access(va, g), CallKind::SetAccess);
        v.map(va, 2 * g, h, 0).unwrap();
        v.map(va + 2 * g, g, h1, 0).unwrap();
        v.map(va + 4 * g, g, h1, 0).unwrap();
        assert_invalid(b, v.set_access(va + 4096, g), CallKind::SetAccess, "ptr");
        assert_invalid(b, v.set_access(va, 0), CallKind::SetAccess, "size");
        assert_invalid(b, v.set_access(va, g / 2), CallKind::SetAccess, "size");
        // A hole at va + 3g.
        assert_not_mapped(b, v.set_access(va, 5 * g), CallKind::SetAccess);
        assert_not_mapped(b, v.set_access(va + 3 * g, g), CallKind::SetAccess);
        assert_not_mapped(b, v.set_access(va + 4 * g, 2 * g), CallKind::SetAccess);
        // Several neighbouring mappings at once, and one alone.
        v.set_access(va, 3 * g).unwrap();
        v.set_access(va + 4 * g, g).unwrap();
        v.unmap(va, 3 * g).unwrap();
        v.unmap(va + 4 * g, g).unwrap();
        assert_not_mapped(b, v.set_access(va, g), CallKind::SetAccess);
        v.release(h1).unwrap();
        release_and_free(v, va, 8 * g, h);
    });
}

// ---------------------------------------------------------------- release while mapped

#[test]
fn release_while_mapped_keeps_memory_until_the_last_unmap() {
    each_backend(|b, v, g| {
        let (va, h) = reserve_and_create(v, 4 * g, 2 * g);
        v.map(va, 2 * g, h, 0).unwrap();
        v.map(va + 2 * g, 2 * g, h, 0).unwrap();
        let before = free_bytes(v);
        v.release(h).unwrap();
        if b.exhaustible.is_some() {
            assert_eq!(free_bytes(v), before, "{}: still mapped twice", b.name());
        }
        // A released handle cannot be mapped again, nor released again.
        assert_invalid(b, v.map(va + g, 2 * g, h, 0), CallKind::Map, "handle");
        assert_invalid(b, v.release(h), CallKind::Release, "handle");
        v.unmap(va, 2 * g).unwrap();
        if b.exhaustible.is_some() {
            assert_eq!(free_bytes(v), before, "{}: still mapped once", b.name());
        }
        v.unmap(va + 2 * g, 2 * g).unwrap();
        if b.exhaustible.is_some() {
            assert_eq!(
                free_bytes(v),
                before + 2 * g,
                "{}: freed at last unmap",
                b.name()
            );
        }
        assert_invalid(b, v.release(h), CallKind::Release, "handle");
        v.address_free(va, 4 * g).unwrap();
    });
}

// ---------------------------------------------------------------- events

#[test]
fn events_record_query_synchronize_destroy() {
    each_backend(|b, v, _| {
        let s = StreamId::DEFAULT;
        let e1 = v.event_record(s).unwrap();
        let e2 = v.event_record(s).unwrap();
        assert_ne!(e1, e2, "{}", b.name());
        // Whether it is complete yet depends on the device; it must answer.
        v.event_query(e1).unwrap();
        v.stream_wait_event(s, e1).unwrap();
        v.stream_synchronize(s).unwrap();
        assert!(
            v.event_query(e1).unwrap(),
            "{}: complete after sync",
            b.name()
        );
        assert!(
            v.event_query(e2).unwrap(),
            "{}: complete after sync",
            b.name()
        );
        // Recorded again: complete once the stream's later work is.
        v.event_record_on(e1, s).unwrap();
        v.stream_synchronize(s).unwrap();
        assert!(
            v.event_query(e1).unwrap(),
            "{}: complete after a record again and a sync",
            b.name()
        );
        v.event_destroy(e1).unwrap();
        v.event_destroy(e2).unwrap();
    });
}

#[test]
fn events_reject_unknown_and_destroyed_events() {
    each_backend(|b, v, _| {
        let s = StreamId::DEFAULT;
        let e = v.event_record(s).unwrap();
        v.event_destroy(e).unwrap();
        assert_invalid(b, v.event_query(e), CallKind::EventQuery, "event");
        assert_invalid(b, v.event_destroy(e), CallKind::EventDestroy, "event");
        assert_invalid(
            b,
            v.stream_wait_event(s, e),
            CallKind::StreamWaitEvent,
            "event",
        );
        assert_invalid(b, v.event_record_on(e, s), CallKind::EventRecord, "event");
        let unknown = quilt_vmm::EventId(0xdead_beef);
        assert_invalid(
            b,
            v.event_record_on(unknown, s),
            CallKind::EventRecord,
            "event",
        );
        assert_invalid(b, v.event_query(unknown), CallKind::EventQuery, "event");
        assert_invalid(b, v.event_destroy(unknown), CallKind::EventDestroy, "event");
        assert_invalid(
            b,
            v.stream_wait_event(s, unknown),
            CallKind::StreamWaitEvent,
            "event",
        );
    });
}

// ---------------------------------------------------------------- counters

#[test]
fn every_call_is_counted_and_failures_apart() {
    each_backend(|b, v, g| {
        let before = v.driver_stats();
        let (va, h) = mapped(v, 2 * g, g);
        v.set_access(va, g).unwrap();
        let _ = v.create(0);
        let _ = v.map(va, g, h, 0);
        let _ = v.mem_info();
        unmapped(v, va, 2 * g, h, g);
        let d = v.driver_stats().since(&before);
        let expect = [
            (CallKind::Reserve, 1, 0),
            (CallKind::Create, 2, 1),
            (CallKind::Map, 2, 1),
            (CallKind::SetAccess, 1, 0),
            (CallKind::MemInfo, 1, 0),
            (CallKind::Unmap, 1, 0),
            (CallKind::Release, 1, 0),
            (CallKind::AddressFree, 1, 0),
        ];
        for (kind, calls, failed) in expect {
            assert_eq!(d.count(kind), calls, "{}: calls of {kind}", b.name());
            assert_eq!(
                d.failed[kind.index()],
                failed,
                "{}: failures of {kind}",
                b.name()
            );
        }
        assert_eq!(d.vmm_calls(), 9, "{}", b.name());
        assert_eq!(d.created_bytes, g, "{}: only successful creates", b.name());
    });
}

// ---------------------------------------------------------------- threads

#[test]
fn threads_share_one_backend() {
    each_backend(|b, v, g| {
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let v = Arc::clone(&b.vmm);
                scope.spawn(move || {
                    for _ in 0..25 {
                        let (va, h) = reserve_and_create(&*v, 2 * g, g);
                        v.map(va + g, g, h, 0).unwrap();
                        v.set_access(va + g, g).unwrap();
                        v.release(h).unwrap();
                        v.unmap(va + g, g).unwrap();
                        v.address_free(va, 2 * g).unwrap();
                    }
                });
            }
        });
        if let Some(capacity) = b.exhaustible {
            assert_eq!(free_bytes(v), capacity, "{}", b.name());
        }
    });
}

// ---------------------------------------------------------------- differential

/// One step of a random workload; indices pick among live objects modulo their count.
#[derive(Clone, Debug)]
enum Op {
    Reserve(u64),
    Free(usize),
    Create(u64),
    Release(usize),
    /// Reservation, granule in it, handle, and what of the handle to map.
    Map(usize, u64, usize, Part),
    Unmap(usize, u64, u64),
    Access(usize, u64, u64),
}

/// What of a handle a [`Op::Map`] maps.
#[derive(Clone, Copy, Debug)]
enum Part {
    /// The whole handle at offset 0 (CUDA's rule; most maps).
    Whole,
    /// `pages` granules from granule `offset` of the handle (refused under
    /// [`MapRule::WholeHandle`] unless that is the whole handle).
    Pages { pages: u64, offset: u64 },
}

/// What a call returned, without addresses or ids (those differ by backend).
fn outcome<T>(r: &quilt_vmm::Result<T>) -> String {
    match r {
        Ok(_) => "ok".into(),
        Err(VmmError::InvalidArgument { call, argument, .. }) => {
            format!("{call:?} invalid {argument}")
        }
        Err(VmmError::NotMapped { call, .. }) => format!("{call:?} not mapped"),
        Err(VmmError::AlreadyMapped { call, .. }) => format!("{call:?} already mapped"),
        Err(VmmError::StillMapped { call, mappings, .. }) => {
            format!("{call:?} still mapped {mappings}")
        }
        Err(VmmError::OutOfMemory {
            call,
            requested,
            available,
        }) => format!("{call:?} oom {requested} {available}"),
        Err(e) => format!("{e}"),
    }
}

/// What a workload left alive: reservations, handles (with whether released), mappings.
#[derive(Default)]
struct Leftovers {
    res: Vec<(DevicePtr, u64)>,
    handles: Vec<(PhysHandle, bool)>,
    maps: std::collections::BTreeMap<DevicePtr, u64>,
}

/// Runs `ops` on `v`, then tears down everything still alive (which must
/// succeed), leaving the backend as it was; returns each call's outcome, then
/// (where `report_free`) the free memory before the teardown.
fn replay(v: &dyn Vmm, ops: &[Op], report_free: bool, after_each: &dyn Fn()) -> Vec<String> {
    let (mut out, left) = run_ops(v, ops, after_each);
    if report_free {
        out.push(format!(
            "free {}",
            v.mem_info().map(|m| m.free).unwrap_or(0)
        ));
    }
    teardown(v, left, after_each);
    out
}

/// Runs `ops` on `v` and returns each call's outcome and what is left alive.
/// Granule counts are scaled by the granularity; reservations and handles are
/// named by index.
fn run_ops(v: &dyn Vmm, ops: &[Op], after_each: &dyn Fn()) -> (Vec<String>, Leftovers) {
    let g = v.granularity();
    let mut res: Vec<(DevicePtr, u64)> = Vec::new();
    // Released handles stay in the list: later calls on them test the rules.
    let mut handles: Vec<(PhysHandle, bool)> = Vec::new();
    // Each handle's size in granules, by the same index.
    let mut sizes: Vec<u64> = Vec::new();
    let mut maps: std::collections::BTreeMap<DevicePtr, u64> = Default::default();
    let mut out = Vec::new();
    let pick = |n: usize, len: usize| if len == 0 { None } else { Some(n % len) };
    // `pages` whole pages of reservation `r` from its page `at` (modulo its
    // length), cut at its end, as (address, bytes).
    let inside = |res: &[(DevicePtr, u64)], r: usize, at: u64, pages: u64| {
        pick(r, res.len()).map(|r| {
            let (start, size) = res[r];
            let at = at % (size / g);
            (start + at * g, pages.min(size / g - at) * g)
        })
    };
    for op in ops {
        let o = match *op {
            Op::Reserve(pages) => {
                let r = v.reserve(pages * g, 0);
                if let Ok(p) = r {
                    res.push((p, pages * g));
                }
                outcome(&r)
            }
            Op::Free(i) => match pick(i, res.len()) {
                Some(i) => {
                    let (p, size) = res[i];
                    let r = v.address_free(p, size);
                    if r.is_ok() {
                        res.remove(i);
                    }
                    outcome(&r)
                }
                None => "skip".into(),
            },
            Op::Create(pages) => {
                let r = v.create(pages * g);
                if let Ok(h) = r {
                    handles.push((h, false));
                    sizes.push(pages);
                }
                outcome(&r)
            }
            Op::Release(i) => match pick(i, handles.len()) {
                Some(i) => {
                    let r = v.release(handles[i].0);
                    if r.is_ok() {
                        handles[i].1 = true;
                    }
                    outcome(&r)
                }
                None => "skip".into(),
            },
            // Ranges start inside their reservation (the layout of reservations
            // differs by backend, so what lies beyond one is not comparable). A
            // map may run past the end (refused everywhere); an unmap or
            // set-access stays inside (neighbouring reservations may touch on
            // some backends, and mappings across them are backend-specific).
            Op::Map(r, at, hi, part) => match (pick(r, res.len()), pick(hi, handles.len())) {
                (Some(r), Some(hi)) => {
                    let (start, size) = res[r];
                    let ptr = start + at % (size / g) * g;
                    let (pages, off) = match part {
                        Part::Whole => (sizes[hi], 0),
                        Part::Pages { pages, offset } => (pages, offset),
                    };
                    let result = v.map(ptr, pages * g, handles[hi].0, off * g);
                    if result.is_ok() {
                        maps.insert(ptr, pages * g);
                    }
                    outcome(&result)
                }
                _ => "skip".into(),
            },
            Op::Unmap(r, at, pages) => match inside(&res, r, at, pages) {
                Some((ptr, len)) => {
                    let result = v.unmap(ptr, len);
                    if result.is_ok() {
                        maps.retain(|&p, _| p < ptr || p >= ptr + len);
                    }
                    outcome(&result)
                }
                None => "skip".into(),
            },
            Op::Access(r, at, pages) => match inside(&res, r, at, pages) {
                Some((ptr, len)) => outcome(&v.set_access(ptr, len)),
                None => "skip".into(),
            },
        };
        out.push(o);
        after_each();
    }
    (out, Leftovers { res, handles, maps })
}

/// Unmaps, releases and frees everything in `left`; every call must succeed.
fn teardown(v: &dyn Vmm, left: Leftovers, after_each: &dyn Fn()) {
    let Leftovers { res, handles, maps } = left;
    for (ptr, size) in maps {
        v.unmap(ptr, size).unwrap();
        after_each();
    }
    for (h, released) in handles {
        if !released {
            v.release(h).unwrap();
            after_each();
        }
    }
    for (ptr, size) in res {
        v.address_free(ptr, size).unwrap();
        after_each();
    }
}

fn op_strategy() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (1u64..6).prop_map(Op::Reserve),
        any::<usize>().prop_map(Op::Free),
        (1u64..6).prop_map(Op::Create),
        any::<usize>().prop_map(Op::Release),
        (any::<usize>(), 0u64..6, any::<usize>()).prop_map(|(r, at, h)| Op::Map(
            r,
            at,
            h,
            Part::Whole
        )),
        (any::<usize>(), 0u64..6, any::<usize>(), 1u64..4, 0u64..4)
            .prop_map(|(r, at, h, pages, offset)| Op::Map(r, at, h, Part::Pages { pages, offset })),
        (any::<usize>(), 0u64..6, 1u64..4).prop_map(|(r, at, p)| Op::Unmap(r, at, p)),
        (any::<usize>(), 0u64..6, 1u64..4).prop_map(|(r, at, p)| Op::Access(r, at, p)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest_config(64))]

    /// The host backend gives the same outcome, call by call, as a simulated
    /// one of the same granularity and map rule on random workloads (capacity
    /// exhaustion included), and the workload tears down cleanly: under
    /// CUDA's rule and under the relaxed rule.
    #[test]
    fn backends_agree_with_the_simulated_one(ops in proptest::collection::vec(op_strategy(), 1..60)) {
        let mut others: Vec<Backend> = host_backend().into_iter().collect();
        others.extend(host_backend_with(MapRule::AnyOffset));
        for b in others {
            agrees_with_the_simulated_one(&b, &ops)?;
        }
    }

}

/// The differential check on CUDA device 0 (over the CUDA double, exhausted
/// exactly like the host backend; on a GPU with `QUILT_CUDA_TESTS=real`,
/// never exhausted), one backend shared by every case.
#[test]
fn cuda_agrees_with_the_simulated_one() {
    if !over_the_double() {
        return;
    }
    let mut runner = proptest::test_runner::TestRunner::new(proptest_config(64));
    let result = runner.run(&proptest::collection::vec(op_strategy(), 1..60), |ops| {
        agrees_with_the_simulated_one(&shared_cuda_backend(), &ops)
    });
    if let Err(e) = result {
        panic!("the CUDA backend disagrees with the simulated one: {e}");
    }
}

/// `b` gives the same outcome as a simulated backend of its granularity and
/// map rule (and its capacity where it is exhaustible) on `ops`.
fn agrees_with_the_simulated_one(
    b: &Backend,
    ops: &[Op],
) -> Result<(), proptest::test_runner::TestCaseError> {
    let reference = SimVmm::new(SimConfig {
        capacity: b.exhaustible.unwrap_or(1 << 50),
        granularity: b.vmm.granularity(),
        map_rule: b.vmm.map_rule(),
        ..SimConfig::default()
    })
    .unwrap();
    let exact = b.exhaustible.is_some();
    let expected = replay(&reference, ops, exact, &|| {});
    proptest::prop_assert!(reference.leak_report().is_empty());
    let got = replay(&*b.vmm, ops, exact, &|| {});
    proptest::prop_assert_eq!(
        &got,
        &expected,
        "{} differs from simulated on {:?}",
        b.name(),
        ops
    );
    Ok(())
}

/// One CUDA backend for every case of the differential check (a context per
/// case would be slow), exhaustible as [`cuda_backend`] says (over the
/// double: exactly at its capacity, as every case ends with nothing held).
fn shared_cuda_backend() -> Backend {
    static SHARED: std::sync::OnceLock<(Arc<dyn Vmm>, Option<u64>)> = std::sync::OnceLock::new();
    let (vmm, exhaustible) = SHARED.get_or_init(|| {
        let b = cuda_backend();
        (b.vmm, b.exhaustible)
    });
    Backend {
        vmm: Arc::clone(vmm),
        exhaustible: *exhaustible,
    }
}

// ================================================================ simulated only

proptest::proptest! {
    #![proptest_config(proptest_config(64))]

    /// The simulated device's bookkeeping stays consistent after every call of a
    /// random workload, with the `k`th VMM call failing (k = 0: none fails),
    /// under either map rule.
    #[test]
    fn sim_invariants_hold_after_every_call(
        ops in proptest::collection::vec(op_strategy(), 1..80),
        k in 0u64..80,
        relaxed in proptest::bool::ANY,
    ) {
        let v = SimVmm::new(SimConfig {
            capacity: SMALL_CAPACITY,
            granularity: SMALL_GRANULARITY,
            map_rule: if relaxed { MapRule::AnyOffset } else { MapRule::WholeHandle },
            ..SimConfig::default()
        })
        .unwrap();
        v.inject(Fault::nth_overall(k));
        let check = || {
            if let Err(broken) = v.check_invariants() {
                panic!("invariant broken: {broken}");
            }
        };
        let (outcomes, left) = run_ops(&v, &ops, &check);
        let failures = v.driver_stats().failed.iter().sum::<u64>();
        let injected = outcomes.iter().filter(|o| o.contains("injected")).count() as u64;
        proptest::prop_assert!(injected <= 1 && failures >= injected);
        proptest::prop_assert_eq!(injected == 1, k >= 1 && k <= v.driver_stats().vmm_calls());
        v.clear_faults();
        teardown(&v, left, &check);
        proptest::prop_assert!(v.leak_report().is_empty(), "{}", v.leak_report());
    }
}

fn sim(capacity: u64) -> SimVmm {
    SimVmm::with_capacity(capacity).unwrap()
}

#[test]
fn sim_rejects_bad_configurations() {
    for granularity in [0, 3, 3 * MIB] {
        let config = SimConfig {
            granularity,
            ..SimConfig::default()
        };
        assert!(
            matches!(
                SimVmm::new(config),
                Err(VmmError::InvalidArgument {
                    argument: "granularity",
                    ..
                })
            ),
            "granularity {granularity}"
        );
    }
    let v = sim(GIB);
    assert_eq!(v.config().capacity, GIB);
    assert_eq!(v.config().granularity, 2 * MIB);
    assert_eq!(v.granularity(), 2 * MIB);
    assert_eq!(v.backend_name(), "simulated");
}

#[test]
fn sim_reserve_requires_power_of_two_alignment_and_respects_va_limit() {
    let v = SimVmm::new(SimConfig {
        va_limit: 8 * MIB,
        ..SimConfig::default()
    })
    .unwrap();
    assert!(matches!(
        v.reserve(2 * MIB, 6 * MIB),
        Err(VmmError::InvalidArgument {
            argument: "alignment",
            ..
        })
    ));
    let a = v.reserve(6 * MIB, 0).unwrap();
    // Out of address space, not of device memory.
    let err = v.reserve(4 * MIB, 0).unwrap_err();
    assert_eq!(
        err,
        VmmError::AddressSpaceExhausted {
            call: CallKind::Reserve,
            requested: 4 * MIB,
            available: 2 * MIB,
        }
    );
    assert!(!err.is_out_of_memory() && err.is_address_space_exhausted());
    let b = v.reserve(2 * MIB, 0).unwrap();
    v.address_free(a, 6 * MIB).unwrap();
    let c = v.reserve(4 * MIB, 0).unwrap();
    // Addresses are never reused, and reservations are never adjacent.
    assert!(c > b + 2 * MIB && b > a + 6 * MIB);
    // An absurd alignment is honoured once, then runs out of addresses: an
    // exhausted address space, not a panic.
    let v = sim(GIB);
    let top = v.reserve(2 * MIB, 1 << 63).unwrap();
    assert_eq!(top, 1 << 63);
    assert!(matches!(
        v.reserve(2 * MIB, 1 << 63),
        Err(VmmError::AddressSpaceExhausted {
            call: CallKind::Reserve,
            ..
        })
    ));
    v.address_free(top, 2 * MIB).unwrap();
}

#[test]
fn sim_leak_report_lists_what_is_alive_and_empties_after_cleanup() {
    let v = sim(GIB);
    assert!(v.leak_report().is_empty());
    assert_eq!(v.leak_report().to_string(), "nothing alive");
    let (va, h) = reserve_and_create(&v, 8 * MIB, 4 * MIB);
    let lonely = v.create(2 * MIB).unwrap();
    v.map(va, 4 * MIB, h, 0).unwrap();
    v.release(h).unwrap(); // still mapped: stays alive
    let e = v.event_record(StreamId(7)).unwrap();
    let report = v.leak_report();
    assert_eq!(report.handles, vec![(h, 4 * MIB), (lonely, 2 * MIB)]);
    assert_eq!(report.reservations, vec![(va, 8 * MIB)]);
    assert_eq!(report.mappings, vec![(va, 4 * MIB)]);
    assert_eq!(report.events, 1);
    assert_eq!(report.handle_bytes(), 6 * MIB);
    let text = report.to_string();
    assert!(
        text.contains("2 handle(s)") && text.contains("1 reservation(s)"),
        "{text}"
    );
    assert!(
        text.contains("1 mapping(s)") && text.contains("1 event(s)"),
        "{text}"
    );
    assert_eq!(v.physical_in_use(), 6 * MIB);
    assert_eq!(v.mapped_bytes(), 4 * MIB);

    v.unmap(va, 4 * MIB).unwrap();
    v.release(lonely).unwrap();
    v.address_free(va, 8 * MIB).unwrap();
    v.event_destroy(e).unwrap();
    assert!(v.leak_report().is_empty(), "{}", v.leak_report());
    assert_eq!(
        (v.physical_in_use(), v.mapped_bytes(), v.reserved_bytes()),
        (0, 0, 0)
    );
    assert_eq!(v.live_counts(), (0, 0, 0));
}

#[test]
fn sim_tracks_access_per_mapping_and_translates() {
    // Offsets on purpose: translate must honour them (the relaxed rule).
    let v = SimVmm::new(SimConfig {
        capacity: GIB,
        map_rule: MapRule::AnyOffset,
        ..SimConfig::default()
    })
    .unwrap();
    assert_eq!(v.map_rule(), MapRule::AnyOffset);
    let (va, h) = reserve_and_create(&v, 8 * MIB, 8 * MIB);
    v.map(va, 4 * MIB, h, 4 * MIB).unwrap();
    v.map(va + 4 * MIB, 2 * MIB, h, 0).unwrap();
    assert_eq!(v.access_set(va), Some(false));
    assert_eq!(v.access_set(va + 6 * MIB), None);
    v.set_access(va, 4 * MIB).unwrap();
    assert_eq!(v.access_set(va + 3 * MIB), Some(true));
    assert_eq!(
        v.access_set(va + 4 * MIB),
        Some(false),
        "a map without set_access"
    );
    assert_eq!(v.translate(va + 5 * MIB + 7), Some((h, MIB + 7)));
    assert_eq!(v.translate(va + MIB), Some((h, 5 * MIB)));
    // Access resets with the mapping.
    v.unmap(va, 4 * MIB).unwrap();
    v.map(va, 4 * MIB, h, 0).unwrap();
    assert_eq!(v.access_set(va), Some(false));
    unmapped(&v, va, 8 * MIB, h, 6 * MIB);
}

/// Everything observable about a simulated device except the counters.
fn observable(v: &SimVmm) -> (quilt_vmm::sim::LeakReport, u64, u64, u64) {
    (
        v.leak_report(),
        v.physical_in_use(),
        v.mapped_bytes(),
        v.reserved_bytes(),
    )
}

#[track_caller]
fn assert_cuda_error<T: Debug>(r: quilt_vmm::Result<T>, kind: CallKind, code: u32, name: &str) {
    match r {
        Err(VmmError::Driver {
            call,
            code: c,
            name: n,
            ..
        }) => assert_eq!((call, c, n.as_str()), (kind, code, name)),
        other => panic!("expected {name} from {kind}, got {other:?}"),
    }
}

#[test]
fn sim_nth_fault_fails_exactly_that_call_and_changes_nothing() {
    let v = sim(GIB);
    // One handle mapped whole at three neighbouring addresses.
    let (va, h) = reserve_and_create(&v, 8 * MIB, 2 * MIB);
    v.inject(Fault::nth(CallKind::Map, 3));
    v.inject(Fault::nth(CallKind::Create, 1));
    assert_eq!(v.armed_faults(), 2);
    v.map(va, 2 * MIB, h, 0).unwrap();
    v.map(va + 2 * MIB, 2 * MIB, h, 0).unwrap();
    let before = observable(&v);
    let stats = v.driver_stats();
    assert_cuda_error(
        v.map(va + 4 * MIB, 2 * MIB, h, 0),
        CallKind::Map,
        1,
        "CUDA_ERROR_INVALID_VALUE",
    );
    assert_eq!(observable(&v), before, "a failed call changes no state");
    let d = v.driver_stats().since(&stats);
    assert_eq!(
        (d.count(CallKind::Map), d.failed[CallKind::Map.index()]),
        (1, 1)
    );
    assert_eq!(
        d.modelled_ns,
        CostModel::default().map_ns,
        "a failed call is still costed"
    );
    // Disarmed after firing: the same call succeeds now.
    v.map(va + 4 * MIB, 2 * MIB, h, 0).unwrap();
    assert_cuda_error(
        v.create(2 * MIB),
        CallKind::Create,
        2,
        "CUDA_ERROR_OUT_OF_MEMORY",
    );
    assert_eq!(v.armed_faults(), 0);
    let h2 = v.create(2 * MIB).unwrap();
    v.release(h2).unwrap();
    unmapped(&v, va, 8 * MIB, h, 6 * MIB);
    assert!(v.leak_report().is_empty());
}

#[test]
fn sim_always_fault_fails_every_call_until_cleared() {
    let v = sim(GIB);
    let custom = VmmError::Unavailable {
        reason: quilt_vmm::Unavailability::NoVmm { ordinal: 0 },
    };
    v.inject(Fault::always(CallKind::SetAccess).with_error(custom.clone()));
    v.inject(Fault::always(CallKind::Reserve));
    for _ in 0..3 {
        assert_cuda_error(
            v.reserve(2 * MIB, 0),
            CallKind::Reserve,
            1,
            "CUDA_ERROR_INVALID_VALUE",
        );
    }
    assert_eq!(v.reserved_bytes(), 0);
    // Calls of other kinds go through.
    let h = v.create(2 * MIB).unwrap();
    v.clear_faults();
    let va = v.reserve(2 * MIB, 0).unwrap();
    v.map(va, 2 * MIB, h, 0).unwrap();
    v.set_access(va, 2 * MIB).unwrap();
    v.inject(Fault::always(CallKind::SetAccess).with_error(custom.clone()));
    assert_eq!(v.set_access(va, 2 * MIB), Err(custom.clone()));
    assert_eq!(v.set_access(va, 2 * MIB), Err(custom));
    let stats = v.driver_stats();
    assert_eq!(stats.failed[CallKind::Reserve.index()], 3);
    assert_eq!(stats.count(CallKind::Reserve), 4);
    assert_eq!(stats.failed[CallKind::SetAccess.index()], 2);
    v.clear_faults();
    assert_eq!(v.armed_faults(), 0);
    unmapped(&v, va, 2 * MIB, h, 2 * MIB);
}

/// A small workload of `SEQUENCE_CALLS` VMM calls (plus events, which are not
/// VMM calls), stopping at the first failure; returns whether it finished.
fn small_workload(v: &SimVmm) -> Result<(), VmmError> {
    let va = v.reserve(8 * MIB, 0)?;
    let h = v.create(4 * MIB)?;
    let e = v.event_record(StreamId(1))?;
    v.map(va, 4 * MIB, h, 0)?;
    v.set_access(va, 4 * MIB)?;
    v.event_destroy(e)?;
    v.unmap(va, 4 * MIB)?;
    v.release(h)?;
    v.address_free(va, 8 * MIB)?;
    Ok(())
}
const SEQUENCE_CALLS: u64 = 7;
/// The kinds of those calls, in order (a page's life).
const SEQUENCE_KINDS: [CallKind; 7] = [
    CallKind::Reserve,
    CallKind::Create,
    CallKind::Map,
    CallKind::SetAccess,
    CallKind::Unmap,
    CallKind::Release,
    CallKind::AddressFree,
];

#[test]
fn sim_nth_overall_fault_fails_the_kth_vmm_call_with_cudas_error() {
    let probe = sim(GIB);
    small_workload(&probe).unwrap();
    assert_eq!(probe.driver_stats().vmm_calls(), SEQUENCE_CALLS);
    for k in 1..=SEQUENCE_CALLS {
        let v = sim(GIB);
        v.inject(Fault::nth_overall(k));
        let err = small_workload(&v).unwrap_err();
        let kind = SEQUENCE_KINDS[(k - 1) as usize];
        let (code, name) = if kind == CallKind::Create {
            (2, "CUDA_ERROR_OUT_OF_MEMORY")
        } else {
            (1, "CUDA_ERROR_INVALID_VALUE")
        };
        assert_cuda_error::<()>(Err(err), kind, code, name);
        let stats = v.driver_stats();
        assert_eq!(stats.vmm_calls(), k, "stopped at call {k}");
        assert_eq!(stats.failed.iter().sum::<u64>(), 1);
        assert_eq!(v.armed_faults(), 0);
    }
    // Past the end: nothing fails, and the fault stays armed.
    let v = sim(GIB);
    v.inject(Fault {
        kind: CallKind::Map,
        trigger: FaultTrigger::NthCallOfAnyKind(SEQUENCE_CALLS + 1),
        error: None,
    });
    small_workload(&v).unwrap();
    assert_eq!(v.armed_faults(), 1);
    // Nth(0) never fires.
    v.clear_faults();
    v.inject(Fault::nth(CallKind::Map, 0));
    small_workload(&v).unwrap();
}

#[test]
fn sim_costs_and_counters_add_up() {
    let v = sim(GIB);
    let c = CostModel::default();
    assert_eq!(
        (
            c.reserve_ns,
            c.create_ns_per_granule,
            c.create_flat_ns,
            c.map_ns
        ),
        (19_000, 193_000, 193_000, 1_500)
    );
    assert_eq!(
        (c.set_access_ns, c.unmap_ns, c.release_ns, c.address_free_ns),
        (36_000, 26_000, 25_000, 19_000)
    );
    let h = v.create(64 * MIB).unwrap();
    let s = v.driver_stats();
    assert_eq!(s.modelled_ns, 32 * 193_000, "64 MiB = 32 granules");
    assert_eq!(s.modelled_flat_create_ns, 193_000);
    assert_eq!(s.created_bytes, 64 * MIB);
    let va = v.reserve(64 * MIB, 0).unwrap();
    v.map(va, 64 * MIB, h, 0).unwrap();
    v.set_access(va, 64 * MIB).unwrap();
    unmapped(&v, va, 64 * MIB, h, 64 * MIB);
    let _ = v.create(3 * GIB); // out of memory: costed flat
    let e = v.event_record(StreamId::DEFAULT).unwrap();
    v.event_query(e).unwrap();
    v.stream_wait_event(StreamId(3), e).unwrap();
    v.event_destroy(e).unwrap();
    v.stream_synchronize(StreamId::DEFAULT).unwrap();
    v.mem_info().unwrap();
    let s = v.driver_stats();
    let others = c.reserve_ns
        + c.map_ns
        + c.set_access_ns
        + c.unmap_ns
        + c.release_ns
        + c.address_free_ns
        + c.create_flat_ns
        + 4 * c.event_ns
        + c.sync_ns
        + c.mem_info_ns;
    assert_eq!(s.modelled_ns, 32 * 193_000 + others);
    assert_eq!(s.modelled_flat_create_ns, 193_000 + others);
    assert_eq!(s.created_bytes, 64 * MIB);
    assert_eq!(s.count(CallKind::Create), 2);
    assert_eq!(s.failed[CallKind::Create.index()], 1);
    assert_eq!(s.calls.iter().sum::<u64>(), 14);
    assert_eq!(s.vmm_calls(), 8);
    v.reset_stats();
    assert_eq!(v.driver_stats(), quilt_vmm::DriverStats::default());
}

#[test]
fn sim_custom_costs_are_used() {
    let v = SimVmm::new(SimConfig {
        granularity: 64 * 1024,
        cost: CostModel {
            create_ns_per_granule: 10,
            create_flat_ns: 7,
            map_ns: 3,
            ..CostModel::default()
        },
        ..SimConfig::default()
    })
    .unwrap();
    let h = v.create(MIB).unwrap();
    let va = v.reserve(MIB, 0).unwrap();
    v.map(va, MIB, h, 0).unwrap();
    let s = v.driver_stats();
    assert_eq!(s.modelled_ns, 16 * 10 + v.config().cost.reserve_ns + 3);
    assert_eq!(
        s.modelled_flat_create_ns,
        7 + v.config().cost.reserve_ns + 3
    );
    unmapped(&v, va, MIB, h, MIB);
}

#[test]
fn sim_huge_capacity_costs_nothing() {
    let v = sim(200 * GIB);
    let (va, h) = mapped(&v, 150 * GIB, 150 * GIB);
    v.set_access(va, 150 * GIB).unwrap();
    let info = v.mem_info().unwrap();
    assert_eq!((info.total, info.free), (200 * GIB, 50 * GIB));
    assert_eq!(v.physical_in_use(), 150 * GIB);
    assert!(v.create(51 * GIB).unwrap_err().is_out_of_memory());
    let h2 = v.create(50 * GIB).unwrap();
    v.release(h2).unwrap();
    unmapped(&v, va, 150 * GIB, h, 150 * GIB);
    assert!(v.leak_report().is_empty());
}

#[test]
fn sim_events_complete_when_their_stream_catches_up() {
    let v = sim(GIB);
    let (s1, s2, s3) = (StreamId(1), StreamId(2), StreamId(3));
    let a = v.event_record(s1).unwrap();
    let b = v.event_record(s2).unwrap();
    assert!(!v.event_query(a).unwrap() && !v.event_query(b).unwrap());
    v.complete_stream(s1);
    assert!(v.event_query(a).unwrap());
    assert!(!v.event_query(b).unwrap(), "other streams stay pending");
    let a2 = v.event_record(s1).unwrap();
    assert!(!v.event_query(a2).unwrap(), "recorded after the catch-up");
    // s3 waits for b: when s3 catches up, b has completed too; a2 has not.
    v.stream_wait_event(s3, b).unwrap();
    let c = v.event_record(s3).unwrap();
    v.stream_synchronize(s3).unwrap();
    assert!(v.event_query(c).unwrap());
    assert!(v.event_query(b).unwrap(), "s3 waited for b");
    assert!(!v.event_query(a2).unwrap());
    // A wait holds back only the events recorded after it: s3 waits for d, which
    // s1 recorded before its own wait for e, so s3 catching up completes d, not e.
    let d = v.event_record(s1).unwrap();
    let e = v.event_record(s2).unwrap();
    v.stream_wait_event(s1, e).unwrap();
    v.stream_wait_event(s3, d).unwrap();
    v.complete_stream(s3);
    assert!(v.event_query(d).unwrap() && v.event_query(a2).unwrap());
    assert!(!v.event_query(e).unwrap());
    v.complete_all();
    assert!(v.event_query(e).unwrap());
    for ev in [a, b, c, a2, d, e] {
        v.event_destroy(ev).unwrap();
    }
    assert!(v.leak_report().is_empty());
}

#[test]
fn sim_is_fast_enough_for_replays() {
    // Many live mappings, then many calls: O(log n) each. No timing is asserted;
    // this only has to finish quickly.
    let v = sim(1 << 50);
    let n = 20_000u64;
    let started = std::time::Instant::now();
    // One handle per page, each mapped whole.
    let va = v.reserve(n * 2 * MIB, 0).unwrap();
    let handles: Vec<PhysHandle> = (0..n).map(|_| v.create(2 * MIB).unwrap()).collect();
    for (i, h) in (0..n).zip(&handles) {
        v.map(va + i * 2 * MIB, 2 * MIB, *h, 0).unwrap();
    }
    for i in 0..n {
        v.set_access(va + i * 2 * MIB, 2 * MIB).unwrap();
    }
    v.unmap(va, n * 2 * MIB).unwrap();
    assert_eq!(v.mapped_bytes(), 0);
    for h in handles {
        v.release(h).unwrap();
    }
    v.address_free(va, n * 2 * MIB).unwrap();
    let calls = v.driver_stats().vmm_calls();
    assert_eq!(calls, 4 * n + 3);
    eprintln!(
        "sim: {calls} calls over {n} live mappings in {:?} ({} ns per call)",
        started.elapsed(),
        started.elapsed().as_nanos() / u128::from(calls)
    );
}

#[test]
fn sim_debug_is_a_summary() {
    let v = sim(GIB);
    let text = format!("{v:?}");
    assert!(
        text.starts_with("SimVmm") && text.contains("capacity"),
        "{text}"
    );
}
