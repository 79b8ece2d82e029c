//! map_probe: asks the real CUDA driver the questions Quilt's driver layer
//! answers strictly, and prints what the driver said, as one JSON object.
//!
//! ```text
//! cargo run --release -p quilt-vmm --example map_probe -- [--device N]
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
//!    each mapped with its own handle, and one `cuMemSetAccess` across both.
//!
//! Where the driver accepts a map, the probe checks what the mapping shows:
//! the handle's two granules are first filled with different bytes through a
//! whole mapping (`cuMemsetD8`), and the new mapping is read back
//! (`cuMemcpyDtoH`), so "accepted" and "really maps that granule" are told
//! apart. Memory is only touched where access was set, so a refusal cannot
//! fault the context and spoil the cases after it.
//!
//! Output: one JSON object on stdout, `{"probe": "map_probe", "available":
//! true, "device": ..., "cases": {...}}`; each case lists every driver call
//! made with its `CUresult` (code and name) and an `answer` (`accepted`,
//! `refused`, or `not_run` with the reason). Exit status 0 when the probe ran
//! (whatever the driver answered), 77 when there is no usable CUDA driver or
//! device (the JSON then says `"available": false` and why), 2 on bad usage.

use std::ffi::{c_int, c_void};
use std::fmt::{self, Write as _};
use std::process::ExitCode;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// A JSON value (enough for this report).
enum Json {
    Bool(bool),
    Num(i128),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
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

    fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    fn num(n: impl Into<i128>) -> Json {
        Json::Num(n.into())
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
            Json::Bool(b) => write!(f, "{b}"),
            Json::Num(n) => write!(f, "{n}"),
            Json::Str(s) => write_str(f, s),
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

    /// `cuMemUnmap(ptr, size)` of one mapping made by [`Probe::map`].
    fn unmap(&mut self, case: &mut Case, ptr: u64, size: u64) -> sys::CUresult {
        sync(case);
        // SAFETY: exactly one mapping of this probe; the context was just
        // synchronised, so no queued work still uses it.
        let r = unsafe { sys::cuMemUnmap(ptr, size as usize) };
        case.note("cuMemUnmap", format!("{ptr:#x}, size={size:#x}"), r);
        if ok(r) {
            self.mappings.retain(|&(p, _)| p != ptr);
        }
        r
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

/// Case 4: one `cuMemSetAccess` across two adjacent reservations, each mapped
/// with its own one-granule handle.
fn set_access_across_reservations(p: &mut Probe) -> Json {
    let g = p.granularity;
    let mut case =
        Case::new("cuMemSetAccess across two adjacent one-granule reservations, each mapped whole");
    // First try: a reservation, then one asked for right after it.
    let mut pair = None;
    if let Some(a) = p.reserve(&mut case, g, 0) {
        match p.reserve(&mut case, g, a + g) {
            Some(b) if b == a + g => pair = Some((a, b)),
            Some(b) if b + g == a => pair = Some((b, a)),
            Some(b) => {
                p.address_free(&mut case, b, g);
                p.address_free(&mut case, a, g);
            }
            None => {
                p.address_free(&mut case, a, g);
            }
        }
    }
    // Second try: find two free granules by reserving them as one range,
    // free it, and reserve each half at its address.
    if pair.is_none() {
        if let Some(both) = p.reserve(&mut case, 2 * g, 0) {
            if p.address_free(&mut case, both, 2 * g) {
                let a = p.reserve(&mut case, g, both);
                let b = p.reserve(&mut case, g, both + g);
                if let (Some(a), Some(b)) = (a, b) {
                    if b == a + g {
                        pair = Some((a, b));
                    }
                }
            }
        }
    }
    let Some((a, b)) = pair else {
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
        // SAFETY: `run` pushed the primary context on this thread before
        // making this guard; `popped` is a valid out-pointer.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
        // SAFETY: the primary context of `device` was retained once in `run`;
        // this is the matching release.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

fn run(ordinal: c_int) -> Result<Json, Unavailable> {
    // SAFETY: only tries to load libcuda by its usual names; calls no CUDA
    // function and never panics.
    if !unsafe { sys::is_culib_present() } {
        return Err(Unavailable(
            "libcuda could not be loaded: no CUDA driver on this machine".to_owned(),
        ));
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
    let _context = Context { device };
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
    let mut probe = Probe {
        ordinal,
        granularity: granularity as u64,
        mappings: Vec::new(),
        handles: Vec::new(),
        reservations: Vec::new(),
    };
    let mut cases = Json::obj();
    cases.set("map_offset_one_granule", map_one_granule(&mut probe, true));
    cases.set("map_prefix_one_granule", map_one_granule(&mut probe, false));
    cases.set(
        "set_access_one_granule_of_two",
        set_access_one_granule(&mut probe),
    );
    cases.set(
        "set_access_across_adjacent_reservations",
        set_access_across_reservations(&mut probe),
    );
    drop(probe);
    let mut out = Json::obj();
    out.set("probe", Json::str("map_probe"))
        .set("available", Json::Bool(true))
        .set("device", Json::Str(name))
        .set("ordinal", Json::num(ordinal))
        .set("driver_version", Json::num(version))
        .set("granularity", Json::num(granularity as u64))
        .set("recommended_granularity", Json::num(recommended as u64))
        .set("cases", cases);
    Ok(out)
}

fn main() -> ExitCode {
    let mut ordinal: c_int = 0;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next().map(|v| v.parse::<c_int>())) {
            ("--device", Some(Ok(n))) if n >= 0 => ordinal = n,
            _ => {
                eprintln!("usage: map_probe [--device N]");
                return ExitCode::from(2);
            }
        }
    }
    match run(ordinal) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(Unavailable(reason)) => {
            let mut out = Json::obj();
            out.set("probe", Json::str("map_probe"))
                .set("available", Json::Bool(false))
                .set("reason", Json::Str(reason));
            println!("{out}");
            ExitCode::from(77)
        }
    }
}
