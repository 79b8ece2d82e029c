//! Live-memory accounting shared by the replay engine and trace statistics:
//! the live requested bytes and the page-granular physical lower bound.

use std::collections::{HashMap, HashSet};

use quilt_alloc::{MIN_BLOCK_SIZE, SMALL_SIZE};

use crate::trace::{Event, Trace};

/// The page size of the ideal bound: the driver's 2 MiB granularity.
pub const PAGE: u64 = 2 << 20;

/// Tracks the live set's figures as allocations come and go.
///
/// Invariants: `live_bytes` is the sum of the requested sizes of live
/// allocations; `large_bytes` the sum of those above 1 MiB; `small_bytes` the sum
/// of the others, each rounded up to 512 bytes; the peaks are maxima of the
/// current values over every state seen.
#[derive(Clone, Debug, Default)]
pub struct LiveTracker {
    /// Live requested bytes now.
    pub live_bytes: u64,
    /// The most `live_bytes` has been.
    pub peak_live_bytes: u64,
    large_bytes: u64,
    small_bytes: u64,
    /// The most [`LiveTracker::ideal_now`] has been.
    pub peak_ideal_bytes: u64,
}

impl LiveTracker {
    /// Nothing live.
    pub fn new() -> Self {
        Self::default()
    }

    /// An allocation of `size` requested bytes became live.
    pub fn add(&mut self, size: u64) {
        self.live_bytes += size;
        if size > SMALL_SIZE {
            self.large_bytes += size;
        } else {
            self.small_bytes += size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE;
        }
        self.peak_live_bytes = self.peak_live_bytes.max(self.live_bytes);
        self.peak_ideal_bytes = self.peak_ideal_bytes.max(self.ideal_now());
    }

    /// An allocation of `size` requested bytes was freed.
    pub fn remove(&mut self, size: u64) {
        self.live_bytes = self.live_bytes.saturating_sub(size);
        if size > SMALL_SIZE {
            self.large_bytes = self.large_bytes.saturating_sub(size);
        } else {
            self.small_bytes = self
                .small_bytes
                .saturating_sub(size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE);
        }
    }

    /// The physical memory a page-granular allocator needs at least for the
    /// live set now: whole 2 MiB pages for the sum of the large requests (summed
    /// before rounding: neighbours share boundary pages), plus whole pages for
    /// the sum of the small requests, each rounded to 512 bytes.
    pub fn ideal_now(&self) -> u64 {
        self.large_bytes.div_ceil(PAGE) * PAGE + self.small_bytes.div_ceil(PAGE) * PAGE
    }
}

/// Figures of a trace that need no allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceStats {
    /// Events.
    pub events: usize,
    /// Allocation events.
    pub allocs: usize,
    /// Pre-existing allocations.
    pub preexisting: usize,
    /// Peak of the live requested bytes.
    pub peak_live_bytes: u64,
    /// Peak of the page-granular lower bound ([`LiveTracker::ideal_now`]).
    pub ideal_bytes: u64,
    /// The largest allocation.
    pub max_alloc_bytes: u64,
    /// Distinct allocation sizes.
    pub distinct_sizes: usize,
    /// Distinct streams.
    pub streams: usize,
}

/// Compute [`TraceStats`] for one pass over `trace` (frees of unknown ids are skipped).
pub fn trace_stats(trace: &Trace) -> TraceStats {
    let mut tracker = LiveTracker::new();
    let mut sizes: HashMap<u64, u64> = HashMap::new();
    // Serving events: growable buffers' lengths, tagged allocations' tags,
    // and the sizes of sleeping tags' allocations (not live while asleep).
    let mut lengths: HashMap<u64, u64> = HashMap::new();
    let mut tags: HashMap<u64, u64> = HashMap::new();
    let mut asleep: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut distinct = HashSet::new();
    let mut streams = HashSet::new();
    let mut allocs = 0;
    let mut max_alloc = 0;
    for event in &trace.events {
        match *event {
            Event::Alloc { id, size, stream } => {
                allocs += 1;
                max_alloc = max_alloc.max(size);
                distinct.insert(size);
                streams.insert(stream);
                sizes.insert(id, size);
                tracker.add(size);
            }
            Event::Free { id } => {
                tags.remove(&id);
                if let Some(size) = sizes.remove(&id) {
                    tracker.remove(size);
                }
            }
            Event::AllocTagged {
                id,
                size,
                stream,
                tag,
            } => {
                allocs += 1;
                max_alloc = max_alloc.max(size);
                distinct.insert(size);
                streams.insert(stream);
                sizes.insert(id, size);
                tags.insert(id, tag);
                tracker.add(size);
            }
            Event::CreateGrowable { id, stream, .. } => {
                streams.insert(stream);
                lengths.insert(id, 0);
            }
            Event::Grow { id, bytes } | Event::Shrink { id, bytes } => {
                if let Some(len) = lengths.get_mut(&id) {
                    tracker.remove(*len);
                    tracker.add(bytes);
                    *len = bytes;
                    max_alloc = max_alloc.max(bytes);
                    distinct.insert(bytes);
                }
            }
            Event::ReleaseGrowable { id } => {
                if let Some(len) = lengths.remove(&id) {
                    tracker.remove(len);
                }
            }
            Event::Sleep { tag } => {
                let members: Vec<u64> = tags
                    .iter()
                    .filter(|&(_, t)| *t == tag)
                    .filter_map(|(id, _)| sizes.get(id).copied())
                    .collect();
                for &size in &members {
                    tracker.remove(size);
                }
                asleep.insert(tag, members);
            }
            Event::Wake { tag } => {
                for size in asleep.remove(&tag).unwrap_or_default() {
                    tracker.add(size);
                }
            }
            Event::RecordStream { stream, .. } => {
                streams.insert(stream);
            }
        }
    }
    TraceStats {
        events: trace.events.len(),
        allocs,
        preexisting: trace.preexisting,
        peak_live_bytes: tracker.peak_live_bytes,
        ideal_bytes: tracker.peak_ideal_bytes,
        max_alloc_bytes: max_alloc,
        distinct_sizes: distinct.len(),
        streams: streams.len(),
    }
}
