//! Statistics in PyTorch's vocabulary (`torch.cuda.memory_stats()`).

use quilt_vmm::DriverStats;

/// One statistic: its current value, its peak, and the totals that moved it.
///
/// Invariant: `current == allocated - freed` and `peak >= current`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Highest value since creation (or the last [`Stat::reset_peak`]).
    pub peak: u64,
    /// Total added over the allocator's life.
    pub allocated: u64,
    /// Total removed over the allocator's life.
    pub freed: u64,
}

impl Stat {
    /// Add `n`.
    pub fn increase(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    /// Remove `n` (saturating: a bug shows up in the invariant checker, not as a panic).
    pub fn decrease(&mut self, n: u64) {
        self.current = self.current.saturating_sub(n);
        self.freed += n;
    }

    /// Set the peak to the current value.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

impl AllocatorStats {
    /// Sets every peak to its current value (`torch.cuda.reset_peak_memory_stats`).
    pub fn reset_peaks(&mut self) {
        for s in [
            &mut self.allocated_bytes,
            &mut self.requested_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
        ] {
            s.reset_peak();
        }
    }
}

/// Allocator statistics. Names follow `torch.cuda.memory_stats()`:
/// - *allocated*: bytes and blocks handed out to live allocations (rounded sizes);
/// - *requested*: the bytes the caller asked for, before rounding;
/// - *reserved*: physical memory held from the driver (segments, or pages);
/// - *active*: blocks in use, including freed blocks still waiting on other streams;
/// - *inactive_split*: free blocks that cannot be released because they are part
///   of a segment that is still partly in use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Allocated bytes.
    pub allocated_bytes: Stat,
    /// Requested (unrounded) bytes.
    pub requested_bytes: Stat,
    /// Reserved bytes.
    pub reserved_bytes: Stat,
    /// Active bytes.
    pub active_bytes: Stat,
    /// Inactive-split bytes.
    pub inactive_split_bytes: Stat,
    /// Live allocations.
    pub allocation: Stat,
    /// Segments (classic) or physical chunks (Quilt) held.
    pub segment: Stat,
    /// Active blocks.
    pub active: Stat,
    /// Inactive-split blocks.
    pub inactive_split: Stat,
    /// Allocations that had to free cached memory and retry.
    pub num_alloc_retries: u64,
    /// Requests that ended in out-of-memory.
    pub num_ooms: u64,
    /// Times a stream was made to wait on another stream's event so that memory
    /// freed there could be reused here.
    pub num_stream_waits: u64,
    /// Frees of blocks recorded on other streams (`record_stream`) released
    /// before those streams' work was known complete, to serve an
    /// allocation that would otherwise run out of memory: that memory is
    /// reused behind a wait for those streams. (Without that pressure such a
    /// free is held until the work completes, as PyTorch's allocator does.)
    pub num_recorded_frees_forced: u64,
    /// Driver calls and driver time of the backend underneath.
    pub driver: DriverStats,
}

/// Counters of growable buffers and sleep/wake (see
/// `QuiltAllocator::serving_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServingStats {
    /// Growable buffers live now.
    pub growables: u64,
    /// Growable buffers created.
    pub created: u64,
    /// `grow_to` calls that grew a buffer.
    pub grows: u64,
    /// Grows that found every page they reached already mapped (mapped
    /// ahead, or left by a shrink): no driver call.
    pub grows_already_mapped: u64,
    /// Pages grows found already mapped.
    pub pages_found_mapped: u64,
    /// Pages grows had to map themselves.
    pub pages_mapped_on_grow: u64,
    /// Pages mapped ahead of a buffer's end.
    pub pages_mapped_ahead: u64,
    /// Spare pages (mapped ahead or left by a shrink) reclaimed for other use.
    pub spare_pages_reclaimed: u64,
    /// `shrink_to` calls that shrank a buffer.
    pub shrinks: u64,
    /// Tags put to sleep.
    pub sleeps: u64,
    /// Tags woken.
    pub wakes: u64,
    /// Bytes copied to the host by sleeps.
    pub bytes_offloaded: u64,
    /// Bytes copied back to the device by wakes.
    pub bytes_restored: u64,
    /// Stream synchronisations made by sleeps (the work on the memory must be
    /// complete before it is copied or unmapped).
    pub sleep_syncs: u64,
    /// Buffers created in the range of a released one (its pages still
    /// mapped: see `Recycle`).
    pub recycled: u64,
    /// Tags the offload tier put to sleep.
    pub tier_offloads: u64,
    /// Requests the offload tier saved from running out of memory.
    pub tier_rescues: u64,
}
