//! map_probe: asks the real CUDA driver the questions Quilt's driver layer
//! answers strictly, and reports what the driver said, case by case.
//!
//! ```text
//! cargo run --release -p quilt-vmm --example map_probe -- [--device N] [--out FILE]
//! ```
//!
//! The ledger (`MapRule::WholeHandle`) refuses a `cuMemMap` at a non-zero
//! offset or of part of a handle, because the `cuMemMap` reference says the
//! offset "currently must be zero". This probe bypasses the ledger and calls
//! the driver directly (`cudarc::driver::sys`), one case at a time:
//!
//! 1. `map_offset_one_granule`: map granule 1 of a two-granule handle
//!    (`offset` = one granule);
//! 2. `map_prefix_one_granule`: map granule 0 only (a prefix) of a
//!    two-granule handle;
//! 3. `set_access_one_granule_of_two`: `cuMemSetAccess` on one granule of a
//!    two-granule mapping (then on the other);
//! 4. `set_access_across_adjacent_reservations`: two one-granule
//!    reservations that are adjacent (asked for with the address hint of
//!    `cuMemAddressReserve`, reported when the driver did not give adjacency),
//!    each mapped with its own handle, and one `cuMemSetAccess` across both;
//! 5. `unmap_two_adjacent_mappings`: two one-granule handles mapped side by
//!    side in one two-granule reservation, and one `cuMemUnmap` over both
//!    (where accepted, a new `cuMemMap` at the first address tells whether
//!    the range really is free); then the same across two adjacent
//!    reservations (`answer_across_reservations`);
//! 6. `per_thread_stream_is_per_thread`: is `CU_STREAM_PER_THREAD` (`0x2`)
//!    the calling thread's own stream? Thread A blocks its `0x2` with a host
//!    function that sleeps for a second (`cuLaunchHostFunc`; where the driver
//!    runs no host functions, with memsets as in case 9) and records an
//!    event after it; thread B then queries its own `0x2`
//!    (`cuStreamQuery`), records an event on it, polls it for 300 ms and
//!    synchronises it. `per_thread` when B's stream is idle and B's event
//!    completed while A's was still pending, `shared` when B's stream held
//!    A's work;
//! 7. `relaxed_capture_calls`: on a new non-blocking stream under
//!    `cuStreamBeginCapture_v2(CU_STREAM_CAPTURE_MODE_RELAXED)`, what
//!    `cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`,
//!    `cuEventCreate`, `cuEventRecord` (on the capturing stream, and on
//!    another), `cuEventQuery` (of an event recorded before the capture and
//!    of one recorded inside it), `cuMemUnmap`, `cuMemRelease`,
//!    `cuMemAddressFree` and `cuStreamQuery` of the capturing stream return,
//!    with the capture status after each (`cuStreamIsCapturing`); then
//!    `cuStreamEndCapture` and `cuGraphDestroy`;
//! 8. `unmap_waits_for_queued_work` (last, in a child process of its own:
//!    the wrong order may kill the context): a 64 MiB mapping, a host
//!    function that holds a new stream for a second, a `cuMemsetD8Async`
//!    over the mapping queued behind it, then `cuMemUnmap` at once, timed;
//!    then `cuStreamSynchronize`. `waited` when the unmap returned only
//!    after the queued memset had run (the stream was idle right after it),
//!    `did_not_wait` when the stream still had the memset queued after the
//!    unmap returned (the result of the synchronisation then says whether
//!    the memset faulted: `CUDA_ERROR_ILLEGAL_ADDRESS`);
//! 9. `unmap_waits_for_queued_device_work` (also its own child process): the
//!    same with device work only: up to 4,000 `cuMemsetD8Async` of a 64 MiB
//!    mapping (for at most 100 ms of queueing) on a stream, then `cuMemUnmap`
//!    while the stream is still busy (`inconclusive` when the work had
//!    finished before the unmap).
//!
//! Where the driver accepts a map, the probe checks what the mapping shows:
//! the handle's two granules are first filled with different bytes through a
//! whole mapping (`cuMemsetD8`), and the new mapping is read back
//! (`cuMemcpyDtoH`), so "accepted" and "really maps that granule" are told
//! apart. Memory is only touched where access was set, so a refusal cannot
//! fault the context and spoil the cases after it. A driver function that
//! the loaded `libcuda` lacks makes its case `not_run` (never a crash).
//!
//! Output, as it goes (so a crash midway leaves the earlier answers): JSON
//! Lines on stdout, flushed one by one: first `{"probe": "map_probe",
//! "available": true, "device": ..., ...}`, then `{"case": NAME, "result":
//! {...}}` after each case, then `{"probe": "map_probe", "complete": true,
//! "answers": {...}}`; one human line per case on stderr. With `--out FILE`,
//! FILE holds one JSON object, rewritten (whole, through a rename) after
//! every case: the header fields, `"complete"` (false until the last case
//! is in), `"answers"` (each case's answer by name) and `"cases"` (each
//! case's calls, every `CUresult` with code and name, and findings). Each
//! case's `answer` is `accepted`, `refused`, a case's own word (`waited`,
//! `per_thread`, ...) or `not_run` with the reason. Exit status 0 when the
//! probe ran (whatever the driver answered), 77 when there is no usable
//! CUDA driver or device (the JSON then says `"available": false` and why),
//! 2 on bad usage. `--child CASE` (used by the probe itself) runs one child
//! case and prints its result as one JSON line.

use std::ffi::{c_int, c_void};
use std::fmt::{self, Write as _};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// A JSON value (enough for this report).
#[derive(Clone)]
enum Json {
    Null,
    Bool(bool),
    Num(i128),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
    /// Text that already is one JSON value (a child's answer).
    Raw(String),
}

impl Json {
    fn obj() -> Json {
        Json::Obj(Vec::new())
    }

    /// Adds `key: value` to an object (ignored on other values).
    fn set(&mut self, key: &str, value: Json) -> &mut Json {
        if let Json::Obj(fields) = self {
            fields.push((key.to_owned(), value));
        }
        self
    }

    /// The value of `key` in an object.
    fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(fields) => fields.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    fn num(n: impl Into<i128>) -> Json {
        Json::Num(n.into())
    }

    /// Microseconds of `d`.
    fn micros(d: Duration) -> Json {
        Json::Num(d.as_micros().min(i128::MAX as u128) as i128)
    }
}

fn write_str(f: &mut fmt::Formatter<'_>, s: &str) -> fmt::Result {
    f.write_char('"')?;
    for c in s.chars() {
        match c {
            '"' => f.write_str("\\\"")?,
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            c if (c as u32) < 0x20 => write!(f, "\\u{:04x}", c as u32)?,
            c => f.write_char(c)?,
        }
    }
    f.write_char('"')
}

impl fmt::Display for Json {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Json::Null => f.write_str("null"),
            Json::Bool(b) => write!(f, "{b}"),
            Json::Num(n) => write!(f, "{n}"),
            Json::Str(s) => write_str(f, s),
            Json::Raw(s) => f.write_str(s),
            Json::Arr(items) => {
                f.write_char('[')?;
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_char(']')
            }
            Json::Obj(fields) => {
                f.write_char('{')?;
                for (i, (key, value)) in fields.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write_str(f, key)?;
                    write!(f, ": {value}")?;
                }
                f.write_char('}')
            }
        }
    }
}

/// The driver's name of a `CUresult`, e.g. `CUDA_ERROR_INVALID_VALUE`.
fn result_name(r: sys::CUresult) -> String {
    DriverError(r)
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("CUresult {}", r as u32))
}

fn ok(r: sys::CUresult) -> bool {
    r == sys::CUresult::CUDA_SUCCESS
}

fn not_ready(r: sys::CUresult) -> bool {
    r == sys::CUresult::CUDA_ERROR_NOT_READY
}

/// Whether the loaded `libcuda` exports `name` (cudarc panics on first use
/// of a missing symbol; a case that needs one is `not_run` instead).
fn has_symbol(name: &str) -> bool {
    // SAFETY: called only after `is_culib_present` found the library, so
    // `culib` loads it without panicking; looking a symbol up runs no code of
    // the library, and the symbol is dropped unused.
    unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    }
}

/// The first of `names` that the loaded `libcuda` lacks.
fn missing_symbol(names: &[&str]) -> Option<String> {
    names
        .iter()
        .find(|n| !has_symbol(n))
        .map(|n| format!("the driver library lacks {n}"))
}

/// One case: the driver calls it made, in order, and its findings.
struct Case {
    calls: Vec<Json>,
    out: Json,
}

impl Case {
    fn new(question: &str) -> Case {
        let mut out = Json::obj();
        out.set("question", Json::str(question));
        Case {
            calls: Vec::new(),
            out,
        }
    }

    /// Notes the call `call(args)` and its result; passes the result on.
    fn note(&mut self, call: &str, args: String, r: sys::CUresult) -> sys::CUresult {
        let mut entry = Json::obj();
        entry
            .set("call", Json::str(call))
            .set("args", Json::Str(args))
            .set("code", Json::num(r as u32))
            .set("result", Json::Str(result_name(r)));
        self.calls.push(entry);
        r
    }

    /// As [`Case::note`], with how long the call took.
    fn note_timed(
        &mut self,
        call: &str,
        args: String,
        r: sys::CUresult,
        took: Duration,
    ) -> sys::CUresult {
        self.note(call, args, r);
        if let Some(Json::Obj(fields)) = self.calls.last_mut() {
            fields.push(("us".to_owned(), Json::micros(took)));
        }
        r
    }

    fn set(&mut self, key: &str, value: Json) {
        self.out.set(key, value);
    }

    fn finish(self) -> Json {
        let Case { calls, mut out } = self;
        out.set("calls", Json::Arr(calls));
        out
    }
}

/// Allocation properties for pinned device memory on device `ordinal`.
fn allocation_prop(ordinal: c_int) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// The device, its context (current on this thread) and everything the probe
/// made, given back at drop (unmaps, releases, frees, in that order).
struct Probe {
    ordinal: c_int,
    granularity: u64,
    mappings: Vec<(u64, u64)>,
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    reservations: Vec<(u64, u64)>,
}

impl Probe {
    /// `cuMemAddressReserve(size, alignment 0, addr hint)`.
    fn reserve(&mut self, case: &mut Case, size: u64, hint: u64) -> Option<u64> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; `hint` is only a request (the driver picks
        // another range if it is taken); flags must be 0.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size as usize, 0, hint, 0) };
        case.note(
            "cuMemAddressReserve",
            format!("size={size:#x}, addr_hint={hint:#x} -> {ptr:#x}"),
            r,
        );
        if ok(r) {
            self.reservations.push((ptr, size));
            Some(ptr)
        } else {
            None
        }
    }

    /// `cuMemAddressFree` of a reservation made by [`Probe::reserve`].
    fn address_free(&mut self, case: &mut Case, ptr: u64, size: u64) -> bool {
        // SAFETY: `ptr..ptr+size` is exactly a reservation this probe made,
        // with no mapping in it (callers free only unmapped reservations).
        let r = unsafe { sys::cuMemAddressFree(ptr, size as usize) };
        case.note("cuMemAddressFree", format!("{ptr:#x}, size={size:#x}"), r);
        if ok(r) {
            self.reservations.retain(|&(p, _)| p != ptr);
        }
        ok(r)
    }

    /// `cuMemCreate(size)`.
    fn create(&mut self, case: &mut Case, size: u64) -> Option<sys::CUmemGenericAllocationHandle> {
        let prop = allocation_prop(self.ordinal);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out-pointer and a fully initialised `prop` that lives
        // across the call; flags must be 0.
        let r = unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) };
        case.note("cuMemCreate", format!("size={size:#x}"), r);
        if ok(r) {
            self.handles.push(handle);
            Some(handle)
        } else {
            None
        }
    }

    /// `cuMemMap(ptr, size, offset, handle)`, straight to the driver.
    fn map(
        &mut self,
        case: &mut Case,
        ptr: u64,
        size: u64,
        offset: u64,
        handle: sys::CUmemGenericAllocationHandle,
    ) -> sys::CUresult {
        // SAFETY: `ptr..ptr+size` lies in a live reservation of this probe
        // with no mapping in it, and `handle` is a live handle of this probe;
        // whether `offset` and `size` are acceptable is the question asked:
        // the driver validates them and answers with a `CUresult`. Flags 0.
        let r = unsafe { sys::cuMemMap(ptr, size as usize, offset as usize, handle, 0) };
        case.note(
            "cuMemMap",
            format!("{ptr:#x}, size={size:#x}, offset={offset:#x}"),
            r,
        );
        if ok(r) {
            self.mappings.push((ptr, size));
        }
        r
    }

    /// `cuMemUnmap(ptr, size)` of mappings made by [`Probe::map`], after a
    /// context synchronisation.
    fn unmap(&mut self, case: &mut Case, ptr: u64, size: u64) -> sys::CUresult {
        sync(case);
        // SAFETY: the range holds only mappings of this probe; the context
        // was just synchronised, so no queued work still uses them.
        let r = unsafe { sys::cuMemUnmap(ptr, size as usize) };
        case.note("cuMemUnmap", format!("{ptr:#x}, size={size:#x}"), r);
        if ok(r) {
            self.forget_mappings(ptr, size);
        }
        r
    }

    /// Forgets every mapping inside `ptr..ptr+size` (unmapped by the driver).
    fn forget_mappings(&mut self, ptr: u64, size: u64) {
        self.mappings
            .retain(|&(p, s)| !(p >= ptr && p + s <= ptr + size));
    }

    /// `cuMemSetAccess(ptr, size)`: read-write for the device.
    fn set_access(&mut self, case: &mut Case, ptr: u64, size: u64) -> sys::CUresult {
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.ordinal,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: `desc` is one fully initialised descriptor living across the
        // call, and count is 1; whether the range is acceptable is the
        // question asked: the driver validates it.
        let r = unsafe { sys::cuMemSetAccess(ptr, size as usize, &desc, 1) };
        case.note("cuMemSetAccess", format!("{ptr:#x}, size={size:#x}"), r);
        r
    }

    /// A two-granule handle whose granule 0 holds `bytes[0]` and granule 1
    /// `bytes[1]`, written through a whole mapping at its own reservation
    /// (left mapped, access set). `None` when a setup call failed (noted).
    fn filled_pair(
        &mut self,
        case: &mut Case,
        bytes: [u8; 2],
    ) -> Option<sys::CUmemGenericAllocationHandle> {
        let g = self.granularity;
        let handle = self.create(case, 2 * g)?;
        let whole = self.reserve(case, 2 * g, 0)?;
        if !ok(self.map(case, whole, 2 * g, 0, handle)) || !ok(self.set_access(case, whole, 2 * g))
        {
            return None;
        }
        for (i, byte) in bytes.iter().enumerate() {
            if !ok(memset(case, whole + i as u64 * g, *byte, g)) {
                return None;
            }
        }
        ok(sync(case)).then_some(handle)
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        // SAFETY: the context is current on this thread (it was pushed in
        // `run` and is popped after the probe drops); no arguments.
        let _ = unsafe { sys::cuCtxSynchronize() };
        for (ptr, size) in self.mappings.drain(..) {
            // SAFETY: a live mapping of this probe, unmapped once; the context
            // was synchronised just above.
            let _ = unsafe { sys::cuMemUnmap(ptr, size as usize) };
        }
        for handle in self.handles.drain(..) {
            // SAFETY: a live handle of this probe, released once.
            let _ = unsafe { sys::cuMemRelease(handle) };
        }
        for (ptr, size) in self.reservations.drain(..) {
            // SAFETY: a reservation of this probe, now without mappings, freed once.
            let _ = unsafe { sys::cuMemAddressFree(ptr, size as usize) };
        }
    }
}

/// `cuMemsetD8(ptr, byte, len)` (on the legacy default stream).
fn memset(case: &mut Case, ptr: u64, byte: u8, len: u64) -> sys::CUresult {
    // SAFETY: callers pass only ranges that are mapped with access set (the
    // driver checks the range and answers with a `CUresult` otherwise).
    let r = unsafe { sys::cuMemsetD8_v2(ptr, byte, len as usize) };
    case.note(
        "cuMemsetD8",
        format!("{ptr:#x}, byte={byte:#04x}, len={len:#x}"),
        r,
    )
}

/// `cuCtxSynchronize`.
fn sync(case: &mut Case) -> sys::CUresult {
    // SAFETY: the probe's context is current; no arguments.
    let r = unsafe { sys::cuCtxSynchronize() };
    case.note("cuCtxSynchronize", String::new(), r)
}

/// The first byte at `ptr` (mapped with access set), or `None` (noted).
fn first_byte(case: &mut Case, ptr: u64) -> Option<u8> {
    let mut out = [0u8; 16];
    // SAFETY: `out` is valid for 16 writes; callers pass a device range that
    // is mapped with access set; the copy is synchronous for device to
    // pageable host memory.
    let r = unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast::<c_void>(), ptr, out.len()) };
    case.note("cuMemcpyDtoH", format!("{ptr:#x}, len=16"), r);
    ok(r).then_some(out[0])
}

fn answer(r: sys::CUresult) -> Json {
    Json::str(if ok(r) { "accepted" } else { "refused" })
}

fn not_run(case: &mut Case, why: &str) {
    case.set("answer", Json::str("not_run"));
    case.set("reason", Json::str(why));
}

/// Case 1 (`at_offset`) or 2 (prefix): map one granule of a two-granule
/// handle whose granules hold 0x11 and 0x22; where accepted, read back which.
fn map_one_granule(p: &mut Probe, at_offset: bool) -> Json {
    let g = p.granularity;
    let (question, offset) = if at_offset {
        (
            "cuMemMap of granule 1 of a two-granule handle (offset = one granule)",
            g,
        )
    } else {
        (
            "cuMemMap of granule 0 only (a one-granule prefix) of a two-granule handle",
            0,
        )
    };
    let mut case = Case::new(question);
    let Some(handle) = p.filled_pair(&mut case, [0x11, 0x22]) else {
        not_run(&mut case, "setting up the filled two-granule handle failed");
        return case.finish();
    };
    let Some(va) = p.reserve(&mut case, g, 0) else {
        not_run(&mut case, "cuMemAddressReserve failed");
        return case.finish();
    };
    let r = p.map(&mut case, va, g, offset, handle);
    case.set("answer", answer(r));
    if ok(r) {
        let access = p.set_access(&mut case, va, g);
        case.set("set_access_after_map", answer(access));
        if ok(access) {
            let expected = if at_offset { 0x22 } else { 0x11 };
            match first_byte(&mut case, va) {
                Some(b) => {
                    case.set("read_back", Json::str(format!("{b:#04x}")));
                    case.set("expected", Json::str(format!("{expected:#04x}")));
                    case.set("shows_the_granule_asked_for", Json::Bool(b == expected));
                }
                None => case.set("read_back", Json::str("cuMemcpyDtoH failed")),
            }
        }
        let _ = p.unmap(&mut case, va, g);
    }
    case.finish()
}

/// Case 3: set access on one granule of a two-granule mapping, then the other.
fn set_access_one_granule(p: &mut Probe) -> Json {
    let g = p.granularity;
    let mut case = Case::new(
        "cuMemSetAccess on one granule of a two-granule mapping (the first, then the second)",
    );
    let Some(handle) = p.create(&mut case, 2 * g) else {
        not_run(&mut case, "cuMemCreate failed");
        return case.finish();
    };
    let Some(va) = p.reserve(&mut case, 2 * g, 0) else {
        not_run(&mut case, "cuMemAddressReserve failed");
        return case.finish();
    };
    if !ok(p.map(&mut case, va, 2 * g, 0, handle)) {
        not_run(&mut case, "the whole-handle cuMemMap failed");
        return case.finish();
    }
    let first = p.set_access(&mut case, va, g);
    case.set("answer", answer(first));
    if ok(first) {
        // Touch only the granule whose access was set.
        let written = memset(&mut case, va, 0x5a, g);
        let synced = sync(&mut case);
        case.set(
            "write_first_granule",
            answer(if ok(written) { synced } else { written }),
        );
    }
    let second = p.set_access(&mut case, va + g, g);
    case.set("answer_second_granule", answer(second));
    case.finish()
}

/// Two adjacent one-granule reservations `(a, a + granule)`, or `None`
/// (whatever was reserved on the way is freed again).
fn adjacent_pair(p: &mut Probe, case: &mut Case) -> Option<(u64, u64)> {
    let g = p.granularity;
    // First try: a reservation, then one asked for right after it.
    if let Some(a) = p.reserve(case, g, 0) {
        match p.reserve(case, g, a + g) {
            Some(b) if b == a + g => return Some((a, b)),
            Some(b) if b + g == a => return Some((b, a)),
            Some(b) => {
                p.address_free(case, b, g);
                p.address_free(case, a, g);
            }
            None => {
                p.address_free(case, a, g);
            }
        }
    }
    // Second try: find two free granules by reserving them as one range,
    // free it, and reserve each half at its address.
    if let Some(both) = p.reserve(case, 2 * g, 0) {
        if p.address_free(case, both, 2 * g) {
            let a = p.reserve(case, g, both);
            let b = p.reserve(case, g, both + g);
            match (a, b) {
                (Some(a), Some(b)) if b == a + g => return Some((a, b)),
                (Some(a), Some(b)) if a == b + g => return Some((b, a)),
                _ => {
                    for r in [a, b].into_iter().flatten() {
                        p.address_free(case, r, g);
                    }
                }
            }
        }
    }
    // Third try, for a driver that ignores hints: several reservations in a
    // row, keeping the first two that touch.
    let mut got: Vec<u64> = Vec::new();
    for _ in 0..ADJACENT_TRIES {
        let Some(r) = p.reserve(case, g, 0) else {
            break;
        };
        got.push(r);
        let touching = got
            .iter()
            .find(|&&o| o + g == r || r + g == o)
            .map(|&o| (o.min(r), o.max(r)));
        if let Some(pair) = touching {
            for &o in got.iter().filter(|&&o| o != pair.0 && o != pair.1) {
                p.address_free(case, o, g);
            }
            return Some(pair);
        }
    }
    for o in got {
        p.address_free(case, o, g);
    }
    None
}

/// One-granule reservations made by the last try of [`adjacent_pair`].
const ADJACENT_TRIES: usize = 8;

/// Case 4: one `cuMemSetAccess` across two adjacent reservations, each mapped
/// with its own one-granule handle.
fn set_access_across_reservations(p: &mut Probe) -> Json {
    let g = p.granularity;
    let mut case =
        Case::new("cuMemSetAccess across two adjacent one-granule reservations, each mapped whole");
    let Some((a, b)) = adjacent_pair(p, &mut case) else {
        case.set("adjacent", Json::Bool(false));
        not_run(
            &mut case,
            "the driver did not give two adjacent reservations (address hints not honoured)",
        );
        return case.finish();
    };
    case.set("adjacent", Json::Bool(true));
    let (Some(ha), Some(hb)) = (p.create(&mut case, g), p.create(&mut case, g)) else {
        not_run(&mut case, "cuMemCreate failed");
        return case.finish();
    };
    if !ok(p.map(&mut case, a, g, 0, ha)) || !ok(p.map(&mut case, b, g, 0, hb)) {
        not_run(&mut case, "a whole-handle cuMemMap failed");
        return case.finish();
    }
    let across = p.set_access(&mut case, a, 2 * g);
    case.set("answer", answer(across));
    if ok(across) {
        let written = memset(&mut case, a, 0x6b, 2 * g);
        let synced = sync(&mut case);
        case.set(
            "write_across_both",
            answer(if ok(written) { synced } else { written }),
        );
    }
    let _ = p.unmap(&mut case, a, g);
    let _ = p.unmap(&mut case, b, g);
    case.finish()
}

/// Case 5: one `cuMemUnmap` over two adjacent one-granule mappings of two
/// handles, in one reservation, then across two adjacent reservations.
fn unmap_two_adjacent(p: &mut Probe) -> Json {
    let g = p.granularity;
    let mut case = Case::new(
        "one cuMemUnmap over two adjacent one-granule mappings of two handles \
         (in one two-granule reservation; then across two adjacent reservations)",
    );
    let (Some(ha), Some(hb)) = (p.create(&mut case, g), p.create(&mut case, g)) else {
        not_run(&mut case, "cuMemCreate failed");
        return case.finish();
    };
    let Some(va) = p.reserve(&mut case, 2 * g, 0) else {
        not_run(&mut case, "cuMemAddressReserve failed");
        return case.finish();
    };
    if !ok(p.map(&mut case, va, g, 0, ha)) || !ok(p.map(&mut case, va + g, g, 0, hb)) {
        not_run(&mut case, "a whole-handle cuMemMap failed");
        return case.finish();
    }
    let one = p.unmap(&mut case, va, 2 * g);
    case.set("answer", answer(one));
    if ok(one) {
        // Accepted: is the range really free? A new map there says.
        let again = p.map(&mut case, va, g, 0, ha);
        case.set("map_again_after", answer(again));
        if ok(again) {
            let _ = p.unmap(&mut case, va, g);
        }
    } else {
        let _ = p.unmap(&mut case, va, g);
        let _ = p.unmap(&mut case, va + g, g);
    }
    match adjacent_pair(p, &mut case) {
        None => case.set(
            "answer_across_reservations",
            Json::str("not_run: the driver did not give two adjacent reservations"),
        ),
        Some((a, b)) => {
            if !ok(p.map(&mut case, a, g, 0, ha)) || !ok(p.map(&mut case, b, g, 0, hb)) {
                case.set(
                    "answer_across_reservations",
                    Json::str("not_run: a whole-handle cuMemMap failed"),
                );
            } else {
                let across = p.unmap(&mut case, a, 2 * g);
                case.set("answer_across_reservations", answer(across));
                if !ok(across) {
                    let _ = p.unmap(&mut case, a, g);
                    let _ = p.unmap(&mut case, b, g);
                }
            }
        }
    }
    case.finish()
}

/// How long a host function holds its stream, in milliseconds.
const HOLD_MS: usize = 1000;

/// `CU_STREAM_PER_THREAD`: the calling thread's default stream.
const PER_THREAD_STREAM: usize = 0x2;

/// A `CUhostFn`: holds the stream it was queued on for `user` milliseconds
/// (the pointer's value is the count; it is never dereferenced). It makes no
/// CUDA call, as host functions must not.
extern "C" fn hold_stream(user: *mut c_void) {
    std::thread::sleep(Duration::from_millis(user as usize as u64));
}

/// `cuLaunchHostFunc(stream, hold_stream, HOLD_MS)`.
fn queue_hold(case: &mut Case, stream: sys::CUstream) -> sys::CUresult {
    // SAFETY: `hold_stream` is a valid host function for the whole run (a
    // plain function), makes no CUDA call, and never dereferences its
    // argument, which only carries the count; `stream` is a live stream of
    // this context or `CU_STREAM_PER_THREAD`.
    let r = unsafe { sys::cuLaunchHostFunc(stream, Some(hold_stream), HOLD_MS as *mut c_void) };
    case.note(
        "cuLaunchHostFunc",
        format!("stream={:#x}, sleeps {HOLD_MS} ms", stream as usize),
        r,
    )
}

/// Queued `cuMemsetD8Async` calls over `va..va+len` on `stream`, at most
/// `max` of them and for at most [`MEMSET_QUEUEING`] of queueing
/// (a driver that runs queued work inside later calls is not left queueing
/// for long). Notes the first, the last and any failure; the count queued,
/// or the failed result.
fn queue_memsets(
    case: &mut Case,
    va: u64,
    len: u64,
    stream: sys::CUstream,
    max: u32,
) -> Result<u32, sys::CUresult> {
    let started = Instant::now();
    let mut queued = 0u32;
    while queued < max && (queued == 0 || started.elapsed() < MEMSET_QUEUEING) {
        // SAFETY: callers pass a range mapped with access set; whether it
        // stays mapped for as long as the work is queued is up to the
        // caller (the unmap cases ask exactly that, in a child process).
        let r = unsafe { sys::cuMemsetD8Async(va, 0x77, len as usize, stream) };
        queued += 1;
        if queued == 1 || !ok(r) {
            case.note(
                "cuMemsetD8Async",
                format!(
                    "{va:#x}, len={len:#x}, stream={:#x}, #{queued}",
                    stream as usize
                ),
                r,
            );
        }
        if !ok(r) {
            return Err(r);
        }
    }
    case.note_timed(
        "cuMemsetD8Async",
        format!("the last of {queued}"),
        sys::CUresult::CUDA_SUCCESS,
        started.elapsed(),
    );
    Ok(queued)
}

/// The most memsets case 9 queues; how many hold thread A's stream in case
/// 6 where the driver runs no host functions (there, work that is not waited
/// for stays queued); how long [`queue_memsets`] queues at most.
const MEMSETS: u32 = 4000;
const HOLD_MEMSETS: u32 = 16;
const MEMSET_QUEUEING: Duration = Duration::from_millis(100);

/// Bytes of each queued memset (64 MiB: tens of microseconds of a GPU's
/// time each, so the queue the driver lets build up is milliseconds deep).
const MEMSET_BYTES: u64 = 64 << 20;

/// `cuEventCreate(flags 0)`.
fn event_create(case: &mut Case) -> Option<sys::CUevent> {
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current on this thread.
    let r = unsafe { sys::cuEventCreate(&mut event, 0) };
    case.note("cuEventCreate", "flags=0".to_owned(), r);
    ok(r).then_some(event)
}

/// `cuEventRecord(event, stream)`.
fn event_record(case: &mut Case, event: sys::CUevent, stream: sys::CUstream) -> sys::CUresult {
    // SAFETY: `event` is a live event of this probe and `stream` a live
    // stream of the current context (or `CU_STREAM_PER_THREAD`).
    let r = unsafe { sys::cuEventRecord(event, stream) };
    case.note("cuEventRecord", format!("stream={:#x}", stream as usize), r)
}

/// `cuEventQuery(event)`.
fn event_query(case: &mut Case, event: sys::CUevent) -> sys::CUresult {
    // SAFETY: `event` is a live event of this probe.
    let r = unsafe { sys::cuEventQuery(event) };
    case.note("cuEventQuery", String::new(), r)
}

/// `cuEventDestroy`.
fn event_destroy(case: &mut Case, event: sys::CUevent) {
    // SAFETY: a live event of this probe, destroyed once and not used after.
    let r = unsafe { sys::cuEventDestroy_v2(event) };
    case.note("cuEventDestroy", String::new(), r);
}

/// `cuStreamQuery(stream)`.
fn stream_query(case: &mut Case, stream: sys::CUstream) -> sys::CUresult {
    // SAFETY: `stream` is a live stream of the current context (or
    // `CU_STREAM_PER_THREAD`).
    let r = unsafe { sys::cuStreamQuery(stream) };
    case.note("cuStreamQuery", format!("stream={:#x}", stream as usize), r)
}

/// `cuStreamCreate(CU_STREAM_NON_BLOCKING)`.
fn stream_create(case: &mut Case) -> Option<sys::CUstream> {
    let mut stream: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current on this thread.
    let r = unsafe { sys::cuStreamCreate(&mut stream, 1) };
    case.note(
        "cuStreamCreate",
        "flags=CU_STREAM_NON_BLOCKING".to_owned(),
        r,
    );
    ok(r).then_some(stream)
}

/// `cuStreamSynchronize(stream)`, timed.
fn stream_sync(case: &mut Case, stream: sys::CUstream) -> (sys::CUresult, Duration) {
    let started = Instant::now();
    // SAFETY: `stream` is a live stream of the current context.
    let r = unsafe { sys::cuStreamSynchronize(stream) };
    let took = started.elapsed();
    case.note_timed(
        "cuStreamSynchronize",
        format!("stream={:#x}", stream as usize),
        r,
        took,
    );
    (r, took)
}

/// `cuStreamDestroy(stream)`.
fn stream_destroy(case: &mut Case, stream: sys::CUstream) {
    // SAFETY: a live stream made by this probe, destroyed once, not used after.
    let r = unsafe { sys::cuStreamDestroy_v2(stream) };
    case.note(
        "cuStreamDestroy",
        format!("stream={:#x}", stream as usize),
        r,
    );
}

/// `cuCtxSetCurrent(context)` on the calling thread.
fn set_current(case: &mut Case, context: usize) -> sys::CUresult {
    // SAFETY: `context` is the address of the probe's primary context, which
    // stays retained until every thread of the probe has been joined.
    let r = unsafe { sys::cuCtxSetCurrent(context as sys::CUcontext) };
    case.note("cuCtxSetCurrent", String::new(), r)
}

/// What one thread of case 6 saw.
struct ThreadSeen {
    case: Case,
    /// Thread A: its stream was busy after queueing the held work.
    /// Thread B: its own stream was busy when it first looked.
    stream_busy: Option<bool>,
    /// Thread A: its event was still pending after B finished.
    /// Thread B: its event completed within the poll.
    event: Option<bool>,
    /// Thread A: what held its stream.
    held_by: Option<&'static str>,
    /// Thread B: its event completed within the poll (before any wait).
    polled_done: Option<bool>,
}

/// How long thread B polls its event (well inside A's hold).
const POLL_MS: u64 = 300;

/// Thread A of case 6: holds its `0x2`, records an event after the hold,
/// lets B look, then checks its event was still pending.
fn per_thread_a(
    context: usize,
    work: Option<(u64, u64)>,
    go_b: mpsc::Sender<()>,
    b_done: mpsc::Receiver<()>,
) -> ThreadSeen {
    let mut seen = ThreadSeen {
        case: Case::new("thread A"),
        stream_busy: None,
        event: None,
        held_by: None,
        polled_done: None,
    };
    let case = &mut seen.case;
    let stream = PER_THREAD_STREAM as sys::CUstream;
    if !ok(set_current(case, context)) {
        let _ = go_b.send(());
        return seen;
    }
    let Some(event) = event_create(case) else {
        let _ = go_b.send(());
        return seen;
    };
    // Hold A's stream: a host function where the driver runs them, else
    // device work (memsets over the case's mapping).
    let mut held = has_symbol("cuLaunchHostFunc") && ok(queue_hold(case, stream));
    if held {
        seen.held_by = Some("host_function");
    } else if let Some((va, len)) = work {
        held = queue_memsets(case, va, len, stream, HOLD_MEMSETS).is_ok();
        seen.held_by = held.then_some("memsets");
    }
    if held && ok(event_record(case, event, stream)) {
        seen.stream_busy = Some(not_ready(stream_query(case, stream)));
        let _ = go_b.send(());
        let b_finished = b_done
            .recv_timeout(Duration::from_millis(HOLD_MS as u64 * 5))
            .is_ok();
        if b_finished {
            seen.event = Some(not_ready(event_query(case, event)));
        }
    } else {
        let _ = go_b.send(());
    }
    let started = Instant::now();
    // SAFETY: a live event of this thread's.
    let r = unsafe { sys::cuEventSynchronize(event) };
    case.note_timed("cuEventSynchronize", String::new(), r, started.elapsed());
    event_destroy(case, event);
    seen
}

/// Thread B of case 6: once A has queued, looks at its own `0x2`.
fn per_thread_b(context: usize, go: mpsc::Receiver<()>, done: mpsc::Sender<()>) -> ThreadSeen {
    let mut seen = ThreadSeen {
        case: Case::new("thread B"),
        stream_busy: None,
        event: None,
        held_by: None,
        polled_done: None,
    };
    let case = &mut seen.case;
    let stream = PER_THREAD_STREAM as sys::CUstream;
    let started = go.recv_timeout(Duration::from_secs(10)).is_ok();
    if !started || !ok(set_current(case, context)) {
        let _ = done.send(());
        return seen;
    }
    let q = stream_query(case, stream);
    seen.stream_busy = Some(not_ready(q));
    if let Some(event) = event_create(case) {
        if ok(event_record(case, event, stream)) {
            let polled = Instant::now();
            let mut polls = 0u32;
            let last = loop {
                // SAFETY: a live event of this thread's.
                let r = unsafe { sys::cuEventQuery(event) };
                polls += 1;
                if !not_ready(r) || polled.elapsed() >= Duration::from_millis(POLL_MS) {
                    break r;
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            case.note_timed(
                "cuEventQuery",
                format!("last of {polls} polls"),
                last,
                polled.elapsed(),
            );
            seen.polled_done = Some(ok(last));
            // A driver that runs queued work only when it is waited for
            // (the CUDA double) completes the event here; where 0x2 is one
            // stream for all threads, this waits for A's held work too.
            let synced_at = Instant::now();
            // SAFETY: a live event of this thread's.
            let r = unsafe { sys::cuEventSynchronize(event) };
            case.note_timed("cuEventSynchronize", String::new(), r, synced_at.elapsed());
            seen.event = Some(ok(r));
        }
        let _ = done.send(());
        event_destroy(case, event);
    } else {
        let _ = done.send(());
    }
    seen
}

/// Case 6: is `CU_STREAM_PER_THREAD` the calling thread's own stream?
fn per_thread_stream(p: &mut Probe, context: sys::CUcontext) -> Json {
    let mut case = Case::new(
        "is CU_STREAM_PER_THREAD (0x2) per thread? Thread A holds its 0x2 with a \
         one-second host function (or, where the driver runs none, with memsets) \
         and records an event after it; thread B then queries its own 0x2, \
         records an event on it, polls it and synchronises it; then A asks whether \
         its event is still pending",
    );
    if let Some(why) = missing_symbol(&[
        "cuCtxSetCurrent",
        "cuMemsetD8Async",
        "cuStreamQuery",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventSynchronize",
        "cuEventDestroy_v2",
    ]) {
        not_run(&mut case, &why);
        return case.finish();
    }
    // A mapping for thread A's memsets, should the driver run no host
    // functions (given back when the probe drops, after a synchronisation).
    let len = MEMSET_BYTES.div_ceil(p.granularity) * p.granularity;
    let mut work = None;
    if let (Some(handle), Some(va)) = (p.create(&mut case, len), p.reserve(&mut case, len, 0)) {
        if ok(p.map(&mut case, va, len, 0, handle)) && ok(p.set_access(&mut case, va, len)) {
            work = Some((va, len));
        }
    }
    let context = context as usize;
    let (go_b, go) = mpsc::channel();
    let (done, b_done) = mpsc::channel();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(move || per_thread_a(context, work, go_b, b_done));
        let b = s.spawn(move || per_thread_b(context, go, done));
        (a.join(), b.join())
    });
    let (Ok(a), Ok(b)) = (a, b) else {
        not_run(&mut case, "a probe thread panicked");
        return case.finish();
    };
    let answer = match (a.stream_busy, a.event, b.stream_busy, b.event) {
        // B's event completed (B synchronised it) while A's, recorded
        // earlier behind the held work, was still pending: B's 0x2 is not A's.
        (Some(true), Some(true), Some(false), Some(true)) => "per_thread",
        // B's own 0x2 held A's work.
        (Some(true), _, Some(true), _) => "shared",
        (None, _, _, _) | (_, _, None, _) => "not_run",
        _ => "inconclusive",
    };
    let flag = |v: Option<bool>| v.map_or(Json::Null, Json::Bool);
    case.set("answer", Json::str(answer));
    case.set("a_stream_busy_after_queueing", flag(a.stream_busy));
    case.set("a_event_pending_after_b_looked", flag(a.event));
    case.set("b_stream_busy", flag(b.stream_busy));
    case.set("b_event_completed_within_poll", flag(b.polled_done));
    case.set("b_event_synchronized", flag(b.event));
    case.set("a_held_by", a.held_by.map_or(Json::Null, Json::str));
    if a.held_by == Some("host_function") {
        case.set("hold_ms", Json::num(HOLD_MS as u64));
    }
    case.set("poll_ms", Json::num(POLL_MS));
    case.set("thread_a", a.case.finish());
    case.set("thread_b", b.case.finish());
    case.finish()
}

/// The capture status of `stream` by name, or the error of the query.
fn capture_status(stream: sys::CUstream) -> String {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: valid out-pointer and a live stream of this probe.
    let r = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
    if ok(r) {
        match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => "none",
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => "active",
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => "invalidated",
        }
        .to_owned()
    } else {
        format!("cuStreamIsCapturing: {}", result_name(r))
    }
}

/// The calls made under capture in case 7: each one's result and the
/// capture status after it.
struct UnderCapture {
    stream: sys::CUstream,
    calls: Json,
    refused: Vec<Json>,
    invalidated_by: Option<String>,
}

impl UnderCapture {
    /// Notes `what` with the result of the case's last call.
    fn after(&mut self, case: &Case, what: &str) {
        let result = match case.calls.last().and_then(|c| c.get("result")) {
            Some(Json::Str(s)) => s.clone(),
            _ => "unknown".to_owned(),
        };
        let status = capture_status(self.stream);
        // Not ready is an answer about the work, not a refusal of the call.
        if result != "CUDA_SUCCESS" && result != "CUDA_ERROR_NOT_READY" {
            self.refused.push(Json::str(what));
        }
        if status != "active" && self.invalidated_by.is_none() {
            self.invalidated_by = Some(what.to_owned());
        }
        let mut entry = Json::obj();
        entry
            .set("result", Json::Str(result))
            .set("capture_status_after", Json::Str(status));
        self.calls.set(what, entry);
    }
}

/// Case 7: driver calls under relaxed stream capture.
fn relaxed_capture(p: &mut Probe) -> Json {
    let g = p.granularity;
    let mut case = Case::new(
        "what VMM and event calls return while a new stream is captured in \
         CU_STREAM_CAPTURE_MODE_RELAXED (cuStreamBeginCapture_v2), with the \
         capture status after each",
    );
    if let Some(why) = missing_symbol(&[
        "cuStreamBeginCapture_v2",
        "cuStreamEndCapture",
        "cuStreamIsCapturing",
        "cuGraphDestroy",
        "cuStreamCreate",
        "cuStreamDestroy_v2",
        "cuStreamQuery",
        "cuStreamSynchronize",
        "cuEventCreate",
        "cuEventRecord",
        "cuEventQuery",
        "cuEventDestroy_v2",
    ]) {
        not_run(&mut case, &why);
        return case.finish();
    }
    let (Some(stream), Some(other)) = (stream_create(&mut case), stream_create(&mut case)) else {
        not_run(&mut case, "cuStreamCreate failed");
        return case.finish();
    };
    let (Some(before), Some(on_other)) = (event_create(&mut case), event_create(&mut case)) else {
        not_run(&mut case, "cuEventCreate failed");
        return case.finish();
    };
    let _ = event_record(&mut case, before, stream);
    let _ = stream_sync(&mut case, stream);
    // SAFETY: a live stream of this probe, not capturing; a valid mode.
    let begun = unsafe {
        sys::cuStreamBeginCapture_v2(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    case.note("cuStreamBeginCapture_v2", "mode=RELAXED".to_owned(), begun);
    case.set("begin_capture", Json::Str(result_name(begun)));
    if !ok(begun) {
        not_run(&mut case, "cuStreamBeginCapture_v2 failed");
        return case.finish();
    }
    let mut under = UnderCapture {
        stream,
        calls: Json::obj(),
        refused: Vec::new(),
        invalidated_by: None,
    };
    let va = p.reserve(&mut case, g, 0);
    under.after(&case, "cuMemAddressReserve");
    let handle = p.create(&mut case, g);
    under.after(&case, "cuMemCreate");
    let mut mapped = false;
    if let (Some(va), Some(handle)) = (va, handle) {
        mapped = ok(p.map(&mut case, va, g, 0, handle));
        under.after(&case, "cuMemMap");
        if mapped {
            let _ = p.set_access(&mut case, va, g);
            under.after(&case, "cuMemSetAccess");
        }
    }
    let inside = event_create(&mut case);
    under.after(&case, "cuEventCreate");
    let _ = event_query(&mut case, before);
    under.after(&case, "cuEventQuery_recorded_before_capture");
    if let Some(inside) = inside {
        let _ = event_record(&mut case, inside, stream);
        under.after(&case, "cuEventRecord_on_capturing_stream");
        let _ = event_query(&mut case, inside);
        under.after(&case, "cuEventQuery_recorded_in_capture");
    }
    let _ = event_record(&mut case, on_other, other);
    under.after(&case, "cuEventRecord_on_other_stream");
    let _ = event_query(&mut case, on_other);
    under.after(&case, "cuEventQuery_recorded_on_other_stream");
    let mut still_mapped = mapped;
    if let (Some(va), true) = (va, mapped) {
        // No synchronisation first: a context synchronisation is not a
        // legal call during capture.
        // SAFETY: a mapping of this probe; nothing queued uses it (the only
        // work queued since it was mapped is an event record, under capture,
        // which runs nothing).
        let r = unsafe { sys::cuMemUnmap(va, g as usize) };
        case.note("cuMemUnmap", format!("{va:#x}, size={g:#x}"), r);
        if ok(r) {
            p.forget_mappings(va, g);
            still_mapped = false;
        }
        under.after(&case, "cuMemUnmap");
    }
    if let (Some(handle), false) = (handle, still_mapped) {
        // SAFETY: a live handle of this probe whose only mapping (made
        // above) is gone, released once.
        let r = unsafe { sys::cuMemRelease(handle) };
        case.note("cuMemRelease", String::new(), r);
        if ok(r) {
            p.handles.retain(|&h| h != handle);
        }
        under.after(&case, "cuMemRelease");
    }
    if let (Some(va), false) = (va, still_mapped) {
        p.address_free(&mut case, va, g);
        under.after(&case, "cuMemAddressFree");
    }
    let _ = stream_query(&mut case, stream);
    under.after(&case, "cuStreamQuery_capturing_stream");
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: valid out-pointer; `stream` is the stream whose capture began
    // on this thread.
    let ended = unsafe { sys::cuStreamEndCapture(stream, &mut graph) };
    case.note("cuStreamEndCapture", String::new(), ended);
    case.set("end_capture", Json::Str(result_name(ended)));
    if !graph.is_null() {
        // SAFETY: the graph the capture just returned, destroyed once.
        let r = unsafe { sys::cuGraphDestroy(graph) };
        case.note("cuGraphDestroy", String::new(), r);
    }
    case.set("status_after_end", Json::Str(capture_status(stream)));
    let _ = stream_sync(&mut case, stream);
    let _ = stream_sync(&mut case, other);
    if let Some(inside) = inside {
        event_destroy(&mut case, inside);
    }
    event_destroy(&mut case, before);
    event_destroy(&mut case, on_other);
    stream_destroy(&mut case, stream);
    stream_destroy(&mut case, other);
    case.set(
        "answer",
        Json::str(if under.refused.is_empty() && ok(ended) {
            "all_accepted"
        } else {
            "some_refused"
        }),
    );
    case.set("refused_under_capture", Json::Arr(under.refused));
    case.set(
        "capture_invalidated_by",
        under.invalidated_by.map_or(Json::Null, Json::Str),
    );
    case.set("under_capture", under.calls);
    case.finish()
}

/// Cases 8 (`device_work` false: a memset held behind a host function) and
/// 9 (`device_work` true: thousands of memsets): `cuMemUnmap` of a mapping
/// with that work still queued, timed. Runs in a child process.
fn unmap_queued(p: &mut Probe, device_work: bool) -> Json {
    let g = p.granularity;
    let mut case = Case::new(if device_work {
        "does cuMemUnmap wait for queued work? Up to 4,000 cuMemsetD8Async over a \
         64 MiB mapping queued on a stream, then cuMemUnmap at once (timed), then \
         cuStreamSynchronize"
    } else {
        "does cuMemUnmap wait for queued work? A cuMemsetD8Async over a 64 MiB mapping \
         queued behind a host function that holds the stream for a second, then \
         cuMemUnmap at once (timed), then cuStreamSynchronize"
    });
    let mut needed = vec![
        "cuStreamCreate",
        "cuStreamDestroy_v2",
        "cuStreamQuery",
        "cuStreamSynchronize",
        "cuMemsetD8Async",
    ];
    if !device_work {
        needed.push("cuLaunchHostFunc");
    }
    if let Some(why) = missing_symbol(&needed) {
        not_run(&mut case, &why);
        return case.finish();
    }
    let size = MEMSET_BYTES.div_ceil(g) * g;
    let Some(stream) = stream_create(&mut case) else {
        not_run(&mut case, "cuStreamCreate failed");
        return case.finish();
    };
    let (Some(handle), Some(va)) = (p.create(&mut case, size), p.reserve(&mut case, size, 0))
    else {
        not_run(&mut case, "cuMemCreate or cuMemAddressReserve failed");
        return case.finish();
    };
    if !ok(p.map(&mut case, va, size, 0, handle))
        || !ok(p.set_access(&mut case, va, size))
        || !ok(memset(&mut case, va, 0, size))
        || !ok(sync(&mut case))
    {
        not_run(&mut case, "setting up the mapping failed");
        return case.finish();
    }
    let queued_at = Instant::now();
    if !device_work && !ok(queue_hold(&mut case, stream)) {
        not_run(&mut case, "cuLaunchHostFunc failed");
        return case.finish();
    }
    let queued = if device_work {
        queue_memsets(&mut case, va, size, stream, MEMSETS)
    } else {
        // SAFETY: `va..va+size` is mapped with access set, and it stays
        // mapped for as long as the work is queued unless the driver's
        // cuMemUnmap does not wait for it: that is the question asked, in a
        // child process of its own so a fault kills nothing else.
        let r = unsafe { sys::cuMemsetD8Async(va, 0x77, size as usize, stream) };
        case.note("cuMemsetD8Async", format!("{va:#x}, len={size:#x}"), r);
        if ok(r) {
            Ok(1)
        } else {
            Err(r)
        }
    };
    let Ok(queued) = queued else {
        not_run(&mut case, "cuMemsetD8Async failed");
        return case.finish();
    };
    case.set("memsets_queued", Json::num(queued));
    case.set("queueing_us", Json::micros(queued_at.elapsed()));
    let before = stream_query(&mut case, stream);
    eprintln!("map_probe child: work queued; calling cuMemUnmap");
    let started = Instant::now();
    // SAFETY: a mapping of this probe, deliberately unmapped with work
    // queued over it (see above): the driver either waits, refuses, or lets
    // the work fault this child's context.
    let unmapped = unsafe { sys::cuMemUnmap(va, size as usize) };
    let unmap_took = started.elapsed();
    case.note_timed(
        "cuMemUnmap",
        format!("{va:#x}, size={size:#x}"),
        unmapped,
        unmap_took,
    );
    if ok(unmapped) {
        p.forget_mappings(va, size);
    }
    let after = stream_query(&mut case, stream);
    eprintln!(
        "map_probe child: cuMemUnmap returned {} after {} us; synchronising",
        result_name(unmapped),
        unmap_took.as_micros()
    );
    let (synced, sync_took) = stream_sync(&mut case, stream);
    let context = sync(&mut case);
    let answer = if !not_ready(before) {
        // The work was done (or failed) before the unmap: nothing was asked.
        "inconclusive"
    } else if !ok(unmapped) {
        "unmap_refused"
    } else if ok(after) {
        "waited"
    } else {
        // Still queued after the unmap returned, or already faulted.
        "did_not_wait"
    };
    case.set("answer", Json::str(answer));
    case.set("mapping_bytes", Json::num(size));
    if !device_work {
        case.set("hold_ms", Json::num(HOLD_MS as u64));
    }
    case.set("stream_before_unmap", Json::Str(result_name(before)));
    case.set("unmap_result", Json::Str(result_name(unmapped)));
    case.set("unmap_us", Json::micros(unmap_took));
    case.set("stream_after_unmap", Json::Str(result_name(after)));
    case.set("stream_sync_result", Json::Str(result_name(synced)));
    case.set("stream_sync_us", Json::micros(sync_took));
    case.set("context_sync_result", Json::Str(result_name(context)));
    case.set(
        "faulted",
        Json::Bool(
            synced == sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
                || context == sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        ),
    );
    stream_destroy(&mut case, stream);
    case.finish()
}

/// The child cases, by name: each runs in a process of its own, last.
const CHILD_CASES: [&str; 2] = [
    "unmap_waits_for_queued_work",
    "unmap_waits_for_queued_device_work",
];

/// How long a child case may take before it is killed.
const CHILD_TIMEOUT: Duration = Duration::from_secs(20);

/// The value of the first `"key": "..."` in JSON text made by this probe.
fn string_field(json: &str, key: &str) -> Option<String> {
    let tag = format!("\"{key}\": \"");
    let start = json.find(&tag)? + tag.len();
    let len = json[start..].find('"')?;
    Some(json[start..start + len].to_owned())
}

/// The last `max` characters of `s`.
fn tail(s: &str, max: usize) -> String {
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(max)).collect()
}

/// All of `pipe`, read on a thread of its own.
fn read_all<R: std::io::Read + Send + 'static>(pipe: Option<R>) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    })
}

/// Runs child case `name` (this program with `--child NAME`), waits at most
/// [`CHILD_TIMEOUT`], and reports what it said and how it ended.
fn run_child(name: &str, ordinal: c_int) -> Json {
    let mut out = Json::obj();
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            out.set("answer", Json::str("not_run"));
            out.set("reason", Json::Str(format!("current_exe: {e}")));
            return out;
        }
    };
    let started = Instant::now();
    let child = Command::new(&exe)
        .args(["--child", name, "--device", &ordinal.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            out.set("answer", Json::str("not_run"));
            out.set(
                "reason",
                Json::Str(format!("spawning the child failed: {e}")),
            );
            return out;
        }
    };
    let stdout = read_all(child.stdout.take());
    let stderr = read_all(child.stderr.take());
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if started.elapsed() < CHILD_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                timed_out = true;
                let _ = child.kill();
                break child.wait().ok();
            }
            Err(_) => break None,
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    out.set("child_us", Json::micros(started.elapsed()));
    let code = status.and_then(|s| s.code());
    let signal = status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s));
    out.set("child_exit_status", code.map_or(Json::Null, Json::num));
    out.set("child_signal", signal.map_or(Json::Null, Json::num));
    out.set("child_timed_out", Json::Bool(timed_out));
    let line = stdout.lines().last().unwrap_or("").trim();
    let answered = line.starts_with('{') && line.ends_with('}');
    let answer = if answered {
        string_field(line, "answer").unwrap_or_else(|| "unknown".to_owned())
    } else if timed_out {
        format!(
            "not_answered: the child ran past {} s",
            CHILD_TIMEOUT.as_secs()
        )
    } else if let Some(signal) = signal {
        format!("not_answered: the child died of signal {signal}")
    } else {
        format!("not_answered: the child exited with {code:?} without an answer")
    };
    out.set("answer", Json::Str(answer));
    out.set("child_stderr", Json::Str(tail(&stderr, 2000)));
    out.set(
        "result",
        if answered {
            Json::Raw(line.to_owned())
        } else {
            Json::Null
        },
    );
    out
}

/// Why there is no probe to run.
struct Unavailable(String);

fn setup(step: &str, r: sys::CUresult) -> Result<(), Unavailable> {
    if ok(r) {
        Ok(())
    } else {
        Err(Unavailable(format!("{step} failed: {}", result_name(r))))
    }
}

/// A retained primary context, current on this thread while this lives.
struct Context {
    device: sys::CUdevice,
}

impl Drop for Context {
    fn drop(&mut self) {
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `open` pushed the primary context on this thread before
        // making this guard; `popped` is a valid out-pointer.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        // SAFETY: the primary context of `device` was retained once in
        // `open`; this is the matching release.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

/// The device under probe, its primary context current on this thread.
struct Device {
    ordinal: c_int,
    context: sys::CUcontext,
    name: String,
    version: c_int,
    granularity: u64,
    recommended: u64,
    // Dropped last: pops and releases the context.
    _guard: Context,
}

impl Device {
    /// An empty probe on this device.
    fn probe(&self) -> Probe {
        Probe {
            ordinal: self.ordinal,
            granularity: self.granularity,
            mappings: Vec::new(),
            handles: Vec::new(),
            reservations: Vec::new(),
        }
    }
}

fn open(ordinal: c_int) -> Result<Device, Unavailable> {
    // SAFETY: only tries to load libcuda by its usual names; calls no CUDA
    // function and never panics.
    if !unsafe { sys::is_culib_present() } {
        return Err(Unavailable(
            "no CUDA driver: libcuda could not be loaded on this machine".to_owned(),
        ));
    }
    let needed = [
        "cuInit",
        "cuDeviceGet",
        "cuDeviceGetAttribute",
        "cuDeviceGetName",
        "cuDriverGetVersion",
        "cuDevicePrimaryCtxRetain",
        "cuDevicePrimaryCtxRelease_v2",
        "cuCtxPushCurrent_v2",
        "cuCtxPopCurrent_v2",
        "cuCtxSynchronize",
        "cuMemGetAllocationGranularity",
        "cuMemAddressReserve",
        "cuMemAddressFree",
        "cuMemCreate",
        "cuMemRelease",
        "cuMemMap",
        "cuMemUnmap",
        "cuMemSetAccess",
        "cuMemsetD8_v2",
        "cuMemcpyDtoH_v2",
        "cuGetErrorName",
    ];
    if let Some(why) = missing_symbol(&needed) {
        return Err(Unavailable(why));
    }
    // SAFETY: libcuda is present, so the symbol loads; no pointers.
    setup("cuInit", unsafe { sys::cuInit(0) })?;
    let mut device: sys::CUdevice = 0;
    // SAFETY: valid out-pointer; an out-of-range ordinal is an error code.
    setup("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut device, ordinal)
    })?;
    let mut vmm: c_int = 0;
    // SAFETY: valid out-pointer and a device from `cuDeviceGet`.
    setup("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut vmm,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
            device,
        )
    })?;
    if vmm == 0 {
        return Err(Unavailable(format!(
            "device {ordinal} does not support virtual memory management"
        )));
    }
    let mut name_buf = [0u8; 256];
    // SAFETY: the buffer is 256 writable bytes and its length is passed.
    let named = unsafe {
        sys::cuDeviceGetName(
            name_buf.as_mut_ptr().cast(),
            name_buf.len() as c_int,
            device,
        )
    };
    let name = if ok(named) {
        let end = name_buf.iter().position(|b| *b == 0).unwrap_or(0);
        String::from_utf8_lossy(&name_buf[..end]).into_owned()
    } else {
        "unknown".to_owned()
    };
    let mut version: c_int = 0;
    // SAFETY: valid out-pointer.
    let _ = unsafe { sys::cuDriverGetVersion(&mut version) };
    let mut context: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out-pointer and a device from `cuDeviceGet`.
    setup("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut context, device)
    })?;
    // SAFETY: the context was just retained and is live.
    let pushed = unsafe { sys::cuCtxPushCurrent_v2(context) };
    if !ok(pushed) {
        // SAFETY: the matching release of the retain above.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(device) };
        return Err(Unavailable(format!(
            "cuCtxPushCurrent failed: {}",
            result_name(pushed)
        )));
    }
    let guard = Context { device };
    let prop = allocation_prop(ordinal);
    let mut granularity: usize = 0;
    let mut recommended: usize = 0;
    // SAFETY: valid out-pointers and a fully initialised `prop` that lives
    // across both calls.
    setup("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    // SAFETY: as above.
    let _ = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut recommended,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    };
    if granularity == 0 {
        return Err(Unavailable(
            "cuMemGetAllocationGranularity answered 0".to_owned(),
        ));
    }
    Ok(Device {
        ordinal,
        context,
        name,
        version,
        granularity: granularity as u64,
        recommended: recommended as u64,
        _guard: guard,
    })
}

/// The probe's report, printed and written as it goes.
struct Report {
    /// When the last case ended (or the probe started).
    since: Instant,
    header: Vec<(String, Json)>,
    answers: Json,
    cases: Json,
    out: Option<PathBuf>,
}

impl Report {
    fn new(out: Option<PathBuf>) -> Report {
        Report {
            since: Instant::now(),
            header: vec![("probe".to_owned(), Json::str("map_probe"))],
            answers: Json::obj(),
            cases: Json::obj(),
            out,
        }
    }

    fn header(&mut self, key: &str, value: Json) {
        self.header.push((key.to_owned(), value));
    }

    /// The whole report as one object.
    fn object(&self, complete: bool) -> Json {
        let mut all = Json::Obj(self.header.clone());
        all.set("complete", Json::Bool(complete))
            .set("answers", self.answers.clone())
            .set("cases", self.cases.clone());
        all
    }

    /// Rewrites the `--out` file with the report so far (through a rename,
    /// so a reader never sees half of it).
    fn write(&self, complete: bool) {
        let Some(path) = &self.out else { return };
        let tmp = path.with_extension("json.tmp");
        let written = std::fs::write(&tmp, format!("{}\n", self.object(complete)))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            eprintln!("map_probe: cannot write {}: {e}", path.display());
        }
    }

    /// Prints one JSON line on stdout and flushes it.
    fn emit(line: &Json) {
        let mut stdout = std::io::stdout().lock();
        let _ = writeln!(stdout, "{line}");
        let _ = stdout.flush();
    }

    /// The header, before the first case.
    fn start(&mut self) {
        self.since = Instant::now();
        Report::emit(&Json::Obj(self.header.clone()));
        self.write(false);
    }

    /// One case done: printed, flushed and written before the next runs.
    fn case(&mut self, name: &str, mut result: Json) {
        result.set("case_us", Json::micros(self.since.elapsed()));
        self.since = Instant::now();
        let answer = match result.get("answer") {
            Some(Json::Str(s)) => s.clone(),
            _ => "unknown".to_owned(),
        };
        eprintln!("map_probe: {name}: {answer}");
        let mut line = Json::obj();
        line.set("case", Json::str(name))
            .set("result", result.clone());
        Report::emit(&line);
        self.answers.set(name, Json::Str(answer));
        self.cases.set(name, result);
        self.write(false);
    }

    /// Every case done.
    fn finish(&self) {
        let mut line = Json::obj();
        line.set("probe", Json::str("map_probe"))
            .set("complete", Json::Bool(true))
            .set("answers", self.answers.clone());
        Report::emit(&line);
        self.write(true);
    }
}

/// Runs every case, reporting each as it goes.
fn run(ordinal: c_int, report: &mut Report) -> Result<(), Unavailable> {
    let device = open(ordinal)?;
    report.header("available", Json::Bool(true));
    report.header("device", Json::Str(device.name.clone()));
    report.header("ordinal", Json::num(ordinal));
    report.header("driver_version", Json::num(device.version));
    report.header("granularity", Json::num(device.granularity));
    report.header("recommended_granularity", Json::num(device.recommended));
    report.start();
    let mut probe = device.probe();
    report.case("map_offset_one_granule", map_one_granule(&mut probe, true));
    report.case("map_prefix_one_granule", map_one_granule(&mut probe, false));
    report.case(
        "set_access_one_granule_of_two",
        set_access_one_granule(&mut probe),
    );
    report.case(
        "set_access_across_adjacent_reservations",
        set_access_across_reservations(&mut probe),
    );
    report.case(
        "unmap_two_adjacent_mappings",
        unmap_two_adjacent(&mut probe),
    );
    report.case(
        "per_thread_stream_is_per_thread",
        per_thread_stream(&mut probe, device.context),
    );
    report.case("relaxed_capture_calls", relaxed_capture(&mut probe));
    drop(probe);
    // Last, each in a process of its own: a wrong order may kill a context.
    for name in CHILD_CASES {
        report.case(name, run_child(name, ordinal));
    }
    report.finish();
    drop(device);
    Ok(())
}

/// `--child NAME`: one child case, its result as one JSON line on stdout.
fn child(name: &str, ordinal: c_int) -> ExitCode {
    let device = match open(ordinal) {
        Ok(device) => device,
        Err(Unavailable(reason)) => {
            let mut out = Json::obj();
            out.set("answer", Json::str("not_run"))
                .set("reason", Json::Str(reason));
            Report::emit(&out);
            return ExitCode::from(77);
        }
    };
    let mut probe = device.probe();
    let result = match name {
        "unmap_waits_for_queued_work" => unmap_queued(&mut probe, false),
        "unmap_waits_for_queued_device_work" => unmap_queued(&mut probe, true),
        _ => {
            eprintln!("map_probe: no child case {name}");
            return ExitCode::from(2);
        }
    };
    Report::emit(&result);
    drop(probe);
    drop(device);
    ExitCode::SUCCESS
}

fn usage() -> ExitCode {
    eprintln!("usage: map_probe [--device N] [--out FILE]");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut ordinal: c_int = 0;
    let mut out: Option<PathBuf> = None;
    let mut child_case: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next();
        match (flag.as_str(), value) {
            ("--device", Some(v)) => match v.parse::<c_int>() {
                Ok(n) if n >= 0 => ordinal = n,
                _ => return usage(),
            },
            ("--out", Some(v)) => out = Some(PathBuf::from(v)),
            ("--child", Some(v)) => child_case = Some(v),
            _ => return usage(),
        }
    }
    if let Some(name) = child_case {
        return child(&name, ordinal);
    }
    let mut report = Report::new(out);
    match run(ordinal, &mut report) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Unavailable(reason)) => {
            report.header("available", Json::Bool(false));
            report.header("reason", Json::Str(reason));
            report.start();
            report.write(true);
            ExitCode::from(77)
        }
    }
}
