//! Blocks, segments and block pools of the PyTorch-style caching allocator
//! (reference §2).

use std::collections::BTreeMap;

use quilt_vmm::{DevicePtr, PhysHandle, StreamId};

use super::config::PoolKind;

/// Index of a block in the block slab.
pub(crate) type BlockId = usize;
/// Index of a segment in the segment slab.
pub(crate) type SegId = usize;

/// A vector with reusable slots: an id stays valid until removed. Removed slots
/// keep their stale value until reused, so indexing never fails for an id this
/// slab handed out (an id that was removed is an allocator bug, caught by the
/// invariant checker through [`Slab::contains`]).
#[derive(Debug)]
pub(crate) struct Slab<T> {
    items: Vec<T>,
    occupied: Vec<bool>,
    vacant: Vec<usize>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            items: Vec::new(),
            occupied: Vec::new(),
            vacant: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Store `item`, returning its id.
    pub fn insert(&mut self, item: T) -> usize {
        self.len += 1;
        match self.vacant.pop() {
            Some(id) => {
                self.items[id] = item;
                self.occupied[id] = true;
                id
            }
            None => {
                self.items.push(item);
                self.occupied.push(true);
                self.items.len() - 1
            }
        }
    }

    /// Remove the item `id` (a no-op for an id that is not stored).
    pub fn remove(&mut self, id: usize) {
        if self.contains(id) {
            self.occupied[id] = false;
            self.len -= 1;
            self.vacant.push(id);
        }
    }

    /// True if `id` names a stored item.
    pub fn contains(&self, id: usize) -> bool {
        self.occupied.get(id).copied().unwrap_or(false)
    }

    /// Number of items stored.
    #[cfg(feature = "invariants")]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Every `(id, item)` stored.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> {
        self.items
            .iter()
            .zip(self.occupied.iter())
            .enumerate()
            .filter_map(|(i, (t, &o))| o.then_some((i, t)))
    }
}

impl<T> std::ops::Index<usize> for Slab<T> {
    type Output = T;
    fn index(&self, id: usize) -> &T {
        &self.items[id]
    }
}

impl<T> std::ops::IndexMut<usize> for Slab<T> {
    fn index_mut(&mut self, id: usize) -> &mut T {
        &mut self.items[id]
    }
}

/// A block: an address range inside one segment.
///
/// States: *allocated* (handed out), *pending free* (`!allocated`,
/// `event_count > 0`: freed by the caller, waiting on other streams' events),
/// *free* (`!allocated`, `event_count == 0`; in its pool's `blocks` when mapped,
/// in `unmapped` otherwise). `stream_uses` is empty unless allocated.
#[derive(Clone, Debug)]
pub(crate) struct Block {
    /// First byte.
    pub ptr: DevicePtr,
    /// Bytes.
    pub size: u64,
    /// Bytes the current user asked for (0 when free).
    pub requested: u64,
    /// The stream the segment belongs to (fixed for the block's life).
    pub stream: StreamId,
    /// The pool.
    pub pool: PoolKind,
    /// The segment that holds it.
    pub segment: SegId,
    /// Handed out to a caller.
    pub allocated: bool,
    /// Backed by physical memory (always true outside expandable segments).
    pub mapped: bool,
    /// Outstanding events recorded at free time.
    pub event_count: u32,
    /// Streams recorded with `record_stream` (a set; never the block's own stream).
    pub stream_uses: Vec<StreamId>,
    /// Address-adjacent block before it in the same segment.
    pub prev: Option<BlockId>,
    /// Address-adjacent block after it in the same segment.
    pub next: Option<BlockId>,
    /// The pool's get-free-block clock when the block entered the pool (GC age).
    pub gc_count_base: u64,
    /// The block's start was handed out to a caller (so a free naming it again
    /// is a double free, not an unknown pointer).
    pub handed_out: bool,
}

impl Block {
    /// A free block with no neighbours, no events and no recorded streams: the
    /// one shape every new block takes (callers set `prev`/`next` with struct
    /// update syntax where it has neighbours).
    pub fn free(
        ptr: DevicePtr,
        size: u64,
        stream: StreamId,
        pool: PoolKind,
        segment: SegId,
        mapped: bool,
    ) -> Block {
        Block {
            ptr,
            size,
            requested: 0,
            stream,
            pool,
            segment,
            allocated: false,
            mapped,
            event_count: 0,
            stream_uses: Vec::new(),
            prev: None,
            next: None,
            gc_count_base: 0,
            handed_out: false,
        }
    }

    /// A block that shares its segment with a neighbour.
    pub fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }

    /// Free and not waiting on any event: may be merged or handed out.
    pub fn is_free(&self) -> bool {
        !self.allocated && self.event_count == 0 && self.stream_uses.is_empty()
    }

    /// One past the last byte.
    pub fn end(&self) -> DevicePtr {
        self.ptr + self.size
    }
}

/// What a segment is backed by.
#[derive(Clone, Debug)]
pub(crate) enum SegmentKind {
    /// A `cudaMalloc`: one reservation, one handle, one mapping of `phys_size`
    /// bytes (the segment size rounded up to the driver's granularity).
    Classic {
        /// The physical handle.
        handle: PhysHandle,
        /// Bytes reserved, created and mapped.
        phys_size: u64,
    },
    /// An expandable segment: a large reservation mapped page by page, one
    /// handle per page.
    Expandable {
        /// Page size.
        page: u64,
        /// Handle of each page, `None` where unmapped.
        handles: Vec<Option<PhysHandle>>,
    },
}

/// A segment: one `cudaMalloc` result or one expandable virtual range.
#[derive(Clone, Debug)]
pub(crate) struct Segment {
    /// Start of the range.
    pub base: DevicePtr,
    /// Bytes of the range (classic: the segment size PyTorch counts as reserved).
    pub size: u64,
    /// Owning stream.
    pub stream: StreamId,
    /// Owning pool.
    pub pool: PoolKind,
    /// Backing.
    pub kind: SegmentKind,
}

impl Segment {
    /// True for an expandable segment.
    pub fn is_expandable(&self) -> bool {
        matches!(self.kind, SegmentKind::Expandable { .. })
    }
}

/// Key of the free-block set: `(stream, size, address)`, so a lower bound on
/// `(stream, size, 0)` is the best fit on that stream.
pub(crate) type SizeKey = (StreamId, u64, DevicePtr);

/// One pool (small or large): its free mapped blocks and its unmapped ranges.
#[derive(Debug, Default)]
pub(crate) struct BlockPool {
    /// Free mapped blocks by `(stream, size, ptr)`.
    pub blocks: BTreeMap<SizeKey, BlockId>,
    /// Unmapped expandable ranges by `(stream, ptr)`.
    pub unmapped: BTreeMap<(StreamId, DevicePtr), BlockId>,
    /// `get_free_blocks_call_count`: the GC clock.
    pub get_free_blocks_call_count: u64,
}

/// The key of `block` in [`BlockPool::blocks`].
pub(crate) fn size_key(block: &Block) -> SizeKey {
    (block.stream, block.size, block.ptr)
}
