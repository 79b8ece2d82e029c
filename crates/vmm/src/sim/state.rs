//! The simulated device's state: the shared [`Ledger`] (every rule and the
//! bookkeeping of reservations, handles and mappings) plus what only the
//! simulated device has: its address placement and limit, and streams whose
//! events complete when the test or harness says the device caught up.
//!
//! Every operation validates all of its arguments before it changes anything,
//! so a failed call leaves the state exactly as it was. O(log n) per call,
//! plus O(k log n) for a call that covers k mappings.

use std::collections::HashMap;

use crate::error::{Result, VmmError};
use crate::events::EventBook;
use crate::leak::LeakReport;
use crate::ledger::Ledger;
use crate::types::{CallKind, DevicePtr, EventId, MapRule, MemInfo, PhysHandle, StreamId};

/// First address handed out by `reserve` (the bump pointer's start).
pub(crate) const VA_BASE: u64 = 0x7f00_0000_0000;

/// Where one stream stands: events recorded and completed so far, and the
/// cross-stream waits not yet satisfied.
#[derive(Clone, Debug, Default)]
struct Stream {
    recorded: u64,
    completed: u64,
    /// `(position, stream, seq)`: work on this stream after its `position`th event waits
    /// for event number `seq` of `stream`.
    waits: Vec<(u64, StreamId, u64)>,
}

/// A live event: the `seq`th event recorded on `stream`.
#[derive(Clone, Copy, Debug)]
struct Event {
    stream: StreamId,
    seq: u64,
}

/// All of the simulated device's state.
#[derive(Debug)]
pub(crate) struct State {
    ledger: Ledger<()>,
    granularity: u64,
    va_limit: u64,
    next_va: u64,
    streams: HashMap<StreamId, Stream>,
    events: EventBook<Event>,
}

impl State {
    /// An empty device.
    pub(crate) fn new(granularity: u64, capacity: u64, va_limit: u64) -> State {
        State {
            ledger: Ledger::new(granularity, capacity),
            granularity,
            va_limit,
            next_va: VA_BASE,
            streams: HashMap::new(),
            events: EventBook::default(),
        }
    }

    /// Sets the ledger's map rule (before the first map).
    pub(crate) fn set_map_rule(&mut self, rule: MapRule) {
        self.ledger.set_map_rule(rule);
    }

    /// Bytes of physical memory held by live handles.
    pub(crate) fn physical_in_use(&self) -> u64 {
        self.ledger.used()
    }

    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.ledger.mapped_bytes()
    }

    /// Bytes of address space reserved.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.ledger.reserved_bytes()
    }

    /// Live handles, reservations and mappings.
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        self.ledger.counts()
    }

    /// `cuMemAddressReserve`: the ledger's rules, then the address-space limit.
    /// Addresses come from a bump pointer, never reused, with one granule of
    /// unreserved gap after each reservation so no two are ever adjacent.
    pub(crate) fn reserve(&mut self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let alignment = self.ledger.check_reserve(size, alignment)?;
        let oom = || VmmError::OutOfMemory {
            call: CallKind::Reserve,
            requested: size,
            available: self.va_limit.saturating_sub(self.ledger.reserved_bytes()),
        };
        if size > self.va_limit.saturating_sub(self.ledger.reserved_bytes()) {
            return Err(oom());
        }
        let Some(ptr) = self.next_va.checked_next_multiple_of(alignment) else {
            return Err(oom());
        };
        let Some(next) = ptr
            .checked_add(size)
            .and_then(|end| end.checked_add(self.granularity))
        else {
            return Err(oom());
        };
        self.next_va = next;
        self.ledger.add_reservation(ptr, size);
        Ok(ptr)
    }

    /// `cuMemAddressFree`.
    pub(crate) fn address_free(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.ledger.check_address_free(ptr, size)?;
        self.ledger.remove_reservation(ptr);
        Ok(())
    }

    /// `cuMemCreate`.
    pub(crate) fn create(&mut self, size: u64) -> Result<PhysHandle> {
        self.ledger.check_create(size)?;
        Ok(self.ledger.add_handle(size, ()))
    }

    /// `cuMemRelease`.
    pub(crate) fn release(&mut self, handle: PhysHandle) -> Result<()> {
        self.ledger.live_handle(CallKind::Release, handle)?;
        self.ledger.release(handle);
        Ok(())
    }

    /// `cuMemMap`.
    pub(crate) fn map(
        &mut self,
        ptr: DevicePtr,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> Result<()> {
        self.ledger.check_map(ptr, size, handle, offset)?;
        self.ledger.add_mapping(ptr, size, handle, offset);
        Ok(())
    }

    /// `cuMemUnmap`.
    pub(crate) fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        let starts = self.ledger.check_unmap(ptr, size)?;
        self.ledger.remove_mappings(&starts);
        Ok(())
    }

    /// `cuMemSetAccess`.
    pub(crate) fn set_access(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        self.ledger.check_set_access(ptr, size)?;
        self.ledger.mark_accessible(ptr, size);
        Ok(())
    }

    /// Whether the mapping containing `addr` has had its access set (any part
    /// of it), or `None` when `addr` is not mapped.
    pub(crate) fn access_set(&self, addr: DevicePtr) -> Option<bool> {
        self.ledger
            .mapping_containing(addr)
            .map(|(_, m)| m.access.any())
    }

    /// The handle and offset mapped at `addr`, or `None` when not mapped.
    pub(crate) fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        self.ledger
            .mapping_containing(addr)
            .map(|(start, m)| (PhysHandle(m.handle), m.offset + (addr - start)))
    }

    /// `cuMemGetInfo`.
    pub(crate) fn mem_info(&self) -> MemInfo {
        self.ledger.mem_info()
    }

    /// Record an event on `stream`.
    pub(crate) fn event_record(&mut self, stream: StreamId) -> EventId {
        let s = self.streams.entry(stream).or_default();
        s.recorded += 1;
        let seq = s.recorded;
        self.events.record(Event { stream, seq })
    }

    fn is_complete(&self, e: &Event) -> bool {
        self.streams
            .get(&e.stream)
            .is_some_and(|s| s.completed >= e.seq)
    }

    /// `cuEventQuery`.
    pub(crate) fn event_query(&self, event: EventId) -> Result<bool> {
        let e = self.events.get(CallKind::EventQuery, event)?;
        Ok(self.is_complete(e))
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroy(&mut self, event: EventId) -> Result<()> {
        self.events.remove(CallKind::EventDestroy, event).map(drop)
    }

    /// `cuStreamWaitEvent`: later work on `stream` is ordered after `event`.
    pub(crate) fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<()> {
        let e = *self.events.get(CallKind::StreamWaitEvent, event)?;
        if !self.is_complete(&e) && e.stream != stream {
            let s = self.streams.entry(stream).or_default();
            let position = s.recorded;
            s.waits.push((position, e.stream, e.seq));
        }
        Ok(())
    }

    /// Complete every event recorded so far on `stream`, and (since the stream
    /// waited for them) every event its waits named, transitively.
    pub(crate) fn complete_stream(&mut self, stream: StreamId) {
        let upto = self.streams.get(&stream).map_or(0, |s| s.recorded);
        let mut work = vec![(stream, upto, true)];
        while let Some((id, seq, all)) = work.pop() {
            let Some(s) = self.streams.get_mut(&id) else {
                continue;
            };
            if seq > s.completed {
                s.completed = seq;
            }
            // A wait at `position` precedes event `position + 1` onwards.
            let mut kept = Vec::new();
            for &(position, other, other_seq) in &s.waits {
                if all || position < seq {
                    work.push((other, other_seq, false));
                } else {
                    kept.push((position, other, other_seq));
                }
            }
            s.waits = kept;
        }
    }

    /// Complete every event on every stream.
    pub(crate) fn complete_all(&mut self) {
        for s in self.streams.values_mut() {
            s.completed = s.recorded;
            s.waits.clear();
        }
    }

    /// Checks every invariant of the bookkeeping (O(n); for tests): the
    /// ledger's (see [`Ledger::check_invariants`]), then reservations never
    /// adjacent and within `va_limit`, and every event on a known stream,
    /// numbered no later than the stream's last record.
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        self.ledger.check_invariants()?;
        let mut last_end: Option<u64> = None;
        for (start, size) in self.ledger.reservations() {
            if last_end.is_some_and(|e| e >= start) {
                return Err(format!(
                    "reservation {start:#x} overlaps or touches its predecessor"
                ));
            }
            last_end = Some(start + size);
        }
        if self.ledger.reserved_bytes() > self.va_limit {
            return Err(format!(
                "reserved {} over the limit {}",
                self.ledger.reserved_bytes(),
                self.va_limit
            ));
        }
        for (id, e) in self.events.iter() {
            match self.streams.get(&e.stream) {
                Some(s) if e.seq <= s.recorded && s.completed <= s.recorded => {}
                _ => return Err(format!("event {} on {:?} is out of order", id.0, e.stream)),
            }
        }
        Ok(())
    }

    /// What is alive now.
    pub(crate) fn leak_report(&self) -> LeakReport {
        LeakReport {
            events: self.events.len(),
            ..self.ledger.leak_report()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    #[test]
    fn catching_up_completes_waited_events_transitively() {
        let mut st = State::new(G, 1 << 30, 1 << 40);
        let (s1, s2, s3) = (StreamId(1), StreamId(2), StreamId(3));
        let a = st.event_record(s1);
        st.stream_wait_event(s2, a).unwrap();
        let b = st.event_record(s2);
        st.stream_wait_event(s3, b).unwrap();
        st.complete_stream(s3);
        assert!(st.event_query(a).unwrap() && st.event_query(b).unwrap());
        st.check_invariants().unwrap();
    }

    #[test]
    fn waiting_on_a_completed_event_or_own_stream_records_nothing() {
        let mut st = State::new(G, 1 << 30, 1 << 40);
        let s = StreamId(4);
        let a = st.event_record(s);
        st.stream_wait_event(s, a).unwrap();
        st.complete_stream(s);
        st.stream_wait_event(StreamId(5), a).unwrap();
        assert!(st.streams.values().all(|s| s.waits.is_empty()));
    }

    #[test]
    fn failed_calls_change_nothing() {
        let mut st = State::new(G, 8 * G, 1 << 40);
        let va = st.reserve(4 * G, 0).unwrap();
        let h = st.create(G).unwrap();
        st.map(va, G, h, 0).unwrap();
        let before = st.leak_report();
        assert!(st.map(va, G, h, G).is_err());
        assert!(st.unmap(va, 2 * G).is_err());
        assert!(st.create(8 * G).is_err());
        assert!(st.address_free(va, 4 * G).is_err());
        assert!(st.set_access(va + G, G).is_err());
        assert_eq!(st.leak_report(), before);
        st.check_invariants().unwrap();
        assert_eq!(st.translate(va + 5), Some((h, 5)));
    }
}
