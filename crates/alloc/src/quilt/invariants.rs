//! The invariant checker: recomputes everything the allocator keeps
//! incrementally and compares.

use std::collections::HashSet;

use quilt_pool::{PageId, PagePool};

use super::export::Exports;
use super::growable::Growables;
use super::sleep::{tag_arenas, tag_members, Tags};
use super::stitch::{Core, Kind};
use crate::error::InvariantViolation;

fn fail<T>(msg: String) -> Result<T, InvariantViolation> {
    Err(InvariantViolation(msg))
}

/// Check every invariant of the state against the pool (see `docs/design.md`):
///
/// 1. In every arena, occupied blocks do not overlap, lie inside the arena, and
///    the gaps are exactly their complement, coalesced, indexed by size.
/// 2. Every block record matches an occupied range, and vice versa; so no two
///    live blocks overlap in virtual memory.
/// 3. Touch counts equal the number of blocks overlapping each page; every
///    touched page is mapped; the cached, touched and mapped counts are right.
/// 4. Every mapped virtual page is one pool page handed out, and every pool
///    page handed out is mapped at exactly one virtual page; so a physical
///    page backs two different blocks only when they share that very virtual
///    page (neighbours on a boundary page).
/// 5. Hazards are kept by the gap that holds them (in address order,
///    disjoint, never under a block: checked with the tiling), name only
///    streams seen, and carry a tick not past the allocator's.
/// 6. Once the reclaim queue is kept (from the first reclaim on), every
///    cached page has exactly one valid entry in it, so reclaim can find
///    every one of them; before, it is empty.
/// 7. Every statistic equals what it counts.
/// 8. A retired page is touched by no block, backs no pool page of its own,
///    and has an entry in the retired queue; the retired count is right; a
///    pool page with a hazard is free in the pool.
/// 9. Growable buffers: each owns one arena of its maximum size (its kind
///    `Growable`), whose only occupied range is `0 .. len` rounded to 512 B
///    (none at length 0); every other growable arena is recycled (released,
///    kept whole, nothing occupied), a zombie (released, nothing occupied,
///    still mapping something) or dead (size 0, its slot free); no arena is
///    two of these.
/// 10. The frozen arenas are exactly the sleeping tags' arenas, and only
///     they may have touched pages unmapped
///     (until a wake maps them); in offload mode a sleeping tag's host
///     copies are exactly its members' ranges.
pub(crate) fn check(
    st: &Core,
    growables: &Growables,
    tags: &Tags,
    exports: &Exports,
    pool: &PagePool,
    page: u64,
) -> Result<(), InvariantViolation> {
    pool.check_invariants().map_err(InvariantViolation)?;
    exports.check(st)?;
    let mut occupied_total = 0usize;
    let mut backing: Vec<PageId> = Vec::new();
    let mut cached_slots: Vec<(usize, u64, u64)> = Vec::new();
    let asleep = check_sleeping_tags(st, growables, tags)?;
    for (ai, a) in st.arenas.iter().enumerate() {
        // 1. blocks and gaps tile the arena, coalesced, gaps indexed by size.
        if let Err(e) = a.tiling.check(a.size) {
            return fail(format!("arena {ai}: {e}"));
        }
        occupied_total += a.tiling.block_count();
        // 3. touch counts.
        let mut touch = vec![0u32; a.pages.len()];
        for (s, e) in a.occupied() {
            let (f, l) = a.page_span(s, e - s);
            if l as usize >= touch.len() {
                return fail(format!("arena {ai}: block {s:#x} beyond the page table"));
            }
            for p in f..=l {
                touch[p as usize] += 1;
            }
        }
        let (mut touched, mut cached, mut mapped, mut retired) = (0u64, 0u64, 0u64, 0u64);
        for (p, slot) in a.pages.iter().enumerate() {
            if slot.retired {
                retired += 1;
                if slot.touch > 0 || slot.phys.is_some() {
                    return fail(format!(
                        "arena {ai}: retired page {p} is touched or backs a pool page"
                    ));
                }
                if !st
                    .retired_queue
                    .iter()
                    .any(|&(qa, qp, _)| qa == ai && qp == p as u64)
                {
                    return fail(format!(
                        "arena {ai}: retired page {p} is not in the retired queue"
                    ));
                }
            }
            if slot.touch != touch[p] {
                return fail(format!(
                    "arena {ai}: page {p} touched {} times, blocks touch it {}",
                    slot.touch, touch[p]
                ));
            }
            if slot.touch > 0 {
                touched += 1;
                if slot.phys.is_none() && !asleep.contains(&ai) {
                    return fail(format!(
                        "arena {ai}: page {p} is touched by a block but not mapped"
                    ));
                }
            }
            if let Some(pg) = slot.phys {
                mapped += 1;
                backing.push(pg.id);
                if (p as u64 + 1) * page > a.size {
                    return fail(format!("arena {ai}: page {p} mapped beyond the arena"));
                }
                if slot.touch == 0 {
                    cached += 1;
                    cached_slots.push((ai, p as u64, slot.cached_at));
                }
            }
        }
        if retired != a.retired_pages {
            return fail(format!(
                "arena {ai}: {} retired pages counted, {retired} found",
                a.retired_pages
            ));
        }
        if (touched, cached, mapped) != (a.touched_pages, a.cached_pages, a.mapped_pages) {
            return fail(format!(
                "arena {ai}: touched/cached/mapped {}/{}/{} but pages say {touched}/{cached}/{mapped}",
                a.touched_pages, a.cached_pages, a.mapped_pages
            ));
        }
        // 5. hazards (in order, inside their gap, none on a block: checked
        // with the tiling).
        let known = super::streams::Streams::mask_of(st.streams.len() as u32);
        if let Some(h) = a
            .tiling
            .all_hazards()
            .find(|h| h.tick > st.tick || h.streams & !known != 0)
        {
            return fail(format!(
                "arena {ai}: hazard at {:#x} names unknown streams or a future tick",
                h.start
            ));
        }
    }
    // 6. the reclaim queue (empty until the first reclaim builds it).
    if !st.reclaim_queue_kept && !st.reclaim_queue.is_empty() {
        return fail("the reclaim queue is not kept but holds entries".into());
    }
    let cached_slots = if st.reclaim_queue_kept {
        cached_slots
    } else {
        Vec::new()
    };
    let valid: HashSet<(usize, u64, u64)> = st
        .reclaim_queue
        .iter()
        .copied()
        .filter(|&(ai, p, stamp)| {
            st.arenas.get(ai).is_some_and(|a| {
                let s = a.slot(p);
                s.is_cached() && s.cached_at == stamp
            })
        })
        .collect();
    let listed = st
        .reclaim_queue
        .iter()
        .filter(|e| valid.contains(e))
        .count();
    if listed != valid.len() || valid.len() != cached_slots.len() {
        return fail(format!(
            "reclaim queue holds {listed} valid entries ({} distinct) for {} cached pages",
            valid.len(),
            cached_slots.len()
        ));
    }
    if let Some(missing) = cached_slots.iter().find(|c| !valid.contains(c)) {
        return fail(format!(
            "cached page {missing:?} is missing from the reclaim queue"
        ));
    }
    // 4. pool pages versus mapped pages.
    let mut seen = HashSet::with_capacity(backing.len());
    for &b in &backing {
        if !seen.insert(b) {
            return fail(format!("pool page {b:?} is mapped twice"));
        }
    }
    if let Some(id) = st.page_hazards.keys().find(|&&id| pool.is_in_use(id)) {
        return fail(format!("pool page {id:?} has a hazard but is handed out"));
    }
    backing.sort_unstable();
    let in_use: Vec<PageId> = pool.pages_in_use();
    if in_use != backing {
        return fail(format!(
            "pool hands out {} pages but {} are mapped",
            in_use.len(),
            backing.len()
        ));
    }
    // 9. growable buffers, zombies, dead arenas.
    let growable_blocks = check_growables(st, growables)?;
    // 2. block records versus occupied ranges.
    if occupied_total != st.blocks.len() + st.held.len() + growable_blocks {
        return fail(format!(
            "{} block records, {} held frees and {growable_blocks} growable buffers but {occupied_total} occupied ranges",
            st.blocks.len(),
            st.held.len()
        ));
    }
    // Held frees (see `held.rs`): occupied, active, not allocated.
    let mut held_bytes = 0u64;
    for (&ptr, h) in &st.held {
        let b = &h.block;
        if st.blocks.contains_key(&ptr) {
            return fail(format!("block {ptr:#x} is both live and held"));
        }
        let Some(a) = st.arenas.get(b.arena) else {
            return fail(format!("held block {ptr:#x} names a missing arena"));
        };
        if a.base + b.off != ptr || a.tiling.block(b.piece) != Some((b.off, b.off + b.size)) {
            return fail(format!(
                "held block {ptr:#x} does not match its occupied range"
            ));
        }
        held_bytes += b.size;
    }
    let (mut alloc_bytes, mut requested) = (0u64, 0u64);
    for g in growables.live.values() {
        alloc_bytes += g.extent();
        requested += g.len;
    }
    for (&ptr, b) in &st.blocks {
        let Some(a) = st.arenas.get(b.arena) else {
            return fail(format!("block {ptr:#x} names a missing arena"));
        };
        if a.base + b.off != ptr || a.tiling.block(b.piece) != Some((b.off, b.off + b.size)) {
            return fail(format!("block {ptr:#x} does not match its occupied range"));
        }
        alloc_bytes += b.size;
        requested += b.requested;
    }
    // 7. statistics.
    let s = &st.stats;
    let n = st.blocks.len() as u64 + growables.live.len() as u64;
    let checks = [
        ("allocated_bytes", s.allocated_bytes.current, alloc_bytes),
        ("allocation", s.allocation.current, n),
        (
            "active_bytes",
            s.active_bytes.current,
            alloc_bytes + held_bytes,
        ),
        (
            "active",
            s.active.current,
            st.blocks.len() as u64 + st.held.len() as u64,
        ),
        ("requested_bytes", s.requested_bytes.current, requested),
        (
            "reserved_bytes",
            s.reserved_bytes.current,
            pool.total_pages() * page,
        ),
        ("segment", s.segment.current, pool.total_pages()),
        (
            "inactive_split",
            s.inactive_split.current,
            st.arenas
                .iter()
                .map(|a| (a.tiling.gap_count() as u64).saturating_sub(1))
                .sum(),
        ),
        (
            "inactive_split_bytes",
            s.inactive_split_bytes.current,
            (st.arenas.iter().map(|a| a.touched_pages).sum::<u64>() * page)
                .saturating_sub(s.active_bytes.current),
        ),
    ];
    for (name, have, want) in checks {
        if have != want {
            return fail(format!("statistic {name} is {have}, counts {want}"));
        }
    }
    for (name, stat) in [
        ("allocated_bytes", &s.allocated_bytes),
        ("active_bytes", &s.active_bytes),
        ("reserved_bytes", &s.reserved_bytes),
        ("allocation", &s.allocation),
    ] {
        if stat.peak < stat.current || stat.allocated - stat.freed != stat.current {
            return fail(format!("statistic {name}: peak or totals inconsistent"));
        }
    }
    Ok(())
}

/// Invariant 9; returns how many growable buffers occupy a range.
fn check_growables(st: &Core, growables: &Growables) -> Result<usize, InvariantViolation> {
    let mut owner: Vec<u8> = vec![0; st.arenas.len()];
    let mut occupying = 0usize;
    for (&id, g) in &growables.live {
        let Some(a) = st.arenas.get(g.arena) else {
            return fail(format!("growable {id} names a missing arena"));
        };
        if st.arena_meta[g.arena].1 != Kind::Own || a.size != g.max || g.len > g.max {
            return fail(format!(
                "growable {id}: arena kind, size {} or length {} (max {}) wrong",
                a.size, g.len, g.max
            ));
        }
        let extent = g.extent();
        let want: Vec<(u64, u64)> = if extent > 0 {
            vec![(0, extent)]
        } else {
            Vec::new()
        };
        let have: Vec<(u64, u64)> = a.occupied().collect();
        if have != want {
            return fail(format!(
                "growable {id}: occupied {have:?}, its length says {want:?}"
            ));
        }
        occupying += usize::from(extent > 0);
        owner[g.arena] += 1;
    }
    for &ai in &st.zombies {
        let Some(a) = st.arenas.get(ai) else {
            return fail(format!("zombie arena {ai} is missing"));
        };
        if a.size == 0 || a.tiling.block_count() != 0 || st.arena_meta[ai].1 != Kind::Own {
            return fail(format!(
                "zombie arena {ai} is dead, occupied or not growable"
            ));
        }
        owner[ai] += 1;
    }
    for &ai in &growables.recycled {
        let Some(a) = st.arenas.get(ai) else {
            return fail(format!("recycled arena {ai} is missing"));
        };
        if a.size == 0 || a.tiling.block_count() != 0 || st.arena_meta[ai].1 != Kind::Own {
            return fail(format!(
                "recycled arena {ai} is dead, occupied or not growable"
            ));
        }
        owner[ai] += 1;
    }
    for &ai in &st.free_arena_slots {
        match st.arenas.get(ai) {
            Some(a) if a.size == 0 && a.pages.is_empty() => owner[ai] += 1,
            _ => return fail(format!("free arena slot {ai} is not a dead arena")),
        }
    }
    for (ai, &n) in owner.iter().enumerate() {
        let growable = st.arena_meta[ai].1 == Kind::Own;
        if (growable && n != 1) || (!growable && n != 0) {
            return fail(format!(
                "arena {ai} ({:?}) is owned {n} times by growables, zombies and free slots",
                st.arena_meta[ai].1
            ));
        }
    }
    Ok(occupying)
}

/// Invariant 10 (the mapping part is checked with the pages); returns the
/// arenas of sleeping tags, which are exactly the core's frozen arenas.
fn check_sleeping_tags(
    st: &Core,
    growables: &Growables,
    tags: &Tags,
) -> Result<HashSet<usize>, InvariantViolation> {
    let mut asleep = HashSet::new();
    for t in 0..tags.len() {
        if !tags.is_asleep(t) {
            continue;
        }
        asleep.extend(tag_arenas(st, growables, t));
        if let Some(saved) = tags.saved_ranges(t) {
            let members: Vec<(u64, u64)> = tag_members(st, growables, t)
                .into_iter()
                .map(|(p, l, _)| (p, l))
                .collect();
            let mut saved = saved;
            saved.sort_unstable();
            if saved != members {
                return fail(format!(
                    "sleeping tag {:?}: host copies {saved:?} but members {members:?}",
                    tags.name(t)
                ));
            }
        }
    }
    let sleeping = (0..tags.len()).filter(|&t| tags.is_asleep(t)).count();
    if tags.any_asleep() != (sleeping > 0) {
        return fail(format!(
            "{sleeping} tags asleep, but the count says otherwise"
        ));
    }
    let frozen: HashSet<usize> = st.frozen.keys().copied().collect();
    if frozen != asleep {
        return fail(format!(
            "frozen arenas {frozen:?} are not the sleeping tags' arenas {asleep:?}"
        ));
    }
    Ok(asleep)
}
