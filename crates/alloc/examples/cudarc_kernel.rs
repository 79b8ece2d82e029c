//! A cudarc kernel on Quilt memory: two Quilt buffers as cudarc device
//! slices (`quilt_alloc::cuda_buffer::CudaBuffer`), filled by cudarc's copy,
//! read and written by a kernel launched with cudarc's launch builder on a
//! second stream, read back on the first and checked.
//!
//! ```sh
//! cargo run --release -p quilt-alloc --example cudarc_kernel
//! ```
//!
//! Where there is no CUDA driver or device it prints
//! `skipped: no CUDA device (<reason>)` and exits 0; on a GPU it exits 0
//! only if every element came back as the kernel computed it.

use std::error::Error;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use quilt_alloc::cuda_buffer::CudaBuffer;
use quilt_alloc::quilt::{QuiltAllocator, QuiltConfig};
use quilt_alloc::DeviceAllocator;
use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::Vmm;

/// `out[i] = in[i] * a + b` for `i < n` (PTX ISA 7.0, any GPU from sm_52).
const AFFINE_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry affine(
    .param .u64 p_in,
    .param .u64 p_out,
    .param .u32 p_n,
    .param .u32 p_a,
    .param .u32 p_b
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<8>;

    ld.param.u64 %rd1, [p_in];
    ld.param.u64 %rd2, [p_out];
    ld.param.u32 %r1, [p_n];
    ld.param.u32 %r2, [p_a];
    ld.param.u32 %r3, [p_b];
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mov.u32 %r6, %tid.x;
    mad.lo.s32 %r7, %r4, %r5, %r6;
    setp.ge.u32 %p1, %r7, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd3, %rd1;
    cvta.to.global.u64 %rd4, %rd2;
    mul.wide.u32 %rd5, %r7, 4;
    add.s64 %rd6, %rd3, %rd5;
    add.s64 %rd7, %rd4, %rd5;
    ld.global.u32 %r8, [%rd6];
    mad.lo.s32 %r9, %r8, %r2, %r3;
    st.global.u32 [%rd7], %r9;
DONE:
    ret;
}
"#;

/// Elements per buffer: 3 Mi `u32`s, 12 MiB, several of Quilt's pages.
const N: u32 = 3 << 20;
const A: u32 = 7;
const B: u32 = 11;

fn main() -> Result<(), Box<dyn Error>> {
    // The backend checks for libcuda before any driver call; cudarc would
    // panic on its first call without one.
    let cuda = match CudaVmm::new(0) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            println!("skipped: no CUDA device ({e})");
            return Ok(());
        }
    };
    println!("device 0: {}", cuda.device_name());
    let vmm: Arc<dyn Vmm> = cuda.clone();
    let alloc: Arc<dyn DeviceAllocator> =
        Arc::new(QuiltAllocator::new(vmm, QuiltConfig::default())?);
    let ctx = CudaContext::new(0)?;
    let s1 = ctx.new_stream()?;
    let s2 = ctx.new_stream()?;
    let func = ctx
        .load_module(Ptx::from_src(AFFINE_PTX))?
        .load_function("affine")?;

    let input: Vec<u32> = (0..N).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let mut xs = CudaBuffer::<u32>::new(alloc.clone(), &cuda, s1.clone(), N as usize)?;
    let mut ys = CudaBuffer::<u32>::new(alloc.clone(), &cuda, s1.clone(), N as usize)?;
    s1.memcpy_htod(&input, &mut xs)?;
    {
        // On s2, a stream the buffers were not allocated on: s2 waits for
        // the copy on s1, and s1 waits for the kernel before the read-back.
        let (x_ptr, _x_read) = xs.device_ptr(&s2);
        let (y_ptr, _y_write) = ys.device_ptr_mut(&s2);
        let mut launch = s2.launch_builder(&func);
        launch.arg(&x_ptr).arg(&y_ptr).arg(&N).arg(&A).arg(&B);
        // SAFETY: `affine` takes (u64, u64, u32, u32, u32), as pushed; both
        // pointers address N u32s of live Quilt buffers, which outlive the
        // kernel (they are freed on s1 after s1 waits for s2's work).
        unsafe { launch.launch(LaunchConfig::for_num_elems(N)) }?;
    }
    let output: Vec<u32> = s1.clone_dtoh(&ys)?;
    let wrong = input
        .iter()
        .zip(&output)
        .filter(|(x, y)| x.wrapping_mul(A).wrapping_add(B) != **y)
        .count();
    println!("{}", alloc.memory_summary());
    drop((xs, ys));
    s1.synchronize()?;
    if wrong > 0 {
        return Err(format!("{wrong} of {N} elements differ from in * {A} + {B}").into());
    }
    println!("ok: {N} elements computed by a cudarc kernel in Quilt memory");
    Ok(())
}
