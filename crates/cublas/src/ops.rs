//! The BLAS calls torch's `libtorch_cuda.so` imports: GEMMs (plain,
//! `Ex`, strided batched), GEMV, dot products, triangular solves, and the
//! batched LU, QR and least-squares routines. Each is checked as cuBLAS's
//! reference says (a live handle; operations, sides, fill modes and
//! diagonals among their values; sizes and batch counts not negative;
//! leading dimensions at least the rows they hold; strides not zero;
//! scalars and arrays present where work is done), answers
//! `CUBLAS_STATUS_INVALID_VALUE` otherwise, and is queued on the handle's
//! stream as one kernel of opaque work (it computes nothing). An empty
//! problem queues nothing, as cuBLAS launches nothing for it. A result
//! returned in host memory (dot products in host pointer mode, `info`)
//! waits for the stream first, as cuBLAS does; the value is left as it was
//! (nothing is computed), except `info`, which reports the arguments'
//! check (0: valid).

#![allow(non_snake_case)] // cuBLAS's names
#![allow(clippy::missing_safety_doc)] // cuBLAS's reference is the contract
#![allow(clippy::too_many_arguments)] // cuBLAS's signatures

use std::ffi::{c_int, c_void};

use crate::handle::{self, Handle};
use crate::lt::Status;

/// `CUBLAS_STATUS_INVALID_VALUE`.
pub const INVALID_VALUE: Status = 7;

/// What a call answers: `Ok` or the status to return.
pub type Answer<T> = Result<T, Status>;

/// The status a result ends in.
pub fn status(r: Answer<()>) -> Status {
    r.err().unwrap_or(0)
}

/// `Ok` where `cond` holds, else `INVALID_VALUE`.
pub fn require(cond: bool) -> Answer<()> {
    if cond {
        Ok(())
    } else {
        Err(INVALID_VALUE)
    }
}

/// Writes `v` through the client's out-pointer; `INVALID_VALUE` for null.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub unsafe fn out<T>(p: *mut T, v: T) -> Answer<()> {
    require(!p.is_null())?;
    // SAFETY: non-null, valid by the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

/// `cublasOperation_t`: N, T, C.
fn operation(t: c_int) -> bool {
    (0..=2).contains(&t)
}

/// `cublasSideMode_t`, `cublasFillMode_t` (lower, upper), `cublasDiagType_t`.
fn binary(v: c_int) -> bool {
    v == 0 || v == 1
}

/// A leading dimension that holds `rows` rows.
fn leading(ld: c_int, rows: c_int) -> bool {
    ld >= rows.max(1)
}

/// Queues the work unless the problem is empty (the caller has checked
/// the handle).
fn run(h: Handle, empty: bool) -> Answer<()> {
    if empty {
        Ok(())
    } else {
        handle::enqueue(h)
    }
}

/// A GEMM's arguments.
struct Gemm {
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    lda: c_int,
    ldb: c_int,
    ldc: c_int,
    batch: c_int,
    /// `alpha` and `beta`.
    scalars: [*const c_void; 2],
    /// `A`, `B` and `C`.
    arrays: [*const c_void; 3],
}

impl Gemm {
    /// Scalars present, and the matrices where the product reads them.
    fn present(&self) -> bool {
        let [a, b, c] = self.arrays;
        self.scalars.iter().all(|p| !p.is_null())
            && !c.is_null()
            && (self.k == 0 || (!a.is_null() && !b.is_null()))
    }
}

fn gemm(h: Handle, g: Gemm) -> Answer<()> {
    handle::settings(h)?;
    require(operation(g.ta) && operation(g.tb))?;
    require(g.m >= 0 && g.n >= 0 && g.k >= 0 && g.batch >= 0)?;
    require(leading(g.lda, if g.ta == 0 { g.m } else { g.k }))?;
    require(leading(g.ldb, if g.tb == 0 { g.k } else { g.n }))?;
    require(leading(g.ldc, g.m))?;
    let empty = g.m == 0 || g.n == 0 || g.batch == 0;
    require(empty || g.present())?;
    run(h, empty)
}

/// A GEMM whose types are given (`Ex`): the matrices' types, and the
/// compute type and algorithm where the call takes them.
fn gemm_ex(h: Handle, g: Gemm, types: [c_int; 3], compute_algo: Option<(c_int, c_int)>) -> Status {
    let known = types.into_iter().all(data_type)
        && compute_algo.is_none_or(|(compute, algo)| compute_type(compute) && gemm_algo(algo));
    status(require(known).and_then(|()| gemm(h, g)))
}

/// `cudaDataType_t` values (`library_types.h`).
fn data_type(t: c_int) -> bool {
    (0..=33).contains(&t)
}

/// `cublasComputeType_t` values, and the legacy `cudaDataType_t` ones
/// `cublasGemmEx` still takes.
fn compute_type(t: c_int) -> bool {
    matches!(t, 64 | 65 | 68 | 69 | 70..=79) || data_type(t)
}

/// `cublasGemmAlgo_t`: the default (-1), the listed ones (0-23), the
/// tensor-op ones (99-115).
fn gemm_algo(a: c_int) -> bool {
    (-1..=23).contains(&a) || (99..=115).contains(&a)
}

macro_rules! gemm_v2 {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, ta: c_int, tb: c_int, m: c_int, n: c_int, k: c_int,
            alpha: *const c_void, a: *const c_void, lda: c_int,
            b: *const c_void, ldb: c_int,
            beta: *const c_void, c: *mut c_void, ldc: c_int,
        ) -> Status {
            status(gemm(h, Gemm {
                ta, tb, m, n, k, lda, ldb, ldc, batch: 1,
                scalars: [alpha.cast(), beta.cast()],
                arrays: [a, b, c.cast_const()],
            }))
        }
    )*};
}
gemm_v2!(
    cublasSgemm_v2,
    cublasDgemm_v2,
    cublasCgemm_v2,
    cublasZgemm_v2
);

macro_rules! gemm_strided_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, ta: c_int, tb: c_int, m: c_int, n: c_int, k: c_int,
            alpha: *const c_void, a: *const c_void, lda: c_int, _stride_a: i64,
            b: *const c_void, ldb: c_int, _stride_b: i64,
            beta: *const c_void, c: *mut c_void, ldc: c_int, _stride_c: i64,
            batch: c_int,
        ) -> Status {
            status(gemm(h, Gemm {
                ta, tb, m, n, k, lda, ldb, ldc, batch,
                scalars: [alpha.cast(), beta.cast()],
                arrays: [a, b, c.cast_const()],
            }))
        }
    )*};
}
gemm_strided_batched!(
    cublasSgemmStridedBatched,
    cublasDgemmStridedBatched,
    cublasCgemmStridedBatched,
    cublasZgemmStridedBatched,
);

#[no_mangle]
pub unsafe extern "C" fn cublasSgemmEx(
    h: Handle,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    beta: *const f32,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
) -> Status {
    let g = Gemm {
        ta,
        tb,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        batch: 1,
        scalars: [alpha.cast(), beta.cast()],
        arrays: [a, b, c.cast_const()],
    };
    gemm_ex(h, g, [a_type, b_type, c_type], None)
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmEx(
    h: Handle,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    compute: c_int,
    algo: c_int,
) -> Status {
    let g = Gemm {
        ta,
        tb,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        batch: 1,
        scalars: [alpha.cast(), beta.cast()],
        arrays: [a, b, c.cast_const()],
    };
    gemm_ex(h, g, [a_type, b_type, c_type], Some((compute, algo)))
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmStridedBatchedEx(
    h: Handle,
    ta: c_int,
    tb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    a_type: c_int,
    lda: c_int,
    _stride_a: i64,
    b: *const c_void,
    b_type: c_int,
    ldb: c_int,
    _stride_b: i64,
    beta: *const c_void,
    c: *mut c_void,
    c_type: c_int,
    ldc: c_int,
    _stride_c: i64,
    batch: c_int,
    compute: c_int,
    algo: c_int,
) -> Status {
    let g = Gemm {
        ta,
        tb,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        batch,
        scalars: [alpha.cast(), beta.cast()],
        arrays: [a, b, c.cast_const()],
    };
    gemm_ex(h, g, [a_type, b_type, c_type], Some((compute, algo)))
}

fn gemv(
    h: Handle,
    trans: c_int,
    m: c_int,
    n: c_int,
    lda: c_int,
    incx: c_int,
    incy: c_int,
    present: bool,
) -> Answer<()> {
    handle::settings(h)?;
    require(operation(trans) && m >= 0 && n >= 0 && leading(lda, m) && incx != 0 && incy != 0)?;
    let empty = m == 0 || n == 0;
    require(empty || present)?;
    run(h, empty)
}

macro_rules! gemv_v2 {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, trans: c_int, m: c_int, n: c_int,
            alpha: *const c_void, a: *const c_void, lda: c_int,
            x: *const c_void, incx: c_int,
            beta: *const c_void, y: *mut c_void, incy: c_int,
        ) -> Status {
            let present = !alpha.is_null() && !beta.is_null() && !a.is_null() && !x.is_null() && !y.is_null();
            status(gemv(h, trans, m, n, lda, incx, incy, present))
        }
    )*};
}
gemv_v2!(
    cublasSgemv_v2,
    cublasDgemv_v2,
    cublasCgemv_v2,
    cublasZgemv_v2
);

/// A dot product: queued; where its result goes to host memory (host
/// pointer mode), the call waits for the stream as cuBLAS does.
fn dot(h: Handle, n: c_int, present: bool, result: *mut c_void) -> Answer<()> {
    let s = handle::settings(h)?;
    require(!result.is_null())?;
    if n <= 0 {
        // cuBLAS writes 0 for an empty dot product; in device pointer mode
        // that is a kernel's write, which the simulated GPU does not make.
        return Ok(());
    }
    require(present)?;
    handle::enqueue(h)?;
    if s.pointer_mode == 0 {
        handle::synchronize(h)?;
    }
    Ok(())
}

macro_rules! dot_v2 {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, n: c_int, x: *const c_void, incx: c_int,
            y: *const c_void, incy: c_int, result: *mut c_void,
        ) -> Status {
            status(dot(h, n, !x.is_null() && !y.is_null() && incx != 0 && incy != 0, result))
        }
    )*};
}
dot_v2!(
    cublasSdot_v2,
    cublasDdot_v2,
    cublasCdotu_v2,
    cublasCdotc_v2,
    cublasZdotu_v2,
    cublasZdotc_v2
);

#[no_mangle]
pub unsafe extern "C" fn cublasDotEx(
    h: Handle,
    n: c_int,
    x: *const c_void,
    x_type: c_int,
    incx: c_int,
    y: *const c_void,
    y_type: c_int,
    incy: c_int,
    result: *mut c_void,
    result_type: c_int,
    execution_type: c_int,
) -> Status {
    let types = [x_type, y_type, result_type, execution_type]
        .into_iter()
        .all(data_type);
    status(require(types).and_then(|()| {
        dot(
            h,
            n,
            !x.is_null() && !y.is_null() && incx != 0 && incy != 0,
            result,
        )
    }))
}

/// A triangular solve's arguments.
fn trsm(
    h: Handle,
    side: c_int,
    uplo: c_int,
    trans: c_int,
    diag: c_int,
    m: c_int,
    n: c_int,
    lda: c_int,
    ldb: c_int,
    batch: c_int,
    present: bool,
) -> Answer<()> {
    handle::settings(h)?;
    require(binary(side) && binary(uplo) && operation(trans) && binary(diag))?;
    require(m >= 0 && n >= 0 && batch >= 0)?;
    require(leading(lda, if side == 0 { m } else { n }) && leading(ldb, m))?;
    let empty = m == 0 || n == 0 || batch == 0;
    require(empty || present)?;
    run(h, empty)
}

macro_rules! trsm_v2 {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, side: c_int, uplo: c_int, trans: c_int, diag: c_int,
            m: c_int, n: c_int, alpha: *const c_void,
            a: *const c_void, lda: c_int, b: *mut c_void, ldb: c_int,
        ) -> Status {
            let present = !alpha.is_null() && !a.is_null() && !b.is_null();
            status(trsm(h, side, uplo, trans, diag, m, n, lda, ldb, 1, present))
        }
    )*};
}
trsm_v2!(
    cublasStrsm_v2,
    cublasDtrsm_v2,
    cublasCtrsm_v2,
    cublasZtrsm_v2
);

macro_rules! trsm_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, side: c_int, uplo: c_int, trans: c_int, diag: c_int,
            m: c_int, n: c_int, alpha: *const c_void,
            a: *const *const c_void, lda: c_int, b: *const *mut c_void, ldb: c_int,
            batch: c_int,
        ) -> Status {
            let present = !alpha.is_null() && !a.is_null() && !b.is_null();
            status(trsm(h, side, uplo, trans, diag, m, n, lda, ldb, batch, present))
        }
    )*};
}
trsm_batched!(
    cublasStrsmBatched,
    cublasDtrsmBatched,
    cublasCtrsmBatched,
    cublasZtrsmBatched
);

/// Writes `info` (host memory) after the arguments' check: 0, or minus the
/// position of the first invalid argument, as cuBLAS's batched solvers do.
///
/// # Safety
/// `info` is null or writable.
unsafe fn host_info(info: *mut c_int, invalid_at: Option<c_int>) -> Answer<()> {
    // SAFETY: the caller's contract.
    unsafe { out(info, invalid_at.map_or(0, |i| -i)) }?;
    require(invalid_at.is_none())
}

macro_rules! getrf_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, n: c_int, a: *const *mut c_void, lda: c_int,
            _pivots: *mut c_int, info: *mut c_int, batch: c_int,
        ) -> Status {
            status((|| {
                handle::settings(h)?;
                require(n >= 0 && leading(lda, n) && batch >= 0)?;
                let empty = n == 0 || batch == 0;
                require(empty || (!a.is_null() && !info.is_null()))?;
                run(h, empty)
            })())
        }
    )*};
}
getrf_batched!(
    cublasSgetrfBatched,
    cublasDgetrfBatched,
    cublasCgetrfBatched,
    cublasZgetrfBatched
);

macro_rules! getrs_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, trans: c_int, n: c_int, nrhs: c_int,
            a: *const *const c_void, lda: c_int, pivots: *const c_int,
            b: *const *mut c_void, ldb: c_int, info: *mut c_int, batch: c_int,
        ) -> Status {
            status((|| {
                handle::settings(h)?;
                let invalid_at = [
                    (!operation(trans), 1), (n < 0, 2), (nrhs < 0, 3),
                    (!leading(lda, n), 5), (!leading(ldb, n), 8), (batch < 0, 10),
                ].into_iter().find(|(bad, _)| *bad).map(|(_, i)| i);
                // SAFETY: the client's host `info`.
                unsafe { host_info(info, invalid_at) }?;
                let empty = n == 0 || nrhs == 0 || batch == 0;
                require(empty || (!a.is_null() && !pivots.is_null() && !b.is_null()))?;
                run(h, empty)
            })())
        }
    )*};
}
getrs_batched!(
    cublasSgetrsBatched,
    cublasDgetrsBatched,
    cublasCgetrsBatched,
    cublasZgetrsBatched
);

macro_rules! geqrf_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, m: c_int, n: c_int, a: *const *mut c_void, lda: c_int,
            tau: *const *mut c_void, info: *mut c_int, batch: c_int,
        ) -> Status {
            status((|| {
                handle::settings(h)?;
                let invalid_at = [(m < 0, 1), (n < 0, 2), (!leading(lda, m), 4), (batch < 0, 7)]
                    .into_iter().find(|(bad, _)| *bad).map(|(_, i)| i);
                // SAFETY: the client's host `info`.
                unsafe { host_info(info, invalid_at) }?;
                let empty = m == 0 || n == 0 || batch == 0;
                require(empty || (!a.is_null() && !tau.is_null()))?;
                run(h, empty)
            })())
        }
    )*};
}
geqrf_batched!(
    cublasSgeqrfBatched,
    cublasDgeqrfBatched,
    cublasCgeqrfBatched,
    cublasZgeqrfBatched
);

macro_rules! gels_batched {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name(
            h: Handle, trans: c_int, m: c_int, n: c_int, nrhs: c_int,
            a: *const *mut c_void, lda: c_int, c: *const *mut c_void, ldc: c_int,
            info: *mut c_int, _dev_info: *mut c_int, batch: c_int,
        ) -> Status {
            status((|| {
                handle::settings(h)?;
                // cuBLAS's gelsBatched solves only m >= n, without transpose.
                let invalid_at = [
                    (trans != 0, 1), (m < 0, 2), (n < 0 || n > m, 3), (nrhs < 0, 4),
                    (!leading(lda, m), 6), (!leading(ldc, m.max(n)), 8), (batch < 0, 11),
                ].into_iter().find(|(bad, _)| *bad).map(|(_, i)| i);
                // SAFETY: the client's host `info`.
                unsafe { host_info(info, invalid_at) }?;
                let empty = m == 0 || n == 0 || nrhs == 0 || batch == 0;
                require(empty || (!a.is_null() && !c.is_null()))?;
                run(h, empty)
            })())
        }
    )*};
}
gels_batched!(
    cublasSgelsBatched,
    cublasDgelsBatched,
    cublasCgelsBatched,
    cublasZgelsBatched
);
