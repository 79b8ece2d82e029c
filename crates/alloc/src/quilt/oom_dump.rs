//! TEMPORARY instrumentation: what is free and where at an out-of-memory.
use super::stitch::{Core, Ctx};

impl Core {
    pub(crate) fn oom_dump(&self, ctx: &Ctx<'_>, n: u64) {
        if std::env::var_os("QUILT_OOM_DUMP").is_none() {
            return;
        }
        let page = ctx.page;
        eprintln!(
            "OOM need {n} pages: pool total {} free {} limit {} hazards {} streams {}",
            ctx.pool.total_pages(),
            ctx.pool.free_pages(),
            ctx.pool.limit_pages(),
            self.page_hazards.len(),
            self.streams.len()
        );
        for (ai, a) in self.arenas.iter().enumerate() {
            if a.size == 0 {
                continue;
            }
            eprintln!(
                "arena {ai} {:?}: touched {} cached {} mapped {} retired {} gaps {} blocks {}",
                self.arena_meta[ai],
                a.touched_pages,
                a.cached_pages,
                a.mapped_pages,
                a.retired_pages,
                a.tiling.gap_count(),
                a.tiling.block_count()
            );
            // Per touched page: bytes used by blocks.
            let mut used: std::collections::BTreeMap<u64, u64> = Default::default();
            let mut small_only: std::collections::BTreeMap<u64, bool> = Default::default();
            for (s, e) in a.occupied() {
                let big = e - s > (1 << 20);
                let (f, l) = a.page_span(s, e - s);
                for p in f..=l {
                    let lo = s.max(p * page);
                    let hi = e.min((p + 1) * page);
                    *used.entry(p).or_default() += hi - lo;
                    let so = small_only.entry(p).or_insert(true);
                    if big {
                        *so = false;
                    }
                }
            }
            let waste: u64 = used.values().map(|u| page - u).sum();
            let small_pages = small_only.values().filter(|&&b| b).count();
            let small_waste: u64 = used
                .iter()
                .filter(|(p, _)| small_only[p])
                .map(|(_, u)| page - u)
                .sum();
            eprintln!(
                "  touched by blocks {} waste {:.1} pages; pages with small blocks only {} (waste {:.1})",
                used.len(),
                waste as f64 / page as f64,
                small_pages,
                small_waste as f64 / page as f64
            );
            // Gaps: those holding free bytes of touched pages.
            let mut hist: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
            for (gi, gs, ge) in a.tiling.gap_ids() {
                let len = ge - gs;
                let hz = a.tiling.gap_hazards(gi);
                let (f, l) = a.page_span(gs, len);
                let mut edge_free = 0;
                for p in [f, l] {
                    if used.contains_key(&p) {
                        let lo = gs.max(p * page);
                        let hi = ge.min((p + 1) * page);
                        edge_free += hi - lo;
                    }
                }
                if f == l && used.contains_key(&f) {
                    edge_free = len;
                }
                let class = if len < page {
                    "gap<page"
                } else if len < 16 * page {
                    "gap<16p"
                } else {
                    "gap>=16p"
                };
                let e = hist.entry(class).or_default();
                e.0 += 1;
                e.1 += edge_free;
                if std::env::var_os("QUILT_OOM_GAPS").is_some() && edge_free > 0 {
                    eprintln!(
                        "   gap {gs:#x}..{ge:#x} len {:.3}p edge-free {:.3}p hazards {} streams {:b}",
                        len as f64 / page as f64,
                        edge_free as f64 / page as f64,
                        hz.len(),
                        hz.iter().fold(0u64, |m, h| m | h.streams)
                    );
                }
            }
            for (k, (c, f)) in hist {
                eprintln!("  {k}: {c} gaps, free in touched pages {:.1} pages", f as f64 / page as f64);
            }
        }
    }
}
