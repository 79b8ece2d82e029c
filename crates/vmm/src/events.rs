//! Event ids, shared by every backend: ids count up from 1 and are never
//! reused, and a call naming an event that was never recorded, or was
//! destroyed, gets the same typed error everywhere.

use rustc_hash::FxHashMap;

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
/// Invariant: every key is below `next`. Kept in a hash map (O(1) per call,
/// where a tree of the few hundred live events costs a search of several
/// nodes); [`EventBook::iter`] and [`EventBook::drain`] therefore follow no
/// particular order.
#[derive(Debug)]
pub(crate) struct EventBook<P> {
    next: u64,
    live: FxHashMap<u64, P>,
}

impl<P> Default for EventBook<P> {
    fn default() -> Self {
        EventBook {
            next: 1,
            live: FxHashMap::default(),
        }
    }
}

impl<P> EventBook<P> {
    /// Records a new event; returns its id.
    pub fn record(&mut self, payload: P) -> EventId {
        let id = self.next;
        self.next += 1;
        self.live.insert(id, payload);
        EventId(id)
    }

    /// The payload of a live event, or `InvalidArgument` naming `call`.
    pub fn get(&self, call: CallKind, event: EventId) -> Result<&P> {
        self.live.get(&event.0).ok_or_else(|| unknown(call, event))
    }

    /// The payload of a live event, to change in place, or `InvalidArgument`
    /// naming `call`.
    pub fn get_mut(&mut self, call: CallKind, event: EventId) -> Result<&mut P> {
        self.live
            .get_mut(&event.0)
            .ok_or_else(|| unknown(call, event))
    }

    /// Forgets a live event; returns its payload, or `InvalidArgument` naming `call`.
    pub fn remove(&mut self, call: CallKind, event: EventId) -> Result<P> {
        self.live
            .remove(&event.0)
            .ok_or_else(|| unknown(call, event))
    }

    /// Live events.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Live events as (id, payload), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (EventId, &P)> {
        self.live.iter().map(|(id, p)| (EventId(*id), p))
    }

    /// Takes every live event out (in no particular order), leaving the book
    /// empty (ids still never reused).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // only the CUDA backend tears down this way
    pub fn drain(&mut self) -> Vec<P> {
        std::mem::take(&mut self.live).into_values().collect()
    }
}
