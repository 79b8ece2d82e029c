//! Attribute tables of cuBLASLt's descriptors (`cublasLt.h`): which
//! attributes a descriptor has, the size of each value, and get/set with
//! cuBLASLt's checks. Every value fits 8 bytes (integers, enums, floats and
//! device or host pointers), kept little-endian in a `u64`.

use std::ffi::c_void;

use crate::status::{out, require, Answer, INVALID_VALUE};

/// One attribute: its number, the size of its value, its default.
#[derive(Debug, Clone, Copy)]
pub struct Attribute {
    /// The enum value (`CUBLASLT_MATMUL_DESC_TRANSA`, ...).
    pub id: u32,
    /// `sizeof` its value type.
    pub size: usize,
    /// Its value until set.
    pub default: u64,
}

/// Shorthand for the tables.
const fn attr(id: u32, size: usize, default: u64) -> Attribute {
    Attribute { id, size, default }
}

/// `cublasLtMatmulDescAttributes_t` (compute and scale types are set by
/// `cublasLtMatmulDescCreate`, in place of these defaults).
pub const MATMUL_DESC: &[Attribute] = &[
    attr(0, 4, 0),                // COMPUTE_TYPE
    attr(1, 4, 0),                // SCALE_TYPE
    attr(2, 4, 0),                // POINTER_MODE: HOST
    attr(3, 4, 0),                // TRANSA: CUBLAS_OP_N
    attr(4, 4, 0),                // TRANSB
    attr(5, 4, 0),                // TRANSC
    attr(6, 4, 2),                // FILL_MODE: CUBLAS_FILL_MODE_FULL
    attr(7, 4, 1),                // EPILOGUE: DEFAULT
    attr(8, 8, 0),                // BIAS_POINTER
    attr(10, 8, 0),               // BIAS_BATCH_STRIDE
    attr(11, 8, 0),               // EPILOGUE_AUX_POINTER
    attr(12, 8, 0),               // EPILOGUE_AUX_LD
    attr(13, 8, 0),               // EPILOGUE_AUX_BATCH_STRIDE
    attr(14, 8, 0),               // ALPHA_VECTOR_BATCH_STRIDE
    attr(15, 4, 0),               // SM_COUNT_TARGET
    attr(17, 8, 0),               // A_SCALE_POINTER
    attr(18, 8, 0),               // B_SCALE_POINTER
    attr(19, 8, 0),               // C_SCALE_POINTER
    attr(20, 8, 0),               // D_SCALE_POINTER
    attr(21, 8, 0),               // AMAX_D_POINTER
    attr(22, 4, u32::MAX as u64), // EPILOGUE_AUX_DATA_TYPE: -1
    attr(23, 8, 0),               // EPILOGUE_AUX_SCALE_POINTER
    attr(24, 8, 0),               // EPILOGUE_AUX_AMAX_POINTER
    attr(25, 1, 0),               // FAST_ACCUM
    attr(26, 4, u32::MAX as u64), // BIAS_DATA_TYPE: -1
    attr(31, 4, 0),               // A_SCALE_MODE
    attr(32, 4, 0),               // B_SCALE_MODE
    attr(33, 4, 0),               // C_SCALE_MODE
    attr(34, 4, 0),               // D_SCALE_MODE
    attr(35, 4, 0),               // EPILOGUE_AUX_SCALE_MODE
    attr(36, 8, 0),               // D_OUT_SCALE_POINTER
    attr(37, 4, 0),               // D_OUT_SCALE_MODE
    attr(38, 8, 0),               // EMULATION_DESCRIPTOR
    attr(39, 8, 0),               // ALPHA_BATCH_STRIDE
    attr(40, 8, 0),               // BETA_BATCH_STRIDE
];

/// `cublasLtMatrixLayoutAttribute_t` (type, rows, cols and ld are set by
/// `cublasLtMatrixLayoutCreate`).
pub const MATRIX_LAYOUT: &[Attribute] = &[
    attr(0, 4, 0),  // TYPE
    attr(1, 4, 0),  // ORDER: CUBLASLT_ORDER_COL
    attr(2, 8, 0),  // ROWS
    attr(3, 8, 0),  // COLS
    attr(4, 8, 0),  // LD
    attr(5, 4, 1),  // BATCH_COUNT
    attr(6, 8, 0),  // STRIDED_BATCH_OFFSET
    attr(7, 8, 0),  // PLANE_OFFSET
    attr(8, 4, 0),  // BATCH_MODE: STRIDED
    attr(9, 8, 0),  // GROUPED_MATRIX_LAYOUT_ROWS_ARRAY
    attr(10, 8, 0), // GROUPED_MATRIX_LAYOUT_COLS_ARRAY
    attr(11, 8, 0), // GROUPED_MATRIX_LAYOUT_LD_ARRAY
    attr(12, 4, 0), // ..._ROWS_COLS_ARRAY_INTEGER_WIDTH
    attr(13, 4, 0), // ..._LD_ARRAY_INTEGER_WIDTH
];

/// `cublasLtMatmulPreferenceAttributes_t`.
pub const MATMUL_PREFERENCE: &[Attribute] = &[
    attr(0, 4, 0),         // SEARCH_MODE: BEST_FIT
    attr(1, 8, 0),         // MAX_WORKSPACE_BYTES: no workspace allowed
    attr(3, 4, 0x7),       // REDUCTION_SCHEME_MASK: all
    attr(5, 4, 256),       // MIN_ALIGNMENT_A_BYTES
    attr(6, 4, 256),       // MIN_ALIGNMENT_B_BYTES
    attr(7, 4, 256),       // MIN_ALIGNMENT_C_BYTES
    attr(8, 4, 256),       // MIN_ALIGNMENT_D_BYTES
    attr(9, 4, 0),         // MAX_WAVES_COUNT (a float: 0.0)
    attr(12, 8, u64::MAX), // IMPL_MASK: everything
    attr(13, 4, 0),        // GROUPED_AVERAGE_REDUCTION_DIM
    attr(14, 4, 0),        // GROUPED_DESC_D_AVERAGE_ROWS
    attr(15, 4, 0),        // GROUPED_DESC_D_AVERAGE_COLS
];

/// `cublasLtMatmulAlgoConfigAttributes_t` (kept inside the algo struct).
pub const ALGO_CONFIG: &[Attribute] = &[
    attr(0, 4, 0), // ID (read-only)
    attr(1, 4, 0), // TILE_ID: UNDEFINED
    attr(2, 4, 1), // SPLITK_NUM
    attr(3, 4, 0), // REDUCTION_SCHEME: NONE
    attr(4, 4, 0), // CTA_SWIZZLING
    attr(5, 4, 0), // CUSTOM_OPTION
    attr(6, 4, 0), // STAGES_ID
    attr(7, 2, 0), // INNER_SHAPE_ID
    attr(8, 2, 0), // CLUSTER_SHAPE_ID
];

/// The values of one descriptor's attributes.
#[derive(Debug, Clone)]
pub struct Values {
    table: &'static [Attribute],
    values: Vec<u64>,
}

impl Values {
    /// Every attribute of `table` at its default.
    pub fn new(table: &'static [Attribute]) -> Self {
        Values {
            table,
            values: table.iter().map(|a| a.default).collect(),
        }
    }

    fn index(&self, id: u32) -> Answer<usize> {
        self.table
            .iter()
            .position(|a| a.id == id)
            .ok_or(INVALID_VALUE)
    }

    /// The value of attribute `id` (the tables' numbers are the face's own
    /// constants, so an unknown one is a bug of the face: 0).
    pub fn get(&self, id: u32) -> u64 {
        self.index(id).map_or(0, |i| self.values[i])
    }

    /// Sets attribute `id` to `v`.
    pub fn put(&mut self, id: u32, v: u64) {
        if let Ok(i) = self.index(id) {
            self.values[i] = v;
        }
    }

    /// `...SetAttribute`: `INVALID_VALUE` for an unknown attribute, a null
    /// buffer, or a size other than the value's.
    ///
    /// # Safety
    /// `buf` is null or readable for `size` bytes.
    pub unsafe fn set_from(&mut self, id: u32, buf: *const c_void, size: usize) -> Answer<()> {
        let i = self.index(id)?;
        require(!buf.is_null() && size == self.table[i].size)?;
        let mut bytes = [0u8; 8];
        // SAFETY: `buf` is readable for `size` (at most 8) bytes.
        unsafe { std::ptr::copy_nonoverlapping(buf.cast::<u8>(), bytes.as_mut_ptr(), size) };
        self.values[i] = u64::from_le_bytes(bytes);
        Ok(())
    }

    /// `...GetAttribute`: with `size` 0 and a null buffer, only the size
    /// needed (through `written`); otherwise `size` must be at least the
    /// value's. `INVALID_VALUE` for an unknown attribute or a wrong call.
    ///
    /// # Safety
    /// `buf` is null or writable for `size` bytes; `written` is null or
    /// writable.
    pub unsafe fn get_into(
        &self,
        id: u32,
        buf: *mut c_void,
        size: usize,
        written: *mut usize,
    ) -> Answer<()> {
        let i = self.index(id)?;
        let need = self.table[i].size;
        if size == 0 && buf.is_null() {
            // SAFETY: the caller's out-pointer.
            return unsafe { out(written, need) };
        }
        require(!buf.is_null() && size >= need)?;
        let bytes = self.values[i].to_le_bytes();
        // SAFETY: `buf` is writable for `size` >= `need` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), need) };
        if !written.is_null() {
            // SAFETY: non-null, writable by the caller's contract.
            unsafe { written.write(need) };
        }
        Ok(())
    }
}
