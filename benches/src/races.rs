//! Unordered reuse, found on the simulated device: a new block given memory
//! that work queued earlier on another stream used and may still use, with
//! nothing ordering the new block's stream after that work (it has not
//! completed, and no chain of `cuStreamWaitEvent` leads from the new
//! block's stream to it). On a GPU that is a data race: the new owner's
//! kernels write bytes the old owner's kernels may still read.
//!
//! - The old work: everything queued, up to the free, on each stream that
//!   used the freed block (the one it was made on and its `record_stream`
//!   streams): CUDA orders nothing more finely, and PyTorch's
//!   `record_stream` contract says the same (the block is safe to reuse
//!   once the work queued on those streams before the free has run).
//! - The new work: whatever is queued on the new block's stream after the
//!   allocation returns ([`SimVmm::ordered_after`]).
//! - Memory is followed by what lies behind the addresses (memory id and
//!   offset, [`SimVmm::memory_pieces`]), not by the addresses: memory an
//!   allocator unmaps and maps somewhere else is the same memory.
//!
//! Blocks made or reused outside the allocate and free calls (growable
//! buffers, sleep and wake) are not followed.

use std::collections::BTreeMap;

use quilt_vmm::sim::SimVmm;
use quilt_vmm::{DevicePtr, StreamId};

/// The work that may still use a freed piece: each stream that used it,
/// with its position ([`SimVmm::stream_position`]) at the free.
type Users = Vec<(StreamId, u64)>;

/// The freed memory whose users' work may still run, and the unordered
/// reuses found so far.
#[derive(Debug)]
pub struct RaceTracker {
    /// Freed pieces by (memory, start): (end, users). Disjoint.
    freed: BTreeMap<(u64, u64), (u64, Users)>,
    /// Allocations that reused memory unordered.
    races: u64,
    /// The first of them, described.
    first: Option<String>,
    /// Drop the pieces whose work completed when this many are kept.
    prune_at: usize,
}

impl Default for RaceTracker {
    fn default() -> Self {
        RaceTracker {
            freed: BTreeMap::new(),
            races: 0,
            first: None,
            prune_at: PRUNE_AT_LEAST,
        }
    }
}

/// Pieces kept before the first pruning.
const PRUNE_AT_LEAST: usize = 1024;

impl RaceTracker {
    /// Nothing freed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Allocations found reusing memory unordered so far.
    pub fn races(&self) -> u64 {
        self.races
    }

    /// The first of them, described (`None` when there was none).
    pub fn first(&self) -> Option<&str> {
        self.first.as_deref()
    }

    /// The block of `len` bytes at `ptr`, used on `streams`, is about to be
    /// freed (call before the free: its memory is read through its
    /// mapping, and after the work its users queued up to the free).
    pub fn freeing(&mut self, sim: &SimVmm, ptr: DevicePtr, len: u64, streams: &[u64]) {
        let users: Users = streams
            .iter()
            .map(|&s| (StreamId(s), sim.stream_position(StreamId(s))))
            .collect();
        for p in sim.memory_pieces(ptr, len) {
            let end = p.offset + p.len;
            self.take(p.memory, p.offset, end);
            self.freed
                .insert((p.memory, p.offset), (end, users.clone()));
        }
        if self.freed.len() >= self.prune_at {
            self.freed
                .retain(|_, (_, users)| users.iter().any(|&(s, pos)| !sim.work_complete(s, pos)));
            self.prune_at = (2 * self.freed.len()).max(PRUNE_AT_LEAST);
        }
    }

    /// A block of `len` bytes at `ptr` was just allocated on `stream`, for
    /// event `event` of the trace: true (and counted) when some of its
    /// memory is freed memory whose users' work the stream is not ordered
    /// after. Its memory is then the block's: the old work is forgotten.
    pub fn allocated(
        &mut self,
        sim: &SimVmm,
        ptr: DevicePtr,
        len: u64,
        stream: u64,
        event: usize,
    ) -> bool {
        let t = StreamId(stream);
        let mut unordered: Option<(StreamId, u64)> = None;
        for p in sim.memory_pieces(ptr, len) {
            for users in self.take(p.memory, p.offset, p.offset + p.len) {
                if unordered.is_none() {
                    unordered = users
                        .into_iter()
                        .find(|&(s, pos)| !sim.ordered_after(t, s, pos));
                }
            }
        }
        let Some((s, pos)) = unordered else {
            return false;
        };
        self.races += 1;
        self.first.get_or_insert_with(|| {
            format!(
                "event {event}: {len} bytes on stream {stream} reuse memory that stream {} \
                 used before a free, its work up to there (position {pos}) not complete \
                 and no wait ordering stream {stream} after it",
                s.0
            )
        });
        true
    }

    /// For each stream other than `stream` whose freed memory's work may
    /// still run, the lowest position of that work `stream` is not ordered
    /// after now ([`SimVmm::ordered_after`], which is monotone in the
    /// position: ordered after a position, ordered after every earlier one).
    /// A stream absent from the answer orders nothing. Read before an
    /// allocation, it tells which streams a wait made by the allocation
    /// could be needed for (see [`RaceTracker::users_under`]).
    pub fn unordered_from(&self, sim: &SimVmm, stream: u64) -> Vec<(StreamId, u64)> {
        let t = StreamId(stream);
        let mut positions: BTreeMap<StreamId, Vec<u64>> = BTreeMap::new();
        for (_, users) in self.freed.values() {
            for &(s, pos) in users {
                if s != t {
                    positions.entry(s).or_default().push(pos);
                }
            }
        }
        let mut lowest = Vec::new();
        for (s, mut pos) in positions {
            pos.sort_unstable();
            pos.dedup();
            // The first position not ordered after (binary search).
            let first = pos.partition_point(|&p| sim.ordered_after(t, s, p));
            if let Some(&p) = pos.get(first) {
                lowest.push((s, p));
            }
        }
        lowest
    }

    /// The users of the freed memory under the block of `len` bytes at
    /// `ptr` (each stream that used it, with its position at the free),
    /// without forgetting them: call after the allocation, before
    /// [`RaceTracker::allocated`].
    pub fn users_under(&self, sim: &SimVmm, ptr: DevicePtr, len: u64) -> Vec<(StreamId, u64)> {
        let mut users = Vec::new();
        for p in sim.memory_pieces(ptr, len) {
            for key in self.overlapping(p.memory, p.offset, p.offset + p.len) {
                if let Some((_, u)) = self.freed.get(&key) {
                    users.extend(u.iter().copied());
                }
            }
        }
        users
    }

    /// The keys of the freed pieces of `memory` that overlap `start .. end`.
    fn overlapping(&self, memory: u64, start: u64, end: u64) -> Vec<(u64, u64)> {
        let before = self
            .freed
            .range(..=(memory, start))
            .next_back()
            .filter(|((m, _), (e, _))| *m == memory && *e > start);
        let inside = self
            .freed
            .range((memory, start.saturating_add(1))..(memory, end));
        before.into_iter().chain(inside).map(|(k, _)| *k).collect()
    }

    /// Forget `start .. end` of `memory`, keeping the parts of pieces
    /// outside it; the users of each piece it overlapped.
    fn take(&mut self, memory: u64, start: u64, end: u64) -> Vec<Users> {
        let mut taken = Vec::new();
        for key in self.overlapping(memory, start, end) {
            let Some((piece_end, users)) = self.freed.remove(&key) else {
                continue;
            };
            if key.1 < start {
                self.freed.insert(key, (start, users.clone()));
            }
            if piece_end > end {
                self.freed.insert((memory, end), (piece_end, users.clone()));
            }
            taken.push(users);
        }
        taken
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_vmm::sim::SimConfig;
    use quilt_vmm::Vmm;

    /// A device 4 operations behind, with one granule mapped at the
    /// returned address.
    fn device() -> (SimVmm, DevicePtr, u64) {
        let sim = SimVmm::new(SimConfig {
            gpu_lag_ops: 4,
            ..SimConfig::default()
        })
        .unwrap();
        let g = sim.config().granularity;
        let va = sim.reserve(2 * g, 0).unwrap();
        let h = sim.create(g).unwrap();
        sim.map(va, g, h, 0).unwrap();
        (sim, va, g)
    }

    #[test]
    fn reuse_by_another_stream_is_a_race_until_a_wait_or_completion_orders_it() {
        let (sim, va, g) = device();
        let (a, b) = (0, 1);
        let mut races = RaceTracker::new();
        sim.queue_work(StreamId(a));
        races.freeing(&sim, va, g, &[a]);
        // The same stream: stream order.
        assert!(!races.allocated(&sim, va, 1024, a, 1));
        // Freed again by a; b takes part of it while a's work may run.
        races.freeing(&sim, va, 1024, &[a]);
        assert!(races.allocated(&sim, va + 512, 512, b, 2));
        assert_eq!(races.races(), 1);
        assert!(races
            .first()
            .unwrap()
            .starts_with("event 2: 512 bytes on stream 1"));
        // The rest of the piece is still a's: b waits for it first.
        let e = sim.event_record(StreamId(a)).unwrap();
        sim.stream_wait_event(StreamId(b), e).unwrap();
        assert!(!races.allocated(&sim, va, 512, b, 3));
        // Completed work orders everything.
        races.freeing(&sim, va, 1024, &[a, 2]);
        sim.advance(10);
        assert!(!races.allocated(&sim, va, 1024, 3, 4));
        assert_eq!(races.races(), 1);
        sim.event_destroy(e).unwrap();
    }

    #[test]
    fn every_stream_that_used_a_block_is_waited_for_and_memory_is_followed_when_remapped() {
        let (sim, va, g) = device();
        let mut races = RaceTracker::new();
        // Made on 1, used on 0 (`record_stream`), freed; 2 waits for 0 only.
        sim.queue_work(StreamId(1));
        sim.queue_work(StreamId(0));
        races.freeing(&sim, va, g, &[1, 0]);
        let e0 = sim.event_record(StreamId(0)).unwrap();
        sim.stream_wait_event(StreamId(2), e0).unwrap();
        // The same memory, unmapped and mapped at another address.
        let h = sim.translate(va).unwrap().0;
        sim.unmap(va, g).unwrap();
        sim.map(va + g, g, h, 0).unwrap();
        assert!(races.allocated(&sim, va + g, g, 2, 7), "stream 1's work");
        assert!(races.first().unwrap().contains("stream 1 used"));
        sim.event_destroy(e0).unwrap();
    }

    #[test]
    fn unordered_from_names_the_streams_a_wait_may_be_needed_for_and_users_under_keeps_them() {
        let (sim, va, g) = device();
        let (a, b) = (0, 1);
        let mut races = RaceTracker::new();
        sim.queue_work(StreamId(a));
        races.freeing(&sim, va, g, &[a]);
        let pos = sim.stream_position(StreamId(a));
        // b is not ordered after a's work up to the free; a orders itself.
        assert_eq!(races.unordered_from(&sim, b), [(StreamId(a), pos)]);
        assert!(races.unordered_from(&sim, a).is_empty());
        // The users under a range, not forgotten by asking.
        assert_eq!(races.users_under(&sim, va + 512, 512), [(StreamId(a), pos)]);
        assert_eq!(races.users_under(&sim, va, g).len(), 1);
        // After b waits for an event of a recorded past the free: nothing.
        let e = sim.event_record(StreamId(a)).unwrap();
        sim.stream_wait_event(StreamId(b), e).unwrap();
        assert!(races.unordered_from(&sim, b).is_empty());
        assert!(!races.allocated(&sim, va, g, b, 1));
        assert!(races.users_under(&sim, va, g).is_empty());
        sim.event_destroy(e).unwrap();
    }

    #[test]
    fn take_keeps_the_parts_outside() {
        let mut races = RaceTracker::new();
        let users = vec![(StreamId(1), 5)];
        races.freed.insert((7, 0), (100, users.clone()));
        races.freed.insert((7, 200), (300, users.clone()));
        races.freed.insert((8, 0), (100, users.clone()));
        assert_eq!(races.take(7, 50, 250), [users.clone(), users]);
        let left: Vec<_> = races.freed.iter().map(|(k, (e, _))| (*k, *e)).collect();
        assert_eq!(left, [((7, 0), 50), ((7, 250), 300), ((8, 0), 100)]);
        assert_eq!(races.overlapping(7, 40, 260).len(), 2);
        assert!(races.take(7, 50, 250).is_empty());
    }
}
