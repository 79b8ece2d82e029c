//! `cublasLtMatmul` and what picks its algorithm: heuristics, algorithm
//! descriptors (`cublasLtMatmulAlgo_t`, 64 bytes the caller owns) and their
//! configuration attributes.
//!
//! A matmul is checked as cuBLASLt checks it (live handle and descriptors,
//! the stream of the handle's context, dimensions that agree with the
//! transposes, leading dimensions, equal batch counts, matching types, an
//! epilogue's pointers, the workspace the algorithm needs) and queued on its
//! stream as one kernel of opaque work. It computes nothing: the face's
//! algorithms need no workspace, which the heuristic says
//! (`workspaceSize` 0).

#![allow(non_snake_case)] // cuBLAS's names
#![allow(clippy::missing_safety_doc)] // cuBLAS's reference is the contract
#![allow(clippy::too_many_arguments)] // cuBLASLt's signatures

use std::ffi::c_void;

use crate::attributes::{Values, ALGO_CONFIG};
use crate::descriptors::{
    known_compute_type, known_data_type, read, LAYOUTS, MATMUL_DESCS, PREFERENCES,
};
use crate::device::Opaque;
use crate::handle;
use crate::status::{out, require, status, Answer, Status, INVALID_VALUE, NOT_SUPPORTED};

/// cuBLAS 13.4.1, the wheel's (`CUBLAS_VERSION`).
pub const VERSION: usize = 130_401;

/// `cublasLtMatmulAlgo_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct Algo {
    data: [u64; 8],
}

/// `cublasLtMatmulHeuristicResult_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct HeuristicResult {
    algo: Algo,
    workspace_size: usize,
    state: Status,
    waves_count: f32,
    reserved: [i32; 4],
}

/// The mark in the first word of an algorithm the face initialised, so that
/// an uninitialised one is refused as cuBLASLt refuses it.
const ALGO_MARK: u32 = 0x5154_4c41; // "QTLA"
/// The algorithm ids the face knows (`cublasLtMatmulAlgoInit`).
const ALGO_IDS: std::ops::Range<i32> = 0..64;

impl Algo {
    fn bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        for (i, w) in self.data.iter().enumerate() {
            b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        b
    }

    fn from_bytes(b: [u8; 64]) -> Algo {
        let mut data = [0u64; 8];
        for (i, w) in data.iter_mut().enumerate() {
            let mut word = [0u8; 8];
            word.copy_from_slice(&b[i * 8..i * 8 + 8]);
            *w = u64::from_le_bytes(word);
        }
        Algo { data }
    }

    /// An initialised algorithm `id` with every configuration at its default.
    fn new(id: i32) -> Algo {
        let mut config = Values::new(ALGO_CONFIG);
        config.put(0, id as u32 as u64);
        Algo::with_config(&config)
    }

    fn with_config(config: &Values) -> Algo {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&ALGO_MARK.to_le_bytes());
        for (slot, a) in ALGO_CONFIG.iter().enumerate() {
            let v = config.get(a.id).to_le_bytes();
            b[4 + slot * 4..4 + slot * 4 + a.size].copy_from_slice(&v[..a.size]);
        }
        Algo::from_bytes(b)
    }

    /// Its configuration; `INVALID_VALUE` where the face did not initialise it.
    fn config(&self) -> Answer<Values> {
        let b = self.bytes();
        require(b[0..4] == ALGO_MARK.to_le_bytes())?;
        let mut config = Values::new(ALGO_CONFIG);
        for (slot, a) in ALGO_CONFIG.iter().enumerate() {
            let mut v = [0u8; 8];
            v[..a.size].copy_from_slice(&b[4 + slot * 4..4 + slot * 4 + a.size]);
            config.put(a.id, u64::from_le_bytes(v));
        }
        Ok(config)
    }
}

/// One matrix layout's figures.
#[derive(Debug, Clone, Copy)]
struct Layout {
    data_type: u32,
    rows: u64,
    cols: u64,
    batch: i32,
}

fn layout(p: *const c_void) -> Answer<Layout> {
    let v = read(&LAYOUTS, p, Values::clone)?;
    let (data_type, order, rows, cols, ld) = (
        v.get(0) as u32,
        v.get(1),
        v.get(2),
        v.get(3),
        v.get(4) as i64,
    );
    // COL and ROW orders; the tiled IMMA orders are not modelled.
    let leading = match order {
        0 => rows,
        1 => cols,
        _ => return Err(NOT_SUPPORTED),
    };
    require(ld >= 1 && ld as u64 >= leading.max(1))?;
    let batch = v.get(5) as u32 as i32;
    require(batch >= 0)?;
    Ok(Layout {
        data_type,
        rows,
        cols,
        batch,
    })
}

/// The problem a matmul describes.
#[derive(Debug, Clone, Copy)]
struct Problem {
    m: u64,
    n: u64,
    k: u64,
    batch: i32,
}

impl Problem {
    fn empty(&self) -> bool {
        self.m == 0 || self.n == 0 || self.batch == 0
    }
}

const FP8: [u32; 2] = [28, 29];
/// `CUBLASLT_EPILOGUE_BIAS`, `BGRADA`, `BGRADB`: need the bias pointer.
const EPILOGUE_BIAS_BITS: u64 = 4 | 256 | 512;
/// The `_AUX` epilogues: need the auxiliary pointer.
const EPILOGUE_AUX_BIT: u64 = 128;

/// Checks a matmul's descriptor and layouts against each other, as
/// cuBLASLt does before choosing or running an algorithm.
fn problem(
    desc: *const c_void,
    a: *const c_void,
    b: *const c_void,
    c: *const c_void,
    d: *const c_void,
) -> Answer<Problem> {
    let desc = read(&MATMUL_DESCS, desc, Values::clone)?;
    let (ta, tb) = (desc.get(3), desc.get(4));
    require(ta <= 2 && tb <= 2)?;
    let (a, b, c, d) = (layout(a)?, layout(b)?, layout(c)?, layout(d)?);
    let (m, n) = (d.rows, d.cols);
    require(c.rows == m && c.cols == n)?;
    let (a_rows, k) = if ta == 0 {
        (a.rows, a.cols)
    } else {
        (a.cols, a.rows)
    };
    let (b_rows, b_cols) = if tb == 0 {
        (b.rows, b.cols)
    } else {
        (b.cols, b.rows)
    };
    require(a_rows == m && b_rows == k && b_cols == n)?;
    require(a.batch == d.batch && b.batch == d.batch && c.batch == d.batch)?;
    let fp8_inputs = FP8.contains(&a.data_type) && FP8.contains(&b.data_type);
    let types_agree = a.data_type == b.data_type && c.data_type == d.data_type;
    if !types_agree && !fp8_inputs {
        return Err(NOT_SUPPORTED);
    }
    let epilogue = desc.get(7);
    if epilogue & EPILOGUE_BIAS_BITS != 0 {
        require(desc.get(8) != 0)?;
    }
    if epilogue & EPILOGUE_AUX_BIT != 0 {
        require(desc.get(11) != 0)?;
    }
    Ok(Problem {
        m,
        n,
        k,
        batch: d.batch,
    })
}

fn result(algo: Algo) -> HeuristicResult {
    HeuristicResult {
        algo,
        workspace_size: 0,
        state: 0,
        waves_count: 1.0,
        reserved: [0; 4],
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtGetVersion() -> usize {
    VERSION
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoGetHeuristic(
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    d: *mut c_void,
    preference: *mut c_void,
    requested: i32,
    results: *mut HeuristicResult,
    returned: *mut i32,
) -> Status {
    status((|| {
        handle::lookup(handle)?;
        require(requested > 0 && !results.is_null() && !returned.is_null())?;
        read(&PREFERENCES, preference, |_| ())?;
        problem(desc, a, b, c, d)?;
        // SAFETY: the client's array of `requested` (> 0) results and its
        // out-pointer.
        unsafe {
            out(results, result(Algo::new(0)))?;
            out(returned, 1)
        }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoInit(
    handle: *mut c_void,
    compute: i32,
    scale: i32,
    a_type: i32,
    b_type: i32,
    c_type: i32,
    d_type: i32,
    id: i32,
    algo: *mut Algo,
) -> Status {
    status((|| {
        handle::lookup(handle)?;
        require(known_compute_type(compute) && ALGO_IDS.contains(&id))?;
        require(
            [scale, a_type, b_type, c_type, d_type]
                .into_iter()
                .all(known_data_type),
        )?;
        // SAFETY: the client's out-pointer.
        unsafe { out(algo, Algo::new(id)) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoCheck(
    handle: *mut c_void,
    desc: *mut c_void,
    a: *mut c_void,
    b: *mut c_void,
    c: *mut c_void,
    d: *mut c_void,
    algo: *const Algo,
    checked: *mut HeuristicResult,
) -> Status {
    status((|| {
        handle::lookup(handle)?;
        problem(desc, a, b, c, d)?;
        // SAFETY: the client's algorithm, or null.
        let algo = unsafe { algo.as_ref() }.copied().ok_or(INVALID_VALUE)?;
        algo.config()?;
        require(!checked.is_null())?;
        // SAFETY: non-null, the client's result; its `algo` is not updated.
        unsafe {
            (*checked).workspace_size = 0;
            (*checked).state = 0;
            (*checked).waves_count = 1.0;
        }
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoConfigSetAttribute(
    algo: *mut Algo,
    attr: u32,
    buf: *const c_void,
    size: usize,
) -> Status {
    status((|| {
        // The algorithm's id is read-only.
        require(attr != 0)?;
        // SAFETY: the client's algorithm, or null.
        let a = unsafe { algo.as_mut() }.ok_or(INVALID_VALUE)?;
        let mut config = a.config()?;
        // SAFETY: the client's buffer of `size` bytes.
        unsafe { config.set_from(attr, buf, size) }?;
        *a = Algo::with_config(&config);
        Ok(())
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmulAlgoConfigGetAttribute(
    algo: *const Algo,
    attr: u32,
    buf: *mut c_void,
    size: usize,
    written: *mut usize,
) -> Status {
    status((|| {
        // SAFETY: the client's algorithm, or null.
        let a = unsafe { algo.as_ref() }.ok_or(INVALID_VALUE)?;
        // SAFETY: the client's buffer and out-pointer.
        unsafe { a.config()?.get_into(attr, buf, size, written) }
    })())
}

#[no_mangle]
pub unsafe extern "C" fn cublasLtMatmul(
    handle: *mut c_void,
    desc: *mut c_void,
    alpha: *const c_void,
    a_ptr: *const c_void,
    a: *mut c_void,
    b_ptr: *const c_void,
    b: *mut c_void,
    beta: *const c_void,
    c_ptr: *const c_void,
    c: *mut c_void,
    d_ptr: *mut c_void,
    d: *mut c_void,
    algo: *const Algo,
    workspace: *mut c_void,
    workspace_size: usize,
    stream: Opaque,
) -> Status {
    status((|| {
        handle::check_stream(handle, stream)?;
        let p = problem(desc, a, b, c, d)?;
        // SAFETY: the client's algorithm, or null (cuBLASLt then chooses).
        if let Some(algo) = unsafe { algo.as_ref() } {
            algo.config()?;
        }
        require(!alpha.is_null() && !beta.is_null())?;
        require(workspace_size == 0 || !workspace.is_null())?;
        if p.empty() {
            return Ok(());
        }
        require(!d_ptr.is_null() && !c_ptr.is_null())?;
        require(p.k == 0 || (!a_ptr.is_null() && !b_ptr.is_null()))?;
        handle::enqueue(handle, stream)
    })())
}
