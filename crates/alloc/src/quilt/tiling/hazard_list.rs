//! A gap's hazards ([`Hazard`]s, in address order): a short list held in
//! place, in the gap's own slot of the tiling, up to [`INLINE`] of them,
//! and in a heap vector only past that.
//!
//! Most gaps that hold hazards hold one or two (on `quilt-bench scale`'s
//! churn over 64 streams, nine in ten), and hazards move from gap to gap at
//! nearly every operation (a block cut from a gap hands them to the gaps
//! beside it, a freed block joins its neighbours' lists): held in place, a
//! list is moved by a copy of its slot, reading and writing the gap's own
//! memory, with no allocation, no pointer to follow and no spare lists to
//! keep.

use super::Hazard;

/// Hazards held in place; a list grows onto the heap past them.
pub(crate) const INLINE: usize = 2;

/// No hazard: what an unused place holds at first (past a list's length,
/// a place holds whatever it last held, never read).
const NONE: Hazard = Hazard {
    start: 0,
    end: 0,
    streams: 0,
    tick: 0,
};

/// A gap's hazards in address order. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) enum HazardList {
    /// At most [`INLINE`] hazards: the first `len` of `held`.
    Inline { len: u8, held: [Hazard; INLINE] },
    /// More (a list that grew past [`INLINE`] stays on the heap until it
    /// is emptied).
    Heap(Vec<Hazard>),
}

impl Default for HazardList {
    fn default() -> HazardList {
        HazardList::Inline {
            len: 0,
            held: [NONE; INLINE],
        }
    }
}

impl HazardList {
    /// The hazards, in address order.
    pub(crate) fn as_slice(&self) -> &[Hazard] {
        match self {
            HazardList::Inline { len, held } => &held[..*len as usize],
            HazardList::Heap(v) => v,
        }
    }

    /// The hazards, to change in place (keeping their order).
    pub(crate) fn as_mut_slice(&mut self) -> &mut [Hazard] {
        match self {
            HazardList::Inline { len, held } => &mut held[..*len as usize],
            HazardList::Heap(v) => v,
        }
    }

    /// How many.
    pub(crate) fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True when there are none.
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            HazardList::Inline { len, .. } => *len == 0,
            HazardList::Heap(v) => v.is_empty(),
        }
    }

    /// True when the list lives on the heap (it grew past [`INLINE`]).
    pub(crate) fn on_heap(&self) -> bool {
        matches!(self, HazardList::Heap(_))
    }

    /// Insert `h` at position `at` (at most the length).
    pub(crate) fn insert(&mut self, at: usize, h: Hazard) {
        match self {
            HazardList::Inline { len, held } if (*len as usize) < INLINE => {
                let n = *len as usize;
                let at = at.min(n);
                if at < n {
                    held.copy_within(at..n, at + 1);
                }
                held[at] = h;
                *len += 1;
            }
            HazardList::Inline { held, .. } => {
                let mut v = Vec::with_capacity(2 * INLINE);
                v.extend_from_slice(held);
                v.insert(at.min(INLINE), h);
                *self = HazardList::Heap(v);
            }
            HazardList::Heap(v) => v.insert(at.min(v.len()), h),
        }
    }

    /// Add `h` at the end.
    pub(crate) fn push(&mut self, h: Hazard) {
        self.insert(self.len(), h);
    }

    /// Take out the hazard at position `at`; `None` when there is none.
    pub(crate) fn remove(&mut self, at: usize) -> Option<Hazard> {
        match self {
            HazardList::Inline { len, held } => {
                let n = *len as usize;
                if at >= n {
                    return None;
                }
                let h = held[at];
                for i in at + 1..n {
                    held[i - 1] = held[i];
                }
                *len -= 1;
                Some(h)
            }
            HazardList::Heap(v) => {
                let h = (at < v.len()).then(|| v.remove(at));
                self.release_if_empty();
                h
            }
        }
    }

    /// Drop the first `n` hazards.
    pub(crate) fn drop_first(&mut self, n: usize) {
        match self {
            HazardList::Inline { len, held } => {
                let n = n.min(*len as usize);
                for i in n..*len as usize {
                    held[i - n] = held[i];
                }
                *len -= n as u8;
            }
            HazardList::Heap(v) => {
                v.drain(..n.min(v.len()));
            }
        }
        self.release_if_empty();
    }

    /// Keep only the hazards for which `keep` is true.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&Hazard) -> bool) {
        match self {
            HazardList::Inline { len, held } => {
                let mut kept = 0;
                for i in 0..*len as usize {
                    if keep(&held[i]) {
                        if kept != i {
                            held[kept] = held[i];
                        }
                        kept += 1;
                    }
                }
                *len = kept as u8;
            }
            HazardList::Heap(v) => v.retain(|h| keep(h)),
        }
        self.release_if_empty();
    }

    /// Add the hazards of `other` (all past this list's) at the end (an
    /// empty list takes `other` whole).
    pub(crate) fn append(&mut self, other: HazardList) {
        if self.is_empty() {
            *self = other;
            return;
        }
        for &h in other.as_slice() {
            self.push(h);
        }
    }

    /// An emptied heap list gives its memory back and is held in place
    /// again.
    fn release_if_empty(&mut self) {
        if self.on_heap() && self.is_empty() {
            *self = HazardList::default();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;
    use proptest::prelude::*;

    fn h(start: u64) -> Hazard {
        Hazard::over(start, 1, 1, start)
    }

    proptest! {
        /// Through any inserts, removes, retains and drops from the front,
        /// the list holds what a vector would, in place while it holds at
        /// most `INLINE`.
        #[test]
        fn holds_what_a_vector_would(ops in proptest::collection::vec((0u8..5, 0usize..8), 1..200)) {
            let mut list = HazardList::default();
            let mut model: Vec<Hazard> = Vec::new();
            for (step, (op, at)) in ops.into_iter().enumerate() {
                let x = h(step as u64);
                match op {
                    0 | 1 => {
                        let at = at.min(model.len());
                        list.insert(at, x);
                        model.insert(at, x);
                    }
                    2 => prop_assert_eq!(list.remove(at), (at < model.len()).then(|| model.remove(at))),
                    3 => {
                        list.retain(|y| y.start % 3 != at as u64 % 3);
                        model.retain(|y| y.start % 3 != at as u64 % 3);
                    }
                    _ => {
                        list.drop_first(at % 3);
                        model.drain(..(at % 3).min(model.len()));
                    }
                }
                prop_assert_eq!(list.as_slice(), &model[..]);
                prop_assert_eq!(list.len(), model.len());
                prop_assert_eq!(list.is_empty(), model.is_empty());
                if model.is_empty() {
                    prop_assert!(!list.on_heap(), "an emptied list is held in place");
                }
            }
        }
    }

    #[test]
    fn grows_onto_the_heap_past_the_inline_places_only() {
        let mut list = HazardList::default();
        for i in 0..INLINE as u64 {
            list.push(h(i));
            assert!(!list.on_heap());
        }
        list.push(h(INLINE as u64));
        assert!(list.on_heap());
        let mut other = HazardList::default();
        other.push(h(100));
        let mut joined = HazardList::default();
        joined.append(other.clone());
        assert!(!joined.on_heap(), "taken whole, in place");
        list.append(other);
        let starts: Vec<u64> = list.as_slice().iter().map(|x| x.start).collect();
        assert_eq!(starts, vec![0, 1, 2, 100]);
        joined.as_mut_slice()[0].end = 200;
        assert_eq!(joined.as_slice()[0].end, 200);
    }
}
