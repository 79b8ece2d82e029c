//! The minimum device capacity at which a replay completes, found by bisection.

use crate::live::PAGE;
use crate::replay::{replay_fresh, ReplayConfig, ReplayError};

/// A probe of the bisection failed (an allocator error other than out-of-memory).
#[derive(Debug, thiserror::Error)]
#[error("probe at capacity {capacity} bytes: {source}")]
pub struct ProbeError {
    /// The capacity of the failing probe.
    pub capacity: u64,
    /// What failed.
    #[source]
    pub source: Box<ReplayError>,
}
use crate::trace::Trace;

/// The smallest capacity, a whole number of 2 MiB pages, at which `trace`
/// replays to completion through the allocator `allocator` (a fresh simulated
/// device and a fresh allocator per probe), searched from `peak_live_bytes`
/// (below it no replay can complete) up to twice `peak_live_bytes`. `None` when
/// it does not complete even at the top of that range.
///
/// Bisection assumes that completing is monotone in capacity, which holds for
/// every allocator here on the traces we measured but is not guaranteed: the
/// answer is the threshold bisection finds. Series recording and timing are
/// turned off in the probes.
pub fn min_capacity_bytes(
    trace: &Trace,
    allocator: &str,
    peak_live_bytes: u64,
    config: &ReplayConfig,
) -> Result<Option<u64>, ProbeError> {
    if peak_live_bytes == 0 {
        return Ok(Some(0));
    }
    let probe_config = ReplayConfig {
        record_series: false,
        time_ops: false,
        find_races: false,
        ..*config
    };
    let completes = |pages: u64| -> Result<bool, ProbeError> {
        let capacity = pages * PAGE;
        replay_fresh(trace, allocator, capacity, &probe_config)
            .map(|r| r.completed)
            .map_err(|source| ProbeError {
                capacity,
                source: Box::new(source),
            })
    };
    // Invariant: `lo` pages fail (below the live peak nothing can complete),
    // `hi` pages complete.
    let mut lo = peak_live_bytes.div_ceil(PAGE) - 1;
    let mut hi = (2 * peak_live_bytes).div_ceil(PAGE).max(lo + 1);
    if !completes(hi)? {
        return Ok(None);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if completes(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi * PAGE))
}
