//! # quilt-pool: the page-granularity physical pool
//!
//! Physical memory is created in **chunks** (one [`Vmm::create`] handle holding
//! many pages of the driver's granularity) and handed out **page by page** as
//! [`PageRun`]s: runs of neighbouring pages inside one chunk, each of which the
//! caller maps with one `cuMemMap` at an offset inside the chunk's handle.
//!
//! - [`PagePool::take`] hands out `n` free pages, preferring long runs inside one
//!   chunk; it never needs them to be contiguous.
//! - [`PagePool::give_back`] returns pages.
//! - [`PagePool::grow`] creates a chunk (or one handle per page, by policy) ahead of demand by the [`GrowthPolicy`],
//!   falling back to exactly the missing pages when the device cannot create the
//!   larger chunk. A failed growth leaves the pool exactly as it was.
//! - [`PagePool::trim`] releases chunks whose pages are all free, down to a threshold.
//! - A [`MemoryLimit`] caps the bytes the pool may hold.
//!
//! Invariants (checked by [`PagePool::check_invariants`]): every page of every held
//! chunk is either free (its bit set in the chunk's free map) or handed out, never
//! both; each chunk's `free_count` equals the number of set bits in its map; the
//! pool's page totals equal the sums over chunks; held bytes never exceed the limit.
//!
//! The pool is `Send + Sync`. Its state sits behind one mutex: the pool is touched
//! only when pages are mapped or unmapped (a driver call follows anyway), never on
//! an allocator's cache-hit path, so the lock does not serialise the hot path.
#![forbid(unsafe_code)]

mod chunk;
mod config;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use quilt_vmm::{PhysHandle, Vmm, VmmError};

use chunk::Chunk;
pub use config::{GrowthPolicy, MemoryLimit, PoolConfig};

/// Identifies a chunk of the pool for as long as the chunk is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkId(pub u32);

/// A run of neighbouring pages inside one chunk: pages `first_page ..
/// first_page + pages` of the chunk, i.e. bytes `first_page * page_size ..` of
/// its handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageRun {
    /// The chunk.
    pub chunk: ChunkId,
    /// The chunk's driver handle (to pass to `cuMemMap`).
    pub handle: PhysHandle,
    /// Index of the first page inside the chunk.
    pub first_page: u64,
    /// Number of pages (at least 1).
    pub pages: u64,
}

/// Errors of the pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Fewer free pages than asked for (no growth attempted by `take`).
    #[error("pool has {free} free pages, {requested} requested")]
    NotEnoughFreePages {
        /// Pages asked for.
        requested: u64,
        /// Pages free.
        free: u64,
    },
    /// Growth would exceed the memory limit or the device.
    #[error("cannot grow by {requested} pages: limit allows {allowed} more")]
    LimitReached {
        /// Pages asked for.
        requested: u64,
        /// Pages the limit and the device still allow.
        allowed: u64,
    },
    /// A run handed back that the pool did not hand out.
    #[error("invalid page run {0:?}: not handed out by this pool")]
    InvalidRun(PageRun),
    /// The driver failed.
    #[error("driver: {0}")]
    Driver(#[from] VmmError),
    /// The pool's lock was poisoned by a panic on another thread.
    #[error("pool state poisoned by a panic on another thread")]
    Poisoned,
}

/// Figures of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Chunks held.
    pub chunks: u64,
    /// Pages held (free or handed out).
    pub total_pages: u64,
    /// Pages free.
    pub free_pages: u64,
    /// Bytes held (`total_pages * page_size`).
    pub held_bytes: u64,
    /// Highest `held_bytes` so far.
    pub peak_held_bytes: u64,
    /// Chunks created so far.
    pub chunks_created: u64,
    /// Chunks released so far.
    pub chunks_released: u64,
}

struct PoolState {
    chunks: Vec<Option<Chunk>>,
    free_slots: Vec<u32>,
    /// (free pages, slot) of every held chunk with a free page.
    by_free: BTreeSet<(u64, u32)>,
    chunk_count: u64,
    total_pages: u64,
    free_pages: u64,
    peak_pages: u64,
    created: u64,
    released: u64,
}

/// The physical page pool of one device. See the crate documentation.
#[derive(Debug)]
pub struct PagePool {
    vmm: Arc<dyn Vmm>,
    page_size: u64,
    limit_pages: u64,
    config: PoolConfig,
    state: Mutex<PoolState>,
}

impl PoolState {
    /// Mark pages of chunk `slot` used (or free), keeping the index and totals.
    fn mark(&mut self, slot: u32, start: u64, n: u64, used: bool) {
        let Some(Some(c)) = self.chunks.get_mut(slot as usize) else {
            return;
        };
        let old = c.free_count;
        if used {
            c.mark_used(start, n);
            self.free_pages -= n;
        } else {
            c.mark_free(start, n);
            self.free_pages += n;
        }
        let new = c.free_count;
        self.by_free.remove(&(old, slot));
        if new > 0 {
            self.by_free.insert((new, slot));
        }
    }
}

impl std::fmt::Debug for PoolState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolState")
            .field("chunks", &self.chunks.iter().flatten().count())
            .field("total_pages", &self.total_pages)
            .field("free_pages", &self.free_pages)
            .finish()
    }
}

impl PagePool {
    /// A pool over `vmm` with no memory held yet. Queries the device's total
    /// memory once to resolve a fractional limit.
    pub fn new(vmm: Arc<dyn Vmm>, config: PoolConfig) -> Result<PagePool, PoolError> {
        let page_size = vmm.granularity();
        let total = vmm.mem_info()?.total;
        let limit_bytes = config.limit.resolve(total);
        let limit_pages = limit_bytes / page_size.max(1);
        Ok(PagePool {
            vmm,
            page_size,
            limit_pages,
            config,
            state: Mutex::new(PoolState {
                chunks: Vec::new(),
                free_slots: Vec::new(),
                by_free: BTreeSet::new(),
                chunk_count: 0,
                total_pages: 0,
                free_pages: 0,
                peak_pages: 0,
                created: 0,
                released: 0,
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, PoolState>, PoolError> {
        self.state.lock().map_err(|_| PoolError::Poisoned)
    }

    /// The page size (the driver's granularity) in bytes.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The most pages the pool may hold (its memory limit, in pages).
    pub fn limit_pages(&self) -> u64 {
        self.limit_pages
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Current figures.
    pub fn stats(&self) -> PoolStats {
        match self.lock() {
            Ok(s) => PoolStats {
                chunks: s.chunk_count,
                total_pages: s.total_pages,
                free_pages: s.free_pages,
                held_bytes: s.total_pages * self.page_size,
                peak_held_bytes: s.peak_pages * self.page_size,
                chunks_created: s.created,
                chunks_released: s.released,
            },
            Err(_) => PoolStats::default(),
        }
    }

    /// Pages free now.
    pub fn free_pages(&self) -> u64 {
        self.lock().map(|s| s.free_pages).unwrap_or(0)
    }

    /// Pages held now (free or handed out).
    pub fn total_pages(&self) -> u64 {
        self.lock().map(|s| s.total_pages).unwrap_or(0)
    }

    /// Pages the pool could still add: the smaller of what its limit allows and
    /// what the device reports free (one `cuMemGetInfo`).
    pub fn growable_pages(&self) -> Result<u64, PoolError> {
        let held = self.total_pages();
        let by_limit = self.limit_pages.saturating_sub(held);
        let device_free = self.vmm.mem_info()?.free / self.page_size.max(1);
        Ok(by_limit.min(device_free))
    }

    /// Hand out `n` free pages as runs, preferring long runs inside one chunk.
    /// Fails (changing nothing) when fewer than `n` pages are free.
    pub fn take(&self, n: u64) -> Result<Vec<PageRun>, PoolError> {
        let mut s = self.lock()?;
        if n == 0 {
            return Ok(Vec::new());
        }
        if s.free_pages < n {
            return Err(PoolError::NotEnoughFreePages {
                requested: n,
                free: s.free_pages,
            });
        }
        // A chunk that holds one free run of n pages serves the request with
        // one run: look at the chunks with the fewest free pages that could
        // (at most 32 of them), for the smallest such run.
        let mut out = Vec::new();
        let mut best: Option<(u32, u64, u64)> = None; // (slot, start, len)
        for &(_, slot) in s.by_free.range((n, 0)..).take(32) {
            let Some(Some(c)) = s.chunks.get(slot as usize) else {
                continue;
            };
            if let Some((start, len)) = c.smallest_run_at_least(n) {
                if best.is_none_or(|b| len < b.2) {
                    best = Some((slot, start, len));
                }
                if len == n {
                    break;
                }
            }
        }
        if let Some((slot, start, _)) = best {
            let handle = s.chunks[slot as usize].as_ref().map(|c| c.handle);
            if let Some(handle) = handle {
                s.mark(slot, start, n, true);
                out.push(PageRun {
                    chunk: ChunkId(slot),
                    handle,
                    first_page: start,
                    pages: n,
                });
            }
        } else {
            // Otherwise take the longest runs first, from the chunks with most free pages.
            let mut left = n;
            while left > 0 {
                let Some(&(_, slot)) = s.by_free.iter().next_back() else {
                    break;
                };
                let Some(Some(c)) = s.chunks.get(slot as usize) else {
                    break;
                };
                let handle = c.handle;
                let mut runs = c.free_runs();
                runs.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                for (start, len) in runs {
                    if left == 0 {
                        break;
                    }
                    let k = len.min(left);
                    s.mark(slot, start, k, true);
                    out.push(PageRun {
                        chunk: ChunkId(slot),
                        handle,
                        first_page: start,
                        pages: k,
                    });
                    left -= k;
                }
            }
        }
        Ok(out)
    }

    /// Return runs handed out by [`PagePool::take`]. Every run is validated
    /// first; on error nothing changes.
    pub fn give_back(&self, runs: &[PageRun]) -> Result<(), PoolError> {
        let mut s = self.lock()?;
        for r in runs {
            let ok = match s.chunks.get(r.chunk.0 as usize) {
                Some(Some(c)) => {
                    c.handle == r.handle && r.pages > 0 && c.all_used(r.first_page, r.pages)
                }
                _ => false,
            };
            if !ok {
                return Err(PoolError::InvalidRun(*r));
            }
        }
        // Validate against overlaps among the runs themselves.
        let mut sorted: Vec<&PageRun> = runs.iter().collect();
        sorted.sort_unstable_by_key(|r| (r.chunk, r.first_page));
        for w in sorted.windows(2) {
            if w[0].chunk == w[1].chunk && w[0].first_page + w[0].pages > w[1].first_page {
                return Err(PoolError::InvalidRun(*w[1]));
            }
        }
        for r in runs {
            s.mark(r.chunk.0, r.first_page, r.pages, false);
        }
        Ok(())
    }

    /// Grow the pool so that at least `needed` more pages are free: one chunk of
    /// `needed` pages plus the growth policy's margin, or exactly `needed` when
    /// the larger chunk cannot be created. Returns the pages added. On error the
    /// pool is exactly as it was.
    pub fn grow(&self, needed: u64) -> Result<u64, PoolError> {
        if needed == 0 {
            return Ok(0);
        }
        let held = self.total_pages();
        let by_limit = self.limit_pages.saturating_sub(held);
        if needed > by_limit {
            return Err(PoolError::LimitReached {
                requested: needed,
                allowed: by_limit,
            });
        }
        let want = self
            .config
            .growth
            .chunk_pages(needed, held, self.page_size)
            .min(by_limit)
            .max(needed);
        let created = match self.create_handles(want) {
            Ok(c) => c,
            Err(PoolError::Driver(e)) if e.is_out_of_memory() && want > needed => {
                self.create_handles(needed)?
            }
            Err(e) => return Err(e),
        };
        let mut s = match self.lock() {
            Ok(s) => s,
            Err(e) => {
                for (h, _) in created {
                    let _ = self.vmm.release(h);
                }
                return Err(e);
            }
        };
        let mut pages = 0;
        for (handle, n) in created {
            let chunk = Chunk::new(handle, n);
            let slot = if let Some(slot) = s.free_slots.pop() {
                s.chunks[slot as usize] = Some(chunk);
                slot
            } else {
                s.chunks.push(Some(chunk));
                (s.chunks.len() - 1) as u32
            };
            s.by_free.insert((n, slot));
            s.chunk_count += 1;
            s.total_pages += n;
            s.free_pages += n;
            s.created += 1;
            pages += n;
        }
        s.peak_pages = s.peak_pages.max(s.total_pages);
        tracing::debug!(pages, "pool grew");
        Ok(pages)
    }

    /// Create `pages` pages as one handle, or as several when the growth policy
    /// limits the handle size. All or nothing: on error, the handles created
    /// so far are released.
    fn create_handles(&self, pages: u64) -> Result<Vec<(PhysHandle, u64)>, PoolError> {
        let per = self
            .config
            .growth
            .handle_pages(self.page_size)
            .unwrap_or(pages)
            .max(1);
        let mut out = Vec::new();
        let mut left = pages;
        while left > 0 {
            let n = left.min(per);
            match self.vmm.create(n * self.page_size) {
                Ok(h) => out.push((h, n)),
                Err(e) => {
                    for (h, _) in out {
                        let _ = self.vmm.release(h);
                    }
                    return Err(e.into());
                }
            }
            left -= n;
        }
        Ok(out)
    }

    /// Release chunks whose pages are all free, largest first, while the pool
    /// holds more than `keep_bytes`. Returns the bytes released. A failing
    /// release keeps that chunk (and stops).
    pub fn trim(&self, keep_bytes: u64) -> Result<u64, PoolError> {
        let mut s = self.lock()?;
        let keep_pages = keep_bytes / self.page_size.max(1);
        let mut candidates: Vec<(u64, usize)> = s
            .chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                c.as_ref()
                    .filter(|c| c.free_count == c.pages)
                    .map(|c| (c.pages, i))
            })
            .collect();
        candidates.sort_unstable_by(|a, b| b.cmp(a));
        let mut released = 0;
        for (pages, slot) in candidates {
            if s.total_pages <= keep_pages {
                break;
            }
            let Some(Some(c)) = s.chunks.get(slot) else {
                continue;
            };
            self.vmm.release(c.handle)?;
            s.chunks[slot] = None;
            s.free_slots.push(slot as u32);
            s.by_free.remove(&(pages, slot as u32));
            s.chunk_count -= 1;
            s.total_pages -= pages;
            s.free_pages -= pages;
            s.released += 1;
            released += pages * self.page_size;
        }
        Ok(released)
    }

    /// True when page `page` of chunk `chunk` is held and handed out.
    pub fn is_in_use(&self, chunk: ChunkId, page: u64) -> bool {
        match self.lock() {
            Ok(s) => match s.chunks.get(chunk.0 as usize) {
                Some(Some(c)) => page < c.pages && !c.is_free(page),
                _ => false,
            },
            Err(_) => false,
        }
    }

    /// Every page handed out now, as (chunk, page index), in order.
    pub fn pages_in_use(&self) -> Vec<(ChunkId, u64)> {
        let mut out = Vec::new();
        if let Ok(s) = self.lock() {
            for (i, c) in s.chunks.iter().enumerate() {
                if let Some(c) = c {
                    for p in 0..c.pages {
                        if !c.is_free(p) {
                            out.push((ChunkId(i as u32), p));
                        }
                    }
                }
            }
        }
        out
    }

    /// Check the pool's invariants (see the crate documentation).
    pub fn check_invariants(&self) -> Result<(), String> {
        let s = self.lock().map_err(|e| e.to_string())?;
        let mut total = 0;
        let mut free = 0;
        for (i, c) in s.chunks.iter().enumerate() {
            if let Some(c) = c {
                let bits = c.count_free();
                if bits != c.free_count {
                    return Err(format!(
                        "chunk {i}: free_count {} but {bits} free bits",
                        c.free_count
                    ));
                }
                total += c.pages;
                free += c.free_count;
            } else if !s.free_slots.contains(&(i as u32)) {
                return Err(format!("empty chunk slot {i} not in the free-slot list"));
            }
        }
        let indexed: BTreeSet<(u64, u32)> = s
            .chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| {
                c.as_ref()
                    .filter(|c| c.free_count > 0)
                    .map(|c| (c.free_count, i as u32))
            })
            .collect();
        if indexed != s.by_free {
            return Err("free-page index out of date".to_string());
        }
        if s.chunk_count != s.chunks.iter().flatten().count() as u64 {
            return Err("chunk count out of date".to_string());
        }
        if total != s.total_pages || free != s.free_pages {
            return Err(format!(
                "pool totals {} / {} free, chunks sum to {total} / {free}",
                s.total_pages, s.free_pages
            ));
        }
        if s.total_pages > self.limit_pages {
            return Err(format!(
                "pool holds {} pages over its limit {}",
                s.total_pages, self.limit_pages
            ));
        }
        Ok(())
    }
}

impl Drop for PagePool {
    fn drop(&mut self) {
        let state = match self.state.get_mut() {
            Ok(s) => s,
            Err(p) => p.into_inner(),
        };
        let in_use = state.total_pages - state.free_pages;
        if in_use > 0 {
            tracing::warn!(
                pages = in_use,
                "page pool dropped with pages still handed out"
            );
        }
        for c in state.chunks.iter_mut() {
            if let Some(c) = c.take() {
                if let Err(e) = self.vmm.release(c.handle) {
                    tracing::warn!(error = %e, "releasing a chunk at drop failed");
                }
            }
        }
        state.total_pages = 0;
        state.free_pages = 0;
    }
}

#[cfg(test)]
mod tests;
