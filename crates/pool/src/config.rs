//! The pool's policies: growth ahead of demand and the memory limit.

/// How much the pool holds at most.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MemoryLimit {
    /// The whole device.
    Device,
    /// At most this many bytes (rounded down to whole pages).
    Bytes(u64),
    /// At most this fraction of the device's total memory (clamped to 0..=1).
    Fraction(f64),
}

impl MemoryLimit {
    /// The limit in bytes on a device of `total` bytes.
    pub fn resolve(self, total: u64) -> u64 {
        match self {
            MemoryLimit::Device => total,
            MemoryLimit::Bytes(b) => b.min(total),
            MemoryLimit::Fraction(f) => {
                let f = if f.is_nan() { 0.0 } else { f.clamp(0.0, 1.0) };
                (total as f64 * f) as u64
            }
        }
    }
}

/// How big a chunk the pool creates when it must grow by `needed` pages.
///
/// A chunk holds `needed` pages plus a margin ahead of demand of
/// `held / ahead_divisor` pages (0 = no margin), at least `min_chunk_bytes` and
/// at most `max_chunk_bytes` in all (the maximum never cuts below `needed`).
/// The margin is proportional to what the pool holds, so the memory it wastes is
/// a bounded fraction of the total while the number of `cuMemCreate` calls grows
/// only logarithmically with the peak.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrowthPolicy {
    /// The smallest chunk in bytes (0 = one page).
    pub min_chunk_bytes: u64,
    /// The largest chunk in bytes, unless a single request needs more.
    pub max_chunk_bytes: u64,
    /// Margin ahead of demand: `held / ahead_divisor` pages; 0 disables it.
    pub ahead_divisor: u64,
    /// The largest single handle in bytes (0 = no limit): a growth larger than
    /// this creates several handles (GMLake and PyTorch's expandable segments
    /// create one handle per page).
    pub max_handle_bytes: u64,
}

impl Default for GrowthPolicy {
    fn default() -> Self {
        GrowthPolicy {
            min_chunk_bytes: 0,
            max_chunk_bytes: 1 << 30,
            ahead_divisor: 256,
            max_handle_bytes: 0,
        }
    }
}

impl GrowthPolicy {
    /// Exactly what is needed, one handle per page (GMLake: one 2 MiB
    /// `cuMemCreate` per page).
    pub fn page_per_chunk() -> GrowthPolicy {
        GrowthPolicy {
            min_chunk_bytes: 0,
            max_chunk_bytes: 0,
            ahead_divisor: 0,
            max_handle_bytes: 1,
        }
    }

    /// Pages per handle (at least 1) when handles are limited, else `None`.
    pub fn handle_pages(&self, page_size: u64) -> Option<u64> {
        (self.max_handle_bytes > 0).then(|| (self.max_handle_bytes / page_size.max(1)).max(1))
    }

    /// Pages of the chunk to create when `needed` pages are missing and the pool
    /// holds `held` pages of `page_size` bytes.
    pub fn chunk_pages(&self, needed: u64, held: u64, page_size: u64) -> u64 {
        let page = page_size.max(1);
        let margin = held.checked_div(self.ahead_divisor).unwrap_or(0);
        let want = needed
            .saturating_add(margin)
            .max(self.min_chunk_bytes / page);
        want.min((self.max_chunk_bytes / page).max(needed))
    }
}

/// The pool's configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PoolConfig {
    /// Chunk sizes when growing.
    pub growth: GrowthPolicy,
    /// The most the pool holds.
    pub limit: MemoryLimit,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            growth: GrowthPolicy::default(),
            limit: MemoryLimit::Device,
        }
    }
}
