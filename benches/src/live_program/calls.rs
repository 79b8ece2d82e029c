//! The double's driver calls (counted by entry point, `crates/cuda-double/src/counters.rs`)
//! grouped into the kinds the live table shows.

use std::collections::BTreeMap;

use serde::Serialize;

/// The seven VMM calls.
pub const VMM: [&str; 7] = [
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
    "cuMemAddressFree",
];

/// `cudaMalloc` and `cudaFree` as the driver sees them (`cuMemFree` waits
/// for all queued work first, as `cudaFree` does).
pub const MALLOC: [&str; 2] = ["cuMemAlloc_v2", "cuMemFree_v2"];

/// Synchronisations: the host waits for a stream, a context (the whole
/// device) or an event.
pub const SYNCS: [&str; 4] = [
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuCtxSynchronize_v2",
    "cuEventSynchronize",
];

/// Event records and queries.
pub const EVENTS: [&str; 2] = ["cuEventRecord", "cuEventQuery"];

/// One stream waiting for another's event.
pub const WAITS: [&str; 1] = ["cuStreamWaitEvent"];

/// Kernel launches (queued by the runtime face as work that computes nothing).
pub const LAUNCHES: [&str; 1] = ["quiltDoubleLaunchOpaqueWork"];

/// A run's driver calls by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CallKinds {
    /// Every driver call.
    pub total: u64,
    /// The seven VMM calls ([`VMM`]).
    pub vmm: u64,
    /// `cuMemAlloc` and `cuMemFree` ([`MALLOC`]).
    pub malloc: u64,
    /// Synchronisations ([`SYNCS`]).
    pub syncs: u64,
    /// Event records and queries ([`EVENTS`]).
    pub events: u64,
    /// Stream waits ([`WAITS`]).
    pub waits: u64,
    /// Kernel launches ([`LAUNCHES`]).
    pub launches: u64,
}

impl CallKinds {
    /// The kinds of `calls` (by entry point).
    pub fn of(calls: &BTreeMap<String, u64>) -> CallKinds {
        let sum =
            |names: &[&str]| -> u64 { names.iter().filter_map(|n| calls.get(*n)).copied().sum() };
        CallKinds {
            total: calls.values().sum(),
            vmm: sum(&VMM),
            malloc: sum(&MALLOC),
            syncs: sum(&SYNCS),
            events: sum(&EVENTS),
            waits: sum(&WAITS),
            launches: sum(&LAUNCHES),
        }
    }

    /// The calls that get or give back device memory: VMM and malloc.
    pub fn memory(&self) -> u64 {
        self.vmm + self.malloc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_add_up_their_entry_points() {
        let calls: BTreeMap<String, u64> = [
            ("cuMemCreate", 3),
            ("cuMemMap", 3),
            ("cuMemAlloc_v2", 5),
            ("cuCtxSynchronize", 2),
            ("cuStreamSynchronize", 1),
            ("cuEventRecord", 4),
            ("cuCtxGetCurrent", 100),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let k = CallKinds::of(&calls);
        assert_eq!((k.vmm, k.malloc, k.memory()), (6, 5, 11));
        assert_eq!((k.syncs, k.events, k.waits), (3, 4, 0));
        assert_eq!(k.total, 118);
    }
}
