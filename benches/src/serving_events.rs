//! The serving events of a trace (growable buffers, tagged allocations,
//! sleep and wake; see [`crate::trace`]) on one allocator: natively on Quilt,
//! emulated on every other allocator. The emulation lives here and nowhere
//! else.
//!
//! Emulation, for an allocator without growable buffers or sleep:
//! - **Growth and shrink** allocate a block of the new length on the buffer's
//!   stream, copy the old contents (as much of them as fits) into it and free
//!   the old block: a device-to-device copy on the stream, counted in
//!   [`GrowthCopies`] and charged with the simulated device's copy figures
//!   ([`CostModel::copy_ns`] per copy plus the bytes at
//!   [`CostModel::copy_bytes_per_us`]). A buffer of length 0 holds no block.
//! - **Sleep** synchronises each stream its tag's allocations were made on
//!   (the copy must see their work complete), copies each to the host
//!   ([`quilt_vmm::Vmm::copy_to_host`], one call per GiB, as Quilt's sleep does; the
//!   simulated device counts and costs it) and frees it. **Wake** allocates
//!   each again (at a new address) and copies it back
//!   ([`quilt_vmm::Vmm::copy_from_host`]).
//!
//! Quilt ([`Target::Native`]) runs `create_growable`, `grow_to`,
//! `shrink_to`, `release_growable`, `allocate_tagged`, `sleep` (offload:
//! contents to the host) and `wake` itself; its sleep copies are the
//! driver's, in [`quilt_vmm::DriverStats::copied_bytes`].

use std::collections::{BTreeMap, BTreeSet, HashMap};

use quilt_alloc::quilt::{GrowableId, QuiltAllocator, ServingStats, SleepMode};
use quilt_alloc::{AllocError, DeviceAllocator};
use quilt_vmm::sim::CostModel;
use quilt_vmm::{DevicePtr, StreamId};

use crate::live::LiveTracker;

/// The largest single host copy of a sleep or wake (as Quilt's sleep).
pub const COPY_CHUNK: u64 = 1 << 30;

/// The allocator a replay drives, and how it runs the serving events.
#[derive(Clone, Copy)]
pub enum Target<'a> {
    /// Quilt's own growable buffers, tags, sleep and wake.
    Native(&'a QuiltAllocator),
    /// Any allocator, the serving events emulated (see the module's text).
    Emulated(&'a dyn DeviceAllocator),
}

impl<'a> Target<'a> {
    /// The allocator behind the target.
    pub fn allocator(&self) -> &'a dyn DeviceAllocator {
        match *self {
            Target::Native(q) => q,
            Target::Emulated(a) => a,
        }
    }
}

/// The device-to-device copies of emulated growth and shrink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrowthCopies {
    /// Copies made.
    pub copies: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// Their modelled time in nanoseconds (the cost model's copy figures).
    pub modelled_ns: u64,
}

impl GrowthCopies {
    /// The difference `self - earlier` (saturating).
    pub fn since(&self, earlier: &GrowthCopies) -> GrowthCopies {
        GrowthCopies {
            copies: self.copies.saturating_sub(earlier.copies),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            modelled_ns: self.modelled_ns.saturating_sub(earlier.modelled_ns),
        }
    }
}

/// Why a serving event did not happen.
#[derive(Debug)]
pub enum ServingFailure {
    /// The allocator ran out of memory (the replay ends there).
    OutOfMemory(AllocError),
    /// The allocator failed otherwise.
    Allocator(AllocError),
    /// The trace is inconsistent (an unknown id or tag, a resize out of bounds).
    BadTrace(String),
}

/// A live growable buffer.
struct Growable {
    len: u64,
    max: u64,
    stream: StreamId,
    handle: Handle,
}

/// What backs a growable buffer.
enum Handle {
    /// Quilt's buffer.
    Native(GrowableId),
    /// The block holding its contents (none at length 0).
    Emulated(Option<DevicePtr>),
}

/// A tag's allocations (trace id to stream) and whether it sleeps.
#[derive(Default)]
struct Tag {
    asleep: bool,
    members: BTreeMap<u64, StreamId>,
}

/// The live allocations of a replay by trace id: (pointer, requested size).
pub type LiveBlocks = HashMap<u64, (DevicePtr, u64)>;

/// The serving state of one replay.
pub struct Serving<'a> {
    target: Target<'a>,
    cost: CostModel,
    growables: HashMap<u64, Growable>,
    tags: HashMap<u64, Tag>,
    /// Tag of each live tagged allocation.
    tag_of: HashMap<u64, u64>,
    copies: GrowthCopies,
    /// The host side of emulated sleep copies: one buffer, never written on
    /// a device that holds no bytes (zeroed pages the OS need not back).
    scratch: Vec<u8>,
}

fn classify(e: AllocError) -> ServingFailure {
    if crate::replay::is_oom(&e) {
        ServingFailure::OutOfMemory(e)
    } else {
        ServingFailure::Allocator(e)
    }
}

impl<'a> Serving<'a> {
    /// Quilt's growable-buffer and sleep counters when the serving events run
    /// natively (`None` when they are emulated).
    pub fn native_stats(&self) -> Option<ServingStats> {
        match self.target {
            Target::Native(q) => Some(q.serving_stats()),
            Target::Emulated(_) => None,
        }
    }

    /// Nothing live, on `target`, whose device costs copies by `cost`.
    pub fn new(target: Target<'a>, cost: CostModel) -> Self {
        Serving {
            target,
            cost,
            growables: HashMap::new(),
            tags: HashMap::new(),
            tag_of: HashMap::new(),
            copies: GrowthCopies::default(),
            scratch: Vec::new(),
        }
    }

    /// The copies emulated growth made so far.
    pub fn growth_copies(&self) -> GrowthCopies {
        self.copies
    }

    /// Ids of the live growable buffers, in order.
    pub fn growable_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.growables.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Tags asleep now, in order.
    pub fn sleeping_tags(&self) -> BTreeSet<u64> {
        self.tags
            .iter()
            .filter(|(_, t)| t.asleep)
            .map(|(&k, _)| k)
            .collect()
    }

    /// Live bytes of the growable buffers (the sum of their lengths).
    pub fn growable_bytes(&self) -> u64 {
        self.growables.values().map(|g| g.len).sum()
    }

    /// True when `id` is a live growable buffer.
    pub fn is_growable(&self, id: u64) -> bool {
        self.growables.contains_key(&id)
    }

    /// The tag of the live allocation `id` when it sleeps (it may not be freed).
    pub fn sleeping_tag_of(&self, id: u64) -> Option<u64> {
        let tag = *self.tag_of.get(&id)?;
        self.tags.get(&tag).filter(|t| t.asleep).map(|_| tag)
    }

    /// Create growable buffer `id` of at most `max` bytes on `stream`.
    pub fn create(&mut self, id: u64, max: u64, stream: u64) -> Result<(), ServingFailure> {
        if self.growables.contains_key(&id) {
            return Err(ServingFailure::BadTrace(format!(
                "growable id {id} created while live"
            )));
        }
        let stream = StreamId(stream);
        let handle = match self.target {
            Target::Native(q) => Handle::Native(q.create_growable(max, stream).map_err(classify)?),
            Target::Emulated(_) => Handle::Emulated(None),
        };
        self.growables.insert(
            id,
            Growable {
                len: 0,
                max,
                stream,
                handle,
            },
        );
        Ok(())
    }

    /// Resize buffer `id` to `bytes` (a grow when `grow`, else a shrink),
    /// keeping `tracker`'s live bytes. Out of memory leaves it as it was.
    pub fn resize(
        &mut self,
        id: u64,
        bytes: u64,
        grow: bool,
        tracker: &mut LiveTracker,
    ) -> Result<(), ServingFailure> {
        let what = if grow { "grow" } else { "shrink" };
        let Some(g) = self.growables.get_mut(&id) else {
            return Err(ServingFailure::BadTrace(format!(
                "{what} of id {id}, which is not a live growable buffer"
            )));
        };
        if (grow && (bytes < g.len || bytes > g.max)) || (!grow && bytes > g.len) {
            return Err(ServingFailure::BadTrace(format!(
                "{what} of id {id} to {bytes} bytes (length {}, maximum {})",
                g.len, g.max
            )));
        }
        if bytes == g.len {
            return Ok(());
        }
        match (&mut g.handle, self.target) {
            (Handle::Native(gid), Target::Native(q)) => {
                if grow {
                    q.grow_to(*gid, bytes)
                } else {
                    q.shrink_to(*gid, bytes)
                }
                .map_err(classify)?;
            }
            (Handle::Emulated(block), target) => {
                let alloc = target.allocator();
                let fresh = if bytes > 0 {
                    Some(alloc.allocate(bytes, g.stream).map_err(classify)?.ptr)
                } else {
                    None
                };
                if let Some(old) = *block {
                    if let Err(e) = alloc.free(old) {
                        // The buffer stays as it was: its old block.
                        if let Some(f) = fresh {
                            alloc.free(f).map_err(ServingFailure::Allocator)?;
                        }
                        return Err(ServingFailure::Allocator(e));
                    }
                    let kept = g.len.min(bytes);
                    if fresh.is_some() && kept > 0 {
                        self.copies.copies += 1;
                        self.copies.bytes += kept;
                        self.copies.modelled_ns += self
                            .cost
                            .copy_ns
                            .saturating_add(self.cost.copy_bytes_ns(kept));
                    }
                }
                *block = fresh;
            }
            (Handle::Native(_), Target::Emulated(_)) => {
                return Err(ServingFailure::BadTrace(format!(
                    "growable id {id} was created on another allocator"
                )));
            }
        }
        tracker.remove(g.len);
        tracker.add(bytes);
        g.len = bytes;
        Ok(())
    }

    /// Release buffer `id`.
    pub fn release(&mut self, id: u64, tracker: &mut LiveTracker) -> Result<(), ServingFailure> {
        let Some(g) = self.growables.remove(&id) else {
            return Err(ServingFailure::BadTrace(format!(
                "release of id {id}, which is not a live growable buffer"
            )));
        };
        match (g.handle, self.target) {
            (Handle::Native(gid), Target::Native(q)) => {
                q.release_growable(gid).map_err(ServingFailure::Allocator)?
            }
            (Handle::Emulated(Some(ptr)), target) => target
                .allocator()
                .free(ptr)
                .map_err(ServingFailure::Allocator)?,
            _ => {}
        }
        tracker.remove(g.len);
        Ok(())
    }

    /// Allocate `size` bytes on `stream` carrying `tag` (the caller records
    /// the allocation as live and calls [`Serving::forget`] when it frees it).
    pub fn allocate_tagged(
        &mut self,
        id: u64,
        size: u64,
        stream: u64,
        tag: u64,
    ) -> Result<DevicePtr, ServingFailure> {
        let entry = self.tags.entry(tag).or_default();
        if entry.asleep {
            return Err(ServingFailure::BadTrace(format!(
                "allocation carrying tag {tag}, which sleeps"
            )));
        }
        let stream = StreamId(stream);
        let ptr = match self.target {
            Target::Native(q) => q.allocate_tagged(size, stream, &tag.to_string()),
            Target::Emulated(a) => a.allocate(size, stream),
        }
        .map_err(classify)?
        .ptr;
        entry.members.insert(id, stream);
        self.tag_of.insert(id, tag);
        Ok(ptr)
    }

    /// The allocation `id` was freed: it leaves its tag, if it had one.
    pub fn forget(&mut self, id: u64) {
        if let Some(tag) = self.tag_of.remove(&id) {
            if let Some(t) = self.tags.get_mut(&tag) {
                t.members.remove(&id);
            }
        }
    }

    /// Put `tag` to sleep: its allocations' bytes leave `tracker`'s live set.
    pub fn sleep(
        &mut self,
        tag: u64,
        live: &mut LiveBlocks,
        tracker: &mut LiveTracker,
    ) -> Result<(), ServingFailure> {
        let t = self.tag_state(tag, false)?;
        let members: Vec<(u64, StreamId)> = t.members.iter().map(|(&k, &s)| (k, s)).collect();
        match self.target {
            Target::Native(q) => q
                .sleep(&tag.to_string(), SleepMode::Offload)
                .map_err(classify)?,
            Target::Emulated(a) => {
                let streams: BTreeSet<StreamId> = members.iter().map(|m| m.1).collect();
                for s in streams {
                    a.vmm()
                        .stream_synchronize(s)
                        .map_err(|e| ServingFailure::Allocator(AllocError::Driver(e)))?;
                }
                for &(id, _) in &members {
                    let &(ptr, size) = live.get(&id).ok_or_else(|| {
                        ServingFailure::BadTrace(format!("tagged id {id} is not live"))
                    })?;
                    self.copy(ptr, size, true)?;
                    a.free(ptr).map_err(ServingFailure::Allocator)?;
                }
            }
        }
        for (id, _) in &members {
            if let Some(&(_, size)) = live.get(id) {
                tracker.remove(size);
            }
        }
        if let Some(t) = self.tags.get_mut(&tag) {
            t.asleep = true;
        }
        Ok(())
    }

    /// Wake `tag`: its allocations' bytes are live again (on an emulated
    /// allocator at new addresses, written into `live`).
    pub fn wake(
        &mut self,
        tag: u64,
        live: &mut LiveBlocks,
        tracker: &mut LiveTracker,
    ) -> Result<(), ServingFailure> {
        let t = self.tag_state(tag, true)?;
        let members: Vec<(u64, StreamId)> = t.members.iter().map(|(&k, &s)| (k, s)).collect();
        match self.target {
            Target::Native(q) => q.wake(&tag.to_string()).map_err(classify)?,
            Target::Emulated(a) => {
                for &(id, stream) in &members {
                    let Some(entry) = live.get_mut(&id) else {
                        return Err(ServingFailure::BadTrace(format!(
                            "tagged id {id} is not live"
                        )));
                    };
                    let size = entry.1;
                    let ptr = a.allocate(size, stream).map_err(classify)?.ptr;
                    entry.0 = ptr;
                    // Its bytes are live again once backed, whatever follows.
                    tracker.add(size);
                    self.copy(ptr, size, false)?;
                }
            }
        }
        if let Target::Native(_) = self.target {
            for (id, _) in &members {
                if let Some(&(_, size)) = live.get(id) {
                    tracker.add(size);
                }
            }
        }
        if let Some(t) = self.tags.get_mut(&tag) {
            t.asleep = false;
        }
        Ok(())
    }

    /// The tag `tag`, which must sleep (`asleep`) or be awake.
    fn tag_state(&self, tag: u64, asleep: bool) -> Result<&Tag, ServingFailure> {
        match self.tags.get(&tag) {
            None => Err(ServingFailure::BadTrace(format!(
                "tag {tag}, which no allocation carried"
            ))),
            Some(t) if t.asleep != asleep => Err(ServingFailure::BadTrace(format!(
                "{} of tag {tag}, which {}",
                if asleep { "wake" } else { "sleep" },
                if asleep { "is awake" } else { "sleeps already" }
            ))),
            Some(t) => Ok(t),
        }
    }

    /// Copy `size` bytes at `ptr` to the host (`out`) or back, a call per
    /// [`COPY_CHUNK`], through the emulated allocator's device.
    fn copy(&mut self, ptr: DevicePtr, size: u64, out: bool) -> Result<(), ServingFailure> {
        let Target::Emulated(a) = self.target else {
            return Ok(());
        };
        let chunk = size.min(COPY_CHUNK) as usize;
        if self.scratch.len() < chunk {
            self.scratch = vec![0u8; chunk];
        }
        let mut done = 0u64;
        while done < size {
            let n = (size - done).min(COPY_CHUNK) as usize;
            let buf = &mut self.scratch[..n];
            let at = ptr + done;
            if out {
                a.vmm().copy_to_host(at, buf)
            } else {
                a.vmm().copy_from_host(at, buf)
            }
            .map_err(|e| ServingFailure::Allocator(AllocError::Driver(e)))?;
            done += n as u64;
        }
        Ok(())
    }
}
