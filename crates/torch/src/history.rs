//! The allocation history (`quilt_record_history`): per device, the last
//! `max_entries` allocator actions in PyTorch's trace vocabulary, for
//! `device_traces` in a snapshot.
//!
//! Besides the blocks' `alloc`, `free_requested`, `free_completed` and `oom`,
//! the history says how the mapped memory changed, as PyTorch writes it for
//! expandable segments, so that its viewer can replay the segments backwards
//! from the snapshot: the mapped memory is a set of [`Run`]s (maximal ranges
//! of mapped address space on one stream, the snapshot's segments), and after
//! each operation that mapped or unmapped pages [`History::sync_segments`]
//! records what changed since the last time ([`segment_events`]): pages
//! mapped are `segment_map`, pages unmapped `segment_unmap`, whether they
//! make or end a run or change one that stays, as PyTorch writes them for
//! its expandable segments. No `segment_alloc` or `segment_free` is written:
//! PyTorch pairs a `segment_free` only with a `segment_alloc` of the same
//! range, and a run of Quilt's grows, shrinks and joins others between the
//! two (its viewer's "Allocator State History" failed on that).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// One action, as an entry of PyTorch's `device_traces`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `oom`, `segment_map` or
    /// `segment_unmap` (no `segment_alloc` or `segment_free`: see the
    /// module's text).
    pub action: &'static str,
    /// The block's or the range's address; for `oom` the bytes the device had
    /// free, which the snapshot writes as `device_free` (PyTorch's key).
    pub addr: u64,
    /// The size asked for (for `oom`: the request).
    pub size: u64,
    /// The stream, as the caller passed it.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// The C function that caused it (`quilt_malloc`, `quilt_empty_cache`,
    /// ...): the entry's one frame, since no Python stack is recorded.
    pub source: &'static str,
    /// Its place in the history of every device, from 1 up, in recording
    /// order ([`History::entries_since`]); 0 in an entry made by hand.
    pub seq: u64,
}

/// A maximal range of mapped address space on one stream: a segment of the
/// snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Its first address.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The stream of its segment.
    pub stream: u64,
}

impl Run {
    fn end(&self) -> u64 {
        self.addr + self.size
    }

    fn overlaps(&self, other: &Run) -> bool {
        self.addr < other.end() && other.addr < self.end()
    }
}

/// The parts of `run` that none of `cover` (sorted by address) covers.
fn uncovered(run: &Run, cover: &[&Run]) -> Vec<Run> {
    let mut out = Vec::new();
    let mut at = run.addr;
    for c in cover {
        if c.addr > at {
            out.push(Run {
                addr: at,
                size: c.addr.min(run.end()) - at,
                stream: run.stream,
            });
        }
        at = at.max(c.end());
        if at >= run.end() {
            break;
        }
    }
    if at < run.end() {
        out.push(Run {
            addr: at,
            size: run.end() - at,
            stream: run.stream,
        });
    }
    out
}

/// The segment events that take the mapped memory from `old` to `new` (both
/// sorted by address, disjoint): removals first, a `segment_unmap` for each
/// part of an old run that no new run of its stream covers (the whole run
/// where it vanished), then additions, a `segment_map` for each part of a
/// new run that no old run of its stream covers (the whole run where it is
/// new). Pages that went over to another stream are unmapped from the old
/// run and mapped onto the new one, since a segment of PyTorch's has one
/// stream. Each range lies in one run: the old one it left, the new one it
/// joined. Replayed
/// backwards from `new`, as PyTorch's viewer does (an undone unmap merges
/// with the neighbours of its stream, an undone map is cut out of the run
/// that holds it), they give `old` back exactly.
pub fn segment_events(old: &[Run], new: &[Run]) -> Vec<(&'static str, Run)> {
    let mut out = Vec::new();
    for o in old {
        let cover: Vec<&Run> = new
            .iter()
            .filter(|n| n.stream == o.stream && n.overlaps(o))
            .collect();
        out.extend(
            uncovered(o, &cover)
                .into_iter()
                .map(|r| ("segment_unmap", r)),
        );
    }
    for n in new {
        let cover: Vec<&Run> = old
            .iter()
            .filter(|o| o.stream == n.stream && o.overlaps(n))
            .collect();
        out.extend(uncovered(n, &cover).into_iter().map(|r| ("segment_map", r)));
    }
    out
}

#[derive(Debug, Default)]
struct Book {
    max_entries: usize,
    per_device: BTreeMap<i32, VecDeque<TraceEntry>>,
    /// Per device: the runs at the last sync, and the driver's map and
    /// unmap count then (the runs change only when it does).
    runs: BTreeMap<i32, (Vec<Run>, u64)>,
    /// The last sequence number given ([`TraceEntry::seq`]).
    last_seq: u64,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl Book {
    /// Keep `entry` with the next sequence number, which is returned (0
    /// when nothing is kept).
    fn push(&mut self, device: i32, mut entry: TraceEntry) -> u64 {
        let max = self.max_entries;
        if max == 0 {
            return 0;
        }
        self.last_seq += 1;
        entry.seq = self.last_seq;
        let q = self.per_device.entry(device).or_default();
        if q.len() == max {
            q.pop_front();
        }
        q.push_back(entry);
        self.last_seq
    }
}

/// The history of every device. Recording costs one relaxed load while it
/// is off.
#[derive(Debug, Default)]
pub struct History {
    enabled: AtomicBool,
    book: Mutex<Book>,
}

impl History {
    /// Start (keeping at most `max_entries` per device, oldest dropped
    /// first) or stop recording. Stopping keeps what was recorded.
    pub fn set(&self, enabled: bool, max_entries: usize) {
        if let Ok(mut b) = self.book.lock() {
            if enabled {
                b.max_entries = max_entries;
                for q in b.per_device.values_mut() {
                    while q.len() > max_entries {
                        q.pop_front();
                    }
                }
            }
        }
        self.enabled.store(enabled, Ordering::Release);
    }

    /// Whether recording is on.
    #[inline]
    pub fn is_on(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Record `action` on `device`, caused by the C function `source`, if
    /// recording. Returns the entry's sequence number (0: not recorded).
    /// Inlined: while recording is off, one load at the call site.
    #[inline]
    pub fn record(
        &self,
        device: i32,
        action: &'static str,
        addr: u64,
        size: u64,
        stream: u64,
        source: &'static str,
    ) -> u64 {
        if !self.is_on() {
            return 0;
        }
        self.push(device, action, addr, size, stream, source)
    }

    /// [`History::record`] while recording.
    #[inline(never)]
    fn push(
        &self,
        device: i32,
        action: &'static str,
        addr: u64,
        size: u64,
        stream: u64,
        source: &'static str,
    ) -> u64 {
        let time_us = now_us();
        match self.book.lock() {
            Ok(mut b) => b.push(
                device,
                TraceEntry {
                    action,
                    addr,
                    size,
                    stream,
                    time_us,
                    source,
                    seq: 0,
                },
            ),
            Err(_) => 0,
        }
    }

    /// Forget every entry recorded so far (torch's `clearHistory`); the
    /// sequence numbers go on from where they were.
    pub fn clear(&self) {
        if let Ok(mut b) = self.book.lock() {
            b.per_device.clear();
        }
    }

    /// The sequence number of the last entry recorded so far (0: none):
    /// every later entry has a higher one.
    pub fn last_seq(&self) -> u64 {
        self.book.lock().map(|b| b.last_seq).unwrap_or(0)
    }

    /// The entries of every device with a sequence number above `seq`, in
    /// recording order.
    pub fn entries_since(&self, seq: u64) -> Vec<(i32, TraceEntry)> {
        let mut out: Vec<(i32, TraceEntry)> = self
            .book
            .lock()
            .map(|b| {
                b.per_device
                    .iter()
                    .flat_map(|(&d, q)| {
                        q.iter()
                            .filter(|t| t.seq > seq)
                            .map(move |t| (d, t.clone()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.sort_by_key(|(_, t)| t.seq);
        out
    }

    /// Take `runs` as `device`'s mapped memory now, with no events (where
    /// recording starts).
    pub fn baseline(&self, device: i32, mark: u64, runs: Vec<Run>) {
        if let Ok(mut b) = self.book.lock() {
            b.runs.insert(device, (runs, mark));
        }
    }

    /// If recording and the driver's map and unmap count `mark` moved since
    /// the last sync of `device`, record the segment events from the runs
    /// then to `runs()` now ([`segment_events`]). A device never synced
    /// starts with nothing mapped.
    pub fn sync_segments(
        &self,
        device: i32,
        mark: u64,
        runs: impl FnOnce() -> Vec<Run>,
        source: &'static str,
    ) {
        if !self.is_on() {
            return;
        }
        if let Ok(mut b) = self.book.lock() {
            let (old, old_mark) = b.runs.remove(&device).unwrap_or_default();
            if old_mark == mark {
                b.runs.insert(device, (old, old_mark));
                return;
            }
            let new = runs();
            let time_us = now_us();
            for (action, r) in segment_events(&old, &new) {
                b.push(
                    device,
                    TraceEntry {
                        action,
                        addr: r.addr,
                        size: r.size,
                        stream: r.stream,
                        time_us,
                        source,
                        seq: 0,
                    },
                );
            }
            b.runs.insert(device, (new, mark));
        }
    }

    /// The entries of every device, oldest first.
    pub fn entries(&self) -> BTreeMap<i32, Vec<TraceEntry>> {
        self.book
            .lock()
            .map(|b| {
                b.per_device
                    .iter()
                    .map(|(&d, q)| (d, q.iter().cloned().collect()))
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    #[test]
    fn records_only_while_on_and_keeps_the_last_entries() {
        let h = History::default();
        h.record(0, "alloc", 1, 2, 0, "quilt_malloc");
        assert!(h.entries().is_empty());
        h.set(true, 2);
        for a in 1..=3 {
            h.record(0, "alloc", a, 8, 0, "quilt_malloc");
        }
        let e = h.entries();
        let addrs: Vec<u64> = e[&0].iter().map(|t| t.addr).collect();
        assert_eq!(addrs, [2, 3]);
        assert!(e[&0].iter().all(|t| t.source == "quilt_malloc"));
        h.set(false, 0);
        h.record(0, "alloc", 9, 8, 0, "quilt_malloc");
        assert_eq!(h.entries()[&0].len(), 2);
    }

    #[test]
    fn sequence_numbers_rise_across_devices_and_survive_a_clear() {
        let h = History::default();
        assert_eq!(h.record(0, "alloc", 1, 8, 0, "quilt_malloc"), 0);
        h.set(true, 10);
        let a = h.record(0, "alloc", 1, 8, 0, "quilt_malloc");
        let b = h.record(1, "alloc", 2, 8, 0, "quilt_malloc");
        let c = h.record(0, "free_requested", 1, 8, 0, "quilt_free");
        assert!(0 < a && a < b && b < c);
        let since: Vec<(i32, u64)> = h
            .entries_since(a)
            .iter()
            .map(|(d, t)| (*d, t.seq))
            .collect();
        assert_eq!(since, [(1, b), (0, c)]);
        h.clear();
        assert!(h.entries_since(0).is_empty());
        assert!(h.record(0, "alloc", 3, 8, 0, "quilt_malloc") > c);
    }

    #[test]
    fn last_seq_is_the_last_entry_recorded() {
        let h = History::default();
        assert_eq!(h.last_seq(), 0, "nothing recorded");
        h.set(true, 10);
        let a = h.record(0, "alloc", 1, 8, 0, "quilt_malloc");
        assert_eq!(h.last_seq(), a);
        let b = h.record(1, "alloc", 2, 8, 0, "quilt_malloc");
        assert_eq!(h.last_seq(), b);
        h.set(false, 10);
        h.record(0, "free_requested", 1, 8, 0, "quilt_free");
        assert_eq!(h.last_seq(), b, "nothing recorded while off");
        h.clear();
        assert_eq!(h.last_seq(), b, "a clear keeps the numbering");
    }

    fn run(addr: u64, size: u64) -> Run {
        Run {
            addr,
            size,
            stream: 0,
        }
    }

    /// PyTorch's viewer's backward replay (`simulate_memory` in
    /// MemoryViz.js, its segment edits ported in
    /// `pytorch_snapshot::viewer_replay`), on segments only, with streams
    /// compared as the viewer does where some event is on another stream
    /// than 0: from `new`, undo `events` last first; None where it would
    /// fail (no segment to cut a mapped range from).
    fn replay_backwards(new: &[Run], events: &[(&str, Run)]) -> Option<Vec<Run>> {
        use crate::pytorch_snapshot::viewer_replay::{start, Piece};
        let mut v = start(new);
        for (action, r) in events.iter().rev() {
            let seg = Piece {
                addr: r.addr,
                size: r.size,
                stream: Some(r.stream),
            };
            match *action {
                "segment_unmap" => v.insert(true, seg),
                "segment_map" => {
                    if !v.cut(true, seg) {
                        return None;
                    }
                }
                _ => return None,
            }
        }
        Some(
            v.pieces
                .iter()
                .map(|p| Run {
                    addr: p.addr,
                    size: p.size,
                    stream: p.stream.unwrap_or(u64::MAX),
                })
                .collect(),
        )
    }

    #[test]
    fn segment_events_replay_back_to_the_old_runs() {
        let m = 1u64 << 20;
        let on = |stream: u64, addr: u64, size: u64| Run { addr, size, stream };
        let cases: Vec<(Vec<Run>, Vec<Run>, Vec<&str>)> = vec![
            // nothing, then a run: mapped; and back: unmapped
            (vec![], vec![run(0, 2 * m)], vec!["segment_map"]),
            (vec![run(0, 2 * m)], vec![], vec!["segment_unmap"]),
            // grown at the end, shrunk at the front
            (
                vec![run(0, 2 * m)],
                vec![run(0, 4 * m)],
                vec!["segment_map"],
            ),
            (
                vec![run(0, 4 * m)],
                vec![run(2 * m, 2 * m)],
                vec!["segment_unmap"],
            ),
            // split in two by an unmapped middle, and joined again
            (
                vec![run(0, 6 * m)],
                vec![run(0, 2 * m), run(4 * m, 2 * m)],
                vec!["segment_unmap"],
            ),
            (
                vec![run(0, 2 * m), run(4 * m, 2 * m)],
                vec![run(0, 6 * m)],
                vec!["segment_map"],
            ),
            // one run vanishes while another appears elsewhere
            (
                vec![run(0, 2 * m)],
                vec![run(8 * m, 2 * m)],
                vec!["segment_unmap", "segment_map"],
            ),
            // a run of another stream takes the place of one that vanished,
            // next to a run that stays
            (
                vec![run(0, 2 * m), on(5, 2 * m, 2 * m)],
                vec![run(0, 2 * m), on(7, 2 * m, 4 * m)],
                vec!["segment_unmap", "segment_map"],
            ),
            // unchanged
            (vec![run(0, 2 * m)], vec![run(0, 2 * m)], vec![]),
        ];
        for (old, new, actions) in cases {
            let events = segment_events(&old, &new);
            let got: Vec<&str> = events.iter().map(|(a, _)| *a).collect();
            assert_eq!(got, actions, "{old:?} -> {new:?}");
            assert_eq!(
                replay_backwards(&new, &events),
                Some(old.clone()),
                "{old:?} -> {new:?}: {events:?}"
            );
        }
    }

    #[test]
    fn sync_records_only_when_the_mark_moves() {
        let m = 1u64 << 20;
        let h = History::default();
        h.set(true, 100);
        h.sync_segments(0, 1, || vec![run(0, 2 * m)], "quilt_malloc");
        h.sync_segments(
            0,
            1,
            || panic!("the runs are not read again"),
            "quilt_malloc",
        );
        h.sync_segments(0, 2, Vec::new, "quilt_empty_cache");
        let e = &h.entries()[&0];
        let got: Vec<(&str, u64, &str)> = e.iter().map(|t| (t.action, t.size, t.source)).collect();
        assert_eq!(
            got,
            [
                ("segment_map", 2 * m, "quilt_malloc"),
                ("segment_unmap", 2 * m, "quilt_empty_cache")
            ]
        );
    }
}
