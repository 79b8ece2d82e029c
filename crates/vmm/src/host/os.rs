//! The system calls behind the host backend, one thin wrapper per operation.
//!
//! On 64-bit Linux these are `memfd_create`, `ftruncate`, `mmap`, `mprotect`
//! and `munmap` through `rustix`; elsewhere every operation fails and
//! [`SUPPORTED`] is false, so the backend reports itself unavailable.
//!
//! Every `unsafe fn` here states what the caller must guarantee; the host
//! backend guarantees it by checking the call against its ledger first
//! (every address handed in lies inside a reservation this backend made).

/// An operating-system error, reduced to what the backend reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OsError {
    /// The raw `errno`.
    pub errno: i32,
    /// Its name-ish label (e.g. `errno 12`).
    pub name: String,
    /// The system's description.
    pub text: String,
    /// True for `ENOMEM`.
    pub out_of_memory: bool,
}

pub(crate) use imp::*;

#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
mod imp {
    use super::OsError;
    use rustix::fd::OwnedFd;
    use rustix::fs::{ftruncate, memfd_create, MemfdFlags};
    use rustix::io::Errno;
    use rustix::mm::{mmap, mmap_anonymous, mprotect, munmap, MapFlags, MprotectFlags, ProtFlags};
    use std::ffi::c_void;

    /// True: the host backend works on this platform.
    pub(crate) const SUPPORTED: bool = true;

    /// Physical memory: a memfd of the handle's size.
    pub(crate) type Memory = OwnedFd;

    fn os_error(e: Errno) -> OsError {
        OsError {
            errno: e.raw_os_error(),
            name: format!("errno {}", e.raw_os_error()),
            text: e.to_string(),
            out_of_memory: e == Errno::NOMEM,
        }
    }

    /// A pointer with the exposed provenance of the mapping at `addr`.
    fn ptr_at(addr: u64) -> *mut c_void {
        std::ptr::with_exposed_provenance_mut::<c_void>(addr as usize)
    }

    /// The OS page size in bytes.
    pub(crate) fn page_size() -> u64 {
        rustix::param::page_size() as u64
    }

    /// `memfd_create` + `ftruncate`: `size` bytes of zeroed memory, allocated lazily.
    pub(crate) fn create_memory(size: u64) -> Result<Memory, OsError> {
        let fd = memfd_create("quilt-host-vmm", MemfdFlags::CLOEXEC).map_err(os_error)?;
        ftruncate(&fd, size).map_err(os_error)?;
        Ok(fd)
    }

    /// A second descriptor of the same memory (`fcntl(F_DUPFD_CLOEXEC)`): what
    /// `export_handle` hands out, and what `import_handle` keeps.
    pub(crate) fn share_memory(memory: &Memory) -> Result<Memory, OsError> {
        memory
            .try_clone()
            .map_err(|e| os_error(Errno::from_io_error(&e).unwrap_or(Errno::BADF)))
    }

    /// The size of the memory behind `fd`, which must be a memfd (a regular
    /// file whose seals can be read: `fcntl(F_GET_SEALS)` fails on anything
    /// else); `None` for any other descriptor.
    pub(crate) fn memory_size(fd: std::os::fd::BorrowedFd<'_>) -> Option<u64> {
        let stat = rustix::fs::fstat(fd).ok()?;
        let is_file = rustix::fs::FileType::from_raw_mode(stat.st_mode).is_file();
        (is_file && rustix::fs::fcntl_get_seals(fd).is_ok())
            .then(|| u64::try_from(stat.st_size).ok())
            .flatten()
    }

    /// `mmap(NULL, size + alignment, PROT_NONE, PRIVATE | NORESERVE)`, then
    /// `munmap` of the head and tail so that what remains is `size` bytes at a
    /// multiple of `alignment` (a multiple of the page size), placed by the
    /// kernel where nothing else is mapped. Returns its address.
    pub(crate) fn reserve_anywhere(size: u64, alignment: u64) -> Result<u64, OsError> {
        let len = size
            .checked_add(alignment)
            .ok_or_else(|| os_error(Errno::NOMEM))?;
        // SAFETY: a null hint without MAP_FIXED lets the kernel pick a range that
        // no existing mapping uses, so no memory Rust knows about is affected.
        let base = unsafe {
            mmap_anonymous(
                std::ptr::null_mut(),
                len as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(os_error)?;
        let base_addr = base.expose_provenance() as u64;
        let aligned = base_addr.next_multiple_of(alignment);
        let head = aligned - base_addr;
        let tail = len - head - size;
        if head > 0 {
            // SAFETY: `base..base+head` is the start of the PROT_NONE mapping made
            // just above; nothing refers to it.
            unsafe { munmap(base, head as usize) }.map_err(os_error)?;
        }
        if tail > 0 {
            let tail_ptr = base.cast::<u8>().wrapping_add((head + size) as usize);
            // SAFETY: `tail_ptr..tail_ptr+tail` is the end of the same fresh
            // mapping, past the part kept; nothing refers to it.
            unsafe { munmap(tail_ptr.cast(), tail as usize) }.map_err(os_error)?;
        }
        Ok(aligned)
    }

    /// `mmap(ptr, size, PROT_NONE, SHARED | FIXED, memory, offset)`: maps part
    /// of a memfd over part of a reservation, inaccessible until
    /// [`protect_read_write`]. If the call fails, the range is put back to a
    /// plain reservation so the address space stays held.
    ///
    /// # Safety
    /// `ptr..ptr+size` lies inside address space made by [`reserve_anywhere`]
    /// that has no mapping in that range, `ptr` and `size` are page multiples, and
    /// `offset + size` is within the memfd's size.
    pub(crate) unsafe fn map_fixed(
        ptr: u64,
        size: u64,
        memory: &Memory,
        offset: u64,
    ) -> Result<(), OsError> {
        // SAFETY: by this function's contract the range belongs to one of this
        // backend's PROT_NONE reservations, which nothing in Rust refers to, so
        // replacing it with MAP_FIXED cannot clobber any other memory.
        let mapped = unsafe {
            mmap(
                ptr_at(ptr),
                size as usize,
                ProtFlags::empty(),
                MapFlags::SHARED | MapFlags::FIXED,
                memory,
                offset,
            )
        };
        match mapped {
            Ok(p) => {
                let _ = p.expose_provenance();
                Ok(())
            }
            Err(e) => {
                // SAFETY: same range as above; re-reserving it keeps it ours.
                let _ = unsafe { reset_to_reserved(ptr, size) };
                Err(os_error(e))
            }
        }
    }

    /// `mprotect(ptr, size, READ | WRITE)`.
    ///
    /// # Safety
    /// `ptr..ptr+size` is wholly covered by mappings made by [`map_fixed`].
    pub(crate) unsafe fn protect_read_write(ptr: u64, size: u64) -> Result<(), OsError> {
        // SAFETY: by contract the range is this backend's memfd mappings;
        // granting access changes no memory contents.
        unsafe {
            mprotect(
                ptr_at(ptr),
                size as usize,
                MprotectFlags::READ | MprotectFlags::WRITE,
            )
        }
        .map_err(os_error)
    }

    /// `mmap(ptr, size, PROT_NONE, PRIVATE | FIXED | NORESERVE)`: replaces
    /// whatever this backend mapped there by plain reserved address space (an
    /// unmap that keeps the hole reserved).
    ///
    /// # Safety
    /// `ptr..ptr+size` lies inside address space made by [`reserve_anywhere`],
    /// and no Rust reference points into it.
    pub(crate) unsafe fn reset_to_reserved(ptr: u64, size: u64) -> Result<(), OsError> {
        // SAFETY: by contract the range is this backend's own address space and
        // nothing borrows it.
        let p = unsafe {
            mmap_anonymous(
                ptr_at(ptr),
                size as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map_err(os_error)?;
        let _ = p.expose_provenance();
        Ok(())
    }

    /// `munmap(ptr, size)`: gives a whole range made by [`reserve_anywhere`]
    /// (and anything mapped in it) back.
    ///
    /// # Safety
    /// `ptr..ptr+size` is exactly a range made by [`reserve_anywhere`], and no
    /// Rust reference points into it.
    pub(crate) unsafe fn unreserve(ptr: u64, size: u64) -> Result<(), OsError> {
        // SAFETY: by contract the range is one of this backend's reservations.
        unsafe { munmap(ptr_at(ptr), size as usize) }.map_err(os_error)
    }

    /// Copies `data` to `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+data.len()` is mapped read-write by this backend and nothing
    /// else accesses it during the call.
    pub(crate) unsafe fn copy_in(ptr: u64, data: &[u8]) {
        // SAFETY: by contract the destination is valid for writes; it cannot
        // overlap `data`, which is ordinary Rust memory outside our reservations.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), ptr_at(ptr).cast::<u8>(), data.len())
        }
    }

    /// Copies from `ptr` into `out`.
    ///
    /// # Safety
    /// As [`copy_in`], for reads of `out.len()` bytes.
    pub(crate) unsafe fn copy_out(ptr: u64, out: &mut [u8]) {
        // SAFETY: by contract the source is valid for reads and is not `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(ptr_at(ptr).cast::<u8>(), out.as_mut_ptr(), out.len())
        }
    }

    /// Sets `len` bytes at `ptr` to `byte`.
    ///
    /// # Safety
    /// As [`copy_in`], for writes of `len` bytes.
    pub(crate) unsafe fn fill(ptr: u64, len: u64, byte: u8) {
        // SAFETY: by contract the range is valid for writes.
        unsafe { std::ptr::write_bytes(ptr_at(ptr).cast::<u8>(), byte, len as usize) }
    }

    /// True when all `len` bytes at `ptr` equal `byte`.
    ///
    /// # Safety
    /// As [`copy_in`], for reads of `len` bytes.
    pub(crate) unsafe fn all_equal(ptr: u64, len: u64, byte: u8) -> bool {
        // SAFETY: by contract the range is valid for reads and nothing writes
        // it while the slice lives (the backend holds its lock).
        let bytes = unsafe { std::slice::from_raw_parts(ptr_at(ptr).cast::<u8>(), len as usize) };
        bytes.iter().all(|b| *b == byte)
    }
}

#[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
mod imp {
    use super::OsError;

    /// False: the host backend needs 64-bit Linux.
    pub(crate) const SUPPORTED: bool = false;

    /// Never constructed on this platform.
    pub(crate) type Memory = std::convert::Infallible;

    fn unsupported() -> OsError {
        OsError {
            errno: 38,
            name: "ENOSYS".to_owned(),
            text: "the host backend needs 64-bit Linux".to_owned(),
            out_of_memory: false,
        }
    }

    pub(crate) fn page_size() -> u64 {
        4096
    }
    pub(crate) fn create_memory(_size: u64) -> Result<Memory, OsError> {
        Err(unsupported())
    }
    pub(crate) fn reserve_anywhere(_size: u64, _alignment: u64) -> Result<u64, OsError> {
        Err(unsupported())
    }
    pub(crate) fn share_memory(memory: &Memory) -> Result<Memory, OsError> {
        match *memory {}
    }
    pub(crate) fn memory_size(_fd: std::os::fd::BorrowedFd<'_>) -> Option<u64> {
        None
    }
    pub(crate) unsafe fn map_fixed(
        _ptr: u64,
        _size: u64,
        memory: &Memory,
        _offset: u64,
    ) -> Result<(), OsError> {
        match *memory {}
    }
    pub(crate) unsafe fn protect_read_write(_ptr: u64, _size: u64) -> Result<(), OsError> {
        Err(unsupported())
    }
    pub(crate) unsafe fn reset_to_reserved(_ptr: u64, _size: u64) -> Result<(), OsError> {
        Err(unsupported())
    }
    pub(crate) unsafe fn unreserve(_ptr: u64, _size: u64) -> Result<(), OsError> {
        Err(unsupported())
    }
    pub(crate) unsafe fn copy_in(_ptr: u64, _data: &[u8]) {}
    pub(crate) unsafe fn copy_out(_ptr: u64, _out: &mut [u8]) {}
    pub(crate) unsafe fn fill(_ptr: u64, _len: u64, _byte: u8) {}
    pub(crate) unsafe fn all_equal(_ptr: u64, _len: u64, _byte: u8) -> bool {
        false
    }
}
