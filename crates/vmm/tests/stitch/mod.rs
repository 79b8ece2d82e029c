//! Shared by the data tests of the host and CUDA backends (`host_data.rs`,
//! `cuda_data.rs`): a range stitched from pages of three buffers reads back,
//! slot by slot, what each page holds. Every page is its own one-granule
//! handle, mapped whole at offset 0 (CUDA's rule for `cuMemMap`), so the scene
//! runs unchanged on the CUDA backend.

// Test code: a failed expectation is a panic (clippy's test allowance covers
// only `#[test]` functions, not the helpers here).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use quilt_vmm::{CallKind, DevicePtr, PhysHandle, Vmm, VmmError};

/// A backend whose device bytes a test can write and read.
pub trait DeviceBytes: Vmm {
    /// Copies `data` to `ptr` (mapped and access-set, else a typed error).
    fn write(&self, ptr: DevicePtr, data: &[u8]) -> quilt_vmm::Result<()>;
    /// Copies `out.len()` bytes from `ptr` into `out`; same rules as `write`.
    fn read(&self, ptr: DevicePtr, out: &mut [u8]) -> quilt_vmm::Result<()>;
}

/// A byte pattern that differs at every position and per `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

/// Slot `i` of the stitched range shows page `PIECES[i].1` of buffer `PIECES[i].0`.
pub const PIECES: [(usize, u64); 4] = [(2, 1), (0, 0), (1, 1), (2, 0)];

/// Three buffers of two pages each, every page a one-granule handle; each
/// buffer mapped at its own two-page reservation (`private`, two neighbouring
/// mappings) and filled with `contents`, and a four-page reservation
/// (`stitched`) that maps the handles of [`PIECES`].
pub struct Stitched {
    /// The handles, page by page: page `p` of buffer `b` is `handles[2 * b + p]`.
    pub handles: Vec<PhysHandle>,
    /// One two-page reservation per buffer, mapping its two handles, access set.
    pub private: Vec<DevicePtr>,
    /// What was written through each buffer's private mappings.
    pub contents: Vec<Vec<u8>>,
    /// The four-page stitched reservation, mapped and access-set.
    pub stitched: DevicePtr,
}

/// Builds a [`Stitched`] scene and checks it:
/// - a copy to a mapping whose access was never set is refused;
/// - every slot of the stitched range (access set with one call over four
///   mappings, as PyTorch does) reads back its page of its buffer;
/// - a write across the seam of slots 0 and 1 lands at the end of page 1 of
///   buffer 2 and at the start of page 0 of buffer 0.
pub fn stitch_three_handles<V: DeviceBytes>(v: &V, seed: u8) -> Stitched {
    let g = v.granularity();
    let handles: Vec<PhysHandle> = (0..6).map(|_| v.create(g).unwrap()).collect();
    let private: Vec<DevicePtr> = (0..3).map(|_| v.reserve(2 * g, 0).unwrap()).collect();
    let contents: Vec<Vec<u8>> = (0..3).map(|i| pattern(2 * g as usize, seed + i)).collect();
    for i in 0..3 {
        v.map(private[i], g, handles[2 * i], 0).unwrap();
        v.map(private[i] + g, g, handles[2 * i + 1], 0).unwrap();
        // Mapped but not accessible yet: the backend refuses the copy.
        assert!(matches!(
            v.write(private[i], &contents[i]),
            Err(VmmError::InvalidArgument {
                call: CallKind::SetAccess,
                ..
            })
        ));
        v.set_access(private[i], 2 * g).unwrap();
        v.write(private[i], &contents[i]).unwrap();
    }

    let stitched = v.reserve(4 * g, 0).unwrap();
    for (slot, (buffer, page)) in PIECES.iter().enumerate() {
        let handle = handles[2 * buffer + *page as usize];
        v.map(stitched + slot as u64 * g, g, handle, 0).unwrap();
    }
    v.set_access(stitched, 4 * g).unwrap();
    let mut whole = vec![0u8; 4 * g as usize];
    v.read(stitched, &mut whole).unwrap();
    for (slot, (hi, page)) in PIECES.iter().enumerate() {
        let got = &whole[slot * g as usize..(slot + 1) * g as usize];
        let want = &contents[*hi][(*page * g) as usize..((*page + 1) * g) as usize];
        assert!(got == want, "slot {slot} shows page {page} of buffer {hi}");
    }

    v.write(stitched + g - 8, b"0123456789abcdef").unwrap();
    let mut tail = [0u8; 8];
    v.read(private[2] + 2 * g - 8, &mut tail).unwrap();
    assert_eq!(&tail, b"01234567", "end of page 1 of buffer 2");
    let mut head = [0u8; 8];
    v.read(private[0], &mut head).unwrap();
    assert_eq!(&head, b"89abcdef", "start of page 0 of buffer 0");

    Stitched {
        handles,
        private,
        contents,
        stitched,
    }
}
