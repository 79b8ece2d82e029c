//! A map from device addresses to records (the live blocks by address), for
//! the lookup every allocation and free makes.
//!
//! Open addressing with linear probing over a power-of-two table kept at
//! most half full, each slot one cache line (the address beside its
//! record): an insert or a removal touches the line its address hashes to
//! and, rarely, the next few, and runs a few lines of code. A removal
//! shifts the entries after it back (no tombstones), so a lookup stops at
//! the first empty slot. Block addresses are multiples of 512, so the hash
//! is a multiplication whose high bits pick the slot (Fibonacci hashing),
//! which spreads aligned keys evenly.

use quilt_vmm::DevicePtr;

/// The fewest slots of a table that holds anything.
const MIN_SLOTS: usize = 16;

/// One slot: empty, or an address and its record, alone on a cache line
/// (for records up to 48 bytes).
#[derive(Clone, Debug)]
#[repr(align(64))]
struct Slot<V>(Option<(DevicePtr, V)>);

/// Records by device address. See the module documentation.
#[derive(Debug)]
pub(crate) struct AddressMap<V> {
    /// `slots.len()` is 0 or a power of two, at least twice `len`.
    slots: Vec<Slot<V>>,
    len: usize,
    /// 64 less the bits of a slot index (the hash's shift).
    shift: u32,
}

impl<V> Default for AddressMap<V> {
    fn default() -> AddressMap<V> {
        AddressMap {
            slots: Vec::new(),
            len: 0,
            shift: 64,
        }
    }
}

impl<V> AddressMap<V> {
    /// Records held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when it holds none.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn mask(&self) -> usize {
        self.slots.len().wrapping_sub(1)
    }

    /// The slot `key` hashes to (the table must have slots).
    fn home(&self, key: DevicePtr) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    /// The slot holding `key`, if any.
    fn find(&self, key: DevicePtr) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match &self.slots[i].0 {
                None => return None,
                Some((k, _)) if *k == key => return Some(i),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    /// The record of `key`.
    pub(crate) fn get(&self, key: &DevicePtr) -> Option<&V> {
        let i = self.find(*key)?;
        self.slots[i].0.as_ref().map(|(_, v)| v)
    }

    /// The record of `key`, to change.
    pub(crate) fn get_mut(&mut self, key: &DevicePtr) -> Option<&mut V> {
        let i = self.find(*key)?;
        self.slots[i].0.as_mut().map(|(_, v)| v)
    }

    /// Hold `value` under `key`; the record it replaces, if any.
    pub(crate) fn insert(&mut self, key: DevicePtr, value: V) -> Option<V> {
        if 2 * (self.len + 1) > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            match &mut self.slots[i].0 {
                slot @ None => {
                    *slot = Some((key, value));
                    self.len += 1;
                    return None;
                }
                Some((k, v)) if *k == key => return Some(std::mem::replace(v, value)),
                Some(_) => i = (i + 1) & mask,
            }
        }
    }

    /// Take the record of `key` out.
    pub(crate) fn remove(&mut self, key: &DevicePtr) -> Option<V> {
        let mut hole = self.find(*key)?;
        let (_, value) = self.slots[hole].0.take()?;
        self.len -= 1;
        // Shift back the entries after the hole that may sit there: those
        // whose home is not between the hole and them.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let Some((k, _)) = &self.slots[j].0 else {
                break;
            };
            let home = self.home(*k);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole].0 = self.slots[j].0.take();
                hole = j;
            }
        }
        Some(value)
    }

    /// Twice the slots (at least [`MIN_SLOTS`]), every record placed again.
    /// (Out of line: a table grows a few times in its life.)
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let n = (2 * self.slots.len()).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, (0..n).map(|_| Slot(None)).collect());
        self.shift = 64 - n.trailing_zeros();
        self.len = 0;
        for (k, v) in old.into_iter().filter_map(|s| s.0) {
            self.insert(k, v);
        }
    }

    /// Every (address, record), in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&DevicePtr, &V)> + '_ {
        self.slots
            .iter()
            .filter_map(|s| s.0.as_ref().map(|(k, v)| (k, v)))
    }
}

impl<'a, V> IntoIterator for &'a AddressMap<V> {
    type Item = (&'a DevicePtr, &'a V);
    type IntoIter = Box<dyn Iterator<Item = (&'a DevicePtr, &'a V)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    proptest! {
        /// Through any inserts and removes of aligned addresses (clustered,
        /// as blocks of an arena are, so that probes run into each other
        /// and removals shift entries back), the map answers as a hash map
        /// does.
        #[test]
        fn answers_as_a_hash_map_does(ops in proptest::collection::vec((0u8..3, 0u64..300), 1..2000)) {
            let mut map = AddressMap::default();
            let mut model: HashMap<DevicePtr, u64> = HashMap::new();
            for (n, (op, slot)) in ops.into_iter().enumerate() {
                let key = (1 << 40) + slot * 512;
                match op {
                    0 => prop_assert_eq!(map.insert(key, n as u64), model.insert(key, n as u64)),
                    1 => prop_assert_eq!(map.remove(&key), model.remove(&key)),
                    _ => {
                        if let Some(v) = map.get_mut(&key) {
                            *v += 1;
                        }
                        if let Some(v) = model.get_mut(&key) {
                            *v += 1;
                        }
                    }
                }
                prop_assert_eq!(map.len(), model.len());
                prop_assert_eq!(map.get(&key), model.get(&key));
            }
            for (k, v) in &model {
                prop_assert_eq!(map.get(k), Some(v));
            }
            let mut all: Vec<(DevicePtr, u64)> = map.iter().map(|(&k, &v)| (k, v)).collect();
            all.sort_unstable();
            let mut want: Vec<(DevicePtr, u64)> = model.into_iter().collect();
            want.sort_unstable();
            prop_assert_eq!(all, want);
        }
    }

    #[test]
    fn stays_at_most_half_full_and_finds_nothing_when_empty() {
        let mut map: AddressMap<u32> = AddressMap::default();
        assert_eq!(map.get(&0), None);
        assert_eq!(map.remove(&512), None);
        for i in 0..1000u64 {
            map.insert(i * 512, i as u32);
            assert!(2 * map.len() <= map.slots.len());
        }
        assert_eq!(map.slots.len(), 2048);
        for i in 0..1000u64 {
            assert_eq!(map.remove(&(i * 512)), Some(i as u32));
        }
        assert!(map.is_empty());
        assert_eq!(map.iter().count(), 0);
    }
}
