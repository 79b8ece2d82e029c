//! Counting and tracing of driver calls for the real backends (host and CUDA).
//!
//! Every call goes through [`CallLog::record`] (or [`CallLog::time`], which
//! times a closure and records it), which bumps the per-kind
//! counters of [`DriverStats`], adds the measured wall time, and emits one
//! `tracing` event (trace level on success, debug level on failure) with the
//! kind, size, result and duration. [`CallLog::locked`] is the one shape of
//! a backend's call: lock its state, run the ledger's check, call and commit
//! on it (see the ledger module), log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::error::Result;
use crate::types::{CallKind, DriverStats};

/// Lock-free counters behind [`DriverStats`].
///
/// Invariant: `calls[k]` counts every recorded call of kind `k`, `failed[k]`
/// the failed ones among them.
#[derive(Debug)]
pub(crate) struct CallLog {
    backend: &'static str,
    calls: [AtomicU64; CallKind::COUNT],
    failed: [AtomicU64; CallKind::COUNT],
    measured_ns: AtomicU64,
    created_bytes: AtomicU64,
    copied_bytes: AtomicU64,
}

impl CallLog {
    /// Empty counters for the named backend.
    pub fn new(backend: &'static str) -> Self {
        CallLog {
            backend,
            calls: Default::default(),
            failed: Default::default(),
            measured_ns: AtomicU64::new(0),
            created_bytes: AtomicU64::new(0),
            copied_bytes: AtomicU64::new(0),
        }
    }

    /// Records one call of `kind` on `size` bytes that started at `started`
    /// and ended with `result`; passes the result through.
    pub fn record<T>(
        &self,
        kind: CallKind,
        size: u64,
        started: Instant,
        result: Result<T>,
    ) -> Result<T> {
        let ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let i = kind.index();
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        self.measured_ns.fetch_add(ns, Ordering::Relaxed);
        match &result {
            Ok(_) => {
                if kind == CallKind::Create {
                    self.created_bytes.fetch_add(size, Ordering::Relaxed);
                }
                if kind.is_copy() {
                    self.copied_bytes.fetch_add(size, Ordering::Relaxed);
                }
                tracing::trace!(
                    backend = self.backend,
                    call = kind.driver_name(),
                    size,
                    ok = true,
                    ns,
                    "driver call"
                );
            }
            Err(error) => {
                self.failed[i].fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    backend = self.backend,
                    call = kind.driver_name(),
                    size,
                    ok = false,
                    ns,
                    %error,
                    "driver call failed"
                );
            }
        }
        result
    }

    /// Runs `op` as one call of `kind` on `size` bytes, timed and recorded.
    pub fn time<T>(&self, kind: CallKind, size: u64, op: impl FnOnce() -> Result<T>) -> Result<T> {
        let started = Instant::now();
        let result = op();
        self.record(kind, size, started, result)
    }

    /// Runs `op` on `state`, under its lock, as one call of `kind` on
    /// `size` bytes, timed and recorded.
    pub fn locked<S, T>(
        &self,
        kind: CallKind,
        size: u64,
        state: &Mutex<S>,
        op: impl FnOnce(&mut S) -> Result<T>,
    ) -> Result<T> {
        self.time(kind, size, || op(&mut lock(state)))
    }

    /// [`CallLog::time`] for a call whose size only `op` learns: it answers
    /// the size (recorded as 0 when it fails).
    pub fn time_sized(&self, kind: CallKind, op: impl FnOnce() -> Result<u64>) -> Result<()> {
        let started = Instant::now();
        let result = op();
        let size = result.as_ref().map_or(0, |s| *s);
        self.record(kind, size, started, result.map(drop))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> DriverStats {
        let mut out = DriverStats::default();
        for i in 0..out.calls.len() {
            out.calls[i] = self.calls[i].load(Ordering::Relaxed);
            out.failed[i] = self.failed[i].load(Ordering::Relaxed);
        }
        out.measured_ns = self.measured_ns.load(Ordering::Relaxed);
        out.created_bytes = self.created_bytes.load(Ordering::Relaxed);
        out.copied_bytes = self.copied_bytes.load(Ordering::Relaxed);
        out
    }
}

/// Locks `m`; a poisoned lock is taken as it is (no backend code panics
/// under a lock, and every call checks before it changes anything).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
