//! Event ids, shared by every backend: an id is never reused (a destroyed
//! event's id names no later event), and a call naming an event that was never
//! recorded, or was destroyed, gets the same typed error everywhere.

use slotmap_careful::{DefaultKey, Key, KeyData, SlotMap};

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

/// The live events of one backend, each with the backend's own payload (the
/// driver's event on CUDA, the stream and position on the simulated backend).
///
/// A generational slot map, O(1) per call with no hashing: an id is the
/// slot's index and version (`KeyData::as_ffi`), a destroyed event's slot
/// is taken again under a new version, and `slotmap-careful` retires a slot
/// before its version could wrap, so no id is ever issued twice (plain
/// `slotmap` would reissue one after about 2^31 reuses of a slot: minutes of
/// a busy allocator). [`EventBook::iter`] and [`EventBook::drain`] follow no
/// particular order.
#[derive(Debug)]
pub(crate) struct EventBook<P> {
    live: SlotMap<DefaultKey, P>,
}

impl<P> Default for EventBook<P> {
    fn default() -> Self {
        EventBook {
            live: SlotMap::new(),
        }
    }
}

/// The id of the event at `key`.
fn id_of(key: DefaultKey) -> EventId {
    EventId(key.data().as_ffi())
}

/// The key an id names (any id names some key; a key no event holds is
/// refused by the map).
fn key_of(event: EventId) -> DefaultKey {
    KeyData::from_ffi(event.0).into()
}

impl<P> EventBook<P> {
    /// Records a new event; returns its id.
    pub fn record(&mut self, payload: P) -> EventId {
        id_of(self.live.insert(payload))
    }

    /// The payload of a live event, or `InvalidArgument` naming `call`.
    pub fn get(&self, call: CallKind, event: EventId) -> Result<&P> {
        self.live
            .get(key_of(event))
            .ok_or_else(|| unknown(call, event))
    }

    /// The payload of a live event, to change in place, or `InvalidArgument`
    /// naming `call`.
    pub fn get_mut(&mut self, call: CallKind, event: EventId) -> Result<&mut P> {
        self.live
            .get_mut(key_of(event))
            .ok_or_else(|| unknown(call, event))
    }

    /// Forgets a live event; returns its payload, or `InvalidArgument` naming `call`.
    pub fn remove(&mut self, call: CallKind, event: EventId) -> Result<P> {
        self.live
            .remove(key_of(event))
            .ok_or_else(|| unknown(call, event))
    }

    /// Live events.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Live events as (id, payload), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (EventId, &P)> {
        self.live.iter().map(|(k, p)| (id_of(k), p))
    }

    /// Takes every live event out (in no particular order), leaving the book
    /// empty (ids still never reused).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend tears down this way
    pub fn drain(&mut self) -> Vec<P> {
        self.live.drain().map(|(_, p)| p).collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
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
}
