//! Device memory as host memory: a reservation is a `PROT_NONE` mapping, a
//! physical handle a memory file, `cuMemMap` maps the file at the address
//! and `cuMemSetAccess` grants access, so device addresses can be read and
//! written directly. The only `unsafe` of the double besides its exports;
//! callers have checked every range against the double's own tables.

use std::os::fd::{AsFd, OwnedFd};

use rustix::fs::{fallocate, fstat, ftruncate, memfd_create, FallocateFlags, MemfdFlags};
use rustix::mm::{mmap, mmap_anonymous, mprotect, munmap, MapFlags, MprotectFlags, ProtFlags};

/// Reserves `size` bytes of address space aligned to `align` (a power of
/// two), inaccessible; `None` where the system refuses.
pub fn reserve(size: u64, align: u64) -> Option<u64> {
    let (size, align) = (usize::try_from(size).ok()?, usize::try_from(align).ok()?);
    let span = size.checked_add(align)?;
    // SAFETY: a fresh private anonymous mapping at an address the kernel
    // chooses; it aliases nothing.
    let base = unsafe {
        mmap_anonymous(
            std::ptr::null_mut(),
            span,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::NORESERVE,
        )
    }
    .ok()? as usize;
    let start = base.next_multiple_of(align);
    let (head, tail) = (start - base, span - (start - base) - size);
    // SAFETY: both pieces lie inside the mapping just made and outside the
    // aligned range kept; nothing else refers to them.
    unsafe {
        if head > 0 {
            let _ = munmap(base as *mut _, head);
        }
        if tail > 0 {
            let _ = munmap((start + size) as *mut _, tail);
        }
    }
    Some(start as u64)
}

/// Gives a reservation's address space back.
pub fn free(ptr: u64, size: u64) {
    // SAFETY: the caller names a whole live reservation made by `reserve`,
    // with no mapping of its own left inside.
    let _ = unsafe { munmap(ptr as usize as *mut _, size as usize) };
}

/// A new memory file of `size` bytes (the physical memory of a handle);
/// sparse, so untouched pages cost nothing.
pub fn backing(size: u64) -> Option<OwnedFd> {
    let fd = memfd_create("quilt-cuda-double", MemfdFlags::CLOEXEC).ok()?;
    ftruncate(&fd, size).ok()?;
    Some(fd)
}

/// Gives the memory behind `[offset, offset + len)` of a memory file back
/// to the system (the range reads as zeros afterwards).
pub fn discard(fd: &impl AsFd, offset: u64, len: u64) {
    let _ = fallocate(
        fd,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        offset,
        len,
    );
}

/// The size of a memory file (an imported handle's real size).
pub fn backing_size(fd: &impl AsFd) -> Option<u64> {
    fstat(fd).ok().and_then(|s| u64::try_from(s.st_size).ok())
}

/// Maps `size` bytes of `fd` from `offset` at `ptr`, inaccessible until
/// [`protect`].
pub fn map(ptr: u64, size: u64, fd: &impl AsFd, offset: u64) -> bool {
    // SAFETY: the caller checked that `[ptr, ptr + size)` lies inside one of
    // its live reservations and overlaps no mapping: only our own PROT_NONE
    // placeholder is replaced.
    unsafe {
        mmap(
            ptr as usize as *mut _,
            size as usize,
            ProtFlags::empty(),
            MapFlags::SHARED | MapFlags::FIXED,
            fd,
            offset,
        )
    }
    .is_ok()
}

/// Replaces the mapping at `[ptr, ptr + size)` by the reservation's
/// inaccessible placeholder again.
pub fn unmap(ptr: u64, size: u64) -> bool {
    // SAFETY: the caller checked that the range is exactly mappings of its
    // own inside a live reservation; the placeholder keeps the range reserved.
    unsafe {
        mmap_anonymous(
            ptr as usize as *mut _,
            size as usize,
            ProtFlags::empty(),
            MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
        )
    }
    .is_ok()
}

/// Sets the host protection of a mapped range: none, read, or read-write.
pub fn protect(ptr: u64, size: u64, read: bool, write: bool) -> bool {
    let mut flags = MprotectFlags::empty();
    if read {
        flags |= MprotectFlags::READ;
    }
    if write {
        flags |= MprotectFlags::WRITE;
    }
    // SAFETY: the caller checked that the range is mappings of its own.
    unsafe { mprotect(ptr as usize as *mut _, size as usize, flags) }.is_ok()
}

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
///
/// Each of `src` and `dst` is either device memory that the caller checked
/// is mapped with the access needed, or a host pointer a client passed for
/// that many bytes (valid by the API's contract, as for the real driver).
pub unsafe fn copy(dst: u64, src: u64, len: u64) {
    // SAFETY: the caller's contract above; `ptr::copy` allows overlap.
    unsafe {
        std::ptr::copy(
            src as usize as *const u8,
            dst as usize as *mut u8,
            len as usize,
        )
    }
}

/// Reads `len` bytes at `src`.
///
/// # Safety
///
/// As for [`copy`]'s `src`.
pub unsafe fn read(src: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    // SAFETY: `out` is ours for `len` bytes; `src` by the caller's contract.
    unsafe { copy(out.as_mut_ptr() as usize as u64, src, len) };
    out
}

/// Writes `bytes` at `dst`.
///
/// # Safety
///
/// As for [`copy`]'s `dst`.
pub unsafe fn write(dst: u64, bytes: &[u8]) {
    // SAFETY: `bytes` is ours; `dst` by the caller's contract.
    unsafe { copy(dst, bytes.as_ptr() as usize as u64, bytes.len() as u64) }
}
