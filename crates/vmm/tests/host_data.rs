//! Data checks on the host backend: bytes written through VMM-style mappings
//! really land in the physical pages they map, so stitching, aliasing and
//! remapping can be tested on real memory.
//!
//! Each test makes its own backend, under CUDA's map rule (a mapping covers
//! its handle whole) unless it is about offsets on purpose, where it uses
//! [`MapRule::AnyOffset`]; every test ends with a clean leak report.

#![cfg(all(target_os = "linux", target_pointer_width = "64"))]
// Test code: a failed expectation is a panic (clippy's test allowance covers
// only `#[test]` functions, not the helpers here).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod stitch;

use quilt_vmm::host::{HostConfig, HostVmm};
use quilt_vmm::{CallKind, DevicePtr, MapRule, PhysHandle, Vmm, VmmError};
use stitch::{pattern, DeviceBytes};

const MIB: u64 = 1 << 20;

fn config() -> HostConfig {
    HostConfig {
        granularity: 2 * MIB,
        capacity: 64 * MIB,
    }
}

fn backend() -> quilt_vmm::Result<HostVmm> {
    HostVmm::new(config())
}

/// A backend under the relaxed map rule, for tests about offsets on purpose.
fn relaxed_backend() -> HostVmm {
    let v = HostVmm::with_map_rule(config(), MapRule::AnyOffset).unwrap();
    assert_eq!(v.map_rule(), MapRule::AnyOffset);
    v
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

impl DeviceBytes for HostVmm {
    fn write(&self, ptr: DevicePtr, data: &[u8]) -> quilt_vmm::Result<()> {
        self.write_bytes(ptr, data)
    }

    fn read(&self, ptr: DevicePtr, out: &mut [u8]) -> quilt_vmm::Result<()> {
        self.read_bytes(ptr, out)
    }
}

/// Reserves `reserve` bytes, creates `size` bytes and maps them read-write at
/// the start of the reservation; returns (reservation, handle).
fn mapped_rw(v: &HostVmm, reserve: u64, size: u64) -> (DevicePtr, PhysHandle) {
    let va = v.reserve(reserve, 0).unwrap();
    let h = v.create(size).unwrap();
    map_rw(v, va, size, h, 0).unwrap();
    (va, h)
}

/// Unmaps `size` bytes at `va`, releases `h`, frees the reservation of
/// `reserve` bytes, and checks that nothing is left alive.
fn finish(v: &HostVmm, va: DevicePtr, reserve: u64, h: PhysHandle, size: u64) {
    v.unmap(va, size).unwrap();
    v.release(h).unwrap();
    v.address_free(va, reserve).unwrap();
    assert_clean(v);
}

#[track_caller]
fn assert_clean(v: &HostVmm) {
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn bytes_written_read_back_through_a_mapping() {
    let v = backend().unwrap();
    let g = v.granularity();
    let (va, h) = mapped_rw(&v, 2 * g, 2 * g);

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

    finish(&v, va, 2 * g, h, 2 * g);
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
    assert_clean(&v);
}

#[test]
fn a_range_stitched_from_three_handles_reads_back_each_handle() {
    let v = backend().unwrap();
    let g = v.granularity();
    let scene = stitch::stitch_three_handles(&v, 40);

    // Four neighbouring mappings in one call.
    v.unmap(scene.stitched, 4 * g).unwrap();
    // The buffer the seam write did not touch still holds what was written.
    let mut back = vec![0u8; 2 * g as usize];
    v.read_bytes(scene.private[1], &mut back).unwrap();
    assert!(back == scene.contents[1]);
    for i in 0..3 {
        v.unmap(scene.private[i], 2 * g).unwrap();
        v.address_free(scene.private[i], 2 * g).unwrap();
    }
    for h in &scene.handles {
        v.release(*h).unwrap();
    }
    v.address_free(scene.stitched, 4 * g).unwrap();
    assert_clean(&v);
}

#[test]
fn unmapping_and_remapping_a_page_elsewhere_keeps_its_bytes() {
    let v = backend().unwrap();
    let g = v.granularity();
    // Three pages, one handle each, mapped side by side.
    let first = v.reserve(3 * g, 0).unwrap();
    let handles: Vec<PhysHandle> = (0..3).map(|_| v.create(g).unwrap()).collect();
    for (i, h) in handles.iter().enumerate() {
        v.map(first + i as u64 * g, g, *h, 0).unwrap();
    }
    v.set_access(first, 3 * g).unwrap();
    let data = pattern(3 * g as usize, 99);
    v.write_bytes(first, &data).unwrap();
    v.unmap(first, 3 * g).unwrap();

    // Remap only the middle page's handle, at the start of another reservation.
    let second = v.reserve(2 * g, 0).unwrap();
    map_rw(&v, second, g, handles[1], 0).unwrap();
    let mut back = vec![0u8; g as usize];
    v.read_bytes(second, &mut back).unwrap();
    assert!(back == data[g as usize..2 * g as usize]);
    // And the old place is gone.
    assert!(matches!(
        v.read_bytes(first + g, &mut back),
        Err(VmmError::NotMapped { .. })
    ));

    v.unmap(second, g).unwrap();
    for h in handles {
        v.release(h).unwrap();
    }
    v.address_free(first, 3 * g).unwrap();
    v.address_free(second, 2 * g).unwrap();
    assert_clean(&v);
}

#[test]
fn relaxed_rule_remaps_one_page_of_a_handle_elsewhere() {
    let v = relaxed_backend();
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
    assert_clean(&v);
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

    finish(&v, va, 4 * g, h, 2 * g);
}

#[test]
fn bad_input_returns_typed_errors_and_changes_nothing() {
    let v = backend().unwrap();
    let g = v.granularity();
    let (va, h) = mapped_rw(&v, 4 * g, 2 * g);
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
    invalid(v.map(va + 4 * g, 2 * g, h, 0), CallKind::Map, "ptr");
    invalid(v.map(va + 2 * g, 3 * g, h, 0), CallKind::Map, "offset");
    // CUDA's rule: offset zero, the handle whole.
    invalid(v.map(va + 2 * g, g, h, g), CallKind::Map, "offset");
    invalid(v.map(va + 2 * g, g, h, 0), CallKind::Map, "size");
    invalid(
        v.map(va + 2 * g, g, PhysHandle(12345), 0),
        CallKind::Map,
        "handle",
    );
    assert!(matches!(
        v.map(va + g, 2 * g, h, 0),
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

    finish(&v, va, 4 * g, h, 2 * g);
}

#[test]
fn threads_write_their_own_mappings_of_one_handle() {
    // Each thread maps its own page of one handle: offsets on purpose.
    let v = relaxed_backend();
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
    finish(&v, va, 4 * g, h, 4 * g);
}
