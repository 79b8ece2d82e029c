//! The simulated device's bookkeeping: reservations, handles, mappings, events.
//!
//! Every operation validates all of its arguments before it changes anything,
//! so a failed call leaves the state exactly as it was. Lookups are `BTreeMap`
//! interval queries: O(log n) per call, plus O(k) for a call that covers k mappings.

use std::collections::{BTreeMap, HashMap};

use crate::error::{Result, VmmError};
use crate::types::{CallKind, DevicePtr, EventId, MemInfo, PhysHandle, StreamId};

use super::leak::LeakReport;

/// First address handed out by `reserve` (the bump pointer's start).
pub(crate) const VA_BASE: u64 = 0x7f00_0000_0000;

/// A live address reservation.
#[derive(Clone, Copy, Debug)]
struct Reservation {
    size: u64,
}

/// A live physical handle (created, and not yet freed: either not released, or
/// released but still mapped).
#[derive(Clone, Copy, Debug)]
struct Handle {
    size: u64,
    released: bool,
    mappings: u64,
}

/// A live mapping of `size` bytes of `handle` from `offset`.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    size: u64,
    handle: u64,
    offset: u64,
    access: bool,
}

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
    granularity: u64,
    capacity: u64,
    va_limit: u64,
    next_va: u64,
    reserved_bytes: u64,
    physical_in_use: u64,
    mapped_bytes: u64,
    next_handle: u64,
    next_event: u64,
    reservations: BTreeMap<u64, Reservation>,
    handles: BTreeMap<u64, Handle>,
    mappings: BTreeMap<u64, Mapping>,
    streams: HashMap<StreamId, Stream>,
    events: HashMap<u64, Event>,
}

fn invalid(call: CallKind, argument: &'static str, value: u64, rule: &'static str) -> VmmError {
    VmmError::InvalidArgument {
        call,
        argument,
        value,
        rule,
    }
}

impl State {
    /// An empty device.
    pub(crate) fn new(granularity: u64, capacity: u64, va_limit: u64) -> State {
        State {
            granularity,
            capacity,
            va_limit,
            next_va: VA_BASE,
            reserved_bytes: 0,
            physical_in_use: 0,
            mapped_bytes: 0,
            next_handle: 1,
            next_event: 1,
            reservations: BTreeMap::new(),
            handles: BTreeMap::new(),
            mappings: BTreeMap::new(),
            streams: HashMap::new(),
            events: HashMap::new(),
        }
    }

    /// Bytes of physical memory held by live handles.
    pub(crate) fn physical_in_use(&self) -> u64 {
        self.physical_in_use
    }

    /// Bytes mapped.
    pub(crate) fn mapped_bytes(&self) -> u64 {
        self.mapped_bytes
    }

    /// Bytes of address space reserved.
    pub(crate) fn reserved_bytes(&self) -> u64 {
        self.reserved_bytes
    }

    /// Live handles, reservations and mappings.
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        (
            self.handles.len(),
            self.reservations.len(),
            self.mappings.len(),
        )
    }

    fn check_aligned(&self, call: CallKind, argument: &'static str, value: u64) -> Result<()> {
        if !value.is_multiple_of(self.granularity) {
            return Err(invalid(
                call,
                argument,
                value,
                "must be a multiple of the granularity",
            ));
        }
        Ok(())
    }

    fn check_size(&self, call: CallKind, size: u64) -> Result<()> {
        if size == 0 {
            return Err(invalid(call, "size", size, "must be non-zero"));
        }
        self.check_aligned(call, "size", size)
    }

    /// `ptr..ptr+size` as an exclusive end, or an error if it wraps.
    fn end_of(call: CallKind, ptr: u64, size: u64) -> Result<u64> {
        ptr.checked_add(size)
            .ok_or_else(|| invalid(call, "size", size, "ptr + size overflows the address space"))
    }

    /// The reservation wholly containing `ptr..end`, if any.
    fn reservation_containing(&self, ptr: u64, end: u64) -> Option<(u64, Reservation)> {
        let (&start, &res) = self.reservations.range(..=ptr).next_back()?;
        let res_end = start.saturating_add(res.size);
        (end <= res_end).then_some((start, res))
    }

    /// The mapping containing address `addr`, if any.
    fn mapping_containing(&self, addr: u64) -> Option<(u64, Mapping)> {
        let (&start, &m) = self.mappings.range(..=addr).next_back()?;
        (addr < start.saturating_add(m.size)).then_some((start, m))
    }

    /// `cuMemAddressReserve`.
    pub(crate) fn reserve(&mut self, size: u64, alignment: u64) -> Result<DevicePtr> {
        let call = CallKind::Reserve;
        self.check_size(call, size)?;
        let alignment = if alignment == 0 {
            self.granularity
        } else {
            alignment
        };
        if !alignment.is_power_of_two() {
            return Err(invalid(
                call,
                "alignment",
                alignment,
                "must be a power of two",
            ));
        }
        self.check_aligned(call, "alignment", alignment)?;
        let available = self.va_limit.saturating_sub(self.reserved_bytes);
        let oom = VmmError::OutOfMemory {
            call,
            requested: size,
            available,
        };
        if size > available {
            return Err(oom);
        }
        // Bump allocation, never reusing an address, with one granule of unreserved
        // gap after each reservation so no two reservations are ever adjacent.
        let ptr = match self.next_va.checked_next_multiple_of(alignment) {
            Some(p) => p,
            None => return Err(oom),
        };
        let next = match ptr
            .checked_add(size)
            .and_then(|e| e.checked_add(self.granularity))
        {
            Some(n) => n,
            None => return Err(oom),
        };
        self.next_va = next;
        self.reserved_bytes += size;
        self.reservations.insert(ptr, Reservation { size });
        Ok(ptr)
    }

    /// `cuMemAddressFree`: `ptr` must start a live reservation (else `NotMapped`)
    /// and `size` be its whole size (else `InvalidArgument`).
    pub(crate) fn address_free(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::AddressFree;
        let res = match self.reservations.get(&ptr) {
            Some(r) => *r,
            None => return Err(VmmError::NotMapped { call, ptr, size }),
        };
        if size != res.size {
            return Err(invalid(
                call,
                "size",
                size,
                "must be the whole reservation's size",
            ));
        }
        let end = ptr.saturating_add(size);
        if self.mappings.range(ptr..end).next().is_some() {
            let mappings = self.mappings.range(ptr..end).count();
            return Err(VmmError::StillMapped {
                call,
                ptr,
                size,
                mappings,
            });
        }
        self.reservations.remove(&ptr);
        self.reserved_bytes -= size;
        Ok(())
    }

    /// `cuMemCreate`.
    pub(crate) fn create(&mut self, size: u64) -> Result<PhysHandle> {
        let call = CallKind::Create;
        self.check_size(call, size)?;
        let available = self.capacity.saturating_sub(self.physical_in_use);
        if size > available {
            return Err(VmmError::OutOfMemory {
                call,
                requested: size,
                available,
            });
        }
        let id = self.next_handle;
        self.next_handle += 1;
        self.handles.insert(
            id,
            Handle {
                size,
                released: false,
                mappings: 0,
            },
        );
        self.physical_in_use += size;
        Ok(PhysHandle(id))
    }

    /// `cuMemRelease`.
    pub(crate) fn release(&mut self, handle: PhysHandle) -> Result<()> {
        let call = CallKind::Release;
        let h = match self.handles.get_mut(&handle.0) {
            Some(h) if !h.released => h,
            Some(_) => {
                return Err(invalid(
                    call,
                    "handle",
                    handle.0,
                    "already released (still mapped)",
                ))
            }
            None => {
                return Err(invalid(
                    call,
                    "handle",
                    handle.0,
                    "not a live handle (unknown or already released)",
                ))
            }
        };
        h.released = true;
        if h.mappings == 0 {
            let size = h.size;
            self.handles.remove(&handle.0);
            self.physical_in_use -= size;
        }
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
        let call = CallKind::Map;
        if ptr == 0 {
            return Err(invalid(call, "ptr", ptr, "must be non-zero"));
        }
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        self.check_aligned(call, "offset", offset)?;
        let end = Self::end_of(call, ptr, size)?;
        let h = match self.handles.get(&handle.0) {
            Some(h) if !h.released => *h,
            Some(_) => {
                return Err(invalid(
                    call,
                    "handle",
                    handle.0,
                    "has been released; a released handle cannot be mapped again",
                ))
            }
            None => {
                return Err(invalid(call, "handle", handle.0, "not a live handle"));
            }
        };
        match offset.checked_add(size) {
            Some(e) if e <= h.size => {}
            _ => {
                return Err(invalid(
                    call,
                    "offset",
                    offset,
                    "offset + size must lie inside the handle",
                ))
            }
        }
        if self.reservation_containing(ptr, end).is_none() {
            return Err(invalid(
                call,
                "ptr",
                ptr,
                "ptr..ptr+size must lie inside one live reservation",
            ));
        }
        // Mappings never overlap, so the last one starting before `end` is the only
        // one that can reach into `ptr..end`.
        if let Some((&start, m)) = self.mappings.range(..end).next_back() {
            if start.saturating_add(m.size) > ptr {
                return Err(VmmError::AlreadyMapped { call, ptr, size });
            }
        }
        self.mappings.insert(
            ptr,
            Mapping {
                size,
                handle: handle.0,
                offset,
                access: false,
            },
        );
        if let Some(h) = self.handles.get_mut(&handle.0) {
            h.mappings += 1;
        }
        self.mapped_bytes += size;
        Ok(())
    }

    /// The start addresses of the mappings that exactly tile `ptr..end` (no
    /// hole, none sticking out), in order.
    fn tiling_mappings(&self, call: CallKind, ptr: u64, size: u64, end: u64) -> Result<Vec<u64>> {
        let mut starts = Vec::new();
        let mut at = ptr;
        for (&start, m) in self.mappings.range(ptr..end) {
            if start != at {
                return Err(VmmError::NotMapped { call, ptr, size });
            }
            starts.push(start);
            at = start.saturating_add(m.size);
        }
        if at < end {
            return Err(VmmError::NotMapped { call, ptr, size });
        }
        if at > end {
            return Err(invalid(
                call,
                "size",
                size,
                "the range ends inside a mapping; unmap must cover whole mappings",
            ));
        }
        Ok(starts)
    }

    /// `cuMemUnmap`.
    pub(crate) fn unmap(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::Unmap;
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        if let Some((start, _)) = self.mapping_containing(ptr) {
            if start != ptr {
                return Err(invalid(
                    call,
                    "ptr",
                    ptr,
                    "the range starts inside a mapping; unmap must cover whole mappings",
                ));
            }
        } else {
            return Err(VmmError::NotMapped { call, ptr, size });
        }
        // Mappings lie inside reservations and no two reservations are adjacent,
        // so a run of neighbouring mappings never leaves its reservation.
        let starts = self.tiling_mappings(call, ptr, size, end)?;
        for start in starts {
            let Some(m) = self.mappings.remove(&start) else {
                continue;
            };
            self.mapped_bytes -= m.size;
            let mut freed = None;
            if let Some(h) = self.handles.get_mut(&m.handle) {
                h.mappings = h.mappings.saturating_sub(1);
                if h.released && h.mappings == 0 {
                    freed = Some(h.size);
                }
            }
            if let Some(bytes) = freed {
                self.handles.remove(&m.handle);
                self.physical_in_use -= bytes;
            }
        }
        Ok(())
    }

    /// `cuMemSetAccess`. Marks every mapping the range touches as accessible.
    pub(crate) fn set_access(&mut self, ptr: DevicePtr, size: u64) -> Result<()> {
        let call = CallKind::SetAccess;
        self.check_aligned(call, "ptr", ptr)?;
        self.check_size(call, size)?;
        let end = Self::end_of(call, ptr, size)?;
        // The range must be fully mapped: start inside a mapping, then mappings
        // follow one another without a hole up to `end`. First check, then mark.
        let Some((first, m)) = self.mapping_containing(ptr) else {
            return Err(VmmError::NotMapped { call, ptr, size });
        };
        let mut at = first.saturating_add(m.size);
        if at < end {
            for (&start, m) in self.mappings.range(at..end) {
                if start != at {
                    return Err(VmmError::NotMapped { call, ptr, size });
                }
                at = start.saturating_add(m.size);
            }
        }
        if at < end {
            return Err(VmmError::NotMapped { call, ptr, size });
        }
        for (_, m) in self.mappings.range_mut(first..end) {
            m.access = true;
        }
        Ok(())
    }

    /// Whether the mapping containing `addr` has had its access set, or `None`
    /// when `addr` is not mapped.
    pub(crate) fn access_set(&self, addr: DevicePtr) -> Option<bool> {
        self.mapping_containing(addr).map(|(_, m)| m.access)
    }

    /// The handle and offset mapped at `addr`, or `None` when not mapped.
    pub(crate) fn translate(&self, addr: DevicePtr) -> Option<(PhysHandle, u64)> {
        self.mapping_containing(addr)
            .map(|(start, m)| (PhysHandle(m.handle), m.offset + (addr - start)))
    }

    /// `cuMemGetInfo`.
    pub(crate) fn mem_info(&self) -> MemInfo {
        MemInfo {
            total: self.capacity,
            free: self.capacity.saturating_sub(self.physical_in_use),
        }
    }

    /// Record an event on `stream`.
    pub(crate) fn event_record(&mut self, stream: StreamId) -> EventId {
        let s = self.streams.entry(stream).or_default();
        s.recorded += 1;
        let seq = s.recorded;
        let id = self.next_event;
        self.next_event += 1;
        self.events.insert(id, Event { stream, seq });
        EventId(id)
    }

    fn event(&self, call: CallKind, event: EventId) -> Result<Event> {
        self.events
            .get(&event.0)
            .copied()
            .ok_or_else(|| invalid(call, "event", event.0, "not a live event"))
    }

    /// `cuEventQuery`.
    pub(crate) fn event_query(&self, event: EventId) -> Result<bool> {
        let e = self.event(CallKind::EventQuery, event)?;
        Ok(self
            .streams
            .get(&e.stream)
            .is_some_and(|s| s.completed >= e.seq))
    }

    /// `cuEventDestroy`.
    pub(crate) fn event_destroy(&mut self, event: EventId) -> Result<()> {
        self.event(CallKind::EventDestroy, event)?;
        self.events.remove(&event.0);
        Ok(())
    }

    /// `cuStreamWaitEvent`: later work on `stream` is ordered after `event`.
    pub(crate) fn stream_wait_event(&mut self, stream: StreamId, event: EventId) -> Result<()> {
        let e = self.event(CallKind::StreamWaitEvent, event)?;
        let done = self
            .streams
            .get(&e.stream)
            .is_some_and(|s| s.completed >= e.seq);
        if !done && e.stream != stream {
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

    /// Checks every invariant of the bookkeeping (O(n); for tests):
    /// reservations disjoint and never adjacent, their sizes summing to
    /// `reserved_bytes <= va_limit`; mappings disjoint, each inside one
    /// reservation and inside its handle, summing to `mapped_bytes`; every
    /// handle's mapping count exact, a released handle only while mapped; live
    /// handles summing to `physical_in_use <= capacity`; every event on a known
    /// stream, numbered no later than the stream's last record.
    pub(crate) fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut reserved = 0u64;
        let mut last_end: Option<u64> = None;
        for (&start, r) in &self.reservations {
            if r.size == 0 || start % self.granularity != 0 || r.size % self.granularity != 0 {
                return Err(format!("reservation {start:#x}+{:#x} misaligned", r.size));
            }
            if last_end.is_some_and(|e| e >= start) {
                return Err(format!(
                    "reservation {start:#x} overlaps or touches its predecessor"
                ));
            }
            last_end = Some(start + r.size);
            reserved += r.size;
        }
        if reserved != self.reserved_bytes || reserved > self.va_limit {
            return Err(format!(
                "reserved {reserved} != counter {} (limit {})",
                self.reserved_bytes, self.va_limit
            ));
        }
        let mut mapped = 0u64;
        let mut per_handle: BTreeMap<u64, u64> = BTreeMap::new();
        let mut last_end: Option<u64> = None;
        for (&start, m) in &self.mappings {
            let end = start + m.size;
            if last_end.is_some_and(|e| e > start) {
                return Err(format!("mapping {start:#x} overlaps its predecessor"));
            }
            last_end = Some(end);
            if self.reservation_containing(start, end).is_none() {
                return Err(format!(
                    "mapping {start:#x}+{:#x} outside every reservation",
                    m.size
                ));
            }
            match self.handles.get(&m.handle) {
                Some(h) if m.offset + m.size <= h.size => {}
                _ => {
                    return Err(format!(
                        "mapping {start:#x} names handle {} that is dead or too small",
                        m.handle
                    ))
                }
            }
            *per_handle.entry(m.handle).or_default() += 1;
            mapped += m.size;
        }
        if mapped != self.mapped_bytes {
            return Err(format!("mapped {mapped} != counter {}", self.mapped_bytes));
        }
        let mut physical = 0u64;
        for (&id, h) in &self.handles {
            let count = per_handle.get(&id).copied().unwrap_or(0);
            if h.mappings != count {
                return Err(format!(
                    "handle {id} counts {} mappings, has {count}",
                    h.mappings
                ));
            }
            if h.released && count == 0 {
                return Err(format!("handle {id} released and unmapped but still alive"));
            }
            physical += h.size;
        }
        if physical != self.physical_in_use || physical > self.capacity {
            return Err(format!(
                "physical {physical} != counter {} (capacity {})",
                self.physical_in_use, self.capacity
            ));
        }
        for (&id, e) in &self.events {
            match self.streams.get(&e.stream) {
                Some(s) if e.seq <= s.recorded && s.completed <= s.recorded => {}
                _ => return Err(format!("event {id} on {:?} is out of order", e.stream)),
            }
        }
        Ok(())
    }

    /// What is alive now.
    pub(crate) fn leak_report(&self) -> LeakReport {
        LeakReport {
            handles: self
                .handles
                .iter()
                .map(|(&id, h)| (PhysHandle(id), h.size))
                .collect(),
            reservations: self
                .reservations
                .iter()
                .map(|(&p, r)| (p, r.size))
                .collect(),
            mappings: self.mappings.iter().map(|(&p, m)| (p, m.size)).collect(),
            events: self.events.len(),
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
        let h = st.create(2 * G).unwrap();
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
