//! The double's driver state: one per process behind one lock, made by
//! `cuInit`. Devices and contexts live here; memory is in `memory.rs`, streams,
//! events, queued work and capture in `work.rs`, peer access and copies
//! between devices in `peer.rs`.
//!
//! Every handle a client sees (contexts, streams, events, physical handles,
//! graphs) is a number the double makes up and never reuses, so a handle
//! used after its object is gone is always recognised
//! (`CUDA_ERROR_INVALID_HANDLE`), never confused with a newer object.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::c_int;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;

use crate::abi::*;
use crate::memory::Memory;
use crate::rules::Rules;
use crate::work::{Capture, Event, Op, Stream};

/// The driver, once `cuInit` has run.
static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);

thread_local! {
    /// The calling thread's context stack (top last).
    static CONTEXTS: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
    /// The calling thread's stream-capture interaction mode
    /// (`cuThreadExchangeStreamCaptureMode`).
    static CAPTURE_MODE: Cell<c_int> = const { Cell::new(CAPTURE_MODE_GLOBAL) };
}

/// A context: the primary context of a device or one made by `cuCtxCreate`.
#[derive(Debug)]
pub struct Context {
    /// Its device.
    pub device: CuDevice,
    /// Whether it is the device's primary context.
    pub primary: bool,
    /// Set when queued work faulted: every later call that needs the
    /// context fails with it (a sticky error, as on a GPU).
    pub poisoned: Option<CuResult>,
}

/// A device's primary context: its handle while retained.
#[derive(Debug, Default)]
pub struct Primary {
    /// The live context, if retained.
    pub context: Option<u64>,
    /// `cuDevicePrimaryCtxRetain`s not yet released.
    pub retained: u32,
    /// `cuDevicePrimaryCtxSetFlags` flags.
    pub flags: u32,
}

/// The whole driver state.
#[derive(Debug)]
pub struct Driver {
    /// The model and its rules.
    pub rules: Rules,
    /// Driver calls made so far (queued work runs `rules.lag` calls later).
    pub calls: u64,
    next_handle: u64,
    /// Live contexts by handle.
    pub contexts: BTreeMap<u64, Context>,
    /// Each device's primary context.
    pub primary: Vec<Primary>,
    /// Reservations, handles, mappings.
    pub memory: Memory,
    /// Streams by handle (internal ones for the legacy and per-thread
    /// default streams included); destroyed ones stay until their work ran.
    pub streams: BTreeMap<u64, Stream>,
    /// Each context's legacy default stream.
    pub legacy: BTreeMap<u64, u64>,
    /// Each thread's per-thread default stream in each context.
    pub per_thread: HashMap<(ThreadId, u64), u64>,
    /// Live events by handle.
    pub events: BTreeMap<u64, Event>,
    /// Capture sequences by id.
    pub captures: BTreeMap<u64, Capture>,
    /// Graphs made by `cuStreamEndCapture`, not destroyed yet: their
    /// recorded work.
    pub graphs: BTreeMap<u64, Vec<Op>>,
    /// Executable graphs (`cuGraphInstantiate`), not destroyed yet.
    pub execs: BTreeMap<u64, Vec<Op>>,
    /// Pinned host allocations (`cuMemHostAlloc`): address to size.
    pub host: BTreeMap<u64, Vec<u8>>,
    /// Peer access enabled (`cuCtxEnablePeerAccess`): from a context to a
    /// peer context (`peer.rs`).
    pub peers: BTreeSet<(u64, u64)>,
}

/// The result of a driver call: a value or a `CUresult` error.
pub type Call<T> = Result<T, CuResult>;

/// Runs `f` on the driver after counting the call and running the work that
/// is due; `CUDA_ERROR_NOT_INITIALIZED` before `cuInit`.
pub fn with_driver<T>(f: impl FnOnce(&mut Driver) -> Call<T>) -> Call<T> {
    let mut guard = lock();
    let driver = guard.as_mut().ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
    driver.tick();
    f(driver)
}

fn lock() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `cuInit`: reads the rules once; later calls change nothing.
pub fn init(flags: u32) -> Call<()> {
    if flags != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut guard = lock();
    if guard.is_none() {
        let rules = Rules::from_env().map_err(|e| {
            eprintln!("quilt-cuda-double: cuInit: {e}");
            CUDA_ERROR_INVALID_VALUE
        })?;
        if rules.devices == 0 {
            return Err(CUDA_ERROR_NO_DEVICE);
        }
        *guard = Some(Driver::new(rules));
    }
    Ok(())
}

/// The driver's rules, where `cuInit` has run (for the version query, which
/// needs no initialisation: the defaults then).
pub fn driver_version() -> i32 {
    lock()
        .as_ref()
        .map(|d| d.rules.driver_version)
        .unwrap_or_else(|| Rules::from_env().unwrap_or_default().driver_version)
}

/// The calling thread's stream-capture mode.
pub fn capture_mode() -> c_int {
    CAPTURE_MODE.with(Cell::get)
}

/// Sets the calling thread's stream-capture mode, returning the old one.
pub fn exchange_capture_mode(mode: c_int) -> c_int {
    CAPTURE_MODE.with(|m| m.replace(mode))
}

/// The calling thread's current context, if any.
pub fn current() -> Option<u64> {
    CONTEXTS.with(|s| s.borrow().last().copied())
}

impl Driver {
    fn new(rules: Rules) -> Driver {
        let devices = rules.devices as usize;
        Driver {
            memory: Memory::new(&rules),
            rules,
            calls: 0,
            next_handle: 0x10_0000,
            contexts: BTreeMap::new(),
            primary: (0..devices).map(|_| Primary::default()).collect(),
            streams: BTreeMap::new(),
            legacy: BTreeMap::new(),
            per_thread: HashMap::new(),
            events: BTreeMap::new(),
            captures: BTreeMap::new(),
            graphs: BTreeMap::new(),
            execs: BTreeMap::new(),
            host: BTreeMap::new(),
            peers: BTreeSet::new(),
        }
    }

    /// A handle never given before.
    pub fn new_handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        self.next_handle
    }

    /// `device` checked against the device count.
    pub fn device(&self, device: CuDevice) -> Call<CuDevice> {
        if (0..self.rules.devices).contains(&device) {
            Ok(device)
        } else {
            Err(CUDA_ERROR_INVALID_DEVICE)
        }
    }

    /// The calling thread's current context: `CUDA_ERROR_INVALID_CONTEXT`
    /// where none is current or it was destroyed; its sticky error where
    /// queued work faulted in it.
    pub fn context(&self) -> Call<u64> {
        let ctx = current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        self.live_context(ctx)
    }

    /// `ctx` if it is a live context without a sticky error.
    pub fn live_context(&self, ctx: u64) -> Call<u64> {
        match self.contexts.get(&ctx) {
            None => Err(CUDA_ERROR_INVALID_CONTEXT),
            Some(c) => match c.poisoned {
                Some(e) => Err(e),
                None => Ok(ctx),
            },
        }
    }

    /// The device of the current context.
    pub fn context_device(&self) -> Call<CuDevice> {
        let ctx = self.context()?;
        Ok(self.contexts.get(&ctx).map(|c| c.device).unwrap_or(0))
    }

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_retain(&mut self, device: CuDevice) -> Call<u64> {
        let device = self.device(device)?;
        let existing = self.primary[device as usize].context;
        let ctx = match existing {
            Some(c) => c,
            None => {
                let c = self.new_handle();
                self.contexts.insert(
                    c,
                    Context {
                        device,
                        primary: true,
                        poisoned: None,
                    },
                );
                self.primary[device as usize].context = Some(c);
                c
            }
        };
        self.primary[device as usize].retained += 1;
        Ok(ctx)
    }

    /// `cuDevicePrimaryCtxRelease`: the last release destroys the context.
    pub fn primary_release(&mut self, device: CuDevice) -> Call<()> {
        let device = self.device(device)?;
        let p = &mut self.primary[device as usize];
        if p.retained == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        p.retained -= 1;
        if p.retained == 0 {
            if let Some(ctx) = p.context.take() {
                self.destroy_context(ctx);
            }
        }
        Ok(())
    }

    /// `cuDevicePrimaryCtxReset`: destroys the primary context now.
    pub fn primary_reset(&mut self, device: CuDevice) -> Call<()> {
        let device = self.device(device)?;
        let p = &mut self.primary[device as usize];
        p.retained = 0;
        if let Some(ctx) = p.context.take() {
            self.destroy_context(ctx);
        }
        Ok(())
    }

    /// `cuCtxCreate`: a new context, pushed on the calling thread.
    pub fn create_context(&mut self, device: CuDevice) -> Call<u64> {
        let device = self.device(device)?;
        let ctx = self.new_handle();
        self.contexts.insert(
            ctx,
            Context {
                device,
                primary: false,
                poisoned: None,
            },
        );
        push(ctx);
        Ok(ctx)
    }

    /// `cuCtxDestroy` of a non-primary context.
    pub fn destroy_created_context(&mut self, ctx: u64) -> Call<()> {
        match self.contexts.get(&ctx) {
            Some(c) if !c.primary => {
                self.destroy_context(ctx);
                CONTEXTS.with(|s| s.borrow_mut().retain(|c| *c != ctx));
                Ok(())
            }
            Some(_) => Err(CUDA_ERROR_INVALID_CONTEXT),
            None => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    }

    /// Destroys a context with its streams and events (their handles become
    /// invalid; queued work is dropped, as when a context is torn down).
    fn destroy_context(&mut self, ctx: u64) {
        self.contexts.remove(&ctx);
        self.streams.retain(|_, s| s.context != ctx);
        self.events.retain(|_, e| e.context != ctx);
        self.legacy.remove(&ctx);
        self.per_thread.retain(|(_, c), _| *c != ctx);
        self.peers.retain(|&(from, to)| from != ctx && to != ctx);
    }

    /// Runs the queued work that is due after this call is counted.
    fn tick(&mut self) {
        self.calls += 1;
        self.run_due();
    }
}

/// `cuCtxPushCurrent`.
pub fn push(ctx: u64) {
    CONTEXTS.with(|s| s.borrow_mut().push(ctx));
}

/// `cuCtxPopCurrent`: the context popped, if any.
pub fn pop() -> Option<u64> {
    CONTEXTS.with(|s| s.borrow_mut().pop())
}

/// `cuCtxSetCurrent`: replaces the top of the stack (pops it for null).
pub fn set_current(ctx: Option<u64>) {
    CONTEXTS.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if let Some(c) = ctx {
            s.push(c);
        }
    })
}
