//! The map-ahead worker: one thread per allocator, started by the first
//! growable buffer under [`AheadMode::Background`], that maps the next pages
//! of a growable buffer after it grows (see [`MapAhead`]), so that the next
//! `grow_to` finds them mapped. It holds only a `Weak` of the allocator's
//! core: dropping the allocator closes its channel and joins it.

use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Sender};

use super::config::{AheadMode, MapAhead};
use super::growable::GrowableId;

/// What the worker maps ahead for: the allocator's shared part, held by the
/// worker only as a `Weak`.
pub(crate) trait MapsAhead: Send + Sync + 'static {
    /// Map ahead of buffer `id` now (a failure is only logged: mapping
    /// ahead is an optimisation).
    fn map_ahead(&self, id: GrowableId);
}

/// The worker, if started.
#[derive(Debug, Default)]
pub(crate) struct Worker {
    running: Mutex<Option<Running>>,
}

#[derive(Debug)]
struct Running {
    tx: Sender<GrowableId>,
    thread: JoinHandle<()>,
}

impl Worker {
    /// Buffer `id` was created or grew: map ahead of it as `policy` says
    /// (inline, in the background, or not at all).
    pub(crate) fn after_growth<T: MapsAhead>(
        &self,
        core: &Arc<T>,
        id: GrowableId,
        policy: MapAhead,
    ) {
        if policy.pages == 0 {
            return;
        }
        match policy.mode {
            AheadMode::Manual => {}
            AheadMode::Inline => core.map_ahead(id),
            AheadMode::Background => {
                if !self.send(core, id) {
                    core.map_ahead(id); // no thread: map on this one
                }
            }
        }
    }

    /// Send `id` to the worker, starting it if need be; false when no
    /// worker can run.
    fn send<T: MapsAhead>(&self, core: &Arc<T>, id: GrowableId) -> bool {
        let Ok(mut running) = self.running.lock() else {
            return false;
        };
        if running.is_none() {
            let (tx, rx) = unbounded::<GrowableId>();
            let weak: Weak<T> = Arc::downgrade(core);
            let spawned = std::thread::Builder::new()
                .name("quilt-map-ahead".into())
                .spawn(move || {
                    for id in rx.iter() {
                        let Some(core) = weak.upgrade() else { break };
                        core.map_ahead(id);
                    }
                });
            match spawned {
                Ok(thread) => *running = Some(Running { tx, thread }),
                Err(e) => {
                    tracing::warn!(error = %e, "starting the map-ahead worker failed");
                    return false;
                }
            }
        }
        running.as_ref().is_some_and(|r| r.tx.send(id).is_ok())
    }

    /// Stop the worker (its channel closes; it finishes what it holds) and
    /// wait for it.
    pub(crate) fn stop(&self) {
        let running = match self.running.lock() {
            Ok(mut r) => r.take(),
            Err(p) => p.into_inner().take(),
        };
        if let Some(Running { tx, thread }) = running {
            drop(tx);
            if thread.join().is_err() {
                tracing::warn!("the map-ahead worker panicked");
            }
        }
    }
}
