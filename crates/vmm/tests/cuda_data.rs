//! CUDA backend checks.
//!
//! Without `libcuda` (every CI machine) only the first test does something:
//! construction must return `Unavailable`, never panic. With a GPU, the others
//! check data through stitched mappings with `cuMemcpyHtoD` / `cuMemcpyDtoH`,
//! streams and events, and that nothing leaks. Each prints why it skipped.

use quilt_vmm::cuda::CudaVmm;
use quilt_vmm::{CallKind, DevicePtr, PhysHandle, Vmm, VmmError};

fn libcuda_present() -> bool {
    // SAFETY: only tries to load the library by name; calls no CUDA function.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The backend on device 0, or `None` (with the reason printed) where there is none.
fn gpu() -> Option<CudaVmm> {
    match CudaVmm::new(0) {
        Ok(v) => Some(v),
        Err(e) => {
            eprintln!("cuda_data: skipped: {e}");
            None
        }
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 9) as u8)
        .collect()
}

#[test]
fn construction_without_a_driver_or_device_is_a_typed_error() {
    let result = CudaVmm::new(0);
    if !libcuda_present() {
        match result {
            Err(VmmError::Unavailable { reason }) => {
                assert!(reason.contains("libcuda"), "{reason}")
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
    let Some(v) = gpu() else { return };
    let g = v.granularity();
    let handles: Vec<PhysHandle> = (0..3).map(|_| v.create(2 * g).unwrap()).collect();
    let private: Vec<DevicePtr> = (0..3).map(|_| v.reserve(2 * g, 0).unwrap()).collect();
    let contents: Vec<Vec<u8>> = (0..3).map(|i| pattern(2 * g as usize, 11 + i)).collect();
    for i in 0..3 {
        v.map(private[i], 2 * g, handles[i], 0).unwrap();
        // Mapped but not accessible yet: the backend refuses the copy.
        assert!(matches!(
            v.copy_to_device(private[i], &contents[i]),
            Err(VmmError::InvalidArgument {
                call: CallKind::SetAccess,
                ..
            })
        ));
        v.set_access(private[i], 2 * g).unwrap();
        v.copy_to_device(private[i], &contents[i]).unwrap();
    }
    let pieces = [(2usize, 1u64), (0, 0), (1, 1), (2, 0)];
    let stitched = v.reserve(4 * g, 0).unwrap();
    for (slot, (hi, page)) in pieces.iter().enumerate() {
        v.map(stitched + slot as u64 * g, g, handles[*hi], page * g)
            .unwrap();
    }
    v.set_access(stitched, 4 * g).unwrap();
    let mut whole = vec![0u8; 4 * g as usize];
    v.copy_from_device(stitched, &mut whole).unwrap();
    for (slot, (hi, page)) in pieces.iter().enumerate() {
        let got = &whole[slot * g as usize..(slot + 1) * g as usize];
        let want = &contents[*hi][(*page * g) as usize..((*page + 1) * g) as usize];
        assert!(got == want, "slot {slot} shows page {page} of handle {hi}");
    }
    // A write across a seam lands in two handles.
    v.copy_to_device(stitched + g - 8, b"0123456789abcdef")
        .unwrap();
    let mut head = [0u8; 8];
    v.copy_from_device(private[0], &mut head).unwrap();
    assert_eq!(&head, b"89abcdef");

    // Release while mapped: memory stays until the last unmap.
    for h in &handles {
        v.release(*h).unwrap();
    }
    let mut again = vec![0u8; g as usize];
    v.copy_from_device(stitched + g, &mut again).unwrap();
    assert!(again[8..] == contents[0][8..g as usize]);

    v.unmap(stitched, 4 * g).unwrap();
    for p in &private {
        v.unmap(*p, 2 * g).unwrap();
        v.address_free(*p, 2 * g).unwrap();
    }
    v.address_free(stitched, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
    let stats = v.driver_stats();
    assert_eq!(stats.count(CallKind::Create), 3);
    assert_eq!(stats.failed[CallKind::Create.index()], 0);
    assert!(stats.measured_ns > 0);
}

#[test]
fn streams_and_events_order_work() {
    let Some(v) = gpu() else { return };
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
    let Some(v) = gpu() else { return };
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
    let Some(v) = gpu() else { return };
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
    let Some(w) = gpu() else { return };
    let va = w.reserve(g, 0).unwrap();
    w.address_free(va, g).unwrap();
    assert!(w.leak_report().is_clean());
}
