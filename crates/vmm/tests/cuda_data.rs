//! CUDA backend checks.
//!
//! The first test runs in the test process itself: without `libcuda` (every
//! CI machine) construction must return `Unavailable`, never panic. The
//! others run over the CUDA double (`quilt-cuda-double`), each in a child
//! process; on a GPU machine `QUILT_CUDA_TESTS=real cargo test --release -p
//! quilt-vmm --test cuda_data` runs them on the real driver
//! (`scripts/gpu-check.sh` does), and there a missing device is a failure. They check data through
//! stitched mappings (one handle per page, each mapped whole: CUDA's rule)
//! with `cuMemcpyHtoD` / `cuMemcpyDtoH`, streams and events, and that
//! nothing leaks.

mod stitch;

use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{CallKind, DevicePtr, Vmm, VmmError};
use stitch::DeviceBytes;

impl DeviceBytes for CudaVmm {
    fn write(&self, ptr: DevicePtr, data: &[u8]) -> quilt_vmm::Result<()> {
        self.copy_to_device(ptr, data)
    }

    fn read(&self, ptr: DevicePtr, out: &mut [u8]) -> quilt_vmm::Result<()> {
        self.copy_from_device(ptr, out)
    }
}

fn libcuda_present() -> bool {
    // SAFETY: only tries to load the library by name; calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The backend on device 0 (the double's, or a GPU's); a test fails without one.
#[allow(clippy::panic)] // a test helper: no device fails the test
fn gpu() -> CudaVmm {
    match CudaVmm::new(0) {
        Ok(v) => v,
        Err(e) => panic!("this test needs CUDA device 0: {e}"),
    }
}

#[test]
fn construction_without_a_driver_or_device_is_a_typed_error() {
    let result = CudaVmm::new(0);
    if !libcuda_present() {
        match result {
            Err(VmmError::Unavailable { reason }) => {
                assert!(reason.to_string().contains("libcuda"), "{reason}")
            }
            other => panic!("expected Unavailable without libcuda, got {other:?}"),
        }
    } else {
        // A driver but perhaps no device: a typed error or a working backend.
        match result {
            Ok(v) => {
                assert!(v.granularity().is_power_of_two());
                eprintln!("cuda_data: {v:?}");
            }
            Err(e) => assert!(matches!(e, VmmError::Unavailable { .. }), "{e}"),
        }
    }
    // An absurd ordinal is a typed error on every machine.
    assert!(matches!(
        CudaVmm::new(1 << 20),
        Err(VmmError::Unavailable { .. })
    ));
}

#[test]
fn stitched_pages_hold_what_each_handle_holds() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let g = v.granularity();
    let scene = stitch::stitch_three_handles(&v, 11);

    // Release while mapped: memory stays until the last unmap.
    for h in &scene.handles {
        v.release(*h).unwrap();
    }
    let mut again = vec![0u8; g as usize];
    v.copy_from_device(scene.stitched + g, &mut again).unwrap();
    assert!(again[8..] == scene.contents[0][8..g as usize]);

    v.unmap(scene.stitched, 4 * g).unwrap();
    for p in &scene.private {
        v.unmap(*p, 2 * g).unwrap();
        v.address_free(*p, 2 * g).unwrap();
    }
    v.address_free(scene.stitched, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
    let stats = v.driver_stats();
    assert_eq!(stats.count(CallKind::Create), 6);
    assert_eq!(stats.failed[CallKind::Create.index()], 0);
    assert!(stats.measured_ns > 0);
}

#[test]
fn streams_and_events_order_work() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let s1 = v.create_stream().unwrap();
    let s2 = v.create_stream().unwrap();
    let e = v.event_record(s1).unwrap();
    v.stream_wait_event(s2, e).unwrap();
    v.stream_synchronize(s2).unwrap();
    v.stream_synchronize(s1).unwrap();
    assert!(
        v.event_query(e).unwrap(),
        "complete after its stream synchronised"
    );
    v.event_destroy(e).unwrap();
    assert!(matches!(
        v.event_query(e),
        Err(VmmError::InvalidArgument {
            argument: "event",
            ..
        })
    ));
    v.destroy_stream(s1).unwrap();
    assert!(matches!(
        v.event_record(s1),
        Err(VmmError::InvalidArgument {
            argument: "stream",
            ..
        })
    ));
    assert!(v.destroy_stream(s1).is_err());
    v.destroy_stream(s2).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn out_of_memory_names_the_size_and_what_is_free() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let g = v.granularity();
    let too_much = (v.total_memory() / g + 1) * g;
    match v.create(too_much) {
        Err(VmmError::OutOfMemory {
            call: CallKind::Create,
            requested,
            available,
        }) => {
            assert_eq!(requested, too_much);
            assert!(available <= v.total_memory());
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let info = v.mem_info().unwrap();
    assert!(info.free <= info.total && info.total == v.total_memory());
}

#[test]
fn drop_gives_back_what_a_careless_user_left() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let g = v.granularity();
    let va = v.reserve(2 * g, 0).unwrap();
    let h = v.create(2 * g).unwrap();
    v.map(va, 2 * g, h, 0).unwrap();
    v.set_access(va, 2 * g).unwrap();
    let _ = v.event_record(quilt_vmm::StreamId::DEFAULT).unwrap();
    let _ = v.create_stream().unwrap();
    let live = v.leak_report();
    assert_eq!(
        (
            live.handles.len(),
            live.mappings.len(),
            live.reservations.len(),
            live.events
        ),
        (1, 1, 1, 1)
    );
    // Drop unmaps, releases, frees and destroys it all (free memory is not
    // compared: other tests share the device). The device stays usable.
    drop(v);
    let w = gpu();
    let va = w.reserve(g, 0).unwrap();
    w.address_free(va, g).unwrap();
    assert!(w.leak_report().is_clean());
}

/// The calling thread's current context (null when none).
fn current_context() -> cudarc::driver::sys::CUcontext {
    let mut ctx: cudarc::driver::sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; only called once libcuda is loaded and
    // initialised (a backend was constructed).
    let r = unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
    assert_eq!(r, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    ctx
}

#[test]
fn calls_leave_the_threads_context_as_they_found_it() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let g = v.granularity();
    // A fresh thread has no current context; construction and every call
    // leave it so.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert!(current_context().is_null(), "a fresh thread");
            let w = CudaVmm::new(0).unwrap();
            assert!(current_context().is_null(), "after construction");
            let va = w.reserve(g, 0).unwrap();
            let h = w.create(g).unwrap();
            w.map(va, g, h, 0).unwrap();
            w.set_access(va, g).unwrap();
            w.copy_to_device(va, &[7u8; 64]).unwrap();
            let mut back = [0u8; 64];
            w.copy_from_device(va, &mut back).unwrap();
            assert_eq!(back, [7u8; 64]);
            w.mem_info().unwrap();
            assert!(current_context().is_null(), "after calls");
            w.unmap(va, g).unwrap();
            w.release(h).unwrap();
            w.address_free(va, g).unwrap();
            drop(w);
            assert!(current_context().is_null(), "after drop");
        });
    });
    drop(v);
}

#[test]
fn destroyed_events_are_pooled_and_recorded_again() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return; // ran over the CUDA double in a child process
    }
    let v = gpu();
    let s = quilt_vmm::StreamId::DEFAULT;
    let a = v.event_record(s).unwrap();
    let b = v.event_record(s).unwrap();
    assert_eq!(v.pooled_events(), 0);
    v.event_destroy(a).unwrap();
    v.event_destroy(b).unwrap();
    assert_eq!(v.pooled_events(), 2);
    // A new id on a reused driver event; the old ids stay dead.
    let c = v.event_record(s).unwrap();
    assert_eq!(v.pooled_events(), 1);
    assert!(c != a && c != b);
    assert!(v.event_query(a).is_err());
    v.stream_synchronize(s).unwrap();
    assert!(v.event_query(c).unwrap());
    v.event_destroy(c).unwrap();
    assert_eq!(v.leak_report().events, 0);
    assert_eq!(v.pooled_events(), 2);
}
