//! # Quilt: the stitching allocator
//!
//! Virtual arenas carved at 512-byte granularity, backed page by page from
//! the physical page pool (`quilt-pool`): a block's pages come from wherever
//! the pool has them, so a request fails only when memory is really short.
//!
//! The files, bottom up (each imports only files below it; `docs/design.md`
//! §1 draws the picture):
//!
//! | layer | files |
//! |---|---|
//! | pure pieces | `gap_index` (gaps by size), `tiling` (gaps and blocks of an arena), `page_table` (an arena's pages, a column per field), `arena` (the two together), `streams` (what each stream's work has reached), `config` (the policy as types) |
//! | the stitching core | `stitch` (arenas, blocks, the cached-page queue, retired pages, page hazards, frozen arenas), `placement` (where a block goes), `backing` (pages behind it), `reclaim` (cached pages back to the pool), `solo` (hazards left unbuilt while one stream allocates alone) |
//! | features | `growable` (growable buffers), `sleep` (tags, sleep and wake), `offload` (the offload tier), `export` (export pins), `snapshot`, `invariants` |
//! | the allocator | `allocator` (one lock over the core, the features and the policy), `serving` (its serving API), `ahead` (the map-ahead worker), `growable_buffer` (the owning handle) |

mod ahead;
mod allocator;
mod arena;
mod backing;
mod config;
mod export;
mod gap_index;
mod growable;
mod growable_buffer;
mod held;
#[cfg(feature = "invariants")]
mod invariants;
mod offload;
mod own;
mod page_table;
mod peers;
mod placement;
mod pressure;
mod reclaim;
mod segments;
mod serving;
mod sleep;
mod solo;
mod stitch;
mod streams;
mod tiling;

pub use crate::stats::ServingStats;
pub use allocator::{LiveBlock, QuiltAllocator};
pub use config::{
    AccessGranularity, AheadMode, ArenaLayout, ArenaSharing, EventTiming, MapAhead, OffloadTier,
    Placement, QuiltConfig, ReclaimPolicy, Recycle, SmallBlocks,
};
pub use growable::{GrowableId, GrowableInfo};
pub use growable_buffer::GrowableBuffer;
pub use quilt_pool::{GrowthPolicy, MemoryLimit, PageSize, PoolConfig, PoolStats};
pub use sleep::{SleepMode, SleepPages};
