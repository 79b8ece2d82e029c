//! The gaps of a tiling by `(length, start)`, for best fit: the smallest
//! gap of at least a length first, then the next ones in that order.
//!
//! An arena holds few gaps (on the real traces at hand, 4 to 255 at most),
//! where a sorted vector beats a B-tree: a binary search and a short move
//! instead of a walk through nodes. An arena cut into thousands of gaps (a
//! fragmenting workload; `quilt-bench scale`'s 100,000 live blocks) would
//! make every insert a long move, so past [`SPILL`] entries the index is a
//! B-tree, and a vector again once it shrinks below half of that.
//!
//! A sorted index remembers where its last search for the first gap of at
//! least a length ended: the allocation that asked next cuts its block
//! from that gap and moves the gap's entry, found there without a second
//! search.

use std::cell::Cell;
use std::collections::{btree_map, BTreeMap};

/// A gap's key: its length, then its start.
pub(crate) type GapKey = (u64, u64);

/// Entries past which the index is a B-tree.
const SPILL: usize = 128;

/// Every gap by [`GapKey`], each with its id `I`. See the module
/// documentation.
#[derive(Debug)]
pub(crate) enum GapIndex<I> {
    /// Few gaps: sorted by key, and where the last
    /// [`GapIndex::first_from`] or [`GapIndex::from`] ended (an index,
    /// perhaps stale).
    Sorted(Vec<(GapKey, I)>, Cell<usize>),
    /// Many.
    Tree(BTreeMap<GapKey, I>),
}

impl<I> Default for GapIndex<I> {
    fn default() -> GapIndex<I> {
        GapIndex::Sorted(Vec::new(), Cell::new(0))
    }
}

/// Where `key` is, or would go, in the sorted entries `v`: the first entry
/// not below it. A search by length alone (one comparison a step), then,
/// for a key past the first gap of its length, a search among the gaps of
/// that length from there. (Out of line: every search of a sorted index
/// runs these same few lines of code, an operation's second search finding
/// them fetched by its first.)
#[inline(never)]
fn position<I>(v: &[(GapKey, I)], key: &GapKey) -> usize {
    let (len, _) = *key;
    let i = v.partition_point(|e| e.0 .0 < len);
    match v.get(i) {
        Some(e) if e.0 < *key => i + 1 + forward(&v[i + 1..], key),
        _ => i,
    }
}

/// [`position`] in `v` for a `key` expected near its start: probes 1, 2,
/// 4, ... entries in, then searches the last span probed.
fn forward<I>(v: &[(GapKey, I)], key: &GapKey) -> usize {
    // v[..lo] are all below `key`.
    let (mut lo, mut step) = (0, 1);
    while let Some(e) = v.get(lo + step - 1) {
        if e.0 >= *key {
            return lo + v[lo..lo + step - 1].partition_point(|e| e.0 < *key);
        }
        lo += step;
        step *= 2;
    }
    lo + v[lo..].partition_point(|e| e.0 < *key)
}

/// Where `key` is in the sorted entries `v`, if it is there: at `found`
/// (where the last search ended) or else where a search finds it.
fn position_of<I>(v: &[(GapKey, I)], key: &GapKey, found: &Cell<usize>) -> Option<usize> {
    let at = |i: usize| v.get(i).is_some_and(|e| e.0 == *key);
    if at(found.get()) {
        return Some(found.get());
    }
    let i = position(v, key);
    at(i).then_some(i)
}

impl<I: Copy> GapIndex<I> {
    /// Gaps held.
    pub(crate) fn len(&self) -> usize {
        match self {
            GapIndex::Sorted(v, _) => v.len(),
            GapIndex::Tree(t) => t.len(),
        }
    }

    /// Add gap `id` under `key` (replacing what `key` held).
    pub(crate) fn insert(&mut self, key: GapKey, id: I) {
        match self {
            GapIndex::Sorted(v, _) => {
                let i = position(v, &key);
                match v.get_mut(i) {
                    Some(e) if e.0 == key => e.1 = id,
                    _ => {
                        v.insert(i, (key, id));
                        if v.len() > SPILL {
                            *self = GapIndex::Tree(v.drain(..).collect());
                        }
                    }
                }
            }
            GapIndex::Tree(t) => {
                t.insert(key, id);
            }
        }
    }

    /// Move gap `id` from `old` to `new` (a gap that changed length or
    /// start keeps its id): one remove and one insert, but in a sorted
    /// vector a single move of the entries between the two places, which
    /// are near each other when a gap changes by little (a block cut from
    /// a gap, a freed block joining one); when `new` lies between the
    /// entry's neighbours, no search and no move. `new` must not be held
    /// already.
    pub(crate) fn rekey(&mut self, old: &GapKey, new: GapKey, id: I) {
        match self {
            GapIndex::Sorted(v, found) => {
                let Some(i) = position_of(v, old, found) else {
                    self.insert(new, id);
                    return;
                };
                // Where `new` goes among the others (`v` less entry `i`):
                // on the side of `i` it lies on.
                let j = if new < *old {
                    match i.checked_sub(1).map(|b| v[b].0 < new) {
                        Some(false) => position(&v[..i], &new),
                        _ => i,
                    }
                } else {
                    match v.get(i + 1).map(|e| e.0 > new) {
                        Some(false) => i + 1 + position(&v[i + 1..], &new),
                        _ => i + 1,
                    }
                };
                if j > i {
                    // Past `i`: the entries between move down one.
                    v.copy_within(i + 1..j, i);
                    v[j - 1] = (new, id);
                } else {
                    // Before it: they move up one.
                    v.copy_within(j..i, j + 1);
                    v[j] = (new, id);
                }
            }
            GapIndex::Tree(t) => {
                t.remove(old);
                t.insert(new, id);
            }
        }
    }

    /// Take the gap under `key` out; `None` when there is none.
    pub(crate) fn remove(&mut self, key: &GapKey) -> Option<I> {
        match self {
            GapIndex::Sorted(v, found) => {
                let i = position_of(v, key, found)?;
                Some(v.remove(i).1)
            }
            GapIndex::Tree(t) => {
                let id = t.remove(key)?;
                if t.len() < SPILL / 2 {
                    *self = GapIndex::Sorted(std::mem::take(t).into_iter().collect(), Cell::new(0));
                }
                Some(id)
            }
        }
    }

    /// The gap under `key`.
    #[cfg(feature = "invariants")]
    pub(crate) fn get(&self, key: &GapKey) -> Option<I> {
        match self {
            GapIndex::Sorted(v, found) => position_of(v, key, found).map(|i| v[i].1),
            GapIndex::Tree(t) => t.get(key).copied(),
        }
    }

    /// The first gap at or past `key` (the first of [`GapIndex::from`],
    /// without an iterator).
    pub(crate) fn first_from(&self, key: GapKey) -> Option<(GapKey, I)> {
        match self {
            GapIndex::Sorted(v, found) => {
                let i = position(v, &key);
                found.set(i);
                v.get(i).copied()
            }
            GapIndex::Tree(t) => t.range(key..).next().map(|(&k, &id)| (k, id)),
        }
    }

    /// The gaps from `key` on, in key order.
    pub(crate) fn from(&self, key: GapKey) -> GapsFrom<'_, I> {
        match self {
            GapIndex::Sorted(v, found) => {
                let i = position(v, &key);
                found.set(i);
                GapsFrom::Sorted(v[i..].iter())
            }
            GapIndex::Tree(t) => GapsFrom::Tree(t.range(key..)),
        }
    }
}

/// The gaps from a key on ([`GapIndex::from`]), as `(key, id)`.
pub(crate) enum GapsFrom<'a, I> {
    Sorted(std::slice::Iter<'a, (GapKey, I)>),
    Tree(btree_map::Range<'a, GapKey, I>),
}

impl<I: Copy> Iterator for GapsFrom<'_, I> {
    type Item = (GapKey, I);

    fn next(&mut self) -> Option<(GapKey, I)> {
        match self {
            GapsFrom::Sorted(it) => it.next().copied(),
            GapsFrom::Tree(it) => it.next().map(|(&k, &id)| (k, id)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Through any inserts and removes, across the switch both ways,
        /// the index answers as a B-tree would.
        #[test]
        fn answers_as_a_btree_does(ops in proptest::collection::vec((0u8..3, 0u64..3, 0u64..100), 1..1200)) {
            let mut index = GapIndex::default();
            let mut model: BTreeMap<GapKey, u32> = BTreeMap::new();
            for (n, (op, len, start)) in ops.into_iter().enumerate() {
                let key = (len, start);
                // A search first, as an allocation makes (the entry it
                // finds, or a stale place, remembered for what follows).
                let first = model.range(key..).next().map(|(&k, &v)| (k, v));
                prop_assert_eq!(index.first_from(key), first);
                match op {
                    0 => {
                        index.insert(key, n as u32);
                        model.insert(key, n as u32);
                    }
                    1 => prop_assert_eq!(index.remove(&key), model.remove(&key)),
                    _ => {
                        // Rekey an entry held (the first at or past `key`)
                        // to a key not held, as the tiling does.
                        let held = model.range(key..).next().map(|(&k, _)| k);
                        let new = (len + 1 + start % 3, start * 7 % 101);
                        if let (Some(old), false) = (held, model.contains_key(&new)) {
                            model.remove(&old);
                            model.insert(new, n as u32);
                            index.rekey(&old, new, n as u32);
                        }
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                let from = (len, 0);
                let got: Vec<_> = index.from(from).take(5).collect();
                let want: Vec<_> = model.range(from..).take(5).map(|(&k, &v)| (k, v)).collect();
                prop_assert_eq!(got, want);
            }
            let all: Vec<_> = index.from((0, 0)).collect();
            let want: Vec<_> = model.into_iter().collect();
            prop_assert_eq!(all, want);
        }
    }

    #[test]
    fn spills_into_a_tree_and_comes_back() {
        let mut index = GapIndex::default();
        for i in 0..=SPILL as u64 {
            index.insert((i % 7, i), i as u32);
        }
        assert!(matches!(index, GapIndex::Tree(_)));
        for i in 0..=SPILL as u64 / 2 + 1 {
            assert_eq!(index.remove(&(i % 7, i)), Some(i as u32));
        }
        assert!(matches!(index, GapIndex::Sorted(..)));
        assert_eq!(index.len(), SPILL / 2 - 1);
        let keys: Vec<GapKey> = index.from((0, 0)).map(|(k, _)| k).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
    }
}
