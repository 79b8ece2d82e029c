//! The invariant checker: recomputes everything the allocator keeps
//! incrementally and compares.

use std::collections::HashSet;

use quilt_pool::{ChunkId, PagePool};

use super::state::State;
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
///    touched page is mapped; mappings do not overlap; cached-page counts and the
///    reclaim order match.
/// 4. Every mapped virtual page is backed by exactly one pool page handed out,
///    and every pool page handed out backs exactly one mapped virtual page; so a
///    physical page backs two different blocks only when they share that very
///    virtual page (VA neighbours on a boundary page).
/// 5. Every statistic equals what it counts.
/// 6. With `single_owner` (the `single_owner_runs` policy): every mapping of
///    more than one page lies wholly inside the pages one occupied block covers
///    entirely, or no block touches any of its pages; so no mapping mixes
///    cached pages with pages under a block, or pages of two blocks.
pub(crate) fn check(
    st: &State,
    pool: &PagePool,
    page: u64,
    single_owner: bool,
) -> Result<(), InvariantViolation> {
    pool.check_invariants().map_err(InvariantViolation)?;
    let mut occupied_total = 0usize;
    let mut backing: Vec<(ChunkId, u64)> = Vec::new();
    let mut reclaim_listed = 0usize;
    for (ai, a) in st.arenas.iter().enumerate() {
        // 1. occupied and gaps tile the arena.
        let mut pos = 0u64;
        let mut occ = a.occupied.iter().peekable();
        let mut gaps = a.gaps.iter().peekable();
        let mut last_was_gap = false;
        loop {
            if let Some((&s, &e)) = occ.peek().copied() {
                if s == pos {
                    if e <= s {
                        return fail(format!("arena {ai}: empty block at {s:#x}"));
                    }
                    pos = e;
                    last_was_gap = false;
                    occ.next();
                    continue;
                }
            }
            if let Some((&s, &e)) = gaps.peek().copied() {
                if s == pos {
                    if e <= s || last_was_gap {
                        return fail(format!("arena {ai}: empty or uncoalesced gap at {s:#x}"));
                    }
                    pos = e;
                    last_was_gap = true;
                    gaps.next();
                    continue;
                }
            }
            break;
        }
        if pos != a.size || occ.next().is_some() || gaps.next().is_some() {
            return fail(format!(
                "arena {ai}: blocks and gaps do not tile the arena (stopped at {pos:#x} of {:#x})",
                a.size
            ));
        }
        if a.gaps_by_size.len() != a.gaps.len()
            || a.gaps
                .iter()
                .any(|(&s, &e)| !a.gaps_by_size.contains(&(e - s, s)))
        {
            return fail(format!("arena {ai}: gap size index out of date"));
        }
        occupied_total += a.occupied.len();
        // 3. touch counts.
        let mut touch = vec![0u32; a.touch.len()];
        for (&s, &e) in &a.occupied {
            let (f, l) = a.page_span(s, e - s);
            if l as usize >= touch.len() {
                return fail(format!("arena {ai}: block {s:#x} beyond the touch table"));
            }
            for p in f..=l {
                touch[p as usize] += 1;
            }
        }
        if touch != a.touch {
            return fail(format!("arena {ai}: touch counts differ from the blocks"));
        }
        let touched = touch.iter().filter(|&&t| t > 0).count() as u64;
        if touched != a.touched_pages {
            return fail(format!(
                "arena {ai}: touched_pages {} but {touched} pages touched",
                a.touched_pages
            ));
        }
        let mut prev_end = 0u64;
        let mut mapped = 0u64;
        let mut cached = 0u64;
        for (&s, m) in &a.mappings {
            if s < prev_end || m.pages == 0 || m.run.pages != m.pages {
                return fail(format!(
                    "arena {ai}: mapping at page {s} overlaps or is malformed"
                ));
            }
            if (s + m.pages) * page > a.size {
                return fail(format!("arena {ai}: mapping at page {s} beyond the arena"));
            }
            prev_end = s + m.pages;
            mapped += m.pages;
            let untouched = (s..s + m.pages).filter(|&p| a.touch_of(p) == 0).count() as u64;
            if untouched != m.untouched {
                return fail(format!(
                    "arena {ai}: mapping at page {s} counts {} cached pages, has {untouched}",
                    m.untouched
                ));
            }
            cached += untouched;
            let want = m.reclaim_class().map(|c| (c, m.tick));
            if m.listed != want {
                return fail(format!(
                    "arena {ai}: mapping at page {s} listed as {:?}, should be {want:?}",
                    m.listed
                ));
            }
            if let Some((c, t)) = want {
                if !st.reclaim.contains(&(c, t, ai, s)) {
                    return fail(format!(
                        "arena {ai}: mapping at page {s} missing from the reclaim order"
                    ));
                }
                reclaim_listed += 1;
            }
            if single_owner && m.pages > 1 && untouched != m.pages {
                // 6. all its pages inside one block's wholly covered pages.
                let (lo, hi) = (s * page, (s + m.pages) * page);
                let owner = a.occupied.range(..hi).next_back();
                if !owner.is_some_and(|(&bs, &be)| bs <= lo && be >= hi) {
                    return fail(format!(
                        "arena {ai}: mapping at page {s} ({} pages) is not single-owner",
                        m.pages
                    ));
                }
            }
            for i in 0..m.pages {
                backing.push((m.run.chunk, m.run.first_page + i));
            }
        }
        if mapped != a.mapped_pages || cached != a.cached_pages {
            return fail(format!(
                "arena {ai}: mapped/cached pages {}/{} but mappings hold {mapped}/{cached}",
                a.mapped_pages, a.cached_pages
            ));
        }
        for (p, &t) in touch.iter().enumerate() {
            if t > 0 && a.mapping_of(p as u64).is_none() {
                return fail(format!(
                    "arena {ai}: page {p} is touched by a block but not mapped"
                ));
            }
        }
    }
    if reclaim_listed != st.reclaim.len() {
        return fail(format!(
            "reclaim order lists {} mappings, {reclaim_listed} expected",
            st.reclaim.len()
        ));
    }
    // 4. pool pages versus mapped pages (and pages kept after a failed remap).
    for r in &st.lost_runs {
        for i in 0..r.pages {
            backing.push((r.chunk, r.first_page + i));
        }
    }
    let mut seen = HashSet::with_capacity(backing.len());
    for &b in &backing {
        if !seen.insert(b) {
            return fail(format!("pool page {b:?} is mapped twice"));
        }
    }
    backing.sort_unstable();
    let in_use = pool.pages_in_use();
    if in_use != backing {
        return fail(format!(
            "pool hands out {} pages but {} are mapped",
            in_use.len(),
            backing.len()
        ));
    }
    // 2. block records versus occupied ranges.
    if occupied_total != st.blocks.len() {
        return fail(format!(
            "{} block records but {occupied_total} occupied ranges",
            st.blocks.len()
        ));
    }
    let (mut alloc_bytes, mut alloc_n, mut active_bytes, mut requested) = (0u64, 0u64, 0u64, 0u64);
    for (&ptr, b) in &st.blocks {
        let Some(a) = st.arenas.get(b.arena) else {
            return fail(format!("block {ptr:#x} names a missing arena"));
        };
        if a.base + b.off != ptr || a.occupied.get(&b.off) != Some(&(b.off + b.size)) {
            return fail(format!("block {ptr:#x} does not match its occupied range"));
        }
        if b.pending.is_none() {
            alloc_bytes += b.size;
            alloc_n += 1;
        }
        active_bytes += b.size;
        requested += b.requested;
    }
    for &p in &st.pending {
        if st.blocks.get(&p).and_then(|b| b.pending.as_ref()).is_none() {
            return fail(format!("pending list names {p:#x}, which is not pending"));
        }
    }
    // 5. statistics.
    let s = &st.stats;
    let checks = [
        ("allocated_bytes", s.allocated_bytes.current, alloc_bytes),
        ("allocation", s.allocation.current, alloc_n),
        ("active_bytes", s.active_bytes.current, active_bytes),
        ("active", s.active.current, st.blocks.len() as u64),
        ("requested_bytes", s.requested_bytes.current, requested),
        (
            "reserved_bytes",
            s.reserved_bytes.current,
            pool.total_pages() * page,
        ),
        ("segment", s.segment.current, pool.stats().chunks),
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
