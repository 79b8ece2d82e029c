//! The shortcuts of Quilt's hot path keep every promise: placement looks at
//! the best fit first and collects the other candidates only when it is not
//! perfect, and an allocation orders its stream after other streams' work
//! unless placement found no wait is needed. Here several gaps fit, so both
//! shortcuts run; the simulated device never progresses, so every free's
//! work is outstanding.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::sync::Arc;

use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{CallKind, StreamId, Vmm};

const MIB: u64 = 1 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

fn waits(sim: &SimVmm) -> u64 {
    sim.driver_stats().count(CallKind::StreamWaitEvent)
}

#[test]
fn a_mapped_gap_of_another_stream_is_taken_with_a_wait_and_of_the_same_stream_without() {
    let sim = Arc::new(SimVmm::with_capacity(256 * MIB).unwrap());
    let vmm: Arc<dyn Vmm> = sim.clone();
    let a = QuiltAllocator::new(vmm, QuiltConfig::default()).unwrap();
    let x = a.allocate(40 * MIB, S0).unwrap();
    // Keeps x's range apart from the free space after it: two gaps fit.
    let sep = a.allocate(4 * MIB, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.check_invariants().unwrap();
    let calls = sim.driver_stats().vmm_calls();

    // Stream 1: x's range is mapped but stream 0's work on it is not known
    // complete; the other gap needs new pages. The mapped one wins, with a wait.
    let y = a.allocate(40 * MIB, S1).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(y.ptr, x.ptr, "the mapped gap is preferred to new pages");
    assert_eq!(sim.driver_stats().vmm_calls(), calls, "no VMM call");
    assert_eq!(waits(&sim), 1, "stream 1 waits for stream 0");
    assert_eq!(a.stats().num_stream_waits, 1);

    // Freed and taken again on stream 1: the best fit is perfect (mapped,
    // its only hazard is stream 1's own work), so no wait.
    a.free(y.ptr).unwrap();
    let z = a.allocate(40 * MIB, S1).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(z.ptr, x.ptr);
    assert_eq!(waits(&sim), 1, "no wait on the freeing stream");

    // Back to stream 0: it must wait for stream 1's work now.
    a.free(z.ptr).unwrap();
    let w = a.allocate(40 * MIB, S0).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(w.ptr, x.ptr);
    assert_eq!(waits(&sim), 2, "stream 0 waits for stream 1");
    assert_eq!(a.stats().num_stream_waits, 2);
    assert_eq!(sim.driver_stats().count(CallKind::StreamSynchronize), 0);

    a.free(w.ptr).unwrap();
    a.free(sep.ptr).unwrap();
    a.check_invariants().unwrap();
}
