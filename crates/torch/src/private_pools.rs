//! torch's private memory pools (CUDA graphs, `torch.cuda.MemPool`), kept
//! in front of Quilt, one [`PrivatePools`] per device.
//!
//! A pool is named by torch's `MempoolId_t` (two integers). While a pool is
//! used (its use count above 0: a `MemPool` object, a graph captured into
//! it, an allocation context routed to it), every block allocated into it
//! stays the pool's: when torch frees one, Quilt does not get it back; the
//! pool keeps it free and hands it out again only to an allocation into the
//! same pool on the same stream. A captured graph's replays write into its
//! intermediates' memory, so that memory must never serve anything else
//! while the graph lives. When the use count drops to 0
//! ([`PrivatePools::release`]), the pool's free blocks go back to Quilt at
//! once and its live ones as they are freed; the pool is gone when it holds
//! nothing.
//!
//! This module only keeps the books: it says which block to reuse and which
//! pointers to give back to Quilt; [`crate::library`] does the allocating.

use std::collections::BTreeMap;

/// torch's `MempoolId_t`.
pub type PoolId = (u64, u64);

/// One block of Quilt memory a pool owns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    pool: PoolId,
    /// The bytes Quilt allocated for it.
    size: u64,
    /// The bytes torch asked for when it was last handed out.
    requested: u64,
    /// The stream it was allocated on: it is reused only there.
    stream: u64,
    /// Handed out now (false: free, kept by the pool).
    live: bool,
}

#[derive(Debug, Default)]
struct Pool {
    use_count: u32,
}

/// What happens to a freed pointer ([`PrivatePools::free`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Freed {
    /// No pool owns it: Quilt frees it.
    NotPooled,
    /// Its pool keeps it, free, for the pool's later allocations.
    KeptByPool,
    /// Its pool is released: Quilt frees it (and the pool may be gone).
    BackToQuilt,
}

/// The pools' figures for torch's statistics: Quilt counts a block a pool
/// keeps as allocated; torch counts it freed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolFigures {
    /// Bytes of the free blocks the pools keep now.
    pub kept_bytes: u64,
    /// Number of those blocks.
    pub kept_blocks: u64,
    /// Bytes and blocks torch freed into a pool, in total.
    pub kept_total: (u64, u64),
    /// Bytes and blocks taken again from a pool, in total.
    pub reused_total: (u64, u64),
    /// Bytes and blocks a pool gave back to Quilt free (Quilt counts their
    /// free), in total.
    pub released_total: (u64, u64),
}

/// The private pools of one device.
#[derive(Debug, Default)]
pub struct PrivatePools {
    pools: BTreeMap<PoolId, Pool>,
    blocks: BTreeMap<u64, Block>,
    /// The totals, and the free blocks kept now (`kept_bytes`,
    /// `kept_blocks`), kept as blocks change.
    figures: PoolFigures,
}

/// A pool's block as torch last had it ([`PrivatePools::free`] gives it
/// back): what torch asked for and the stream it was handed out on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolBlock {
    /// The bytes torch asked for.
    pub requested: u64,
    /// The stream.
    pub stream: u64,
}

fn add(total: &mut (u64, u64), bytes: u64) {
    total.0 += bytes;
    total.1 += 1;
}

/// Whether a free block of `size` bytes serves a request of `want` bytes:
/// large enough, and not wasting more than the request itself or 1 MiB,
/// whichever is more (a block is handed out whole).
fn fits(size: u64, want: u64) -> bool {
    size >= want && size - want <= want.max(1 << 20)
}

impl PrivatePools {
    /// Create the pool `id` with a use count of 1, or add 1 to its count
    /// (torch's `createOrIncrefPool`; `beginAllocateToPool` does it too).
    pub fn create_or_incref(&mut self, id: PoolId) {
        self.pools.entry(id).or_default().use_count += 1;
    }

    /// The pool's use count (0 for a pool that does not exist or is released).
    pub fn use_count(&self, id: PoolId) -> u32 {
        self.pools.get(&id).map_or(0, |p| p.use_count)
    }

    /// Whether `id` exists and is used (allocations may go into it).
    pub fn is_used(&self, id: PoolId) -> bool {
        self.use_count(id) > 0
    }

    /// torch's `releasePool`: one use fewer. At 0 the pool's free blocks are
    /// returned (for Quilt to free) and its live ones will be as they are
    /// freed. An error for a pool that does not exist or is released.
    pub fn release(&mut self, id: PoolId) -> Result<Vec<u64>, String> {
        let pool = self
            .pools
            .get_mut(&id)
            .filter(|p| p.use_count > 0)
            .ok_or_else(|| format!("releasePool of pool {id:?}, which is not in use"))?;
        pool.use_count -= 1;
        if pool.use_count > 0 {
            return Ok(Vec::new());
        }
        let free: Vec<u64> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && !b.live)
            .map(|(&p, _)| p)
            .collect();
        for p in &free {
            if let Some(b) = self.blocks.remove(p) {
                add(&mut self.figures.released_total, b.size);
                self.figures.kept_bytes -= b.size;
                self.figures.kept_blocks -= 1;
            }
        }
        self.drop_if_empty(id);
        Ok(free)
    }

    fn drop_if_empty(&mut self, id: PoolId) {
        let used = self.use_count(id) > 0;
        if !used && !self.blocks.values().any(|b| b.pool == id) {
            self.pools.remove(&id);
        }
    }

    /// A free block of pool `id` on `stream` for a request of `size` bytes
    /// (the smallest that `fits`), now live; None when there is none (the
    /// caller allocates from Quilt and [`PrivatePools::adopt`]s it). An error
    /// for a pool not in use.
    pub fn take(&mut self, id: PoolId, size: u64, stream: u64) -> Result<Option<u64>, String> {
        if !self.is_used(id) {
            return Err(format!(
                "allocation into pool {id:?}, which is not in use (released or never created)"
            ));
        }
        let best = self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && !b.live && b.stream == stream && fits(b.size, size))
            .min_by_key(|(&p, b)| (b.size, p))
            .map(|(&p, _)| p);
        if let Some(p) = best {
            if let Some(b) = self.blocks.get_mut(&p) {
                b.live = true;
                b.requested = size;
                add(&mut self.figures.reused_total, b.size);
                self.figures.kept_bytes -= b.size;
                self.figures.kept_blocks -= 1;
            }
        }
        Ok(best)
    }

    /// The block at `ptr`, just allocated from Quilt for pool `id` (torch
    /// asked for `size` bytes), is the pool's, live. An error for a pool not
    /// in use or a pointer already known.
    pub fn adopt(&mut self, id: PoolId, ptr: u64, size: u64, stream: u64) -> Result<(), String> {
        if !self.is_used(id) {
            return Err(format!(
                "adopting {ptr:#x} into pool {id:?}, which is not in use"
            ));
        }
        if self.blocks.contains_key(&ptr) {
            return Err(format!(
                "adopting {ptr:#x} into pool {id:?}: a pool owns it already"
            ));
        }
        self.blocks.insert(
            ptr,
            Block {
                pool: id,
                size,
                requested: size,
                stream,
                live: true,
            },
        );
        Ok(())
    }

    /// torch frees `ptr`: see [`Freed`], with the block as torch had it
    /// when a pool owned it. An error for a pool's block that is free
    /// already (a double free).
    pub fn free(&mut self, ptr: u64) -> Result<(Freed, Option<PoolBlock>), String> {
        let Some(b) = self.blocks.get(&ptr).copied() else {
            return Ok((Freed::NotPooled, None));
        };
        let had = Some(PoolBlock {
            requested: b.requested,
            stream: b.stream,
        });
        if !b.live {
            return Err(format!(
                "double free of {ptr:#x}, free in pool {:?} already",
                b.pool
            ));
        }
        if self.is_used(b.pool) {
            if let Some(b) = self.blocks.get_mut(&ptr) {
                b.live = false;
                add(&mut self.figures.kept_total, b.size);
                self.figures.kept_bytes += b.size;
                self.figures.kept_blocks += 1;
            }
            return Ok((Freed::KeptByPool, had));
        }
        self.blocks.remove(&ptr);
        self.drop_if_empty(b.pool);
        Ok((Freed::BackToQuilt, had))
    }

    /// Whether any pool exists or owns a block: where none does, a free or
    /// an allocation has nothing to ask the pools.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty() && self.blocks.is_empty()
    }

    /// The pool owning `ptr` (live or free), if any.
    pub fn owner(&self, ptr: u64) -> Option<PoolId> {
        self.blocks.get(&ptr).map(|b| b.pool)
    }

    /// What torch asked for the pool's live block at `ptr`, if it is one.
    pub fn live_requested(&self, ptr: u64) -> Option<u64> {
        self.blocks
            .get(&ptr)
            .filter(|b| b.live)
            .map(|b| b.requested)
    }

    /// Whether `ptr` is a pool's free block (Quilt has it allocated; torch
    /// does not).
    pub fn is_kept_free(&self, ptr: u64) -> bool {
        self.blocks.get(&ptr).is_some_and(|b| !b.live)
    }

    /// Bytes and number of the free blocks the pools keep: reserved, not
    /// allocated, in torch's statistics. A walk over the blocks (the
    /// figures keep the same as counters, [`PrivatePools::figures`]).
    pub fn kept_free(&self) -> (u64, u64) {
        self.blocks
            .values()
            .filter(|b| !b.live)
            .fold((0, 0), |(bytes, n), b| (bytes + b.size, n + 1))
    }

    /// The figures for torch's statistics, with what is kept now (kept
    /// as blocks change: no walk).
    pub fn figures(&self) -> PoolFigures {
        self.figures
    }

    /// Bytes each pool owns (live and free), for pools that own any.
    pub fn bytes_by_pool(&self) -> BTreeMap<PoolId, u64> {
        let mut out = BTreeMap::new();
        for b in self.blocks.values() {
            *out.entry(b.pool).or_insert(0) += b.size;
        }
        out
    }

    /// The pools that exist (used, or released with live blocks).
    pub fn pool_count(&self) -> usize {
        self.pools.len()
    }
}

/// One block of a pool as a checkpoint keeps it ([`PrivatePools::checkpoint`]),
/// laid out as the C struct `QuiltPoolBlock` of torch's allocator class.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckpointBlock {
    /// Its address.
    pub ptr: u64,
    /// The bytes Quilt allocated for it.
    pub size: u64,
    /// The bytes torch asked for when it was last handed out.
    pub requested: u64,
    /// The stream it belongs to.
    pub stream: u64,
    /// 1: handed out at the checkpoint; 0: free, kept by the pool.
    pub live: i32,
}

/// What [`PrivatePools::restore`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    /// The blocks that were handed out and are now free (without torch
    /// freeing them): torch's `CheckpointDelta::ptrs_freed`.
    pub freed: Vec<CheckpointBlock>,
    /// The blocks handed out again, at the checkpoint's addresses: torch's
    /// `CheckpointDelta::dataptrs_allocd`. A block may be in both.
    pub allocated: Vec<CheckpointBlock>,
}

/// CUDA graph trees (`torch.compile(mode="reduce-overhead")`): a pool's
/// state checkpointed and restored, and its live blocks checked, with the
/// semantics of torch's `getCheckpointState`, `setCheckpointPoolState` and
/// `checkPoolLiveAllocations`. A pool's blocks never leave it while it is
/// used, so a checkpoint is the list of its blocks and whether each was
/// handed out.
impl PrivatePools {
    fn known(&self, id: PoolId, what: &str) -> Result<(), String> {
        match self.pools.get(&id) {
            None => Err(format!("{what}: could not find pool {id:?}")),
            Some(_) => Ok(()),
        }
    }

    fn used(&self, id: PoolId, what: &str) -> Result<(), String> {
        self.known(id, what)?;
        if !self.is_used(id) {
            return Err(format!(
                "{what}: pool {id:?} is released (a freeable pool is not checkpointed)"
            ));
        }
        Ok(())
    }

    /// The state of pool `id`: each of its blocks, in address order, with
    /// whether it is handed out (torch's `getCheckpointState`). An error for
    /// a pool that does not exist or is released.
    pub fn checkpoint(&self, id: PoolId) -> Result<Vec<CheckpointBlock>, String> {
        self.used(id, "getCheckpointState")?;
        Ok(self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id)
            .map(|(&ptr, b)| CheckpointBlock {
                ptr,
                size: b.size,
                requested: b.requested,
                stream: b.stream,
                live: i32::from(b.live),
            })
            .collect())
    }

    /// Put pool `id` back in the state `state` ([`PrivatePools::checkpoint`]
    /// gave it): every block handed out now is free, then every block
    /// handed out at the checkpoint is handed out again, at its address
    /// (torch's `setCheckpointPoolState`). Blocks the pool gained since stay
    /// the pool's, free. An error, with nothing changed, for a pool that
    /// does not exist or is released, or a state whose blocks are not the
    /// pool's as they were (another pool's, another size or stream, or
    /// listed twice).
    pub fn restore(&mut self, id: PoolId, state: &[CheckpointBlock]) -> Result<Restored, String> {
        self.used(id, "setCheckpointPoolState")?;
        let mut seen = std::collections::BTreeSet::new();
        for c in state {
            if !seen.insert(c.ptr) {
                return Err(format!(
                    "setCheckpointPoolState: {:#x} is listed twice in the state of pool {id:?}",
                    c.ptr
                ));
            }
            match self.blocks.get(&c.ptr) {
                Some(b) if b.pool == id && b.size == c.size && b.stream == c.stream => {}
                Some(b) => {
                    return Err(format!(
                        "setCheckpointPoolState: {:#x} of pool {id:?} ({} bytes on stream {:#x}) \
                         is now pool {:?}'s, {} bytes on stream {:#x}",
                        c.ptr, c.size, c.stream, b.pool, b.size, b.stream
                    ))
                }
                None => {
                    return Err(format!(
                        "setCheckpointPoolState: {:#x} of pool {id:?} is no block of a pool now",
                        c.ptr
                    ))
                }
            }
        }
        let mut out = Restored::default();
        for (&ptr, b) in self.blocks.iter_mut() {
            if b.pool == id && b.live {
                b.live = false;
                add(&mut self.figures.kept_total, b.size);
                self.figures.kept_bytes += b.size;
                self.figures.kept_blocks += 1;
                out.freed.push(CheckpointBlock {
                    ptr,
                    size: b.size,
                    requested: b.requested,
                    stream: b.stream,
                    live: 0,
                });
            }
        }
        for c in state.iter().filter(|c| c.live != 0) {
            if let Some(b) = self.blocks.get_mut(&c.ptr) {
                b.live = true;
                b.requested = c.requested;
                add(&mut self.figures.reused_total, b.size);
                self.figures.kept_bytes -= b.size;
                self.figures.kept_blocks -= 1;
                out.allocated.push(*c);
            }
        }
        Ok(out)
    }

    /// The blocks of pool `id` handed out now, in address order (torch's
    /// `checkPoolLiveAllocations` compares them with the tensors it knows).
    /// An error for a pool that does not exist (a released pool with live
    /// blocks exists until they are freed).
    pub fn live_blocks(&self, id: PoolId) -> Result<Vec<u64>, String> {
        self.known(id, "checkPoolLiveAllocations")?;
        Ok(self
            .blocks
            .iter()
            .filter(|(_, b)| b.pool == id && b.live)
            .map(|(&p, _)| p)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashMap};

    const A: PoolId = (1, 0);
    const B: PoolId = (0, 1);

    #[test]
    fn a_block_freed_in_a_used_pool_serves_only_that_pool_and_stream() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x1000, 4096, 7).unwrap();
        assert_eq!(
            p.free(0x1000).unwrap(),
            (
                Freed::KeptByPool,
                Some(PoolBlock {
                    requested: 4096,
                    stream: 7
                })
            )
        );
        assert_eq!(p.kept_free(), (4096, 1));
        assert_eq!(p.take(B, 4096, 7).unwrap(), None);
        assert_eq!(p.take(A, 4096, 8).unwrap(), None);
        assert_eq!(p.take(A, 4096, 7).unwrap(), Some(0x1000));
        assert!(p.free(0x1000).is_ok());
        assert!(p.free(0x1000).is_err(), "a double free is refused");
        assert_eq!(p.free(0x9999).unwrap(), (Freed::NotPooled, None));
    }

    #[test]
    fn release_returns_free_blocks_now_and_live_ones_when_freed() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(A); // a second graph shares it
        p.adopt(A, 0x1000, 4096, 0).unwrap();
        p.adopt(A, 0x2000, 4096, 0).unwrap();
        p.free(0x1000).unwrap();
        assert_eq!(p.release(A).unwrap(), Vec::<u64>::new(), "still used once");
        assert_eq!(p.release(A).unwrap(), vec![0x1000]);
        assert_eq!(p.use_count(A), 0);
        assert!(p.take(A, 16, 0).is_err(), "a released pool takes nothing");
        assert_eq!(p.free(0x2000).unwrap().0, Freed::BackToQuilt);
        assert_eq!(p.pool_count(), 0);
        assert!(p.release(A).is_err());
    }

    #[test]
    fn a_small_request_does_not_take_a_much_larger_block() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.adopt(A, 0x1000, 64 << 20, 0).unwrap();
        p.free(0x1000).unwrap();
        assert_eq!(p.take(A, 1 << 20, 0).unwrap(), None);
        assert_eq!(p.take(A, 40 << 20, 0).unwrap(), Some(0x1000));
        assert_eq!(
            p.free(0x1000).unwrap().1,
            Some(PoolBlock {
                requested: 40 << 20,
                stream: 0
            }),
            "the free gives torch's request of the last take"
        );
    }

    fn live(p: &PrivatePools, id: PoolId) -> Vec<u64> {
        p.live_blocks(id).unwrap()
    }

    #[test]
    fn a_restore_frees_what_is_live_and_hands_back_what_was_live_at_the_same_addresses() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.adopt(A, 0x1000, 4096, 7).unwrap(); // live at the checkpoint
        p.adopt(A, 0x2000, 4096, 7).unwrap(); // live at the checkpoint, and after
        p.adopt(A, 0x3000, 8192, 7).unwrap();
        p.free(0x3000).unwrap(); // free at the checkpoint
        let state = p.checkpoint(A).unwrap();
        assert_eq!(
            state.iter().map(|c| (c.ptr, c.live)).collect::<Vec<_>>(),
            vec![(0x1000, 1), (0x2000, 1), (0x3000, 0)]
        );
        // Since: 0x1000 freed, 0x3000 handed out again, 0x4000 new.
        p.free(0x1000).unwrap();
        assert_eq!(p.take(A, 8192, 7).unwrap(), Some(0x3000));
        p.adopt(A, 0x4000, 4096, 7).unwrap();
        assert_eq!(live(&p, A), vec![0x2000, 0x3000, 0x4000]);

        let r = p.restore(A, &state).unwrap();
        let ptrs = |v: &[CheckpointBlock]| v.iter().map(|c| c.ptr).collect::<Vec<_>>();
        assert_eq!(ptrs(&r.freed), vec![0x2000, 0x3000, 0x4000]);
        assert_eq!(ptrs(&r.allocated), vec![0x1000, 0x2000]);
        assert_eq!(live(&p, A), vec![0x1000, 0x2000]);
        // What was free at the checkpoint, and what came since, is the pool's, free.
        assert_eq!(p.kept_free(), (8192 + 4096, 2));
        assert!(p.is_kept_free(0x3000) && p.is_kept_free(0x4000));
        // The restored blocks are freed as any other; the pool hands out its free ones.
        assert_eq!(p.free(0x1000).unwrap().0, Freed::KeptByPool);
        assert!(p.free(0x1000).is_err(), "a double free is refused");
        assert_eq!(p.take(A, 8192, 7).unwrap(), Some(0x3000));
        // Restoring again gives the same state.
        let r = p.restore(A, &state).unwrap();
        assert_eq!(ptrs(&r.freed), vec![0x2000, 0x3000]);
        assert_eq!(live(&p, A), vec![0x1000, 0x2000]);
        let f = p.figures();
        assert_eq!((f.kept_bytes, f.kept_blocks), p.kept_free());
        assert_eq!(
            f.kept_bytes,
            f.kept_total.0 - f.reused_total.0 - f.released_total.0
        );
    }

    #[test]
    fn a_restore_touches_only_its_pool() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x1000, 4096, 0).unwrap();
        p.adopt(B, 0x2000, 4096, 0).unwrap();
        let state = p.checkpoint(A).unwrap();
        p.adopt(B, 0x3000, 4096, 0).unwrap();
        p.restore(A, &state).unwrap();
        assert_eq!(live(&p, B), vec![0x2000, 0x3000]);
        assert_eq!(live(&p, A), vec![0x1000]);
    }

    #[test]
    fn a_state_that_no_longer_matches_the_pool_is_refused_and_changes_nothing() {
        let mut p = PrivatePools::default();
        p.create_or_incref(A);
        p.create_or_incref(B);
        p.adopt(A, 0x1000, 4096, 0).unwrap();
        p.adopt(B, 0x2000, 4096, 0).unwrap();
        p.adopt(A, 0x5000, 4096, 0).unwrap();
        let state = p.checkpoint(A).unwrap();
        let with = |f: &dyn Fn(&mut CheckpointBlock)| {
            let mut s = state.clone();
            f(&mut s[0]);
            s
        };
        let bad = [
            with(&|c| c.ptr = 0x2000), // another pool's block
            with(&|c| c.ptr = 0x9000), // no block at all
            with(&|c| c.size = 8192),  // another size
            with(&|c| c.stream = 3),   // another stream
            with(&|c| c.ptr = 0x5000), // listed twice
        ];
        p.free(0x5000).unwrap();
        for s in &bad {
            let e = p.restore(A, s).unwrap_err();
            assert!(e.contains("setCheckpointPoolState"), "{e}");
            assert_eq!(live(&p, A), vec![0x1000], "nothing changed");
        }
        assert!(
            p.restore(B, &[]).is_ok(),
            "an empty state frees the pool's blocks"
        );
        assert_eq!(live(&p, B), Vec::<u64>::new());
    }

    #[test]
    fn unknown_and_released_pools_are_not_checkpointed() {
        let mut p = PrivatePools::default();
        assert!(p.checkpoint(A).unwrap_err().contains("could not find pool"));
        assert!(p.restore(A, &[]).is_err());
        assert!(p.live_blocks(A).is_err());
        p.create_or_incref(A);
        assert_eq!(p.checkpoint(A).unwrap(), vec![]);
        p.adopt(A, 0x1000, 4096, 0).unwrap();
        let state = p.checkpoint(A).unwrap();
        p.release(A).unwrap();
        // Released, with a live block: it exists until the block is freed.
        assert_eq!(live(&p, A), vec![0x1000]);
        assert!(p.checkpoint(A).unwrap_err().contains("released"));
        assert!(p.restore(A, &state).unwrap_err().contains("released"));
        assert_eq!(p.free(0x1000).unwrap().0, Freed::BackToQuilt);
        assert!(p.live_blocks(A).is_err());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Incref(usize),
        Release(usize),
        Alloc {
            pool: Option<usize>,
            size: u64,
            stream: u64,
        },
        Free(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3usize).prop_map(Op::Incref),
            (0..3usize).prop_map(Op::Release),
            (prop::option::of(0..3usize), 1..6u64, 0..2u64).prop_map(|(pool, s, stream)| {
                Op::Alloc {
                    pool,
                    size: s << 20,
                    stream,
                }
            }),
            (0..64usize).prop_map(Op::Free),
        ]
    }

    const IDS: [PoolId; 3] = [(1, 0), (0, 1), (2, 0)];

    proptest! {
        /// Against a model of Quilt (the pointers it has handed out): a
        /// pointer is never handed to two holders at once; a block kept by a
        /// pool never serves anything outside its pool or stream; once every
        /// pool is released and every block freed, all memory is back with
        /// Quilt.
        #[test]
        fn no_pool_memory_escapes_and_all_comes_back(ops in prop::collection::vec(op(), 1..120)) {
            let mut p = PrivatePools::default();
            let mut quilt: BTreeSet<u64> = BTreeSet::new(); // allocated from Quilt
            let mut next = 0x10_0000u64;
            // What torch holds: ptr -> (pool, stream).
            let mut held: Vec<(u64, Option<PoolId>, u64)> = Vec::new();
            let mut counts: HashMap<PoolId, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Incref(i) => {
                        p.create_or_incref(IDS[i]);
                        *counts.entry(IDS[i]).or_default() += 1;
                    }
                    Op::Release(i) => {
                        let c = counts.entry(IDS[i]).or_default();
                        let got = p.release(IDS[i]);
                        if *c == 0 {
                            prop_assert!(got.is_err());
                        } else {
                            *c -= 1;
                            for ptr in got.unwrap() {
                                prop_assert!(quilt.remove(&ptr), "{ptr:#x} returned twice");
                                prop_assert!(held.iter().all(|h| h.0 != ptr), "{ptr:#x} is held");
                            }
                        }
                    }
                    Op::Alloc { pool, size, stream } => {
                        let id = pool.map(|i| IDS[i]);
                        let ptr = match id {
                            Some(id) if counts.get(&id).copied().unwrap_or(0) > 0 => {
                                match p.take(id, size, stream).unwrap() {
                                    Some(ptr) => {
                                        prop_assert_eq!(p.owner(ptr), Some(id));
                                        ptr
                                    }
                                    None => {
                                        next += 8 << 20;
                                        quilt.insert(next);
                                        p.adopt(id, next, size, stream).unwrap();
                                        next
                                    }
                                }
                            }
                            Some(id) => {
                                prop_assert!(p.take(id, size, stream).is_err());
                                continue;
                            }
                            None => {
                                next += 8 << 20;
                                quilt.insert(next);
                                next
                            }
                        };
                        prop_assert!(held.iter().all(|h| h.0 != ptr), "{ptr:#x} handed out twice");
                        held.push((ptr, id, stream));
                    }
                    Op::Free(i) => {
                        if held.is_empty() {
                            continue;
                        }
                        let (ptr, _, _) = held.remove(i % held.len());
                        match p.free(ptr).unwrap().0 {
                            Freed::KeptByPool => prop_assert!(p.is_kept_free(ptr)),
                            Freed::NotPooled | Freed::BackToQuilt => {
                                prop_assert!(quilt.remove(&ptr));
                            }
                        }
                    }
                }
                // After every operation: what pools keep free is Quilt's
                // (allocated there), held by nobody, and in a used pool.
                for (&ptr, b) in &p.blocks {
                    prop_assert!(quilt.contains(&ptr));
                    if !b.live {
                        prop_assert!(held.iter().all(|h| h.0 != ptr));
                        prop_assert!(p.is_used(b.pool), "a released pool keeps {ptr:#x}");
                    }
                }
                for (ptr, id, _) in &held {
                    prop_assert_eq!(p.owner(*ptr), *id);
                }
                for (&id, &c) in &counts {
                    prop_assert_eq!(p.use_count(id), c);
                }
                let f = p.figures();
                prop_assert_eq!((f.kept_bytes, f.kept_blocks), p.kept_free(), "the counters against a walk");
                prop_assert_eq!(
                    f.kept_bytes,
                    f.kept_total.0 - f.reused_total.0 - f.released_total.0
                );
            }
            // Everything back.
            for (ptr, _, _) in std::mem::take(&mut held) {
                if p.free(ptr).unwrap().0 != Freed::KeptByPool {
                    quilt.remove(&ptr);
                }
            }
            for (&id, &c) in &counts {
                for _ in 0..c {
                    for ptr in p.release(id).unwrap() {
                        quilt.remove(&ptr);
                    }
                }
            }
            prop_assert!(quilt.is_empty(), "left with Quilt: {quilt:?}");
            prop_assert_eq!(p.pool_count(), 0);
            prop_assert_eq!(p.kept_free(), (0, 0));
        }
    }

    /// One pool's allocations and frees, as (is an allocation, size in MiB,
    /// stream, which held block to free).
    fn pool_ops() -> impl Strategy<Value = Vec<(bool, u64, u64, usize)>> {
        prop::collection::vec((any::<bool>(), 1..5u64, 0..2u64, 0..32usize), 0..40)
    }

    fn run_pool_ops(
        p: &mut PrivatePools,
        ops: &[(bool, u64, u64, usize)],
        held: &mut Vec<u64>,
        next: &mut u64,
    ) {
        for &(alloc, mib, stream, i) in ops {
            if alloc {
                let size = mib << 20;
                let ptr = match p.take(A, size, stream).unwrap() {
                    Some(ptr) => ptr,
                    None => {
                        *next += 8 << 20;
                        p.adopt(A, *next, size, stream).unwrap();
                        *next
                    }
                };
                assert!(!held.contains(&ptr), "{ptr:#x} handed out twice");
                held.push(ptr);
            } else if !held.is_empty() {
                let ptr = held.remove(i % held.len());
                assert_eq!(p.free(ptr).unwrap().0, Freed::KeptByPool);
            }
        }
    }

    proptest! {
        /// Whatever happened since a checkpoint, a restore leaves handed
        /// out exactly the blocks handed out at the checkpoint, at their
        /// addresses; everything else the pool has is free and serves its
        /// later allocations; the figures still add up.
        #[test]
        fn a_restore_gives_back_the_checkpoint(before in pool_ops(), after in pool_ops(), later in pool_ops()) {
            let mut p = PrivatePools::default();
            p.create_or_incref(A);
            let mut held = Vec::new();
            let mut next = 0x10_0000u64;
            run_pool_ops(&mut p, &before, &mut held, &mut next);
            let state = p.checkpoint(A).unwrap();
            let mut at_checkpoint = held.clone();
            at_checkpoint.sort_unstable();
            run_pool_ops(&mut p, &after, &mut held, &mut next);
            let r = p.restore(A, &state).unwrap();
            let mut now_live = held.clone();
            now_live.sort_unstable();
            prop_assert_eq!(r.freed.iter().map(|c| c.ptr).collect::<Vec<_>>(), now_live);
            prop_assert_eq!(r.allocated.iter().map(|c| c.ptr).collect::<Vec<_>>(), at_checkpoint.clone());
            prop_assert_eq!(p.live_blocks(A).unwrap(), at_checkpoint.clone());
            for c in &state {
                prop_assert_eq!(p.is_kept_free(c.ptr), c.live == 0);
            }
            let f = p.figures();
            prop_assert_eq!((f.kept_bytes, f.kept_blocks), p.kept_free(), "the counters against a walk");
            prop_assert_eq!(f.kept_bytes, f.kept_total.0 - f.reused_total.0 - f.released_total.0);
            // torch holds what the checkpoint held; the pool goes on.
            held = at_checkpoint;
            run_pool_ops(&mut p, &later, &mut held, &mut next);
            held.sort_unstable();
            prop_assert_eq!(p.live_blocks(A).unwrap(), held.clone());
            for ptr in held {
                p.free(ptr).unwrap();
            }
            let mut back = p.release(A).unwrap();
            back.sort_unstable();
            prop_assert_eq!(back, adopted_up_to(next));
            prop_assert_eq!(p.pool_count(), 0);
        }
    }

    /// Every block adopted from 0x10_0000 + 8 MiB up to `last`.
    fn adopted_up_to(last: u64) -> Vec<u64> {
        (1..)
            .map(|k| 0x10_0000u64 + k * (8 << 20))
            .take_while(|&a| a <= last)
            .collect()
    }
}
