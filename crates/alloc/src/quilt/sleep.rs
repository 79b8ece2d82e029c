//! Tags, and putting a tag's memory to sleep and waking it.
//!
//! A tag's members are the blocks allocated with it (in arenas of their own,
//! `Kind::Isolated`, so that no page is shared with another tag or with
//! untagged blocks) and the growable buffers created with it. `sleep` makes
//! the work queued on the members' memory complete (a synchronisation of
//! each stream that used it: what a sleep costs), copies their contents to
//! host memory (`SleepMode::Offload`) or not (`SleepMode::Discard`), and
//! unmaps every page of their arenas, returning the pool pages: they are
//! free pool pages while the tag sleeps. The virtual ranges stay reserved and
//! the blocks stay live (at the same addresses, counted as allocated), so
//! pointers held elsewhere (a captured CUDA graph) stay valid across a wake.
//! `wake` backs the members' pages again, at the same addresses, and copies
//! the contents back. A wake that cannot get its pages is an out-of-memory
//! that leaves the tag asleep with its host copy intact; a driver failure
//! half-way leaves it asleep too, and a later wake maps only what is still
//! unmapped. While asleep a tag refuses new members and every operation on
//! its members but a free (resize, record-stream, release) with
//! [`AllocError::TagState`]: its arenas are frozen in the core. A member
//! freed while its tag sleeps is freed when the tag wakes (its contents are
//! not copied back): until then it counts as allocated, and its host copy
//! is kept.

use rustc_hash::FxHashMap as HashMap;

use quilt_vmm::DevicePtr;

use super::growable::Growables;
use super::stitch::{pool_err, Core, Ctx, Kind, PagesFor};
use crate::error::AllocError;
use crate::stats::ServingStats;

/// What a sleep does with the contents of the tag's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepMode {
    /// Copy them to host memory (pageable memory owned by the allocator);
    /// `wake` copies them back: every byte of every member is as it was.
    Offload,
    /// Drop them: after `wake` the members' bytes are undefined (vLLM's
    /// level-2 sleep, e.g. for a KV cache that is rebuilt anyway).
    Discard,
}

/// Where a sleeping tag's pages go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SleepPages {
    /// Back to the pool: free pool pages, which any allocation of this
    /// allocator uses (no driver call).
    #[default]
    KeepInPool,
    /// Released to the device (`cuMemRelease` each), so that other programs
    /// can use the memory (vLLM's sleep mode); the wake creates pages again.
    ReleaseToDevice,
}

/// The host copy of one member: its device range and its bytes (empty on a
/// backend whose memory holds no bytes: the copy was only costed).
#[derive(Debug)]
struct Saved {
    ptr: DevicePtr,
    len: u64,
    bytes: Vec<u8>,
}

/// On a backend without bytes, copies go through one scratch buffer of at
/// most this many bytes (zeroed by the allocator, never touched: no host
/// memory is used), one copy per this many bytes of a member.
const SCRATCH_MAX: u64 = 1 << 30;

/// Copy the `len` bytes at `ptr` to the host: into a buffer kept for the
/// wake when the backend holds bytes, else through a scratch buffer (the
/// copies are counted and costed, nothing is kept).
fn copy_out(ctx: &Ctx<'_>, ptr: DevicePtr, len: u64) -> Result<Saved, AllocError> {
    let host_oom = || {
        AllocError::Driver(quilt_vmm::VmmError::OutOfMemory {
            call: quilt_vmm::CallKind::MemcpyDtoH,
            requested: len,
            available: 0,
        })
    };
    let size = usize::try_from(len).map_err(|_| host_oom())?;
    if ctx.vmm.holds_bytes() {
        let mut bytes = Vec::new();
        bytes.try_reserve_exact(size).map_err(|_| host_oom())?;
        bytes.resize(size, 0);
        ctx.vmm.copy_to_host(ptr, &mut bytes)?;
        return Ok(Saved { ptr, len, bytes });
    }
    let mut scratch = vec![0u8; len.min(SCRATCH_MAX) as usize];
    let mut off = 0;
    while off < len {
        let n = (len - off).min(SCRATCH_MAX) as usize;
        ctx.vmm.copy_to_host(ptr + off, &mut scratch[..n])?;
        off += n as u64;
    }
    Ok(Saved {
        ptr,
        len,
        bytes: Vec::new(),
    })
}

/// Copy a member back (see [`copy_out`]).
fn copy_back(ctx: &Ctx<'_>, saved: &Saved) -> Result<(), AllocError> {
    if saved.bytes.len() as u64 == saved.len {
        ctx.vmm.copy_from_host(saved.ptr, &saved.bytes)?;
        return Ok(());
    }
    let scratch = vec![0u8; saved.len.min(SCRATCH_MAX) as usize];
    let mut off = 0;
    while off < saved.len {
        let n = (saved.len - off).min(SCRATCH_MAX) as usize;
        ctx.vmm.copy_from_host(saved.ptr + off, &scratch[..n])?;
        off += n as u64;
    }
    Ok(())
}

/// A sleeping tag.
#[derive(Debug)]
struct Sleeping {
    /// Read by the invariant checks (offload mode keeps host copies).
    #[cfg_attr(not(feature = "invariants"), allow(dead_code))]
    mode: SleepMode,
    saved: Vec<Saved>,
}

/// Every tag seen, by dense index, with its state.
#[derive(Debug, Default)]
pub(crate) struct Tags {
    names: Vec<String>,
    index: HashMap<String, u32>,
    asleep: Vec<Option<Sleeping>>,
    /// Whether the offload tier may put the tag to sleep.
    offloadable: Vec<bool>,
    /// How many tags are asleep.
    sleeping: usize,
    /// Counters (the sleep and offload fields of [`ServingStats`]).
    pub(crate) counts: ServingStats,
}

impl Tags {
    /// The index of `name`, registering it on first sight.
    pub(crate) fn index(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.index.get(name) {
            return i;
        }
        let i = self.names.len() as u32;
        self.names.push(name.to_string());
        self.index.insert(name.to_string(), i);
        self.asleep.push(None);
        self.offloadable.push(false);
        i
    }

    /// True when the offload tier may put tag `i` to sleep.
    pub(crate) fn is_offloadable(&self, i: u32) -> bool {
        self.offloadable.get(i as usize).copied().unwrap_or(false)
    }

    /// Let the offload tier put tag `i` to sleep, or not.
    pub(crate) fn set_offloadable(&mut self, i: u32, yes: bool) {
        if let Some(o) = self.offloadable.get_mut(i as usize) {
            *o = yes;
        }
    }

    /// The index of `name`, if it was ever used.
    pub(crate) fn lookup(&self, name: &str) -> Option<u32> {
        self.index.get(name).copied()
    }

    /// The index of `name`, or the error for an unknown tag.
    fn find(&self, name: &str) -> Result<u32, AllocError> {
        self.index
            .get(name)
            .copied()
            .ok_or_else(|| AllocError::TagState {
                tag: name.to_string(),
                reason: "unknown tag: no allocation or growable buffer ever carried it",
            })
    }

    /// How many tags were seen.
    pub(crate) fn len(&self) -> u32 {
        self.names.len() as u32
    }

    /// The name of tag `i`.
    pub(crate) fn name(&self, i: u32) -> &str {
        self.names.get(i as usize).map(String::as_str).unwrap_or("")
    }

    /// True when some tag is asleep.
    #[cfg(feature = "invariants")]
    pub(crate) fn any_asleep(&self) -> bool {
        self.sleeping > 0
    }

    /// True when tag `i` is asleep.
    pub(crate) fn is_asleep(&self, i: u32) -> bool {
        self.asleep.get(i as usize).is_some_and(Option::is_some)
    }

    /// Bytes held on the host for sleeping tags.
    pub(crate) fn host_bytes(&self) -> u64 {
        self.asleep
            .iter()
            .flatten()
            .flat_map(|s| &s.saved)
            .map(|s| s.len)
            .sum()
    }

    /// An error unless tag `i` is awake.
    pub(crate) fn check_awake(&self, i: u32) -> Result<(), AllocError> {
        if self.is_asleep(i) {
            return Err(AllocError::TagState {
                tag: self.name(i).to_string(),
                reason: "the tag is asleep: wake it first",
            });
        }
        Ok(())
    }

    /// For a sleeping tag `i` in offload mode, its host copies as (device
    /// address, length); `None` when awake or discarded.
    #[cfg(feature = "invariants")]
    pub(crate) fn saved_ranges(&self, i: u32) -> Option<Vec<(DevicePtr, u64)>> {
        let s = self.asleep.get(i as usize)?.as_ref()?;
        (s.mode == SleepMode::Offload).then(|| s.saved.iter().map(|c| (c.ptr, c.len)).collect())
    }
}

/// The arenas of tag `t`: its isolated arenas and its growable buffers'.
pub(crate) fn tag_arenas(core: &Core, growables: &Growables, t: u32) -> Vec<usize> {
    let mut out: Vec<usize> = core.group_arenas(t).collect();
    out.extend(growables.tag_arenas(t));
    out.sort_unstable();
    out
}

/// The members of tag `t` as (device address, bytes, streams mask): its
/// blocks (their rounded size) and its growable buffers (their length).
pub(crate) fn tag_members(
    core: &Core,
    growables: &Growables,
    t: u32,
) -> Vec<(DevicePtr, u64, u64)> {
    let mut out: Vec<(DevicePtr, u64, u64)> = core
        .blocks
        .iter()
        .filter(|(_, b)| core.arena_meta[b.arena].1 == Kind::Isolated(t))
        .map(|(&p, b)| (p, b.size, b.streams))
        .collect();
    out.extend(growables.tag_members(core, t));
    out.sort_unstable();
    out
}

impl Tags {
    /// Put tag `name` to sleep (see the module documentation).
    pub(crate) fn sleep(
        &mut self,
        core: &mut Core,
        growables: &Growables,
        ctx: &Ctx<'_>,
        name: &str,
        mode: SleepMode,
        pages: SleepPages,
    ) -> Result<(), AllocError> {
        let t = self.find(name)?;
        if self.is_asleep(t) {
            return Err(AllocError::TagState {
                tag: name.to_string(),
                reason: "the tag is already asleep",
            });
        }
        core.tick += 1;
        let tick = core.tick;
        let arenas = tag_arenas(core, growables, t);
        let members = tag_members(core, growables, t);
        // 1. The work queued on the memory completes: every stream that used
        // a member or freed on one of the arenas' pages.
        let mut mask = members.iter().fold(0u64, |m, &(_, _, s)| m | s);
        for &ai in &arenas {
            for slot in core.arenas[ai].pages.iter() {
                if slot.phys.is_some() || slot.retired {
                    mask |= slot.freed_by;
                }
            }
        }
        for s in core.streams.in_mask(mask) {
            if core.streams.complete(ctx.vmm, s, tick, tick)? {
                self.counts.sleep_syncs += 1;
            }
        }
        // 2. The contents, copied out before anything is unmapped.
        let mut saved = Vec::new();
        if mode == SleepMode::Offload {
            for &(ptr, len, _) in &members {
                saved.push(copy_out(ctx, ptr, len)?);
            }
        }
        let offloaded: u64 = saved.iter().map(|s| s.len).sum();
        self.counts.bytes_offloaded += offloaded;
        self.counts.sleeps += 1;
        if let Some(slot) = self.asleep.get_mut(t as usize) {
            *slot = Some(Sleeping { mode, saved });
            self.sleeping += 1;
        }
        for &ai in &arenas {
            core.freeze(ai, name);
        }
        // 3. Every page of the tag's arenas unmapped, its pool page returned
        // (a failure leaves the rest mapped; a wake maps what is missing).
        let mut give = Vec::new();
        let mut result = Ok(());
        'arenas: for &ai in &arenas {
            for p in 0..core.arenas[ai].pages.len() as u64 {
                let slot = core.arenas[ai].slot(p);
                if slot.phys.is_none() && !slot.retired {
                    continue;
                }
                if let Err(e) = ctx.vmm.unmap(core.arenas[ai].page_addr(p), ctx.page) {
                    result = Err(e.into());
                    break 'arenas;
                }
                if slot.retired {
                    core.arenas[ai].clear_retired(p);
                } else {
                    give.extend(core.arenas[ai].set_unmapped(p));
                }
            }
        }
        let n = give.len() as u64;
        let mut given = ctx.pool.give_back(&give).map_err(pool_err);
        if given.is_ok() && pages == SleepPages::ReleaseToDevice && n > 0 {
            // The pool's free pages are a stack: the `n` on top are the ones
            // just given back (their work complete), and trimming releases them.
            let keep = ctx.pool.total_pages().saturating_sub(n) * ctx.page;
            given = ctx.pool.trim(keep).map(|_| ()).map_err(pool_err);
        }
        core.sync_stats(ctx);
        result.and(given)
    }

    /// Wake tag `name` (see the module documentation).
    pub(crate) fn wake(
        &mut self,
        core: &mut Core,
        growables: &Growables,
        ctx: &Ctx<'_>,
        name: &str,
    ) -> Result<(), AllocError> {
        let t = self.find(name)?;
        if !self.is_asleep(t) {
            return Err(AllocError::TagState {
                tag: name.to_string(),
                reason: "the tag is awake",
            });
        }
        core.tick += 1;
        let tick = core.tick;
        let arenas = tag_arenas(core, growables, t);
        let need: Vec<(usize, Vec<u64>)> = arenas
            .iter()
            .map(|&ai| {
                let a = &core.arenas[ai];
                let pages = (0..a.pages.len() as u64)
                    .filter(|&p| {
                        let s = a.slot(p);
                        s.touch > 0 && s.phys.is_none()
                    })
                    .collect();
                (ai, pages)
            })
            .collect();
        let total: u64 = need.iter().map(|(_, p)| p.len() as u64).sum();
        if total > 0 {
            let bytes = total * ctx.page;
            if total > ctx.pool.limit_pages() {
                return Err(core.oom(ctx, bytes, total, 0));
            }
            let obtained = core.obtain_free_pages(ctx, bytes, total, PagesFor::Mapping);
            core.sync_stats(ctx);
            obtained?;
        }
        for (ai, at) in need {
            if at.is_empty() {
                continue;
            }
            let pages = ctx.pool.take(at.len() as u64).map_err(pool_err)?;
            // Pages whose last use elsewhere may still run: that work
            // completes before the copy writes them.
            let mut done = Ok(());
            for pg in &pages {
                if let Some(&(mask, k)) = core.page_hazards.get(&pg.id) {
                    for s in core.streams.in_mask(mask) {
                        if let Err(e) = core.streams.complete(ctx.vmm, s, k, tick) {
                            done = Err(AllocError::from(e));
                        }
                    }
                }
            }
            if let Err(e) = done {
                ctx.pool.give_back(&pages).map_err(pool_err)?;
                return Err(e);
            }
            for pg in &pages {
                core.page_hazards.remove(&pg.id);
            }
            let mapped = core.map_pages(ctx, ai, &at, &pages);
            core.sync_stats(ctx);
            mapped?;
        }
        // The contents, back at the same addresses (not those of members
        // freed meanwhile).
        if let Some(Some(s)) = self.asleep.get(t as usize) {
            for c in &s.saved {
                if !core.freed_asleep.contains(&c.ptr) {
                    copy_back(ctx, c)?;
                }
            }
        }
        let sleeping = self.asleep.get_mut(t as usize).and_then(Option::take);
        for &ai in &arenas {
            core.thaw(ai);
        }
        // The members freed while it slept.
        let freed = core.free_thawed(ctx, &arenas);
        if let Some(s) = sleeping {
            self.sleeping -= 1;
            self.counts.bytes_restored += s.saved.iter().map(|c| c.len).sum::<u64>();
        }
        self.counts.wakes += 1;
        core.sync_arena_stats(ctx);
        freed
    }
}
