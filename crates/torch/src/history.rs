//! The allocation history (`quilt_record_history`): per device, the last
//! `max_entries` allocator actions in PyTorch's trace vocabulary, for
//! `device_traces` in a snapshot.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// One action, as an entry of PyTorch's `device_traces`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// `alloc`, `free_requested`, `free_completed` or `oom`.
    pub action: &'static str,
    /// The block's address (for `oom`: the bytes the device had free, as PyTorch writes it).
    pub addr: u64,
    /// The size asked for (for `oom`: the request).
    pub size: u64,
    /// The stream, as the caller passed it.
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

#[derive(Debug, Default)]
struct Book {
    max_entries: usize,
    per_device: BTreeMap<i32, VecDeque<TraceEntry>>,
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

    /// Record `action` on `device`, if recording.
    pub fn record(&self, device: i32, action: &'static str, addr: u64, size: u64, stream: u64) {
        if !self.enabled.load(Ordering::Acquire) {
            return;
        }
        let time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0);
        if let Ok(mut b) = self.book.lock() {
            let max = b.max_entries;
            if max == 0 {
                return;
            }
            let q = b.per_device.entry(device).or_default();
            if q.len() == max {
                q.pop_front();
            }
            q.push_back(TraceEntry {
                action,
                addr,
                size,
                stream,
                time_us,
            });
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
        h.record(0, "alloc", 1, 2, 0);
        assert!(h.entries().is_empty());
        h.set(true, 2);
        for a in 1..=3 {
            h.record(0, "alloc", a, 8, 0);
        }
        let e = h.entries();
        let addrs: Vec<u64> = e[&0].iter().map(|t| t.addr).collect();
        assert_eq!(addrs, [2, 3]);
        h.set(false, 0);
        h.record(0, "alloc", 9, 8, 0);
        assert_eq!(h.entries()[&0].len(), 2);
    }
}
