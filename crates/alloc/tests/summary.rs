//! `memory_summary()` and `last_oom()` for every allocator behind the trait:
//! after a known sequence the table shows the figures the sequence implies
//! (checked against the allocations handed out and against the simulated
//! device's own books), and after a forced out-of-memory error the last
//! report is the one the error carried, replaced by the next.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
use quilt_alloc::baselines::{CachingAllocator, CachingConfig};
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::summary::{format_bytes, MemorySummary};
use quilt_alloc::{AllocError, DeviceAllocator, OomVerdict};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

const MIB: u64 = 1 << 20;
const CAPACITY: u64 = 64 * MIB;
const S0: StreamId = StreamId(0);

/// Every allocator of the crate, each on its own simulated 64 MiB device.
fn allocators() -> Vec<(Arc<SimVmm>, Box<dyn DeviceAllocator>)> {
    let sim = || Arc::new(SimVmm::with_capacity(CAPACITY).unwrap());
    let mut all: Vec<(Arc<SimVmm>, Box<dyn DeviceAllocator>)> = Vec::new();
    let s = sim();
    let q = QuiltAllocator::new(s.clone(), QuiltConfig::default()).unwrap();
    all.push((s, Box::new(q)));
    let s = sim();
    let g = QuiltAllocator::new(s.clone(), QuiltConfig::gmlake()).unwrap();
    all.push((s, Box::new(g)));
    let s = sim();
    let c = CachingAllocator::new(s.clone(), CachingConfig::classic()).unwrap();
    all.push((s, Box::new(c)));
    let s = sim();
    let e = CachingAllocator::new(s.clone(), CachingConfig::expandable()).unwrap();
    all.push((s, Box::new(e)));
    let s = sim();
    let o = OffsetAllocator::new(s.clone(), OffsetConfig::default()).unwrap();
    all.push((s, Box::new(o)));
    all
}

/// The cells of the table row whose first cell is `name`.
fn row(text: &str, name: &str) -> Vec<String> {
    text.lines()
        .map(|l| {
            l.trim_matches('|')
                .split('|')
                .map(|c| c.trim().to_string())
                .collect::<Vec<_>>()
        })
        .find(|cells| cells.first().map(String::as_str) == Some(name))
        .unwrap_or_else(|| panic!("no row {name:?} in\n{text}"))
}

#[test]
fn every_allocator_names_every_allocator() {
    let names: Vec<String> = allocators()
        .iter()
        .map(|(_, a)| a.name().to_string())
        .collect();
    assert_eq!(
        names,
        ["quilt", "gmlake", "classic", "expandable", "offset"]
    );
}

#[test]
fn the_summary_shows_what_a_known_sequence_implies() {
    for (sim, alloc) in allocators() {
        let name = alloc.name().to_string();
        let a = alloc.allocate(3 * MIB, S0).unwrap();
        let b = alloc.allocate(5 * MIB + 1, S0).unwrap();
        alloc.free(a.ptr).unwrap();
        alloc.check_invariants().unwrap();

        let driver = sim.driver_stats();
        let summary = MemorySummary::of(alloc.as_ref());
        let text = alloc.memory_summary();
        assert_eq!(text, summary.to_string(), "{name}");
        let used = {
            let info = sim.mem_info().unwrap();
            info.total - info.free
        };

        // Figures the sequence implies, from the allocations handed out.
        let s = &summary.stats;
        assert_eq!(summary.allocator, name);
        assert_eq!(s.allocated_bytes.current, b.size, "{name}");
        assert_eq!(s.allocated_bytes.peak, a.size + b.size, "{name}");
        assert_eq!(s.allocated_bytes.freed, a.size, "{name}");
        assert_eq!(s.requested_bytes.current, 5 * MIB + 1, "{name}");
        assert_eq!((s.allocation.current, s.allocation.peak), (1, 2), "{name}");
        // Reserved memory is what the device itself says is in use.
        assert_eq!(s.reserved_bytes.current, used, "{name}");
        assert_eq!(summary.cached_bytes(), used - b.size, "{name}");
        assert_eq!(s.driver, driver, "{name}");
        assert!(summary.last_oom.is_none(), "{name}");

        // The same figures in the text.
        let allocated = row(&text, "Allocated memory");
        assert_eq!(allocated[1], format_bytes(b.size), "{name}: {allocated:?}");
        assert_eq!(allocated[2], format_bytes(a.size + b.size), "{name}");
        assert_eq!(allocated[3], format_bytes(a.size + b.size), "{name}");
        assert_eq!(allocated[4], format_bytes(a.size), "{name}");
        assert_eq!(
            row(&text, "Reserved memory")[1],
            format_bytes(used),
            "{name}"
        );
        assert_eq!(row(&text, "Cached memory")[1], format_bytes(used - b.size));
        assert_eq!(row(&text, "Allocations")[1..3], ["1", "2"], "{name}");
        assert_eq!(
            row(&text, "Segments")[1],
            s.segment.current.to_string(),
            "{name}"
        );
        let calls: u64 = driver.calls.iter().sum();
        assert!(calls > 0, "{name}");
        assert!(
            text.contains(&format!(
                "Driver calls: {calls} ({} VMM",
                driver.vmm_calls()
            )),
            "{name}:\n{text}"
        );
        assert!(text.contains("cuMemCreate"), "{name}:\n{text}");
        assert!(text.contains("Last out-of-memory error: none"), "{name}");
        assert!(text.contains(&format!("{name} memory summary")), "{name}");
        assert!(
            text.lines().all(|l| l.chars().count() == 81),
            "{name}:\n{text}"
        );
        alloc.free(b.ptr).unwrap();
        alloc.check_invariants().unwrap();
    }
}

#[test]
fn the_last_out_of_memory_report_is_kept_and_replaced() {
    for (_sim, alloc) in allocators() {
        let name = alloc.name().to_string();
        assert!(alloc.last_oom().is_none(), "{name}");
        let live = alloc.allocate(8 * MIB, S0).unwrap();
        let first = alloc.allocate(4 * CAPACITY, S0).unwrap_err();
        alloc.check_invariants().unwrap();
        let AllocError::OutOfMemory(report) = &first else {
            panic!("{name}: {first:?}");
        };
        assert_eq!(alloc.last_oom().as_ref(), Some(report.as_ref()), "{name}");
        assert_eq!(report.requested, 4 * CAPACITY, "{name}");
        assert_eq!(report.verdict, OomVerdict::Capacity, "{name}");

        let text = alloc.memory_summary();
        assert!(text.contains("OOMs: 1, "), "{name}:\n{text}");
        let flat = text
            .lines()
            .map(|l| l.trim_matches('|').trim())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(
            flat.contains(&format!("Last out-of-memory error: {report}")),
            "{name}:\n{text}"
        );

        // A later failure replaces it; a success does not clear it.
        let second = alloc.allocate(2 * CAPACITY, S0).unwrap_err();
        let _ok = alloc.allocate(MIB, S0).unwrap();
        let last = alloc.last_oom().unwrap();
        assert_eq!(Some(&last), second.oom_report(), "{name}");
        assert_eq!(last.requested, 2 * CAPACITY, "{name}");
        assert_eq!(MemorySummary::of(alloc.as_ref()).stats.num_ooms, 2);
        alloc.free(live.ptr).unwrap();
        alloc.check_invariants().unwrap();
    }
}
