//! The BLAS calls that only `libtorch_cuda_linalg.so` imports (torch's
//! linear algebra, which also needs NVIDIA's cuSOLVER: it reaches the
//! driver through tables the double does not have, so `torch.linalg` on
//! CUDA cannot run on the simulated GPU). Each answers
//! `CUBLAS_STATUS_NOT_SUPPORTED` and names itself on standard error, never
//! a silent success. The arguments are not read, so one signature serves
//! every call (the caller's arguments are left in its registers and stack,
//! as the C calling convention allows).

#![allow(non_snake_case)] // cuBLAS's names
#![allow(missing_docs)] // each is the cuBLAS function of the same name

use crate::lt::Status;

/// `CUBLAS_STATUS_NOT_SUPPORTED`.
const NOT_SUPPORTED: Status = 15;

macro_rules! refused {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> Status {
            eprintln!(
                "quilt cuBLAS face: {} is not implemented on the simulated GPU (torch.linalg needs cuSOLVER)",
                stringify!($name)
            );
            NOT_SUPPORTED
        }
    )*};
}

refused!(
    cublasCaxpy_v2,
    cublasCcopy_v2,
    cublasCgemmBatched,
    cublasCgerc_v2,
    cublasCgeru_v2,
    cublasChemm_v2,
    cublasChemv_v2,
    cublasCher2_v2,
    cublasCher2k_v2,
    cublasCher_v2,
    cublasCherk_v2,
    cublasCrot_v2,
    cublasCrotg_v2,
    cublasCscal_v2,
    cublasCsrot_v2,
    cublasCsscal_v2,
    cublasCswap_v2,
    cublasCsymm_v2,
    cublasCsymv_v2,
    cublasCsyr2_v2,
    cublasCsyr2k_v2,
    cublasCsyr_v2,
    cublasCsyrk_v2,
    cublasCtrmm_v2,
    cublasCtrmv_v2,
    cublasCtrsv_v2,
    cublasDasum_v2,
    cublasDaxpy_v2,
    cublasDcopy_v2,
    cublasDgemmBatched,
    cublasDger_v2,
    cublasDnrm2_v2,
    cublasDrot_v2,
    cublasDrotg_v2,
    cublasDrotm_v2,
    cublasDrotmg_v2,
    cublasDscal_v2,
    cublasDswap_v2,
    cublasDsymm_v2,
    cublasDsymv_v2,
    cublasDsyr2_v2,
    cublasDsyr2k_v2,
    cublasDsyr_v2,
    cublasDsyrk_v2,
    cublasDtrmm_v2,
    cublasDtrmv_v2,
    cublasDtrsv_v2,
    cublasDzasum_v2,
    cublasDznrm2_v2,
    cublasGetMatrixAsync,
    cublasGetVectorAsync,
    cublasIcamax_v2,
    cublasIcamin_v2,
    cublasIdamax_v2,
    cublasIdamin_v2,
    cublasIsamax_v2,
    cublasIsamin_v2,
    cublasIzamax_v2,
    cublasIzamin_v2,
    cublasSasum_v2,
    cublasSaxpy_v2,
    cublasScasum_v2,
    cublasScnrm2_v2,
    cublasScopy_v2,
    cublasSetMatrixAsync,
    cublasSetVectorAsync,
    cublasSgemmBatched,
    cublasSger_v2,
    cublasSnrm2_v2,
    cublasSrot_v2,
    cublasSrotg_v2,
    cublasSrotm_v2,
    cublasSrotmg_v2,
    cublasSscal_v2,
    cublasSswap_v2,
    cublasSsymm_v2,
    cublasSsymv_v2,
    cublasSsyr2_v2,
    cublasSsyr2k_v2,
    cublasSsyr_v2,
    cublasSsyrk_v2,
    cublasStrmm_v2,
    cublasStrmv_v2,
    cublasStrsv_v2,
    cublasZaxpy_v2,
    cublasZcopy_v2,
    cublasZdrot_v2,
    cublasZdscal_v2,
    cublasZgemmBatched,
    cublasZgerc_v2,
    cublasZgeru_v2,
    cublasZhemm_v2,
    cublasZhemv_v2,
    cublasZher2_v2,
    cublasZher2k_v2,
    cublasZher_v2,
    cublasZherk_v2,
    cublasZrot_v2,
    cublasZrotg_v2,
    cublasZscal_v2,
    cublasZswap_v2,
    cublasZsymm_v2,
    cublasZsymv_v2,
    cublasZsyr2_v2,
    cublasZsyr2k_v2,
    cublasZsyr_v2,
    cublasZsyrk_v2,
    cublasZtrmm_v2,
    cublasZtrmv_v2,
    cublasZtrsv_v2,
);
