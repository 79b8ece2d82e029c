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
//! records what changed since the last time ([`segment_events`]): a new run
//! is `segment_alloc`, a vanished one `segment_free`, pages mapped onto or
//! unmapped from a run that stays are `segment_map` and `segment_unmap`.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// One action, as an entry of PyTorch's `device_traces`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed`, `oom`, `segment_alloc`,
    /// `segment_free`, `segment_map` or `segment_unmap`.
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
/// sorted by address, disjoint): removals first (`segment_free` for a run
/// that no new run overlaps, `segment_unmap` for each part of a run that
/// stays but lost pages), then additions (`segment_alloc` for a run that
/// overlaps no old run, `segment_map` for each part newly mapped onto one).
/// Replayed backwards from `new`, as PyTorch's viewer does, they give `old`
/// back exactly.
pub fn segment_events(old: &[Run], new: &[Run]) -> Vec<(&'static str, Run)> {
    let mut out = Vec::new();
    for o in old {
        let cover: Vec<&Run> = new.iter().filter(|n| n.overlaps(o)).collect();
        if cover.is_empty() {
            out.push(("segment_free", *o));
        } else {
            out.extend(
                uncovered(o, &cover)
                    .into_iter()
                    .map(|r| ("segment_unmap", r)),
            );
        }
    }
    for n in new {
        let cover: Vec<&Run> = old.iter().filter(|o| o.overlaps(n)).collect();
        if cover.is_empty() {
            out.push(("segment_alloc", *n));
        } else {
            out.extend(uncovered(n, &cover).into_iter().map(|r| ("segment_map", r)));
        }
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
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl Book {
    fn push(&mut self, device: i32, entry: TraceEntry) {
        let max = self.max_entries;
        if max == 0 {
            return;
        }
        let q = self.per_device.entry(device).or_default();
        if q.len() == max {
            q.pop_front();
        }
        q.push_back(entry);
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
    pub fn is_on(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Record `action` on `device`, caused by the C function `source`, if
    /// recording.
    pub fn record(
        &self,
        device: i32,
        action: &'static str,
        addr: u64,
        size: u64,
        stream: u64,
        source: &'static str,
    ) {
        if !self.is_on() {
            return;
        }
        let time_us = now_us();
        if let Ok(mut b) = self.book.lock() {
            b.push(
                device,
                TraceEntry {
                    action,
                    addr,
                    size,
                    stream,
                    time_us,
                    source,
                },
            );
        }
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

    fn run(addr: u64, size: u64) -> Run {
        Run {
            addr,
            size,
            stream: 0,
        }
    }

    /// PyTorch's viewer's backward replay (`simulate_memory` in
    /// MemoryViz.js), on segments only: from `new`, undo `events` last
    /// first; None where it would fail (no segment to cut from or remove).
    fn replay_backwards(new: &[Run], events: &[(&str, Run)]) -> Option<Vec<Run>> {
        let mut segs: Vec<Run> = new.to_vec();
        for (action, r) in events.iter().rev() {
            match *action {
                "segment_free" => segs.push(*r),
                "segment_unmap" => {
                    segs.push(*r);
                    segs.sort_by_key(|s| s.addr);
                    let mut merged: Vec<Run> = Vec::new();
                    for s in segs.drain(..) {
                        match merged.last_mut() {
                            Some(p) if p.end() == s.addr && p.stream == s.stream => {
                                p.size += s.size
                            }
                            _ => merged.push(s),
                        }
                    }
                    segs = merged;
                }
                "segment_alloc" => {
                    let i = segs.iter().position(|s| s.addr == r.addr)?;
                    segs.remove(i);
                }
                "segment_map" => {
                    let i = segs
                        .iter()
                        .position(|s| s.addr <= r.addr && r.end() <= s.end())?;
                    let s = segs.remove(i);
                    if s.addr < r.addr {
                        segs.push(run(s.addr, r.addr - s.addr));
                    }
                    if r.end() < s.end() {
                        segs.push(run(r.end(), s.end() - r.end()));
                    }
                }
                _ => return None,
            }
        }
        segs.sort_by_key(|s| s.addr);
        Some(segs)
    }

    #[test]
    fn segment_events_replay_back_to_the_old_runs() {
        let m = 1u64 << 20;
        let cases: Vec<(Vec<Run>, Vec<Run>, Vec<&str>)> = vec![
            // nothing, then a run: segment_alloc; and back
            (vec![], vec![run(0, 2 * m)], vec!["segment_alloc"]),
            (vec![run(0, 2 * m)], vec![], vec!["segment_free"]),
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
                vec!["segment_free", "segment_alloc"],
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
                ("segment_alloc", 2 * m, "quilt_malloc"),
                ("segment_free", 2 * m, "quilt_empty_cache")
            ]
        );
    }
}
