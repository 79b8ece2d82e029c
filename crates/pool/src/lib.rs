//! # quilt-pool: the page-granularity physical pool
//!
//! The physical memory under the Quilt allocator: GPU memory created **one
//! handle per page** (one `cuMemCreate` of the page size, the driver's
//! granularity by default), under a memory limit, and handed out and taken
//! back page by page. The caller maps each page whole, at offset 0, with its
//! own `cuMemMap`, as CUDA's reference requires ("offset currently must be
//! zero") and as every production VMM allocator does: any page can later be
//! unmapped alone without touching its neighbours.
//!
//! It runs on any backend of [`quilt_vmm`] (CUDA, host memory, a simulated
//! device). A program that wants GPU memory takes `quilt-alloc`, which holds
//! one pool per device; this crate is for building on pages directly. It has
//! no feature flags, and no streams: which work still uses a page is the
//! allocator's business.
//!
//! ## A first program
//!
//! On the simulated device (no GPU; `quilt-pool` and `quilt-vmm` as
//! dependencies): pages created and handed out under a limit, mapped behind
//! one virtual range, a growth the limit refuses, the statistics.
//!
//! ```
//! use std::sync::Arc;
//!
//! use quilt_pool::{MemoryLimit, PagePool, PoolConfig, PoolError};
//! use quilt_vmm::{sim::SimVmm, Vmm};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // A simulated device of 1 GiB (no GPU), of which the pool may hold 64 MiB.
//!     // On a GPU: `Arc::new(quilt_vmm::cuda::CudaVmm::new(0)?)`.
//!     let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(1 << 30)?);
//!     let config = PoolConfig { limit: MemoryLimit::Bytes(64 << 20), ..PoolConfig::default() };
//!     let pool = PagePool::new(vmm.clone(), config)?;
//!     let page = pool.page_size(); // one `cuMemCreate` handle: 2 MiB here
//!
//!     // Pages are created on demand, then handed out; any eight will do.
//!     pool.grow(8)?;
//!     let pages = pool.take(8)?;
//!     // The caller maps each page whole, at offset 0, behind one virtual range.
//!     let va = vmm.reserve(8 * page, 0)?;
//!     for (i, p) in (0u64..).zip(&pages) {
//!         vmm.map(va + i * page, page, p.handle, 0)?;
//!     }
//!     vmm.set_access(va, 8 * page)?;
//!
//!     // Past the memory limit: refused with the figures, nothing changed.
//!     match pool.grow(100) {
//!         Err(PoolError::LimitReached { requested, allowed }) => {
//!             println!("refused: {requested} pages asked, the limit allows {allowed} more")
//!         }
//!         other => return Err(format!("expected the limit, got {other:?}").into()),
//!     }
//!
//!     vmm.unmap(va, 8 * page)?;
//!     vmm.address_free(va, 8 * page)?;
//!     pool.give_back(&pages)?;
//!     let stats = pool.stats();
//!     println!(
//!         "{} pages held, {} free, {} handles created",
//!         stats.total_pages, stats.free_pages, stats.handles_created
//!     );
//!     pool.trim(0)?; // release the free pages to the driver
//!     assert_eq!(pool.stats().held_bytes, 0);
//!     Ok(())
//! }
//! ```
//!
//! It prints `refused: 100 pages asked, the limit allows 24 more` and
//! `8 pages held, 8 free, 8 handles created`.
//!
//! ## On a GPU
//!
//! The same over CUDA's driver: `quilt-vmm` with its `cuda` feature (on by
//! default) and a GPU (the doctests compile this program, and do not run
//! it). Streams, and cudarc's, appear one layer up: the front pages of
//! `quilt-vmm` and `quilt-alloc`.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use quilt_pool::{MemoryLimit, PagePool, PoolConfig};
//! use quilt_vmm::{cuda::CudaVmm, Vmm};
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     // Device 0 (libcuda loaded at run time); the pool may hold a quarter of it.
//!     let cuda = Arc::new(CudaVmm::new(0)?);
//!     let vmm: Arc<dyn Vmm> = cuda.clone();
//!     let config = PoolConfig { limit: MemoryLimit::Fraction(0.25), ..PoolConfig::default() };
//!     let pool = PagePool::new(vmm, config)?;
//!     let page = pool.page_size();
//!
//!     // Three pages, wherever the device has them, behind one range.
//!     pool.grow(3)?;
//!     let pages = pool.take(3)?;
//!     let va = cuda.reserve(3 * page, 0)?;
//!     for (i, p) in (0u64..).zip(&pages) {
//!         cuda.map(va + i * page, page, p.handle, 0)?;
//!     }
//!     cuda.set_access(va, 3 * page)?;
//!     cuda.copy_to_device(va, &vec![1u8; (3 * page) as usize])?; // one copy across three handles
//!
//!     cuda.unmap(va, 3 * page)?;
//!     cuda.address_free(va, 3 * page)?;
//!     pool.give_back(&pages)?;
//!     pool.trim(0)?;
//!     assert!(cuda.leak_report().is_empty());
//!     Ok(())
//! }
//! ```
//!
//! ## The pool
//!
//! - [`PagePool::take`] hands out `n` free pages; they never need to be
//!   contiguous in any sense.
//! - [`PagePool::give_back`] returns pages (validated first: a page not handed
//!   out, or named twice, changes nothing).
//! - [`PagePool::grow`] creates `needed` pages plus the [`GrowthPolicy`]'s
//!   margin ahead of demand, falling back to exactly `needed` when the device
//!   cannot create the margin. All or nothing: a failed growth releases what it
//!   created and leaves the pool as it was.
//! - [`PagePool::trim`] releases free pages down to a threshold.
//! - A [`MemoryLimit`] caps the bytes the pool may hold; the check and the
//!   commit of a growth happen under one lock.
//!
//! Invariants (checked by [`PagePool::check_invariants`]): every held page is
//! either free (its bit set and its id on the free stack, once) or handed out,
//! never both; the totals equal what they count; held bytes never exceed the
//! limit.
//!
//! The pool is `Send + Sync`; its state sits behind one mutex, taken only when
//! pages change hands (a driver call follows anyway), never on an allocator's
//! cache-hit path.
//!
//! ## Where to go next
//!
//! - `quilt-alloc`: the allocator on top (stitching pages into ranges,
//!   caching them, reclaiming them under streams' work).
//! - `docs/design.md` in the repository, §2: the pool as built, and the
//!   growth policy's reasoning.
#![forbid(unsafe_code)]

mod config;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bitvec::prelude::*;
use quilt_vmm::{PhysHandle, Vmm, VmmError};

pub use config::{GrowthPolicy, MemoryLimit, PageSize, PoolConfig};

/// Identifies a page of the pool for as long as the pool holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u32);

/// One page: its id in the pool and the driver handle to map (whole, at offset 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Page {
    /// The page's id.
    pub id: PageId,
    /// The page's driver handle (to pass to `cuMemMap`).
    pub handle: PhysHandle,
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
    /// Growth would exceed the memory limit.
    #[error("cannot grow by {requested} pages: limit allows {allowed} more")]
    LimitReached {
        /// Pages asked for.
        requested: u64,
        /// Pages the limit still allows.
        allowed: u64,
    },
    /// A new limit below what the pool already holds.
    #[error("a limit of {limit} pages is below the {held} pages held now")]
    LimitBelowHeld {
        /// The limit asked for, in pages.
        limit: u64,
        /// Pages held.
        held: u64,
    },
    /// A page handed back that the pool did not hand out (or named twice).
    #[error("invalid page {0:?}: not handed out by this pool")]
    InvalidPage(Page),
    /// The configured page size is not a multiple of the driver's granularity.
    #[error("page size {page_size:?} is not a non-zero multiple of the granularity {granularity}")]
    InvalidPageSize {
        /// The configured page size.
        page_size: PageSize,
        /// The driver's granularity.
        granularity: u64,
    },
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
    /// Pages held (free or handed out): one handle each.
    pub total_pages: u64,
    /// Pages free.
    pub free_pages: u64,
    /// Bytes held (`total_pages * page_size`).
    pub held_bytes: u64,
    /// Highest `held_bytes` so far.
    pub peak_held_bytes: u64,
    /// Handles created so far.
    pub handles_created: u64,
    /// Handles released so far.
    pub handles_released: u64,
    /// The page size in bytes (the size of every handle).
    pub page_size: u64,
    /// The most pages the pool may hold (its memory limit, in pages).
    pub limit_pages: u64,
    /// The device's total memory in bytes, as `cuMemGetInfo` said at
    /// construction: what a [`MemoryLimit`] is resolved against.
    pub device_total: u64,
}

struct PoolState {
    /// The handle of each held page, by id; `None` for a vacant id.
    slots: Vec<Option<PhysHandle>>,
    /// One bit per id: set when the page is held and free.
    free: BitVec<u64, Lsb0>,
    /// The free pages' ids (each once), taken from the top.
    free_stack: Vec<u32>,
    /// Vacant ids, reused by growth.
    vacant: Vec<u32>,
    total_pages: u64,
    peak_pages: u64,
    created: u64,
    released: u64,
}

impl PoolState {
    fn handle(&self, id: PageId) -> Option<PhysHandle> {
        self.slots.get(id.0 as usize).copied().flatten()
    }

    fn is_free(&self, id: PageId) -> bool {
        self.free.get(id.0 as usize).is_some_and(|b| *b)
    }

    fn set_free(&mut self, id: u32, free: bool) {
        if let Some(mut b) = self.free.get_mut(id as usize) {
            *b = free;
        }
    }

    /// Hold a new page with `handle`, free; returns its id.
    fn add(&mut self, handle: PhysHandle) -> u32 {
        let id = match self.vacant.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(handle);
                id
            }
            None => {
                self.slots.push(Some(handle));
                self.free.push(false);
                (self.slots.len() - 1) as u32
            }
        };
        self.set_free(id, true);
        self.free_stack.push(id);
        self.total_pages += 1;
        self.created += 1;
        id
    }
}

impl std::fmt::Debug for PoolState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolState")
            .field("total_pages", &self.total_pages)
            .field("free_pages", &self.free_stack.len())
            .finish()
    }
}

/// The physical page pool of one device. See the crate documentation.
#[derive(Debug)]
pub struct PagePool {
    vmm: Arc<dyn Vmm>,
    page_size: u64,
    /// The memory limit in pages; changed only under the state lock, so a
    /// growth checks and commits against one value.
    limit_pages: AtomicU64,
    /// The device's total memory, as `cuMemGetInfo` said at construction.
    device_total: u64,
    config: PoolConfig,
    state: Mutex<PoolState>,
}

impl PagePool {
    /// A pool over `vmm` with no memory held yet. Queries the device's total
    /// memory once to resolve a fractional limit.
    pub fn new(vmm: Arc<dyn Vmm>, config: PoolConfig) -> Result<PagePool, PoolError> {
        let granularity = vmm.granularity();
        let page_size =
            config
                .page_size
                .resolve(granularity)
                .ok_or(PoolError::InvalidPageSize {
                    page_size: config.page_size,
                    granularity,
                })?;
        let total = vmm.mem_info()?.total;
        let limit_pages = config.limit.resolve(total) / page_size;
        Ok(PagePool {
            vmm,
            page_size,
            limit_pages: AtomicU64::new(limit_pages),
            device_total: total,
            config,
            state: Mutex::new(PoolState {
                slots: Vec::new(),
                free: BitVec::new(),
                free_stack: Vec::new(),
                vacant: Vec::new(),
                total_pages: 0,
                peak_pages: 0,
                created: 0,
                released: 0,
            }),
        })
    }

    fn lock(&self) -> Result<MutexGuard<'_, PoolState>, PoolError> {
        self.state.lock().map_err(|_| PoolError::Poisoned)
    }

    /// The page size in bytes (the size of every handle).
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The most pages the pool may hold (its memory limit, in pages).
    pub fn limit_pages(&self) -> u64 {
        self.limit_pages.load(Ordering::Relaxed)
    }

    /// Change the memory limit (resolved against the device total the pool
    /// saw at construction). A limit below what the pool holds now is
    /// refused ([`PoolError::LimitBelowHeld`], nothing changes): release
    /// pages first (`trim`). Returns the new limit in pages.
    pub fn set_limit(&self, limit: MemoryLimit) -> Result<u64, PoolError> {
        let s = self.lock()?;
        let pages = limit.resolve(self.device_total) / self.page_size;
        if pages < s.total_pages {
            return Err(PoolError::LimitBelowHeld {
                limit: pages,
                held: s.total_pages,
            });
        }
        self.limit_pages.store(pages, Ordering::Relaxed);
        Ok(pages)
    }

    /// The device's total memory in bytes, as `cuMemGetInfo` said at
    /// construction (what a [`MemoryLimit`] is resolved against).
    pub fn device_total(&self) -> u64 {
        self.device_total
    }

    /// The configuration.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Current figures.
    pub fn stats(&self) -> PoolStats {
        match self.lock() {
            Ok(s) => PoolStats {
                total_pages: s.total_pages,
                free_pages: s.free_stack.len() as u64,
                held_bytes: s.total_pages * self.page_size,
                peak_held_bytes: s.peak_pages * self.page_size,
                handles_created: s.created,
                handles_released: s.released,
                page_size: self.page_size,
                limit_pages: self.limit_pages(),
                device_total: self.device_total,
            },
            Err(_) => PoolStats::default(),
        }
    }

    /// Pages free now.
    pub fn free_pages(&self) -> u64 {
        self.lock().map(|s| s.free_stack.len() as u64).unwrap_or(0)
    }

    /// Pages held now (free or handed out).
    pub fn total_pages(&self) -> u64 {
        self.lock().map(|s| s.total_pages).unwrap_or(0)
    }

    /// Pages the pool could still add: the smaller of what its limit allows and
    /// what the device reports free (one `cuMemGetInfo`).
    pub fn growable_pages(&self) -> Result<u64, PoolError> {
        let held = self.total_pages();
        let by_limit = self.limit_pages().saturating_sub(held);
        let device_free = self.vmm.mem_info()?.free / self.page_size;
        Ok(by_limit.min(device_free))
    }

    /// Hand out `n` free pages. Fails (changing nothing) when fewer than `n`
    /// pages are free.
    pub fn take(&self, n: u64) -> Result<Vec<Page>, PoolError> {
        let mut s = self.lock()?;
        let free = s.free_stack.len() as u64;
        if free < n {
            return Err(PoolError::NotEnoughFreePages { requested: n, free });
        }
        let at = s.free_stack.len() - n as usize;
        let ids: Vec<u32> = s.free_stack.split_off(at);
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            s.set_free(id, false);
            if let Some(handle) = s.handle(PageId(id)) {
                out.push(Page {
                    id: PageId(id),
                    handle,
                });
            }
        }
        Ok(out)
    }

    /// Return pages handed out by [`PagePool::take`]. Every page is validated
    /// first; on error nothing changes.
    pub fn give_back(&self, pages: &[Page]) -> Result<(), PoolError> {
        let mut s = self.lock()?;
        for (i, p) in pages.iter().enumerate() {
            if s.handle(p.id) != Some(p.handle) || s.is_free(p.id) {
                // Undo the marks made for the pages before this one.
                for q in &pages[..i] {
                    s.set_free(q.id.0, false);
                }
                return Err(PoolError::InvalidPage(*p));
            }
            // Marked now so that a page named twice is caught.
            s.set_free(p.id.0, true);
        }
        s.free_stack.extend(pages.iter().map(|p| p.id.0));
        Ok(())
    }

    /// Grow the pool so that at least `needed` more pages are free: `needed`
    /// pages plus the growth policy's margin, or exactly `needed` when the
    /// device cannot create the margin. Returns the pages added. On error the
    /// pool is exactly as it was.
    pub fn grow(&self, needed: u64) -> Result<u64, PoolError> {
        if needed == 0 {
            return Ok(0);
        }
        let mut s = self.lock()?;
        let by_limit = self.limit_pages().saturating_sub(s.total_pages);
        if needed > by_limit {
            return Err(PoolError::LimitReached {
                requested: needed,
                allowed: by_limit,
            });
        }
        let want = self
            .config
            .growth
            .pages_to_create(needed, s.total_pages, self.page_size)
            .min(by_limit);
        let created = match self.create_handles(want) {
            Ok(c) => c,
            Err(PoolError::Driver(e)) if e.is_out_of_memory() && want > needed => {
                self.create_handles(needed)?
            }
            Err(e) => return Err(e),
        };
        let pages = created.len() as u64;
        for h in created {
            s.add(h);
        }
        s.peak_pages = s.peak_pages.max(s.total_pages);
        tracing::debug!(pages, "pool grew");
        Ok(pages)
    }

    /// Create `pages` handles of one page each. All or nothing: on error, the
    /// handles created so far are released.
    fn create_handles(&self, pages: u64) -> Result<Vec<PhysHandle>, PoolError> {
        let mut out = Vec::with_capacity(pages as usize);
        for _ in 0..pages {
            let props = self.config.create_props;
            let created = if props == quilt_vmm::CreateProps::default() {
                self.vmm.create(self.page_size)
            } else {
                self.vmm.create_with(self.page_size, props)
            };
            match created {
                Ok(h) => out.push(h),
                Err(e) => {
                    for h in out {
                        if let Err(r) = self.vmm.release(h) {
                            tracing::warn!(error = %r, "releasing a page after a failed growth failed");
                        }
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(out)
    }

    /// Release free pages while the pool holds more than `keep_bytes`.
    /// Returns the bytes released. A failing release keeps that page (free)
    /// and returns the error.
    pub fn trim(&self, keep_bytes: u64) -> Result<u64, PoolError> {
        let mut s = self.lock()?;
        let keep_pages = keep_bytes / self.page_size;
        let mut released = 0;
        while s.total_pages > keep_pages {
            let Some(id) = s.free_stack.pop() else {
                break;
            };
            let Some(handle) = s.handle(PageId(id)) else {
                continue;
            };
            if let Err(e) = self.vmm.release(handle) {
                s.free_stack.push(id);
                return Err(e.into());
            }
            s.slots[id as usize] = None;
            s.set_free(id, false);
            s.vacant.push(id);
            s.total_pages -= 1;
            s.released += 1;
            released += self.page_size;
        }
        Ok(released)
    }

    /// True when page `id` is held and handed out.
    pub fn is_in_use(&self, id: PageId) -> bool {
        match self.lock() {
            Ok(s) => s.handle(id).is_some() && !s.is_free(id),
            Err(_) => false,
        }
    }

    /// Every page handed out now, in id order.
    pub fn pages_in_use(&self) -> Vec<PageId> {
        let Ok(s) = self.lock() else {
            return Vec::new();
        };
        (0..s.slots.len() as u32)
            .map(PageId)
            .filter(|&id| s.handle(id).is_some() && !s.is_free(id))
            .collect()
    }

    /// Check the pool's invariants (see the crate documentation).
    pub fn check_invariants(&self) -> Result<(), String> {
        let s = self.lock().map_err(|e| e.to_string())?;
        let held = s.slots.iter().flatten().count() as u64;
        if held != s.total_pages {
            return Err(format!("pool counts {} pages, holds {held}", s.total_pages));
        }
        if s.free.len() != s.slots.len() {
            return Err("free map and slots differ in length".to_string());
        }
        let mut seen = bitvec![u64, Lsb0; 0; s.slots.len()];
        for &id in &s.free_stack {
            let i = id as usize;
            if i >= s.slots.len() || s.slots[i].is_none() {
                return Err(format!("free stack names page {id}, which is not held"));
            }
            if seen[i] {
                return Err(format!("page {id} is on the free stack twice"));
            }
            seen.set(i, true);
        }
        if seen != s.free {
            return Err("free map and free stack disagree".to_string());
        }
        for &id in &s.vacant {
            if s.slots.get(id as usize).is_none_or(|h| h.is_some()) {
                return Err(format!("vacant id {id} holds a page"));
            }
        }
        if s.vacant.len() as u64 + held != s.slots.len() as u64 {
            return Err("vacant ids out of date".to_string());
        }
        if s.total_pages > self.limit_pages() {
            return Err(format!(
                "pool holds {} pages over its limit {}",
                s.total_pages,
                self.limit_pages()
            ));
        }
        if s.created - s.released != s.total_pages {
            return Err(format!(
                "created {} - released {} != held {}",
                s.created, s.released, s.total_pages
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
        let in_use = state.total_pages - state.free_stack.len() as u64;
        if in_use > 0 {
            tracing::warn!(
                pages = in_use,
                "page pool dropped with pages still handed out"
            );
        }
        for h in state.slots.iter_mut().filter_map(Option::take) {
            if let Err(e) = self.vmm.release(h) {
                tracing::warn!(error = %e, "releasing a page at drop failed");
            }
        }
        state.total_pages = 0;
        state.free_stack.clear();
    }
}

#[cfg(test)]
mod tests;
