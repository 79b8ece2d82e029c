//! Driver calls counted by entry point, for the live A/B (`quilt-bench live`)
//! and anyone who wants to know what a program asked of the driver.
//!
//! Every exported driver function that does its own work counts one call
//! under its own name when it is entered, whether it succeeds or not; a
//! function that only forwards to another (`_ptsz`/`_ptds` aliases onto the
//! per-thread stream, unversioned names onto `_v2`, `cuEventRecordWithFlags`
//! onto `cuEventRecord`, ...) is counted once, under the name of the
//! function it forwards to. Calls the double makes to itself are not
//! counted, and neither are the functions' own internal steps (`cuMemAlloc`
//! is one call, not a reserve, a create and a map).
//!
//! A count is one relaxed atomic add on a counter of the call site; the
//! first call of an entry point also adds its counter, once, to the list the
//! readers walk. [`snapshot`] reads them; the exported
//! `quiltDoubleCounts(char *buffer, size_t length)` writes them as text, a
//! line `NAME COUNT` per entry point called so far, sorted by name, for a
//! client that loads the double as `libcuda.so.1` (`ctypes` in Python):
//! like `snprintf`, it returns the length of the whole text and writes at
//! most `length - 1` bytes of it and a NUL (nothing where the buffer is null
//! or `length` is 0).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// The calls of one entry point.
#[derive(Debug)]
pub struct Counter {
    name: &'static str,
    calls: AtomicU64,
}

/// The counters called at least once, in the order of their first call.
static CALLED: Mutex<Vec<&'static Counter>> = Mutex::new(Vec::new());

impl Counter {
    /// A counter of the entry point `name`, at zero.
    pub const fn new(name: &'static str) -> Counter {
        Counter {
            name,
            calls: AtomicU64::new(0),
        }
    }

    /// Counts one call.
    pub fn bump(&'static self) {
        if self.calls.fetch_add(1, Ordering::Relaxed) == 0 {
            CALLED
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(self);
        }
    }
}

/// Counts one call of the entry point named by the literal: a counter of
/// the call site, made once.
macro_rules! count {
    ($name:literal) => {{
        static COUNTER: $crate::counters::Counter = $crate::counters::Counter::new($name);
        COUNTER.bump();
    }};
}
pub(crate) use count;

/// Every entry point called so far and its calls, sorted by name.
pub fn snapshot() -> Vec<(&'static str, u64)> {
    let mut out: Vec<(&'static str, u64)> = CALLED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|c| (c.name, c.calls.load(Ordering::Relaxed)))
        .collect();
    out.sort_unstable();
    out
}

/// [`snapshot`] as text: a line `NAME COUNT` per entry point.
pub fn text() -> String {
    snapshot()
        .into_iter()
        .map(|(name, calls)| format!("{name} {calls}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // test code
    use super::*;

    #[test]
    fn a_call_site_counts_its_calls_under_its_name() {
        fn called() {
            count!("quiltDoubleTestEntry");
        }
        let before = snapshot()
            .into_iter()
            .find(|(n, _)| *n == "quiltDoubleTestEntry")
            .map_or(0, |(_, c)| c);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..1000 {
                        called();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let counts = snapshot();
        let (_, after) = counts
            .iter()
            .find(|(n, _)| *n == "quiltDoubleTestEntry")
            .unwrap();
        assert_eq!(after - before, 4000);
        // Listed once, and the text says the same.
        assert_eq!(
            counts
                .iter()
                .filter(|(n, _)| *n == "quiltDoubleTestEntry")
                .count(),
            1
        );
        assert!(text().contains(&format!("quiltDoubleTestEntry {after}\n")));
    }
}
