//! Placement under memory pressure (the pool cannot grow): every new page a
//! block needs is a cached page moved from elsewhere, so a mapped gap saves
//! calls, not memory, and a block goes where it touches the fewest
//! untouched pages, the tighter gap on a tie (see
//! `crates/alloc/src/quilt/pressure.rs`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::quilt::{MemoryLimit, QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::{SimConfig, SimVmm};
use quilt_vmm::{StreamId, Vmm};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);

/// Quilt on a simulated device that keeps up with the host (freed work is
/// done at once, so a moved page leaves no retired mapping behind), with a
/// limit of 20 MiB: ten 2 MiB pages.
fn limited_to_ten_pages() -> QuiltAllocator {
    let sim = Arc::new(
        SimVmm::new(SimConfig {
            capacity: 64 * MIB,
            gpu_lag_ops: 0,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let v: Arc<dyn Vmm> = sim;
    let config = QuiltConfig::default().with_limit(MemoryLimit::Bytes(20 * MIB));
    QuiltAllocator::new(v, config).unwrap()
}

#[test]
fn under_pressure_a_block_takes_the_best_fit_not_a_looser_mapped_gap() {
    let q = limited_to_ten_pages();
    // Ten 2 MiB pages at most. Offsets in MiB: a 0..4, t 4..6, b 6..8,
    // l 8..14, c 14..16.
    let a = q.allocate(4 * MIB, S0).unwrap();
    let t = q.allocate(2 * MIB, S0).unwrap();
    let _b = q.allocate(2 * MIB, S0).unwrap();
    let l = q.allocate(6 * MIB, S0).unwrap();
    let c = q.allocate(2 * MIB, S0).unwrap();
    assert_eq!(t.ptr, a.ptr + 4 * MIB, "blocks are packed in order");
    q.free(t.ptr).unwrap();
    // d at 16..20 takes the last two pages the limit allows.
    let _d = q.allocate(4 * MIB, S0).unwrap();
    q.free(c.ptr).unwrap();
    // g (3 MiB) fits only past d: the pool cannot grow, so the two cached
    // pages (t's and c's, oldest first) are moved under it. The allocator
    // is under pressure from here on, and t's gap (4..6) has no page.
    let _g = q.allocate(3 * MIB, S0).unwrap();
    // l's gap and c's are one: 8..16, three of its four pages mapped.
    q.free(l.ptr).unwrap();
    // 2 MiB fit t's gap exactly; 8..16 is looser but mapped. Under
    // pressure the page the tight gap needs is moved from the loose one,
    // which stays one gap for a later block.
    let h = q.allocate(2 * MIB, S0).unwrap();
    assert_eq!(
        h.ptr,
        a.ptr + 4 * MIB,
        "under pressure the block goes to the best-fitting gap"
    );
}

/// A 20 MiB limit (ten 2 MiB pages) filled, then put under pressure, over
/// offsets in MiB: `a` 0..4 (pages 0, 1), a gap 4..7 (page 2 untouched,
/// page 3 shared with `b`), `b` 7..9 (pages 3, 4), `y` 9..21 (pages 4 to
/// 10). Returns the allocator and `a`'s pointer.
fn gap_beside_a_partly_used_page() -> (QuiltAllocator, u64) {
    let q = limited_to_ten_pages();
    let a = q.allocate(4 * MIB, S0).unwrap();
    let x = q.allocate(3 * MIB, S0).unwrap();
    let b = q.allocate(2 * MIB, S0).unwrap();
    let fill = q.allocate(11 * MIB, S0).unwrap();
    assert_eq!(b.ptr, a.ptr + 7 * MIB, "blocks are packed in order");
    assert_eq!(q.pool_stats().total_pages, 10, "the limit is reached");
    q.free(x.ptr).unwrap();
    q.free(fill.ptr).unwrap();
    // 9..21 needs page 10: the pool cannot grow, so a cached page is moved
    // under it, and the allocator is under pressure from here on.
    let y = q.allocate(12 * MIB, S0).unwrap();
    assert_eq!(y.ptr, a.ptr + 9 * MIB);
    (q, a.ptr)
}

#[test]
fn under_pressure_a_block_shares_the_partly_used_page_at_its_gaps_end() {
    let (q, a) = gap_beside_a_partly_used_page();
    // Every page the limit allows is touched but page 2. 1 MiB at the
    // gap's start (4..5) would be page 2's first block and need an eleventh
    // page; at the gap's end (6..7) it lies on page 3, which `b` already
    // touches: no new page, nothing newly stranded.
    let h = q
        .allocate(MIB, S0)
        .expect("1 MiB fits on the partly used page beside the gap");
    assert_eq!(
        h.ptr,
        a + 6 * MIB,
        "under pressure the block goes to the end of its gap that shares a used page"
    );
    assert_eq!(q.pool_stats().total_pages, 10);
}
