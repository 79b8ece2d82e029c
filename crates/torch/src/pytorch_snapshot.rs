//! Snapshots in the layout of `torch.cuda.memory._snapshot()`, as a pickle
//! that PyTorch's memory viewer and `torch.cuda._memory_viz` read.
//!
//! How Quilt's memory is shown: one segment per maximal run of mapped pages
//! on one stream (a virtual range backed end to end; runs of two arenas that
//! happen to be adjacent are one segment, as PyTorch's viewer merges them),
//! tiled exactly by its blocks: live blocks `active_allocated`, the free
//! pieces between them `inactive`. Unmapped virtual space is not shown. The pool's pages that are held but
//! mapped nowhere (the growth margin, pages reclaimed and not yet reused)
//! make one more segment of their own at address 0, wholly `inactive`, so
//! that the segments add up to the reserved bytes, as in PyTorch.
//! `device_traces` holds the recorded history (`quilt_record_history`),
//! with its `segment_map` entries split where PyTorch's viewer replays the
//! segments in pieces ([`viewer_replay::for_viewer`]).

pub mod viewer_replay;

use std::collections::BTreeMap;

use quilt_alloc::{BlockState, DeviceAllocator, MemorySnapshot, SegmentInfo};
use serde_pickle::{HashableValue, Value};

use crate::history::{Run, TraceEntry};

/// `snap`'s segments with adjacent ones of the same stream joined: the
/// segments a snapshot shows, and the [`Run`]s of the history.
pub fn joined(snap: MemorySnapshot) -> MemorySnapshot {
    let mut segments: Vec<SegmentInfo> = Vec::with_capacity(snap.segments.len());
    for s in snap.segments {
        match segments.last_mut() {
            Some(p) if p.address + p.total_size == s.address && p.stream == s.stream => {
                p.total_size += s.total_size;
                p.mapped_size += s.mapped_size;
                p.blocks.extend(s.blocks);
            }
            _ => segments.push(s),
        }
    }
    MemorySnapshot {
        allocator: snap.allocator,
        segments,
    }
}

/// The runs of mapped memory of `alloc`: its [`joined`] GPU segments.
pub fn runs_of(alloc: &dyn DeviceAllocator) -> Vec<Run> {
    joined(alloc.gpu_segments())
        .segments
        .iter()
        .map(|s| Run {
            addr: s.address,
            size: s.total_size,
            stream: s.stream.0,
        })
        .collect()
}

/// One device's memory for a snapshot.
pub struct DeviceMemory {
    /// The device index.
    pub device: i32,
    /// Its segments as the GPU sees them ([`DeviceAllocator::gpu_segments`]).
    pub segments: MemorySnapshot,
    /// Bytes reserved beyond those segments (Quilt: pool pages mapped nowhere).
    pub unmapped_pool_bytes: u64,
}

impl DeviceMemory {
    /// The memory of `alloc` as device `device`: its
    /// [`gpu_segments`](DeviceAllocator::gpu_segments), and what it reserves
    /// beyond them.
    pub fn of(device: i32, alloc: &dyn DeviceAllocator) -> DeviceMemory {
        let segments = joined(alloc.gpu_segments());
        let shown: u64 = segments.segments.iter().map(|s| s.total_size).sum();
        DeviceMemory {
            device,
            unmapped_pool_bytes: alloc.stats().reserved_bytes.current.saturating_sub(shown),
            segments,
        }
    }
}

/// A snapshot pickle of one allocator as device 0, with no history (what
/// `quilt-bench ab --export-snapshot` writes).
pub fn pickle_of(alloc: &dyn DeviceAllocator) -> Result<Vec<u8>, String> {
    let value = snapshot(&[DeviceMemory::of(0, alloc)], &BTreeMap::new(), "");
    serde_pickle::value_to_vec(&value, serde_pickle::SerOptions::new())
        .map_err(|e| format!("encoding the snapshot: {e}"))
}

fn key(k: &str) -> HashableValue {
    HashableValue::String(k.to_string())
}

fn int(v: u64) -> Value {
    Value::I64(i64::try_from(v).unwrap_or(i64::MAX))
}

fn dict(entries: Vec<(&str, Value)>) -> Value {
    Value::Dict(entries.into_iter().map(|(k, v)| (key(k), v)).collect())
}

/// The one frame of an entry or a block: the C function it came from (no
/// Python stack is recorded).
fn frames(function: &str) -> Value {
    Value::List(vec![dict(vec![
        (
            "filename",
            Value::String("libquilt_torch.so (no Python stack recorded)".into()),
        ),
        ("line", Value::I64(0)),
        ("name", Value::String(function.to_string())),
    ])])
}

fn pool_id() -> Value {
    Value::Tuple(vec![Value::I64(0), Value::I64(0)])
}

fn block(address: u64, size: u64, requested: u64, state: &str) -> Value {
    let from = if state == "inactive" {
        Value::List(Vec::new())
    } else {
        frames("quilt_malloc")
    };
    dict(vec![
        ("address", int(address)),
        ("size", int(size)),
        ("requested_size", int(requested)),
        ("state", Value::String(state.to_string())),
        ("frames", from),
    ])
}

fn segment(device: i32, address: u64, stream: u64, blocks: Vec<(u64, u64, u64, &str)>) -> Value {
    let total: u64 = blocks.iter().map(|b| b.1).sum();
    let allocated: u64 = blocks
        .iter()
        .filter(|b| b.3 == "active_allocated")
        .map(|b| b.1)
        .sum();
    let requested: u64 = blocks
        .iter()
        .filter(|b| b.3 == "active_allocated")
        .map(|b| b.2)
        .sum();
    dict(vec![
        ("device", Value::I64(i64::from(device))),
        ("address", int(address)),
        ("total_size", int(total)),
        ("allocated_size", int(allocated)),
        ("active_size", int(allocated)),
        ("requested_size", int(requested)),
        ("stream", int(stream)),
        ("segment_type", Value::String("large".into())),
        ("segment_pool_id", pool_id()),
        ("is_expandable", Value::Bool(true)),
        ("frames", frames("quilt_malloc")),
        (
            "blocks",
            Value::List(
                blocks
                    .into_iter()
                    .map(|(a, s, r, st)| block(a, s, r, st))
                    .collect(),
            ),
        ),
    ])
}

/// One history entry as PyTorch writes it: `device_free` instead of `addr`
/// on `oom`.
fn trace_entry(t: &TraceEntry) -> Value {
    let addr_key = if t.action == "oom" {
        "device_free"
    } else {
        "addr"
    };
    dict(vec![
        ("action", Value::String(t.action.to_string())),
        (addr_key, int(t.addr)),
        ("size", int(t.size)),
        ("stream", int(t.stream)),
        ("time_us", int(t.time_us)),
        ("frames", frames(t.source)),
        ("pool_id", pool_id()),
        ("user_metadata", Value::String(String::new())),
        ("compile_context", Value::String("N/A".into())),
    ])
}

/// What PyTorch's viewer starts its replay of `memory`'s device from: the
/// segments a snapshot shows (the pool's unmapped pages as the segment at
/// address 0 included) and the live blocks, those of a private pool's
/// segment as `pool_live` gives them for its address (the pool's blocks
/// handed out, as address and bytes asked for).
pub fn viewer_start(
    memory: &DeviceMemory,
    pool_live: impl Fn(u64) -> Option<Vec<(u64, u64)>>,
) -> viewer_replay::ViewerStart {
    let mut start = viewer_replay::ViewerStart::default();
    for s in &memory.segments.segments {
        start.segments.push(Run {
            addr: s.address,
            size: s.total_size,
            stream: s.stream.0,
        });
        for b in &s.blocks {
            match b.state {
                BlockState::Active => match pool_live(b.address) {
                    Some(live) => start.blocks.extend(live),
                    None => start.blocks.push((b.address, b.requested)),
                },
                BlockState::PendingFree => start.blocks.push((b.address, b.requested)),
                BlockState::Inactive | BlockState::Unmapped => {}
            }
        }
    }
    if memory.unmapped_pool_bytes > 0 {
        start.segments.push(Run {
            addr: 0,
            size: memory.unmapped_pool_bytes,
            stream: 0,
        });
    }
    start
}

/// The snapshot of `devices` with the history `traces`, as a pickle value;
/// `conf` is `QUILT_ALLOC_CONF`'s text, for `allocator_settings`.
pub fn snapshot(
    devices: &[DeviceMemory],
    traces: &BTreeMap<i32, Vec<TraceEntry>>,
    conf: &str,
) -> Value {
    let shown: BTreeMap<i32, viewer_replay::ViewerStart> = devices
        .iter()
        .map(|d| (d.device, viewer_start(d, |_| None)))
        .collect();
    let traces = viewer_replay::for_viewer(traces, &shown);
    let mut segments = Vec::new();
    for d in devices {
        for s in &d.segments.segments {
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    let state = match b.state {
                        BlockState::Active => "active_allocated",
                        BlockState::PendingFree => "active_pending_free",
                        BlockState::Inactive | BlockState::Unmapped => "inactive",
                    };
                    (b.address, b.size, b.requested, state)
                })
                .collect();
            segments.push(segment(d.device, s.address, s.stream.0, blocks));
        }
        if d.unmapped_pool_bytes > 0 {
            segments.push(segment(
                d.device,
                0,
                0,
                vec![(0, d.unmapped_pool_bytes, 0, "inactive")],
            ));
        }
    }
    let top_device = devices
        .iter()
        .map(|d| d.device)
        .chain(traces.keys().copied())
        .max()
        .unwrap_or(0)
        .max(0);
    let device_traces = (0..=top_device)
        .map(|d| {
            Value::List(
                traces
                    .get(&d)
                    .map(|entries| entries.iter().map(trace_entry).collect())
                    .unwrap_or_default(),
            )
        })
        .collect();
    let settings = dict(vec![
        ("PYTORCH_CUDA_ALLOC_CONF", Value::String(String::new())),
        ("QUILT_ALLOC_CONF", Value::String(conf.to_string())),
        ("max_split_size", Value::I64(-1)),
        ("garbage_collection_threshold", Value::F64(0.0)),
        ("expandable_segments", Value::Bool(true)),
        ("pinned_num_register_threads", Value::I64(1)),
        ("release_lock_on_cudamalloc", Value::Bool(false)),
        ("pinned_use_cuda_host_register", Value::Bool(false)),
        ("roundup_power2_divisions", Value::Dict(BTreeMap::new())),
    ]);
    dict(vec![
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(device_traces)),
        ("allocator_settings", settings),
        ("external_annotations", Value::List(Vec::new())),
        ("host_segments", Value::List(Vec::new())),
        ("host_traces", Value::List(Vec::new())),
    ])
}
