//! Data checks on the host backend: bytes written through VMM-style mappings
//! really land in the physical pages they map, so stitching, aliasing and
//! remapping can be tested on real memory.
//!
//! Each test makes its own backend; every test ends with a clean leak report.

#![cfg(all(target_os = "linux", target_pointer_width = "64"))]

use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::{CallKind, DevicePtr, PhysHandle, Vmm, VmmError};

const MIB: u64 = 1 << 20;

fn backend() -> quilt_vmm::Result<HostVmm> {
    HostVmm::new(HostConfig {
        granularity: 2 * MIB,
        capacity: 64 * MIB,
    })
}

/// Maps `size` bytes of `handle` from `offset` at `ptr` and sets access.
fn map_rw(
    v: &HostVmm,
    ptr: DevicePtr,
    size: u64,
    handle: PhysHandle,
    offset: u64,
) -> quilt_vmm::Result<()> {
    v.map(ptr, size, handle, offset)?;
    v.set_access(ptr, size)
}

/// A byte pattern that differs at every position and per `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

#[test]
fn bytes_written_read_back_through_a_mapping() {
    let v = backend().unwrap();
    let g = v.granularity();
    let va = v.reserve(2 * g, 0).unwrap();
    let h = v.create(2 * g).unwrap();
    map_rw(&v, va, 2 * g, h, 0).unwrap();

    // A write across the page boundary, at an odd offset.
    let data = pattern(5000, 7);
    let at = va + g - 1234;
    v.write_bytes(at, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    v.read_bytes(at, &mut back).unwrap();
    assert_eq!(back, data);
    // Untouched bytes are still zero.
    assert!(v.check_filled(va, g - 1234, 0).unwrap());
    assert!(v
        .check_filled(
            at + data.len() as u64,
            va + 2 * g - at - data.len() as u64,
            0
        )
        .unwrap());

    // fill / check_filled over the whole mapping.
    v.fill(va, 2 * g, 0xa5).unwrap();
    assert!(v.check_filled(va, 2 * g, 0xa5).unwrap());
    v.write_bytes(va + g, &[0]).unwrap();
    assert!(!v.check_filled(va, 2 * g, 0xa5).unwrap());

    v.unmap(va, 2 * g).unwrap();
    v.release(h).unwrap();
    v.address_free(va, 2 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn one_handle_mapped_at_two_addresses_shows_the_same_bytes() {
    let v = backend().unwrap();
    let g = v.granularity();
    let a = v.reserve(g, 0).unwrap();
    let b = v.reserve(g, 0).unwrap();
    let h = v.create(g).unwrap();
    map_rw(&v, a, g, h, 0).unwrap();
    map_rw(&v, b, g, h, 0).unwrap();
    assert_ne!(a, b);

    let data = pattern(g as usize, 3);
    v.write_bytes(a, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    v.read_bytes(b, &mut back).unwrap();
    assert_eq!(
        back, data,
        "a write through one alias is seen through the other"
    );

    v.write_bytes(b + 100, b"through b").unwrap();
    let mut word = [0u8; 9];
    v.read_bytes(a + 100, &mut word).unwrap();
    assert_eq!(&word, b"through b");

    // Releasing the handle keeps the memory alive while mapped.
    v.release(h).unwrap();
    v.unmap(a, g).unwrap();
    v.read_bytes(b + 100, &mut word).unwrap();
    assert_eq!(&word, b"through b");
    v.unmap(b, g).unwrap();
    v.address_free(a, g).unwrap();
    v.address_free(b, g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn a_range_stitched_from_three_handles_reads_back_each_handle() {
    let v = backend().unwrap();
    let g = v.granularity();
    // Three handles of two pages each; one private mapping of each to write through.
    let handles: Vec<PhysHandle> = (0..3).map(|_| v.create(2 * g).unwrap()).collect();
    let private: Vec<DevicePtr> = (0..3).map(|_| v.reserve(2 * g, 0).unwrap()).collect();
    let contents: Vec<Vec<u8>> = (0..3).map(|i| pattern(2 * g as usize, 40 + i)).collect();
    for i in 0..3 {
        map_rw(&v, private[i], 2 * g, handles[i], 0).unwrap();
        v.write_bytes(private[i], &contents[i]).unwrap();
    }

    // Stitch: page 1 of handle 2, page 0 of handle 0, page 1 of handle 1, page 0 of handle 2.
    let pieces = [(2usize, 1u64), (0, 0), (1, 1), (2, 0)];
    let stitched = v.reserve(4 * g, 0).unwrap();
    for (slot, (hi, page)) in pieces.iter().enumerate() {
        v.map(stitched + slot as u64 * g, g, handles[*hi], page * g)
            .unwrap();
    }
    // One set-access over the whole stitched range, as PyTorch does.
    v.set_access(stitched, 4 * g).unwrap();

    let mut whole = vec![0u8; 4 * g as usize];
    v.read_bytes(stitched, &mut whole).unwrap();
    for (slot, (hi, page)) in pieces.iter().enumerate() {
        let got = &whole[slot * g as usize..(slot + 1) * g as usize];
        let want = &contents[*hi][(*page * g) as usize..((*page + 1) * g) as usize];
        assert!(got == want, "slot {slot} shows page {page} of handle {hi}");
    }

    // A write across a seam of the stitched range lands in two handles.
    let seam = stitched + g - 8;
    v.write_bytes(seam, b"0123456789abcdef").unwrap();
    let mut tail = [0u8; 8];
    v.read_bytes(private[2] + 2 * g - 8, &mut tail).unwrap();
    assert_eq!(&tail, b"01234567", "end of page 1 of handle 2");
    let mut head = [0u8; 8];
    v.read_bytes(private[0], &mut head).unwrap();
    assert_eq!(&head, b"89abcdef", "start of page 0 of handle 0");

    v.unmap(stitched, 4 * g).unwrap(); // four neighbouring mappings in one call
    for i in 0..3 {
        v.unmap(private[i], 2 * g).unwrap();
        v.release(handles[i]).unwrap();
        v.address_free(private[i], 2 * g).unwrap();
    }
    v.address_free(stitched, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn unmapping_and_remapping_a_page_elsewhere_keeps_its_bytes() {
    let v = backend().unwrap();
    let g = v.granularity();
    let h = v.create(3 * g).unwrap();
    let first = v.reserve(3 * g, 0).unwrap();
    map_rw(&v, first, 3 * g, h, 0).unwrap();
    let data = pattern(3 * g as usize, 99);
    v.write_bytes(first, &data).unwrap();
    v.unmap(first, 3 * g).unwrap();

    // Remap only the middle page, at the start of another reservation.
    let second = v.reserve(2 * g, 0).unwrap();
    map_rw(&v, second, g, h, g).unwrap();
    let mut back = vec![0u8; g as usize];
    v.read_bytes(second, &mut back).unwrap();
    assert!(back == data[g as usize..2 * g as usize]);
    // And the old place is gone.
    assert!(matches!(
        v.read_bytes(first + g, &mut back),
        Err(VmmError::NotMapped { .. })
    ));

    v.unmap(second, g).unwrap();
    v.release(h).unwrap();
    v.address_free(first, 3 * g).unwrap();
    v.address_free(second, 2 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn writes_need_a_mapping_and_access() {
    let v = backend().unwrap();
    let g = v.granularity();
    let va = v.reserve(4 * g, 0).unwrap();
    let h = v.create(2 * g).unwrap();

    // Reserved but not mapped.
    assert!(matches!(
        v.write_bytes(va, b"x"),
        Err(VmmError::NotMapped {
            call: CallKind::Map,
            ..
        })
    ));
    // Mapped but access never set: rejected, as on CUDA.
    v.map(va, 2 * g, h, 0).unwrap();
    for result in [
        v.write_bytes(va, b"x"),
        v.fill(va, 10, 1),
        v.read_bytes(va, &mut [0u8; 4]),
        v.check_filled(va, 4, 0).map(|_| ()),
    ] {
        assert!(
            matches!(
                result,
                Err(VmmError::InvalidArgument {
                    call: CallKind::SetAccess,
                    ..
                })
            ),
            "{result:?}"
        );
    }
    // Access on the first page only: a write spilling into the second fails
    // and writes nothing.
    v.set_access(va, g).unwrap();
    v.write_bytes(va + g - 4, b"abcd").unwrap();
    assert!(v.write_bytes(va + g - 4, b"abcdefgh").is_err());
    v.set_access(va + g, g).unwrap();
    assert!(v.check_filled(va + g, g, 0).unwrap());
    // A range running past the mapping into unmapped space.
    assert!(matches!(
        v.write_bytes(va + 2 * g - 2, b"xyz"),
        Err(VmmError::NotMapped { .. })
    ));
    // Outside every reservation, and wrapping around the address space.
    assert!(matches!(
        v.write_bytes(0x1000, b"x"),
        Err(VmmError::NotMapped { .. })
    ));
    assert!(matches!(
        v.check_filled(u64::MAX - 1, 4, 0),
        Err(VmmError::InvalidArgument { .. })
    ));
    // Empty copies are fine anywhere.
    v.write_bytes(0, &[]).unwrap();
    v.read_bytes(0, &mut []).unwrap();

    v.unmap(va, 2 * g).unwrap();
    v.release(h).unwrap();
    v.address_free(va, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn bad_input_returns_typed_errors_and_changes_nothing() {
    let v = backend().unwrap();
    let g = v.granularity();
    let va = v.reserve(4 * g, 0).unwrap();
    let h = v.create(2 * g).unwrap();
    map_rw(&v, va, 2 * g, h, 0).unwrap();
    v.fill(va, 2 * g, 0x11).unwrap();
    let before = v.leak_report();

    let invalid = |r: quilt_vmm::Result<()>, call: CallKind, arg: &str| match r {
        Err(VmmError::InvalidArgument {
            call: c,
            argument: a,
            ..
        }) => assert!(c == call && a == arg, "{c:?} {a}"),
        other => panic!("expected InvalidArgument({call:?}, {arg}), got {other:?}"),
    };
    invalid(v.map(va + 1, g, h, 0), CallKind::Map, "ptr");
    invalid(v.map(va + 2 * g, g, h, 2 * g), CallKind::Map, "offset");
    invalid(v.map(va + 4 * g, g, h, 0), CallKind::Map, "ptr");
    invalid(v.map(va + 2 * g, 3 * g, h, 0), CallKind::Map, "offset");
    invalid(
        v.map(va + 2 * g, g, PhysHandle(12345), 0),
        CallKind::Map,
        "handle",
    );
    assert!(matches!(
        v.map(va + g, g, h, 0),
        Err(VmmError::AlreadyMapped { .. })
    ));
    invalid(v.unmap(va + g, g), CallKind::Unmap, "ptr");
    invalid(v.unmap(va, g), CallKind::Unmap, "size");
    assert!(matches!(
        v.unmap(va + 2 * g, g),
        Err(VmmError::NotMapped { .. })
    ));
    assert!(matches!(
        v.set_access(va + g, 2 * g),
        Err(VmmError::NotMapped { .. })
    ));
    invalid(v.set_access(va, 0), CallKind::SetAccess, "size");
    assert!(matches!(
        v.address_free(va, 4 * g),
        Err(VmmError::StillMapped { mappings: 1, .. })
    ));
    invalid(v.address_free(va, 2 * g), CallKind::AddressFree, "size");
    invalid(
        v.reserve(g, 3 * g).map(|_| ()),
        CallKind::Reserve,
        "alignment",
    );
    invalid(v.create(g + 1).map(|_| ()), CallKind::Create, "size");
    assert!(matches!(
        v.create(128 * MIB),
        Err(VmmError::OutOfMemory {
            call: CallKind::Create,
            ..
        })
    ));

    // Nothing changed: same live objects, same bytes, still writable.
    assert_eq!(v.leak_report(), before);
    assert!(v.check_filled(va, 2 * g, 0x11).unwrap());
    v.fill(va, 2 * g, 0x22).unwrap();

    v.unmap(va, 2 * g).unwrap();
    v.release(h).unwrap();
    v.address_free(va, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn threads_write_their_own_mappings_of_one_handle() {
    let v = backend().unwrap();
    let g = v.granularity();
    let h = v.create(4 * g).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let v = &v;
            scope.spawn(move || {
                let va = v.reserve(g, 0).unwrap();
                map_rw(v, va, g, h, t * g).unwrap();
                for round in 0..20u8 {
                    v.fill(va, g, round ^ t as u8).unwrap();
                    assert!(v.check_filled(va, g, round ^ t as u8).unwrap());
                }
                v.unmap(va, g).unwrap();
                v.address_free(va, g).unwrap();
            });
        }
    });
    // Every page of the handle holds its thread's last fill.
    let va = v.reserve(4 * g, 0).unwrap();
    map_rw(&v, va, 4 * g, h, 0).unwrap();
    for t in 0..4u64 {
        assert!(v.check_filled(va + t * g, g, 19 ^ t as u8).unwrap());
    }
    v.unmap(va, 4 * g).unwrap();
    v.release(h).unwrap();
    v.address_free(va, 4 * g).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}
