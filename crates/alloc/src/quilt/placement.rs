//! Placement: where a block goes in an arena, behind one small trait
//! ([`Placer`]) with two implementations, [`BestFit`] (Quilt's: best-fitting
//! gaps scored by mapped pages and waits) and [`Gmlake`] (GMLake's limits);
//! and ordering a block's stream after the other streams' work on its range.
//!
//! Candidates are scored in one pass, best fit first, and the first that
//! is mapped and needs no wait is taken at once: scoring a candidate walks
//! its hazards once, learning the progress of each stream whose work it may
//! still carry until one is found running (a query of the earliest event
//! covering what is asked, none where this operation already learnt the
//! answer or the stream is known done or already waited for). A block
//! that would wait for a stream capturing a CUDA graph is passed over (see
//! [`Core::under_capture`]).

use std::ops::ControlFlow;

use quilt_vmm::Vmm;

use super::arena::{Arena, PageSlot};
use super::config::Placement;
use super::pressure::packed_in_gap;
use super::stitch::{Core, Ctx, Kind, MappedAhead};
use super::streams::Streams;
use super::tiling::PieceId;
use crate::error::AllocError;

/// How good a place for a block is: lower is better, fields compared in order.
/// (Retired pages still in use need no field: placement steps past them
/// first, so either no candidate covers one or, when none fits past them,
/// every candidate does.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct PlaceScore {
    /// Needs new pages.
    needs_pages: bool,
    /// Every page mapped, but another stream's work must be waited for (a
    /// wait costs less than new pages).
    waits_though_mapped: bool,
    /// How many new pages.
    new_pages: u64,
    /// Another stream's work must be waited for.
    waits: bool,
}

impl PlaceScore {
    /// The score of a place needing `unmapped` new pages that must (`wait`)
    /// or need not wait for another stream's work.
    fn of(unmapped: u64, wait: bool) -> PlaceScore {
        PlaceScore {
            needs_pages: unmapped > 0,
            waits_though_mapped: unmapped == 0 && wait,
            new_pages: unmapped,
            waits: wait,
        }
    }

    /// Mapped and wait-free: taken at once.
    const PERFECT: PlaceScore = PlaceScore {
        needs_pages: false,
        waits_though_mapped: false,
        new_pages: 0,
        waits: false,
    };
}

/// Where placement puts a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Placed {
    /// The block's offset in its arena.
    pub(super) off: u64,
    /// The gap that holds it.
    pub(super) gap: PieceId,
    /// Placement found, this operation, that the block needs no wait for
    /// another stream's work (so ordering its stream is a no-op); false
    /// when it did not ask.
    pub(super) wait_free: bool,
}

impl Placed {
    /// A place whose waits placement did not ask about.
    fn unchecked((off, gap): (u64, PieceId)) -> Placed {
        Placed {
            off,
            gap,
            wait_free: false,
        }
    }

    /// A place found, this operation, to need no wait.
    fn wait_free((off, gap): (u64, PieceId)) -> Placed {
        Placed {
            off,
            gap,
            wait_free: true,
        }
    }
}

/// Where [`BestFit`]'s candidates come from: the `n` best-fitting gaps of
/// the arena, or a list made first (starts moved past retired pages).
#[derive(Clone, Copy, Debug)]
enum Candidates<'c> {
    Fitting(usize),
    Listed(&'c [(u64, PieceId)]),
}

/// A block to place: `rounded` bytes (asked for as `size`) on stream index `t`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    size: u64,
    rounded: u64,
    t: u32,
}

/// A placement policy: where a block goes in an arena.
pub(super) trait Placer {
    /// Where `req` goes in arena `ai` of `core`; `None` when no gap fits.
    fn place(&self, core: &mut Core, ctx: &Ctx<'_>, ai: usize, req: Request) -> Option<Placed>;
}

/// Quilt's placement: among up to `candidates` best-fitting gaps, the first
/// whose pages are all mapped and need no wait for another stream, then one
/// whose pages are all mapped (a wait costs less than new pages), then the
/// one needing the fewest new pages; the block goes at the gap's start
/// (past retired pages still in use).
pub(super) struct BestFit {
    pub(super) candidates: usize,
    /// Under pressure (see `pressure.rs`): among the candidates, the place
    /// touching the fewest untouched pages, at either end of its gap.
    pub(super) pack: bool,
}

impl Placer for BestFit {
    fn place(&self, core: &mut Core, ctx: &Ctx<'_>, ai: usize, req: Request) -> Option<Placed> {
        let Request { rounded, t, .. } = req;
        if self.pack {
            return core.place_packed(ctx, ai, (rounded, t), self.candidates);
        }
        let n = self.candidates;
        if core.arenas[ai].retired_pages == 0 {
            if core.streams.len() >= 2 {
                return core.place_among_streams(ctx, ai, (rounded, t), n);
            }
            // The best fit, needing no new page and over no hazard (a
            // single stream leaves none), is what scoring would take first:
            // taken without it.
            let arena = &core.arenas[ai];
            let ready = arena.best_fit(rounded).filter(|&(off, gap)| {
                new_pages(arena, (&core.mapped_ahead, ai), off, rounded) == 0
                    && arena.tiling.gap_hazards(gap).is_empty()
            });
            if let Some(found) = ready {
                return Some(Placed::wait_free(found));
            }
            return core.best_candidate(ctx, ai, rounded, t, Candidates::Fitting(n));
        }
        core.place_past_retired(ctx, ai, (rounded, t), n)
    }
}

/// GMLake's placement (its `fragLimit` and `reuseLimit`): a large request
/// below `frag_limit` is served from a cached range whose pages are all
/// mapped, else from fresh, page-aligned virtual space past the arena's
/// mapped tail (new pages, no stitching); one at or above it reuses a
/// cached range of at most `reuse_limit` times its size, else is stitched
/// into the best-fitting gap.
pub(super) struct Gmlake {
    frag_limit: u64,
    reuse_limit: u64,
}

impl Placer for Gmlake {
    fn place(&self, core: &mut Core, _: &Ctx<'_>, ai: usize, req: Request) -> Option<Placed> {
        let Request { size, rounded, .. } = req;
        let a = &core.arenas[ai];
        let limit = if size >= self.frag_limit && self.reuse_limit > 0 {
            rounded.saturating_mul(self.reuse_limit)
        } else {
            u64::MAX
        };
        if let Some(found) = a.best_fit_mapped(rounded, limit, 64) {
            return Some(Placed::unchecked(found));
        }
        if size >= self.frag_limit {
            return a.fitting_gaps(rounded, 1).next().map(Placed::unchecked);
        }
        a.fresh_tail(rounded).map(Placed::unchecked)
    }
}

impl Core {
    /// [`BestFit`] under pressure (see `pressure.rs`), for a block of
    /// `rounded` bytes on stream `t` in arena `ai`: among up to `n`
    /// best-fitting gaps, the place (either end of a gap, past retired pages
    /// still in use) touching the fewest untouched pages, the better fit on a
    /// tie, whatever its mapping or waits. When every fitting gap is blocked
    /// by retired pages still in use, the best of them as without pressure
    /// (a synchronisation).
    fn place_packed(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (rounded, t): (u64, u32),
        n: usize,
    ) -> Option<Placed> {
        let fitting: Vec<(u64, PieceId)> = self.arenas[ai].fitting_gaps(rounded, n).collect();
        let retired = self.arenas[ai].retired_pages > 0;
        let mut best: Option<(u64, (u64, PieceId))> = None;
        for &(_, gap) in &fitting {
            let Some(start) = self.past_retired_in_use(ctx, ai, gap, rounded) else {
                continue;
            };
            let Some((_, end)) = self.arenas[ai].tiling.gap(gap) else {
                continue;
            };
            let Some((mut place, at_start)) =
                packed_in_gap(&self.arenas[ai], (start, end), rounded)
            else {
                continue;
            };
            if let Some(at_start) = at_start {
                if retired
                    && self
                        .last_retired_in_use(ctx, ai, place.off, rounded)
                        .is_some()
                {
                    place = at_start;
                }
            }
            if best.is_none_or(|(touches, _)| place.first_touches < touches) {
                best = Some((place.first_touches, (place.off, gap)));
            }
        }
        let listed = match best {
            Some((_, place)) => vec![place],
            None => fitting,
        };
        self.best_candidate(ctx, ai, rounded, t, Candidates::Listed(&listed))
    }

    /// [`BestFit`] in arena `ai` with retired pages, for a block of
    /// `rounded` bytes on stream `t`, among up to `n` candidates: each is
    /// looked at past retired pages still in use. (Out of line: only after
    /// reclaim retired pages.)
    #[inline(never)]
    fn place_past_retired(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (rounded, t): (u64, u32),
        n: usize,
    ) -> Option<Placed> {
        let candidates: Vec<(u64, PieceId)> = self.arenas[ai].fitting_gaps(rounded, n).collect();
        let moved: Vec<(u64, PieceId)> = candidates
            .iter()
            .filter_map(|&(_, g)| {
                self.past_retired_in_use(ctx, ai, g, rounded)
                    .map(|off| (off, g))
            })
            .collect();
        // If every fitting gap is blocked, a retired page will be
        // synchronised for (rare; only after reclaim moved pages).
        let candidates = if moved.is_empty() { candidates } else { moved };
        self.best_candidate(ctx, ai, rounded, t, Candidates::Listed(&candidates))
    }

    /// [`BestFit`] with several streams, in arena `ai` without retired
    /// pages, for a block of `rounded` bytes on stream `t`, among up to `n`
    /// candidates. The best fit is scored first, as [`best_of`] would score
    /// it (its new pages counted once, its hazards walked once): needing
    /// no new page and no wait, it is taken at once (over no hazard, or
    /// over hazards known without a call to need no wait, nothing is
    /// asked). A lone candidate is taken unscored, wait free when mapped
    /// and known without a call to need no wait; else the rest of the same
    /// walk of the size index is ranked after it ([`ranked`]). (Out of
    /// line: a single stream never gets here, and its fast path stays
    /// short.)
    #[inline(never)]
    fn place_among_streams(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (rounded, t): (u64, u32),
        n: usize,
    ) -> Option<Placed> {
        let tick = self.tick;
        let (arena, streams) = (&self.arenas[ai], &mut self.streams);
        let ahead = (&self.mapped_ahead, ai);
        let mut fitting = arena.fitting_gaps(rounded, n);
        let first = fitting.next()?;
        let unmapped = new_pages(arena, ahead, first.0, rounded);
        let hazards = !arena.tiling.gap_hazards(first.1).is_empty();
        if unmapped == 0 && !hazards {
            return Some(Placed::wait_free(first));
        }
        let best = match fitting.next() {
            // A lone candidate is taken unscored (as `best_of` does): wait
            // free when mapped and known without a call to need no wait.
            None if unmapped == 0
                && !must_wait(arena, streams, (None, tick), first, rounded, t) =>
            {
                return Some(Placed::wait_free(first));
            }
            None => Some(Placed::unchecked(first)),
            // Scored as `best_of` scores its first candidate.
            Some(second) => {
                let ask = (Some(ctx.vmm), tick);
                let wait = hazards && must_wait(arena, streams, ask, first, rounded, t);
                let score = PlaceScore::of(unmapped, wait);
                if score == PlaceScore::PERFECT {
                    return Some(Placed::wait_free(first));
                }
                let req = (rounded, t, tick);
                let upcoming = fitting.next();
                let rest = (
                    second,
                    upcoming,
                    &mut fitting as &mut dyn Iterator<Item = _>,
                );
                ranked(arena, streams, ctx, req, ahead, Some((score, first)), rest)
            }
        };
        drop(fitting);
        if best.is_none_or(|p| p.wait_free) {
            // Nothing skipped, and no wait to check for a capture.
            return best;
        }
        self.unless_under_capture(ctx, ai, (rounded, t), Candidates::Fitting(n), best)
    }

    /// The best of `candidates` (starts of a block of `rounded` bytes on
    /// stream `t` in arena `ai`, each with its gap, best fit first), by
    /// [`PlaceScore`] ([`best_of`]), skipping any whose range
    /// another stream freed while capturing a CUDA graph that is still
    /// under way ([`Core::under_capture`]; nothing may wait for such work:
    /// it runs only when the graph is launched). When every candidate is
    /// skipped so, fresh virtual space past the arena's mapped tail.
    fn best_candidate(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        rounded: u64,
        t: u32,
        candidates: Candidates<'_>,
    ) -> Option<Placed> {
        let best = self.best_round(ctx, ai, (rounded, t), candidates, &[]);
        self.unless_under_capture(ctx, ai, (rounded, t), candidates, best)
    }

    /// The best of `candidates` not in `skipped`, by [`PlaceScore`]
    /// ([`best_of`]), for a block of `rounded` bytes on stream `t` in
    /// arena `ai`.
    fn best_round(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (rounded, t): (u64, u32),
        candidates: Candidates<'_>,
        skipped: &[(u64, PieceId)],
    ) -> Option<Placed> {
        let req = (rounded, t, self.tick);
        let (arena, streams) = (&self.arenas[ai], &mut self.streams);
        let ahead = (&self.mapped_ahead, ai);
        match candidates {
            Candidates::Fitting(n) => {
                let mut fitting = arena.fitting_gaps(rounded, n);
                let first = fitting.next()?;
                best_of(
                    arena,
                    streams,
                    ctx,
                    req,
                    ahead,
                    (first, &mut fitting),
                    skipped,
                )
            }
            Candidates::Listed(list) => {
                let (&first, rest) = list.split_first()?;
                let mut rest = rest.iter().copied();
                best_of(arena, streams, ctx, req, ahead, (first, &mut rest), skipped)
            }
        }
    }

    /// `best`, the best of `candidates` for a block of `rounded` bytes on
    /// stream `t` in arena `ai`, unless it would wait for a capture under
    /// way ([`Core::under_capture`]): then the best of the others, and so
    /// on; when every candidate is passed over so, fresh virtual space past
    /// the arena's mapped tail.
    fn unless_under_capture(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (rounded, t): (u64, u32),
        candidates: Candidates<'_>,
        mut best: Option<Placed>,
    ) -> Option<Placed> {
        let mut skipped: Vec<(u64, PieceId)> = Vec::new();
        loop {
            let Some(placed) = best else {
                if skipped.is_empty() {
                    return None;
                }
                return self.arenas[ai].fresh_tail(rounded).map(Placed::unchecked);
            };
            if placed.wait_free
                || !self.under_capture(ctx, ai, (placed.off, placed.gap), rounded, t)
            {
                return Some(placed);
            }
            skipped.push((placed.off, placed.gap));
            best = self.best_round(ctx, ai, (rounded, t), candidates, &skipped);
        }
    }

    /// Whether a block of `len` bytes on stream `t` at `off` of gap `gap`
    /// in arena `ai` would cover a range another stream freed and may
    /// still use from inside a capture under way: that stream's work
    /// there is not known done, and the stream is capturing now (asked of
    /// the driver at most once per stream per operation). Such work runs
    /// only when the graph is launched, so no event can order `t` after
    /// it; the range waits for the capture to end.
    fn under_capture(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (off, gap): (u64, PieceId),
        len: u64,
        t: u32,
    ) -> bool {
        let tick = self.tick;
        let found = self.each_hazard_stream(ai, (off, gap), len, t, |streams, s, k| {
            if !streams.orders_nothing(t, s, k) && streams.capturing(ctx.vmm, s, tick) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        found.is_break()
    }

    /// Order stream `t` after every other stream's work that may still use
    /// `off .. off + len` of gap `gap` in arena `ai`.
    pub(super) fn order_after_hazards(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        (off, gap): (u64, PieceId),
        len: u64,
        t: u32,
    ) -> Result<(), AllocError> {
        let tick = self.tick;
        let ordered =
            self.each_hazard_stream(ai, (off, gap), len, t, |streams, s, k| {
                match streams.order_after(ctx.vmm, t, s, k, tick) {
                    Ok(_) => ControlFlow::Continue(()),
                    Err(e) => ControlFlow::Break(e),
                }
            });
        match ordered {
            ControlFlow::Break(e) => Err(e.into()),
            ControlFlow::Continue(()) => Ok(()),
        }
    }

    /// Call `visit(streams, s, k)`, until it breaks, for each hazard over
    /// `off .. off + len` of gap `gap` in arena `ai` and each stream `s`
    /// other than `t` in it (`k`: the hazard's tick). A single stream has
    /// no hazards to visit.
    fn each_hazard_stream<B>(
        &mut self,
        ai: usize,
        (off, gap): (u64, PieceId),
        len: u64,
        t: u32,
        mut visit: impl FnMut(&mut Streams, u32, u64) -> ControlFlow<B>,
    ) -> ControlFlow<B> {
        if self.streams.len() < 2 {
            return ControlFlow::Continue(());
        }
        let streams = &mut self.streams;
        for h in self.arenas[ai].tiling.hazards_over(gap, off, len) {
            for s in streams.in_mask(h.streams).filter(|&s| s != t) {
                visit(streams, s, h.tick)?;
            }
        }
        ControlFlow::Continue(())
    }

    /// Where a block of `rounded` bytes (asked for as `size`) of class
    /// `kind` on stream `t` goes in arena `ai`: GMLake's limits govern the
    /// large blocks of a [`Placement::GmlakeLimits`] policy, best fit every
    /// other.
    pub(super) fn place(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        kind: Kind,
        size: u64,
        rounded: u64,
        t: u32,
    ) -> Option<Placed> {
        let req = Request { size, rounded, t };
        match (ctx.cfg.placement, kind) {
            (
                Placement::GmlakeLimits {
                    frag_limit,
                    reuse_limit,
                },
                Kind::Large,
            ) => Gmlake {
                frag_limit,
                reuse_limit,
            }
            .place(self, ctx, ai, req),
            (policy, _) => BestFit {
                candidates: policy.candidates().max(1),
                pack: self.under_pressure,
            }
            .place(self, ctx, ai, req),
        }
    }

    /// The last retired page under `off .. off + len` of arena `ai` whose
    /// freeing work is not known complete (a block there would need a
    /// synchronisation before that page could be mapped again).
    pub(super) fn last_retired_in_use(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        off: u64,
        len: u64,
    ) -> Option<u64> {
        let tick = self.tick;
        let retired: Vec<(u64, PageSlot)> = self.arenas[ai].retired_in(off, len).collect();
        retired
            .into_iter()
            .rev()
            .find(|(_, slot)| !self.work_done(ctx, slot.freed_by, slot.freed_at, tick))
            .map(|(p, _)| p)
    }

    /// Where in gap `gap` a block of `len` bytes can go without covering a
    /// retired page still in use: the gap's start, or the first page
    /// boundary past such pages; `None` when it no longer fits.
    pub(super) fn past_retired_in_use(
        &mut self,
        ctx: &Ctx<'_>,
        ai: usize,
        gap: PieceId,
        len: u64,
    ) -> Option<u64> {
        let (gap_start, end) = self.arenas[ai].tiling.gap(gap)?;
        if self.arenas[ai].retired_pages == 0 {
            return Some(gap_start);
        }
        let mut start = gap_start;
        while let Some(p) = self.last_retired_in_use(ctx, ai, start, len) {
            start = (p + 1) * ctx.page;
            if start.checked_add(len).is_none_or(|e| e > end) {
                return None;
            }
        }
        Some(start)
    }

    /// True when the work of every stream in `mask` up to tick `k` that the
    /// memory they freed can depend on is known complete (after
    /// [`Streams::learn`](super::streams::Streams::learn): an event recorded
    /// on demand where none covers those frees, then a query unless this
    /// operation already learnt the answer).
    pub(super) fn work_done(&mut self, ctx: &Ctx<'_>, mask: u64, k: u64, tick: u64) -> bool {
        self.streams.in_mask(mask).all(|s| {
            self.streams.learn(ctx.vmm, s, k, tick);
            self.streams.freed_done(s, k)
        })
    }
}

/// The best of the candidates `first` then `rest` (starts of a block of
/// `len` bytes on stream `t` in `arena`, each with its gap, best fit
/// first) not in `skipped`, by [`PlaceScore`], scored in one pass at
/// operation `tick` ([`ranked`]). A lone candidate is taken unscored.
/// (`rest` is a trait object, so that this loop exists once whatever the
/// candidates come from, each source's `next` out of line.)
fn best_of(
    arena: &Arena,
    streams: &mut Streams,
    ctx: &Ctx<'_>,
    req: (u64, u32, u64),
    ahead: (&MappedAhead, usize),
    (first, rest): ((u64, PieceId), &mut dyn Iterator<Item = (u64, PieceId)>),
    skipped: &[(u64, PieceId)],
) -> Option<Placed> {
    let mut rest = rest.filter(|c| skipped.is_empty() || !skipped.contains(c));
    let c = if skipped.contains(&first) {
        rest.next()?
    } else {
        first
    };
    let upcoming = rest.next();
    if upcoming.is_none() {
        return Some(Placed::unchecked(c));
    }
    ranked(
        arena,
        streams,
        ctx,
        req,
        ahead,
        None,
        (c, upcoming, &mut rest),
    )
}

/// A candidate place: a block's start, and the gap that holds it.
type Candidate = (u64, PieceId);

/// The best of `best` (a candidate scored already, if any) and the
/// candidates `c`, `upcoming`, then `rest` (as [`best_of`]'s), by
/// [`PlaceScore`], scored in one pass at operation `tick`: the first that
/// is mapped and wait-free is taken at once.
fn ranked(
    arena: &Arena,
    streams: &mut Streams,
    ctx: &Ctx<'_>,
    (len, t, tick): (u64, u32, u64),
    ahead: (&MappedAhead, usize),
    mut best: Option<(PlaceScore, Candidate)>,
    (mut c, mut upcoming, rest): (
        Candidate,
        Option<Candidate>,
        &mut dyn Iterator<Item = Candidate>,
    ),
) -> Option<Placed> {
    loop {
        let to_beat = best.map(|(b, _)| b);
        let score = score(arena, streams, ctx, (len, t), ahead, c, tick, to_beat);
        if score == PlaceScore::PERFECT {
            return Some(Placed::wait_free(c));
        }
        if best.is_none_or(|(b, _)| score < b) {
            best = Some((score, c));
        }
        let Some(n) = upcoming else {
            break;
        };
        c = n;
        upcoming = rest.next();
    }
    best.map(|(score, (off, gap))| Placed {
        off,
        gap,
        wait_free: !score.waits,
    })
}

/// The score of a block of `len` bytes on stream `t` at `start` of gap `gap`
/// in `arena`. Walks the gap's hazards over the range once: a hazard's
/// streams other than `t`, not known done and not waited for, are learnt
/// (an event recorded on demand where none covers their frees, a query
/// unless operation `tick` already learnt the answer) until one is found
/// still running:
/// the block then waits, and further answers would not change its score.
/// A candidate that needs more new pages than `to_beat` (the best score so
/// far) loses whatever its waits: its hazards are not walked, and nothing
/// is asked of the device for it (it scores as waiting).
#[allow(clippy::too_many_arguments)] // one private call site, in best_of
fn score(
    arena: &Arena,
    streams: &mut Streams,
    ctx: &Ctx<'_>,
    (len, t): (u64, u32),
    (ahead, ai): (&MappedAhead, usize),
    (start, gap): (u64, PieceId),
    tick: u64,
    to_beat: Option<PlaceScore>,
) -> PlaceScore {
    let unmapped = new_pages(arena, (ahead, ai), start, len);
    let loses = to_beat.is_some_and(|b| unmapped > 0 && (!b.needs_pages || unmapped > b.new_pages));
    if loses {
        return PlaceScore {
            needs_pages: true,
            waits_though_mapped: false,
            new_pages: unmapped,
            waits: true,
        };
    }
    // A single stream orders its own reuse.
    let ask = (Some(ctx.vmm), tick);
    let wait = streams.len() >= 2 && must_wait(arena, streams, ask, (start, gap), len, t);
    PlaceScore::of(unmapped, wait)
}

/// Whether a block of `len` bytes on stream `t` at `start` of gap `gap`
/// in `arena` must wait for another stream: walks the hazards over the
/// range until one of their streams other than `t` is found that `t` must
/// wait for ([`Streams::must_wait_for`]). With `ask`'s device (and the
/// operation's tick), a stream not known without a call to order nothing
/// for `t` is learnt (an event recorded on demand where none covers its
/// frees, a query unless this operation already learnt the answer), and
/// counts while its work is still running; without, nothing is asked, and
/// every such stream counts. Out of line: placement's one walk of a
/// range's hazards.
#[inline(never)]
fn must_wait(
    arena: &Arena,
    streams: &mut Streams,
    ask: (Option<&dyn Vmm>, u64),
    (start, gap): (u64, PieceId),
    len: u64,
    t: u32,
) -> bool {
    for h in arena.tiling.hazards_over(gap, start, len) {
        if streams.must_wait_for(t, h.streams, h.tick, ask) {
            return true;
        }
    }
    false
}

/// The new pages a block of `len` bytes at `start` of arena `ai` would
/// need: its unmapped pages, and the pages mapped ahead of the top, which
/// count as the new pages they would be without mapping ahead (see
/// `MappedAhead`). Out of line: one copy for every caller.
#[inline(never)]
fn new_pages(arena: &Arena, (ahead, ai): (&MappedAhead, usize), start: u64, len: u64) -> u64 {
    arena.unmapped_pages(start, len) + ahead.pages_in(arena, ai, start, len)
}
