//! How PyTorch's browser viewer (`torch/utils/viz/MemoryViz.js`) replays a
//! snapshot's segments, and the history rewritten so that its replay holds.
//!
//! The viewer's "Allocator State History" draws the memory at an event by
//! starting from the snapshot's segments and undoing the history backwards
//! to that event (`simulate_memory`): an undone `segment_unmap` inserts the
//! range and merges it with an adjacent segment of the same stream, an undone
//! `segment_map` cuts the range out of the one segment that holds it (the
//! page fails with `Cannot read properties of undefined (reading 'addr')`
//! where none does), an undone `segment_free` inserts without merging and an
//! undone `segment_alloc` removes the segment that starts at its address.
//!
//! Streams are compared after the viewer renames them (`annotate_snapshot`):
//! 0 stays 0 and the others are numbered, except that where every event of
//! every device is on stream 0 the events' streams become `null` while the
//! segments' stay 0. A range put back by an undone unmap then never merges
//! with what is left of a snapshot segment, so a segment of the snapshot
//! ends up in pieces, and an undone map across two pieces fails.
//! [`for_viewer`] follows the viewer's replay ([`ViewerSegments`], a port of
//! its `map_segment` and `unmap_segment`) from the snapshot's segments back
//! through a device's history and writes each `segment_map` as one entry per
//! piece it spans, so that every undone map finds its segment. What is
//! mapped stays what the history says: the pieces of one range, in address
//! order, at the same time.
//!
//! The viewer also looks up the segment of every live block at every event
//! (`Cannot read properties of null (reading 'occupied')` where there is
//! none). A tag put to sleep keeps its blocks, unmapped, until it wakes:
//! the history then has the sleep's `segment_unmap` and the wake's
//! `segment_map` under blocks that stay allocated. For the viewer a block
//! lives in device memory, so [`for_viewer`] writes such a block as freed
//! just before the unmap that took its pages and allocated again just after
//! the map that brought them back (`free_requested`, `free_completed` and
//! `alloc` entries with the unmap's or map's frame, `quilt_sleep` and
//! `quilt_wake`).

use std::collections::{BTreeMap, BTreeSet};

use crate::history::{Run, TraceEntry};

/// A segment as the viewer holds it during its replay: `stream` is `None`
/// for the viewer's `null` (an event's stream where every event is on
/// stream 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Its first address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its stream as the viewer compares it.
    pub stream: Option<u64>,
}

impl Piece {
    fn end(&self) -> u64 {
        self.addr + self.size
    }
}

/// The viewer's list of segments during its replay (`l_segments`), with its
/// two edits ported as they are, quirks included.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ViewerSegments {
    /// The segments in the viewer's order (by address, unless an undone
    /// `segment_free` put one out of place).
    pub pieces: Vec<Piece>,
}

impl ViewerSegments {
    /// The snapshot's segments, sorted by address as the viewer sorts them.
    pub fn new(mut pieces: Vec<Piece>) -> ViewerSegments {
        pieces.sort_by_key(|p| p.addr);
        ViewerSegments { pieces }
    }

    /// The viewer's `map_segment(merge, seg)`: the undo of `segment_unmap`
    /// (`merge`) or `segment_free`. Without `merge` it inserts before the
    /// first segment above `seg`, or where there is none, before the last
    /// one (JavaScript's `splice(-1, 0, seg)`).
    pub fn insert(&mut self, merge: bool, seg: Piece) {
        let above = self.pieces.iter().position(|e| e.addr > seg.addr);
        if !merge {
            let at = above.unwrap_or(self.pieces.len().saturating_sub(1));
            self.pieces.insert(at, seg);
            return;
        }
        let idx = above.unwrap_or(self.pieces.len());
        self.pieces.insert(idx, seg);
        if idx + 1 < self.pieces.len() {
            let next = self.pieces[idx + 1];
            if seg.end() == next.addr && seg.stream == next.stream {
                self.pieces[idx].size += next.size;
                self.pieces.remove(idx + 1);
            }
        }
        if idx > 0 {
            let prev = self.pieces[idx - 1];
            let this = self.pieces[idx];
            if prev.end() == this.addr && prev.stream == this.stream {
                self.pieces[idx - 1].size += this.size;
                self.pieces.remove(idx);
            }
        }
    }

    /// The viewer's `unmap_segment(merge, seg)`: the undo of `segment_map`
    /// (`merge`: cut `seg` out of the segment that holds it) or
    /// `segment_alloc` (remove the first segment at `seg.addr`, or where
    /// there is none, the last one: `splice(-1, 1)`). False where the viewer
    /// would fail (no segment holds a mapped range) or remove the wrong
    /// segment.
    pub fn cut(&mut self, merge: bool, seg: Piece) -> bool {
        if !merge {
            return match self.pieces.iter().position(|e| e.addr == seg.addr) {
                Some(i) => self.pieces.remove(i).size == seg.size,
                None => {
                    self.pieces.pop();
                    false
                }
            };
        }
        let Some(idx) = self
            .pieces
            .iter()
            .position(|e| e.addr <= seg.addr && seg.end() <= e.end())
        else {
            return false;
        };
        let existing = self.pieces[idx];
        if existing.addr == seg.addr {
            self.pieces[idx].addr += seg.size;
            self.pieces[idx].size -= seg.size;
            if self.pieces[idx].size == 0 {
                self.pieces.remove(idx);
            }
        } else if existing.end() == seg.end() {
            self.pieces[idx].size -= seg.size;
        } else {
            self.pieces[idx].size = seg.addr - existing.addr;
            self.pieces.insert(
                idx + 1,
                Piece {
                    addr: seg.end(),
                    size: existing.end() - seg.end(),
                    stream: seg.stream,
                },
            );
        }
        true
    }

    /// The segments as the viewer searches them for a block's segment:
    /// sorted by size then address, then (stably) by address.
    pub fn finder(&self) -> Vec<Piece> {
        let mut by = self.pieces.clone();
        by.sort_by_key(|p| (p.size, p.addr));
        by.sort_by_key(|p| p.addr);
        by
    }

    /// The parts of `[addr, addr + size)` that the segments hold, one per
    /// segment, in address order (a part no segment holds is left out).
    pub fn parts(&self, addr: u64, size: u64) -> Vec<(u64, u64)> {
        let end = addr + size;
        let mut out: Vec<(u64, u64)> = self
            .pieces
            .iter()
            .filter(|p| p.addr < end && addr < p.end())
            .map(|p| {
                let a = p.addr.max(addr);
                (a, p.end().min(end) - a)
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// Undo `t` as the viewer does (`null_streams`: the viewer made every
    /// event's stream `null`). False where the viewer would fail.
    pub fn undo(&mut self, t: &TraceEntry, null_streams: bool) -> bool {
        let seg = Piece {
            addr: t.addr,
            size: t.size,
            stream: if null_streams { None } else { Some(t.stream) },
        };
        match t.action {
            "segment_unmap" => {
                self.insert(true, seg);
                true
            }
            "segment_free" => {
                self.insert(false, seg);
                true
            }
            "segment_map" => self.cut(true, seg),
            "segment_alloc" => self.cut(false, seg),
            _ => true,
        }
    }
}

/// Whether the viewer makes every event's stream `null`: where every event
/// of every device is on stream 0 (`annotate_snapshot`).
pub fn null_streams(traces: &BTreeMap<i32, Vec<TraceEntry>>) -> bool {
    traces.values().flatten().all(|t| t.stream == 0)
}

/// The snapshot's segments of one device as the viewer starts its replay
/// from them (each `(address, size, stream)`; the viewer renames streams,
/// but one to one, so equal stays equal).
pub fn start(segments: &[Run]) -> ViewerSegments {
    ViewerSegments::new(
        segments
            .iter()
            .map(|r| Piece {
                addr: r.addr,
                size: r.size,
                stream: Some(r.stream),
            })
            .collect(),
    )
}

/// Where the viewer's replay of one device starts: the snapshot's segments
/// and its live blocks.
#[derive(Clone, Debug, Default)]
pub struct ViewerStart {
    /// The segments (`(address, size, stream)`; the viewer renames streams,
    /// but one to one, so equal stays equal).
    pub segments: Vec<Run>,
    /// The live blocks (`active_allocated` and `active_pending_free`): each
    /// address and requested size.
    pub blocks: Vec<(u64, u64)>,
}

/// `t` as another action on another range (the other fields, `t`'s).
fn like(t: &TraceEntry, action: &'static str, addr: u64, size: u64) -> TraceEntry {
    TraceEntry {
        action,
        addr,
        size,
        ..t.clone()
    }
}

/// Whether the viewer finds a segment for a block at `addr` among
/// `finder` ([`ViewerSegments::finder`]): its `find_segment`, a binary
/// search.
pub fn found(finder: &[Piece], addr: u64) -> bool {
    let (mut left, mut right) = (0i64, finder.len() as i64 - 1);
    while left <= right {
        let mid = (left + right) / 2;
        let p = finder[mid as usize];
        if addr < p.addr {
            right = mid - 1;
        } else if addr >= p.end() {
            left = mid + 1;
        } else {
            return true;
        }
    }
    false
}

/// `traces` (every device's history, oldest first) rewritten for the
/// viewer's replay from `starts` (every device's segments and live blocks
/// in the snapshot): each `segment_map` becomes one entry per viewer segment
/// it spans when undone, and a block that the history keeps alive while its
/// pages are unmapped is freed before the unmap and allocated after the map
/// (see the module's text). Where the history does not end at the snapshot
/// (memory changed after recording stopped), a part of a map that no
/// segment holds and the free of a block in memory no segment holds are
/// left out, since the viewer fails on them. Every other entry is kept as
/// it is.
pub fn for_viewer(
    traces: &BTreeMap<i32, Vec<TraceEntry>>,
    starts: &BTreeMap<i32, ViewerStart>,
) -> BTreeMap<i32, Vec<TraceEntry>> {
    let null = null_streams(traces);
    let none = ViewerStart::default();
    traces
        .iter()
        .map(|(&device, entries)| {
            let start_at = starts.get(&device).unwrap_or(&none);
            let mut viewer = start(&start_at.segments);
            // The viewer's live blocks (address: size) as it replays, and
            // those taken out because their pages were mapped again.
            let mut live: BTreeMap<u64, u64> = start_at.blocks.iter().copied().collect();
            let mut unmapped: BTreeMap<u64, u64> = BTreeMap::new();
            // Blocks whose free was left out, until their request is met.
            let mut unknown: BTreeSet<u64> = BTreeSet::new();
            // Built last entry first, as the viewer undoes them.
            let mut backwards: Vec<TraceEntry> = Vec::with_capacity(entries.len());
            for t in entries.iter().rev() {
                match t.action {
                    "segment_map" | "segment_alloc" | "segment_unmap" | "segment_free" => {
                        // A map is undone in parts, last first; each lies in
                        // a segment of its own, so each cut finds its
                        // segment.
                        let parts = if t.action == "segment_map" {
                            viewer.parts(t.addr, t.size)
                        } else {
                            vec![(t.addr, t.size)]
                        };
                        for (addr, size) in parts.into_iter().rev() {
                            let e = like(t, t.action, addr, size);
                            let mut next = viewer.clone();
                            if !next.undo(&e, null) {
                                // No segment holds it: left out.
                                continue;
                            }
                            // A block the viewer would now find in no
                            // segment came back with this map (a tag woke):
                            // allocated right after it.
                            let finder = next.finder();
                            let lost: Vec<(u64, u64)> = live
                                .iter()
                                .filter(|(a, _)| !found(&finder, **a))
                                .map(|(&a, &s)| (a, s))
                                .collect();
                            for (a, s) in lost.into_iter().rev() {
                                live.remove(&a);
                                unmapped.insert(a, s);
                                backwards.push(like(t, "alloc", a, s));
                            }
                            viewer = next;
                            backwards.push(e);
                            if matches!(t.action, "segment_unmap" | "segment_free") {
                                // A block that came back with a later map
                                // was alive here, on these pages: freed
                                // right before the unmap.
                                let finder = viewer.finder();
                                let back: Vec<(u64, u64)> = unmapped
                                    .range(addr..addr + size)
                                    .filter(|(a, _)| found(&finder, **a))
                                    .map(|(&a, &s)| (a, s))
                                    .collect();
                                for (a, s) in back.into_iter().rev() {
                                    unmapped.remove(&a);
                                    live.insert(a, s);
                                    backwards.push(like(t, "free_completed", a, s));
                                    backwards.push(like(t, "free_requested", a, s));
                                }
                            }
                        }
                    }
                    "free_completed" if !found(&viewer.finder(), t.addr) => {
                        // Freed where the snapshot's segments, replayed,
                        // hold nothing (memory unmapped after recording
                        // stopped): the viewer would draw the block in no
                        // segment. The free is left out, with its request.
                        unknown.insert(t.addr);
                    }
                    "free_requested" if unknown.remove(&t.addr) => {}
                    action => {
                        match action {
                            "alloc" => {
                                live.remove(&t.addr);
                                unmapped.remove(&t.addr);
                            }
                            "free_completed" => {
                                live.insert(t.addr, t.size);
                            }
                            _ => {}
                        }
                        viewer.undo(t, null);
                        backwards.push(t.clone());
                    }
                }
            }
            backwards.reverse();
            (device, backwards)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    const M: u64 = 1 << 20;

    fn piece(addr: u64, size: u64, stream: Option<u64>) -> Piece {
        Piece { addr, size, stream }
    }

    fn entry(action: &'static str, addr: u64, size: u64, stream: u64) -> TraceEntry {
        let t = crate::history::History::default();
        t.set(true, 10);
        t.record(0, action, addr, size, stream, "test");
        t.entries().remove(&0).unwrap().remove(0)
    }

    #[test]
    fn merges_only_equal_streams_as_the_viewer_does() {
        let mut v = ViewerSegments::new(vec![piece(0, 2 * M, Some(0))]);
        // An undone unmap next to a snapshot segment, the event's stream
        // null: no merge, two pieces.
        v.insert(true, piece(2 * M, 2 * M, None));
        assert_eq!(v.pieces.len(), 2);
        // A map across both pieces cannot be undone.
        assert!(!v.clone().cut(true, piece(M, 2 * M, None)));
        // Its parts can.
        let parts = v.parts(M, 2 * M);
        assert_eq!(parts, [(M, M), (2 * M, M)]);
        for (a, s) in parts.into_iter().rev() {
            assert!(v.cut(true, piece(a, s, None)));
        }
        assert_eq!(
            v.pieces,
            [piece(0, M, Some(0)), piece(3 * M, M, None)],
            "the middle cut out of two pieces"
        );
        // Equal streams merge on both sides.
        let mut w = ViewerSegments::new(vec![piece(0, M, Some(7)), piece(2 * M, M, Some(7))]);
        w.insert(true, piece(M, M, Some(7)));
        assert_eq!(w.pieces, [piece(0, 3 * M, Some(7))]);
    }

    #[test]
    fn segment_free_with_nothing_above_goes_before_the_last_as_in_javascript() {
        let mut v = ViewerSegments::new(vec![piece(0, M, Some(0)), piece(4 * M, M, Some(0))]);
        v.insert(false, piece(8 * M, M, Some(0)));
        let addrs: Vec<u64> = v.pieces.iter().map(|p| p.addr).collect();
        assert_eq!(addrs, [0, 8 * M, 4 * M]);
    }

    #[test]
    fn maps_are_split_where_the_viewer_holds_pieces() {
        // Forward, on stream 0 only: [0, 4M) mapped, then [2M, 4M)
        // unmapped and mapped again; the snapshot holds [0, 4M). Backwards
        // the viewer puts [2M, 4M) back unmerged (null against 0), so the
        // first map, [0, 4M), spans two pieces.
        let mut traces = BTreeMap::new();
        traces.insert(
            0,
            vec![
                entry("segment_map", 0, 4 * M, 0),
                entry("segment_unmap", 2 * M, 2 * M, 0),
                entry("segment_map", 2 * M, 2 * M, 0),
            ],
        );
        let mut segments = BTreeMap::new();
        segments.insert(
            0,
            ViewerStart {
                segments: vec![Run {
                    addr: 0,
                    size: 4 * M,
                    stream: 0,
                }],
                blocks: vec![],
            },
        );
        let mut v = start(&segments[&0].segments);
        assert!(!traces[&0]
            .iter()
            .rev()
            .all(|t| v.undo(t, null_streams(&traces))));
        let fixed = for_viewer(&traces, &segments);
        let got: Vec<(&str, u64, u64)> = fixed[&0]
            .iter()
            .map(|t| (t.action, t.addr, t.size))
            .collect();
        assert_eq!(
            got,
            [
                ("segment_map", 0, 2 * M),
                ("segment_map", 2 * M, 2 * M),
                ("segment_unmap", 2 * M, 2 * M),
                ("segment_map", 2 * M, 2 * M),
            ]
        );
        let mut v = start(&segments[&0].segments);
        assert!(fixed[&0].iter().rev().all(|t| v.undo(t, true)));
        assert!(v.pieces.is_empty());
        // With another stream somewhere the viewer merges, and nothing is
        // split.
        traces.insert(1, vec![entry("alloc", 9 * M, M, 0x1111)]);
        let fixed = for_viewer(&traces, &segments);
        assert_eq!(fixed[&0], traces[&0]);
    }

    /// Undo `entries` from `start` as the viewer does, checking at every
    /// event that each live block lies in a segment; the segments at the
    /// first event.
    fn replay_with_blocks(start_at: &ViewerStart, entries: &[TraceEntry]) -> Vec<Piece> {
        let mut v = start(&start_at.segments);
        let mut live: BTreeMap<u64, u64> = start_at.blocks.iter().copied().collect();
        for (i, t) in entries.iter().enumerate().rev() {
            assert!(v.undo(t, true), "event {i}: {t:?}");
            match t.action {
                "alloc" => {
                    live.remove(&t.addr);
                }
                "free_completed" => {
                    live.insert(t.addr, t.size);
                }
                _ => {}
            }
            for a in live.keys() {
                assert!(
                    v.pieces.iter().any(|p| p.addr <= *a && *a < p.end()),
                    "before event {i}: block {a:#x} in no segment: {:?}",
                    v.pieces
                );
            }
        }
        v.pieces
    }

    #[test]
    fn blocks_asleep_are_freed_before_the_unmap_and_allocated_after_the_map() {
        let mut e = vec![
            entry("segment_map", 0, 4 * M, 0),
            entry("alloc", 0, 2 * M, 0),
            entry("segment_unmap", 0, 4 * M, 0),
            entry("segment_map", 0, 4 * M, 0),
        ];
        e[2].source = "quilt_sleep";
        e[3].source = "quilt_wake";
        let mut traces = BTreeMap::new();
        traces.insert(0, e);
        let at_end = ViewerStart {
            segments: vec![Run {
                addr: 0,
                size: 4 * M,
                stream: 0,
            }],
            blocks: vec![(0, 2 * M)],
        };
        let mut starts = BTreeMap::new();
        starts.insert(0, at_end.clone());
        let fixed = for_viewer(&traces, &starts);
        let got: Vec<(&str, u64, u64, &str)> = fixed[&0]
            .iter()
            .map(|t| (t.action, t.addr, t.size, t.source))
            .collect();
        assert_eq!(
            got,
            [
                ("segment_map", 0, 4 * M, "test"),
                ("alloc", 0, 2 * M, "test"),
                ("free_requested", 0, 2 * M, "quilt_sleep"),
                ("free_completed", 0, 2 * M, "quilt_sleep"),
                ("segment_unmap", 0, 4 * M, "quilt_sleep"),
                ("segment_map", 0, 4 * M, "quilt_wake"),
                ("alloc", 0, 2 * M, "quilt_wake"),
            ]
        );
        assert!(replay_with_blocks(&at_end, &fixed[&0]).is_empty());
    }

    #[test]
    fn what_changed_after_recording_stopped_is_left_out_where_the_viewer_fails() {
        // Recorded: [4M, 6M) mapped, a block there allocated and freed;
        // after recording stopped the range was unmapped: the snapshot
        // holds [0, 2M) only.
        let traces = BTreeMap::from([(
            0,
            vec![
                entry("segment_map", 0, 2 * M, 0),
                entry("alloc", 0, M, 0),
                entry("segment_map", 4 * M, 2 * M, 0),
                entry("alloc", 4 * M, M, 0),
                entry("free_requested", 4 * M, M, 0),
                entry("free_completed", 4 * M, M, 0),
            ],
        )]);
        let at_end = ViewerStart {
            segments: vec![Run {
                addr: 0,
                size: 2 * M,
                stream: 0,
            }],
            blocks: vec![(0, M)],
        };
        let fixed = for_viewer(&traces, &BTreeMap::from([(0, at_end.clone())]));
        let got: Vec<(&str, u64)> = fixed[&0].iter().map(|t| (t.action, t.addr)).collect();
        assert_eq!(
            got,
            [("segment_map", 0), ("alloc", 0), ("alloc", 4 * M)],
            "the map and the free of memory the snapshot lacks are left out"
        );
        assert!(replay_with_blocks(&at_end, &fixed[&0]).is_empty());
    }
}
