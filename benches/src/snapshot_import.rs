//! Import of PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`
//! pickles) as traces.
//!
//! The recipe is section 8.5 of `shared/reference/pytorch-caching-allocator.md`:
//!
//! 1. Take `device_traces[device]` and the segments of that device.
//! 2. The initial live set (allocations made before the recorded window) is every
//!    `free_completed` whose address has no live allocation from the trace, plus
//!    every block of a segment in state `active_allocated` (or
//!    `active_pending_free`) whose address never appears in an `alloc` or
//!    `free_completed` entry. They are emitted first, ordered by address.
//! 3. Walking the trace: `alloc` emits an allocation of the unrounded `size` under
//!    a fresh id; `free_completed` emits the free of the allocation live at that
//!    address (the moment the allocator really got the block back). Every other
//!    action (`free_requested`, `segment_*`, `oom`, `snapshot`, annotations) is
//!    ground truth for validation, not an event.
//!
//! Ids are `0, 1, 2, ...` in order of emission. Streams are renumbered: raw stream
//! 0 is stream 0, every other raw stream gets `1, 2, ...` in order of first
//! appearance among the emitted events.
//!
//! Malformed input (not a pickle, a missing or mistyped field, a size of 0 or
//! past [`quilt_alloc::MAX_ALLOCATION`], an `alloc` at an address that is already
//! live, a free of an address that lies in no segment the snapshot knows of, or
//! the second free of an address) is a [`TraceError::Snapshot`] naming the entry;
//! nothing here panics on any input.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use serde_pickle::{DeOptions, HashableValue, Value};

use crate::trace::{Event, Trace, TraceError};

/// One entry of `device_traces[d]`, reduced to what the importer needs.
struct TraceEntry {
    action: String,
    addr: u64,
    size: u64,
    stream: u64,
}

/// One block of a segment that a live allocation occupies.
struct LiveBlock {
    address: u64,
    requested: u64,
    stream: u64,
}

/// Read a snapshot pickle and import device 0. The trace's name is the file stem.
pub fn load_snapshot(path: &Path) -> Result<Trace, TraceError> {
    let bytes = std::fs::read(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    import_snapshot(&bytes, &name, 0)
}

/// Stack reserved for the thread that decodes a pickle. `serde-pickle` builds and
/// drops nested values recursively, about 1 KiB of stack per level, so the 2 MiB
/// of an ordinary thread overflow (and abort the process) at a few thousand
/// levels. This reserve is virtual memory, touched only as deep as the input
/// nests: it takes about half a million levels, far beyond any real snapshot.
const DECODE_STACK_BYTES: usize = 512 << 20;

/// Import the pickled snapshot `bytes` for device `device` as a trace named `name`.
///
/// The import runs on its own thread with `DECODE_STACK_BYTES` of stack, and a
/// panic inside `serde-pickle` (it panics on some malformed input, such as a set
/// holding NaN) becomes a [`TraceError::Snapshot`]: bad input never takes the
/// caller down.
pub fn import_snapshot(bytes: &[u8], name: &str, device: usize) -> Result<Trace, TraceError> {
    std::thread::scope(|scope| {
        let decoder = std::thread::Builder::new()
            .name("snapshot-import".into())
            .stack_size(DECODE_STACK_BYTES)
            .spawn_scoped(scope, || import_snapshot_here(bytes, name, device))
            .map_err(|e| snap(format!("cannot start the decoding thread: {e}")))?;
        decoder.join().unwrap_or_else(|payload| {
            let why = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown cause".into());
            Err(snap(format!(
                "not a readable pickle: the decoder panicked: {why}"
            )))
        })
    })
}

/// [`import_snapshot`] on the calling thread.
fn import_snapshot_here(bytes: &[u8], name: &str, device: usize) -> Result<Trace, TraceError> {
    let value = serde_pickle::value_from_slice(
        bytes,
        DeOptions::new()
            .replace_unresolved_globals()
            .replace_recursive_structures(),
    )
    .map_err(|e| snap(format!("not a readable pickle: {e}")))?;
    let top = as_dict(&value, "the top-level object")?;

    let traces = list_field(top, "device_traces", "the top-level dict")?;
    let entries_value = match traces.get(device) {
        Some(v) => v,
        None if traces.is_empty() && device == 0 => &Value::List(Vec::new()),
        None => {
            return Err(snap(format!(
                "device_traces has {} device(s); device {device} is not among them",
                traces.len()
            )))
        }
    };
    let raw_entries = as_list(entries_value, &format!("device_traces[{device}]"))?;
    let mut entries = Vec::with_capacity(raw_entries.len());
    for (i, raw) in raw_entries.iter().enumerate() {
        entries.push(read_entry(raw, device, i)?);
    }

    let segments = read_segments(top, device)?;
    build_events(name, &entries, &segments, device)
}

/// Segments of `device`: their address ranges and the blocks live in them.
struct Segments {
    ranges: Vec<(u64, u64)>,
    live_blocks: Vec<LiveBlock>,
}

fn read_segments(
    top: &BTreeMap<HashableValue, Value>,
    device: usize,
) -> Result<Segments, TraceError> {
    let mut out = Segments {
        ranges: Vec::new(),
        live_blocks: Vec::new(),
    };
    let list = match get(top, "segments") {
        Some(v) => as_list(v, "segments")?,
        None => return Ok(out),
    };
    for (si, seg_value) in list.iter().enumerate() {
        let what = format!("segments[{si}]");
        let seg = as_dict(seg_value, &what)?;
        let seg_device = match get(seg, "device") {
            Some(v) => int(v, &what, "device")?,
            None => 0,
        };
        if seg_device != device as u64 {
            continue;
        }
        let address = int_field(seg, &what, "address")?;
        let total = int_field(seg, &what, "total_size")?;
        let stream = match get(seg, "stream") {
            Some(v) => int(v, &what, "stream")?,
            None => 0,
        };
        let end = address.checked_add(total).ok_or_else(|| {
            snap(format!(
                "{what}: address {address:#x} + total_size {total} overflows"
            ))
        })?;
        out.ranges.push((address, end));
        let blocks = match get(seg, "blocks") {
            Some(v) => as_list(v, &format!("{what}.blocks"))?,
            None => &[][..],
        };
        for (bi, block_value) in blocks.iter().enumerate() {
            let bwhat = format!("{what}.blocks[{bi}]");
            let block = as_dict(block_value, &bwhat)?;
            let state = str_field(block, &bwhat, "state")?;
            if state != "active_allocated" && state != "active_pending_free" {
                continue;
            }
            let baddr = int_field(block, &bwhat, "address")?;
            let requested = match get(block, "requested_size") {
                Some(v) => int(v, &bwhat, "requested_size")?,
                None => int_field(block, &bwhat, "size")?,
            };
            check_alloc_size(requested, &bwhat)?;
            out.live_blocks.push(LiveBlock {
                address: baddr,
                requested,
                stream,
            });
        }
    }
    Ok(out)
}

fn build_events(
    name: &str,
    entries: &[TraceEntry],
    segments: &Segments,
    device: usize,
) -> Result<Trace, TraceError> {
    // Every address range the snapshot knows a segment for: the final segments and
    // every segment created or destroyed in the window.
    let mut ranges = segments.ranges.clone();
    for e in entries {
        if e.action.starts_with("segment_") {
            if let Some(end) = e.addr.checked_add(e.size) {
                ranges.push((e.addr, end));
            }
        }
    }
    let known = |addr: u64| ranges.iter().any(|&(lo, hi)| lo <= addr && addr < hi);

    // Pass 1: find the allocations live before the window.
    let mut live: HashSet<u64> = HashSet::new();
    let mut touched: HashSet<u64> = HashSet::new();
    let mut freed_pre: HashSet<u64> = HashSet::new();
    let mut pre: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // addr -> (size, raw stream)
    for (i, e) in entries.iter().enumerate() {
        let what = || format!("device_traces[{device}][{i}] ({})", e.action);
        match e.action.as_str() {
            "alloc" => {
                check_alloc_size(e.size, &what())?;
                if !live.insert(e.addr) {
                    return Err(snap(format!(
                        "{}: alloc at {:#x}, which is already live",
                        what(),
                        e.addr
                    )));
                }
                touched.insert(e.addr);
            }
            "free_completed" => {
                touched.insert(e.addr);
                if live.remove(&e.addr) {
                    continue;
                }
                if !known(e.addr) {
                    return Err(snap(format!(
                        "{}: free of unknown address {:#x} (no allocation there and no segment holds it)",
                        what(),
                        e.addr
                    )));
                }
                if !freed_pre.insert(e.addr) {
                    return Err(snap(format!(
                        "{}: second free of address {:#x} with no allocation between",
                        what(),
                        e.addr
                    )));
                }
                check_alloc_size(e.size, &what())?;
                pre.insert(e.addr, (e.size, e.stream));
            }
            _ => {}
        }
    }
    for b in &segments.live_blocks {
        if !touched.contains(&b.address) && !pre.contains_key(&b.address) {
            pre.insert(b.address, (b.requested, b.stream));
        }
    }

    // Pass 2: emit.
    let mut streams: HashMap<u64, u64> = HashMap::new();
    let mut renumber = |raw: u64| -> u64 {
        if raw == 0 {
            return 0;
        }
        let next = streams.len() as u64 + 1;
        *streams.entry(raw).or_insert(next)
    };
    let mut events = Vec::with_capacity(entries.len() + pre.len());
    let mut next_id = 0u64;
    let mut live_ids: HashMap<u64, u64> = HashMap::new();
    for (&addr, &(size, stream)) in &pre {
        let stream = renumber(stream);
        events.push(Event::Alloc {
            id: next_id,
            size,
            stream,
        });
        live_ids.insert(addr, next_id);
        next_id += 1;
    }
    let preexisting = events.len();
    for (i, e) in entries.iter().enumerate() {
        match e.action.as_str() {
            "alloc" => {
                let stream = renumber(e.stream);
                events.push(Event::Alloc {
                    id: next_id,
                    size: e.size,
                    stream,
                });
                live_ids.insert(e.addr, next_id);
                next_id += 1;
            }
            "free_completed" => match live_ids.remove(&e.addr) {
                Some(id) => events.push(Event::Free { id }),
                None => {
                    // Pass 1 accepted every free; reaching here means the two passes disagree.
                    return Err(snap(format!(
                        "device_traces[{device}][{i}] (free_completed): address {:#x} not live",
                        e.addr
                    )));
                }
            },
            _ => {}
        }
    }
    Ok(Trace {
        name: name.to_string(),
        events,
        preexisting,
    })
}

fn read_entry(raw: &Value, device: usize, i: usize) -> Result<TraceEntry, TraceError> {
    let what = format!("device_traces[{device}][{i}]");
    let dict = as_dict(raw, &what)?;
    let action = str_field(dict, &what, "action")?.to_string();
    let relevant = matches!(
        action.as_str(),
        "alloc"
            | "free_completed"
            | "segment_alloc"
            | "segment_free"
            | "segment_map"
            | "segment_unmap"
    );
    if !relevant {
        return Ok(TraceEntry {
            action,
            addr: 0,
            size: 0,
            stream: 0,
        });
    }
    let what = format!("{what} ({action})");
    let addr = int_field(dict, &what, "addr")?;
    let size = int_field(dict, &what, "size")?;
    let stream = match get(dict, "stream") {
        Some(v) => int(v, &what, "stream")?,
        None => 0,
    };
    Ok(TraceEntry {
        action,
        addr,
        size,
        stream,
    })
}

fn check_alloc_size(size: u64, what: &str) -> Result<(), TraceError> {
    if size == 0 || size > quilt_alloc::MAX_ALLOCATION {
        return Err(snap(format!(
            "{what}: absurd allocation size {size} (must be 1 byte to 1 TiB)"
        )));
    }
    Ok(())
}

fn snap(message: String) -> TraceError {
    TraceError::Snapshot(message)
}

fn get<'a>(dict: &'a BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
    dict.get(&HashableValue::String(key.to_string()))
}

fn as_dict<'a>(v: &'a Value, what: &str) -> Result<&'a BTreeMap<HashableValue, Value>, TraceError> {
    match v {
        Value::Dict(d) => Ok(d),
        other => Err(snap(format!(
            "{what}: expected a dict, found {}",
            kind(other)
        ))),
    }
}

fn as_list<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], TraceError> {
    match v {
        Value::List(l) | Value::Tuple(l) => Ok(l),
        other => Err(snap(format!(
            "{what}: expected a list, found {}",
            kind(other)
        ))),
    }
}

fn list_field<'a>(
    dict: &'a BTreeMap<HashableValue, Value>,
    key: &str,
    what: &str,
) -> Result<&'a [Value], TraceError> {
    match get(dict, key) {
        Some(v) => as_list(v, &format!("{what}.{key}")),
        None => Err(snap(format!("{what}: missing field `{key}`"))),
    }
}

fn int(v: &Value, what: &str, key: &str) -> Result<u64, TraceError> {
    match v {
        Value::I64(n) if *n >= 0 => Ok(*n as u64),
        Value::I64(n) => Err(snap(format!("{what}: field `{key}` is negative ({n})"))),
        Value::Int(big) => u64::try_from(big).map_err(|_| {
            snap(format!(
                "{what}: field `{key}` = {big} does not fit 64 bits"
            ))
        }),
        other => Err(snap(format!(
            "{what}: field `{key}` should be an integer, found {}",
            kind(other)
        ))),
    }
}

fn int_field(
    dict: &BTreeMap<HashableValue, Value>,
    what: &str,
    key: &str,
) -> Result<u64, TraceError> {
    match get(dict, key) {
        Some(v) => int(v, what, key),
        None => Err(snap(format!("{what}: missing field `{key}`"))),
    }
}

fn str_field<'a>(
    dict: &'a BTreeMap<HashableValue, Value>,
    what: &str,
    key: &str,
) -> Result<&'a str, TraceError> {
    match get(dict, key) {
        Some(Value::String(s)) => Ok(s),
        Some(other) => Err(snap(format!(
            "{what}: field `{key}` should be a string, found {}",
            kind(other)
        ))),
        None => Err(snap(format!("{what}: missing field `{key}`"))),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::I64(_) | Value::Int(_) => "an integer",
        Value::F64(_) => "a float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "a string",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Dict(_) => "a dict",
    }
}
