//! Event ids, shared by every backend: an id is never reused (a destroyed
//! event's id names no later event), and a call naming an event that was never
//! recorded, or was destroyed, gets the same typed error everywhere.

use crate::error::{Result, VmmError};
use crate::ledger::invalid;
use crate::types::{CallKind, EventId};

fn unknown(call: CallKind, event: EventId) -> VmmError {
    invalid(
        call,
        "event",
        event.0,
        "is not a live event (never recorded, or already destroyed)",
    )
}

/// Bits of an id that give the slot's index; the bits above give its
/// generation.
const INDEX_BITS: u32 = 40;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// The last generation a slot may use (24 bits); a slot past it is retired.
const LAST_GENERATION: u32 = (1 << (64 - INDEX_BITS)) - 1;

/// One slot of an [`EventBook`]: the live event's payload, or `None` when
/// the slot is free; `generation` is the one the slot's current or next id
/// carries.
#[derive(Debug)]
struct Slot<P> {
    generation: u32,
    payload: Option<P>,
}

/// The live events of one backend, each with the backend's own payload (the
/// driver's event on CUDA, the stream and position on the simulated backend).
///
/// Kept in a vector of slots, O(1) per call with no hashing: an id is the
/// slot's index (low 40 bits) and its generation (high 24 bits, from 1, so
/// no id is 0). Destroying an event frees its slot and moves the slot to its
/// next generation, so the old id no longer matches; a slot that used its
/// last generation is retired (never used again, a few bytes kept), so no
/// id is ever issued twice. A free slot is taken again before the vector
/// grows (most recently freed first), so the vector is as long as the most
/// events ever live at once plus the retired slots (2^40 slots, the most an
/// id can name, would take terabytes).
///
/// Invariants: a slot's payload is `Some` exactly when it holds a live
/// event, whose id carries the slot's generation; the free slots are those
/// in `free`, each at most [`LAST_GENERATION`]; `live` counts the `Some`
/// slots. [`EventBook::iter`] and [`EventBook::drain`] follow no particular
/// order.
#[derive(Debug)]
pub(crate) struct EventBook<P> {
    slots: Vec<Slot<P>>,
    /// Free slots, reused last freed first.
    free: Vec<u64>,
    live: usize,
}

impl<P> Default for EventBook<P> {
    fn default() -> Self {
        EventBook {
            slots: Vec::new(),
            free: Vec::new(),
            live: 0,
        }
    }
}

/// The id of slot `index` at `generation`.
fn id_of(index: u64, generation: u32) -> EventId {
    EventId((u64::from(generation) << INDEX_BITS) | index)
}

/// The slot index and generation an id names.
fn parts(event: EventId) -> (usize, u64) {
    ((event.0 & INDEX_MASK) as usize, event.0 >> INDEX_BITS)
}

impl<P> EventBook<P> {
    /// Records a new event; returns its id.
    pub fn record(&mut self, payload: P) -> EventId {
        self.live += 1;
        if let Some(index) = self.free.pop() {
            if let Some(slot) = self.slots.get_mut(index as usize) {
                slot.payload = Some(payload);
                return id_of(index, slot.generation);
            }
        }
        let index = self.slots.len() as u64;
        self.slots.push(Slot {
            generation: 1,
            payload: Some(payload),
        });
        id_of(index, 1)
    }

    /// The payload of a live event, or `InvalidArgument` naming `call`.
    pub fn get(&self, call: CallKind, event: EventId) -> Result<&P> {
        let (index, generation) = parts(event);
        match self.slots.get(index) {
            Some(slot) if u64::from(slot.generation) == generation => slot.payload.as_ref(),
            _ => None,
        }
        .ok_or_else(|| unknown(call, event))
    }

    /// The payload of a live event, to change in place, or `InvalidArgument`
    /// naming `call`.
    pub fn get_mut(&mut self, call: CallKind, event: EventId) -> Result<&mut P> {
        let (index, generation) = parts(event);
        match self.slots.get_mut(index) {
            Some(slot) if u64::from(slot.generation) == generation => slot.payload.as_mut(),
            _ => None,
        }
        .ok_or_else(|| unknown(call, event))
    }

    /// Forgets a live event; returns its payload, or `InvalidArgument` naming `call`.
    pub fn remove(&mut self, call: CallKind, event: EventId) -> Result<P> {
        let (index, generation) = parts(event);
        let payload = match self.slots.get_mut(index) {
            Some(slot) if u64::from(slot.generation) == generation => {
                let payload = slot.payload.take();
                if payload.is_some() {
                    self.live -= 1;
                    Self::free_slot(&mut self.free, slot, index as u64);
                }
                payload
            }
            _ => None,
        };
        payload.ok_or_else(|| unknown(call, event))
    }

    /// Moves the emptied `slot` (at `index`) to its next generation, so that
    /// its old id names nothing, and makes it free; a slot that used its
    /// last generation is retired instead.
    fn free_slot(free: &mut Vec<u64>, slot: &mut Slot<P>, index: u64) {
        if slot.generation < LAST_GENERATION {
            slot.generation += 1;
            free.push(index);
        }
    }

    /// Live events.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Live events as (id, payload), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (EventId, &P)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            s.payload
                .as_ref()
                .map(|p| (id_of(i as u64, s.generation), p))
        })
    }

    /// Takes every live event out (in no particular order), leaving the book
    /// empty (ids still never reused).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend tears down this way
    pub fn drain(&mut self) -> Vec<P> {
        let mut out = Vec::with_capacity(self.live);
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let Some(p) = slot.payload.take() {
                out.push(p);
                Self::free_slot(&mut self.free, slot, i as u64);
            }
        }
        self.live = 0;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_never_reused_and_dead_ids_are_refused() {
        let mut book = EventBook::default();
        let a = book.record('a');
        assert_ne!(a.0, 0);
        book.remove(CallKind::EventDestroy, a).unwrap();
        // The slot is taken again, under a new id.
        let b = book.record('b');
        assert_ne!(a, b);
        assert!(book.get(CallKind::EventQuery, a).is_err());
        assert!(book.get_mut(CallKind::EventRecord, a).is_err());
        assert!(book.remove(CallKind::EventDestroy, a).is_err());
        assert_eq!(book.get(CallKind::EventQuery, b).copied().unwrap(), 'b');
        *book.get_mut(CallKind::EventRecord, b).unwrap() = 'c';
        assert_eq!(book.iter().collect::<Vec<_>>(), vec![(b, &'c')]);
        for unknown in [EventId(0), EventId(0xdead_beef), EventId(u64::MAX)] {
            assert!(book.get(CallKind::EventQuery, unknown).is_err());
        }
        assert_eq!(book.len(), 1);
        assert_eq!(book.drain(), vec!['c']);
        assert_eq!(book.len(), 0);
        assert!(book.get(CallKind::EventQuery, b).is_err(), "drained");
        let mut seen = std::collections::HashSet::from([a, b]);
        for _ in 0..1000 {
            let e = book.record('x');
            assert!(seen.insert(e), "{e:?} issued twice");
            book.remove(CallKind::EventDestroy, e).unwrap();
        }
    }

    #[test]
    fn a_slot_past_its_last_generation_is_retired() {
        let mut book = EventBook::default();
        let a = book.record(1);
        book.slots[0].generation = LAST_GENERATION;
        let last = id_of(0, LAST_GENERATION);
        book.remove(CallKind::EventDestroy, last).unwrap();
        assert!(book.free.is_empty(), "retired, not freed");
        let b = book.record(2);
        assert_eq!(parts(b), (1, 1), "a new slot");
        assert!(book.get(CallKind::EventQuery, last).is_err());
        assert!(book.get(CallKind::EventQuery, a).is_err());
        assert_eq!(book.len(), 1);
    }
}
