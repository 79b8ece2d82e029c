//! Every exported C function, called as C would call it, in one process
//! configured by `QUILT_ALLOC_CONF` (host backend, real bytes). One test:
//! the library reads its configuration once per process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::ffi::{c_char, c_void, CString};

use quilt_torch::device_stats::QuiltDeviceStats;
use quilt_torch::ffi::{
    quilt_device_stats, quilt_dump_snapshot, quilt_empty_cache, quilt_free, quilt_last_error,
    quilt_malloc, quilt_record_history, quilt_record_stream, quilt_set_memory_fraction,
    quilt_stats_json, quilt_torch_block_size, quilt_torch_free, quilt_torch_malloc,
    QuiltAllocation, QuiltFreed,
};

const MIB: usize = 1 << 20;

/// Read a text function's result the way C does: ask the length, then fill.
fn read(f: impl Fn(*mut c_char, usize) -> usize) -> String {
    let n = f(std::ptr::null_mut(), 0);
    let mut buf = vec![0u8; n + 1];
    assert_eq!(f(buf.as_mut_ptr().cast(), buf.len()), n);
    assert_eq!(buf[n], 0, "NUL-terminated");
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

fn last_error() -> String {
    // SAFETY: `read` passes null with 0, or a buffer of the length it gives.
    read(|b, l| unsafe { quilt_last_error(b, l) })
}

fn stats() -> serde_json::Value {
    // SAFETY: as in `last_error`.
    serde_json::from_str(&read(|b, l| unsafe { quilt_stats_json(0, b, l) })).unwrap()
}

fn dump(path: *const c_char) -> i32 {
    // SAFETY: `path` is null or a NUL-terminated string (a `CString`'s).
    unsafe { quilt_dump_snapshot(path) }
}

#[test]
fn every_exported_function() {
    std::env::set_var("QUILT_ALLOC_CONF", "backend:host,capacity:128MiB");
    assert_eq!(last_error(), "");
    assert_eq!(quilt_record_history(1, 1000), 0);

    // Allocate on two streams, write, read, free.
    let a = quilt_malloc(3 * MIB, 0, std::ptr::null_mut());
    let b = quilt_malloc(5000, 0, 7 as *mut c_void);
    assert!(!a.is_null() && !b.is_null());
    // SAFETY: both are live host-backend blocks of at least these sizes.
    unsafe {
        std::ptr::write_bytes(a.cast::<u8>(), 0xA5, 3 * MIB);
        std::ptr::write_bytes(b.cast::<u8>(), 0x5A, 5000);
        assert_eq!(*a.cast::<u8>().add(3 * MIB - 1), 0xA5);
        assert_eq!(*b.cast::<u8>().add(4999), 0x5A);
    }
    quilt_record_stream(b, 9 as *mut c_void);
    assert_eq!(stats()["allocation"]["current"], 2);

    // The snapshot, while both are live.
    let dir = std::env::temp_dir().join(format!("quilt-ffi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = CString::new(dir.join("s.pickle").to_str().unwrap()).unwrap();
    assert_eq!(dump(path.as_ptr()), 0, "{}", last_error());
    let bytes = std::fs::read(dir.join("s.pickle")).unwrap();
    assert!(serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).is_ok());
    let bad = CString::new("/nonexistent-dir/s.pickle").unwrap();
    assert_ne!(dump(bad.as_ptr()), 0);
    assert!(last_error().contains("nonexistent-dir"));
    assert_ne!(dump(std::ptr::null()), 0);

    quilt_free(a, 3 * MIB, 0, std::ptr::null_mut());
    quilt_free(b, 5000, 0, 7 as *mut c_void);
    assert_eq!(stats()["allocated_bytes"]["current"], 0);

    // Errors: never a crash, always a message for this thread.
    quilt_free(b, 5000, 0, std::ptr::null_mut());
    assert!(last_error().contains("double free"), "{}", last_error());
    quilt_free(std::ptr::null_mut(), 0, 0, std::ptr::null_mut());
    assert!(last_error().contains("null"));
    quilt_free(0x1234 as *mut c_void, 1, 0, std::ptr::null_mut());
    assert!(!last_error().is_empty());
    assert!(quilt_malloc(1 << 40, 0, std::ptr::null_mut()).is_null());
    assert!(
        last_error().contains("verdict: capacity"),
        "{}",
        last_error()
    );
    // Another thread has its own last error.
    std::thread::spawn(|| assert_eq!(last_error(), ""))
        .join()
        .unwrap();

    // snprintf: a short buffer gets a prefix and a NUL, and the full length back.
    let full = last_error();
    let mut small = [0x7fu8; 6];
    // SAFETY: `small` has 6 writable bytes; the call may write 5.
    let n = unsafe { quilt_last_error(small.as_mut_ptr().cast(), 5) };
    assert_eq!(n, full.len());
    assert_eq!(&small[..4], &full.as_bytes()[..4]);
    assert_eq!(small[4], 0);
    assert_eq!(small[5], 0x7f, "nothing past len");

    // Memory fraction, empty cache.
    quilt_set_memory_fraction(0.5, 0);
    assert_eq!(stats()["capacity_bytes"], 64 * MIB as u64);
    assert!(quilt_malloc(100 * MIB, 0, std::ptr::null_mut()).is_null());
    quilt_set_memory_fraction(2.0, 0);
    assert!(last_error().contains("memory_fraction") && last_error().contains("(0, 1]"));
    quilt_empty_cache();
    assert_eq!(stats()["reserved_bytes"]["current"], 0);
    assert_eq!(quilt_record_history(0, 0), 0);
    let _ = std::fs::remove_dir_all(dir);
    quilt_set_memory_fraction(1.0, 0);
    torch_allocator_class_functions();
}

/// What torch's allocator class calls: an allocation on devices 0 and 1, a
/// free by the pointer alone (the device, size and stream come back from
/// Quilt), the block's size, torch's statistics.
fn torch_allocator_class_functions() {
    let malloc = |size: usize, device: i32, stream: usize| {
        let mut a = QuiltAllocation::default();
        // SAFETY: `a` is a writable `QuiltAllocation`.
        let rc =
            unsafe { quilt_torch_malloc(size, device, stream as *mut c_void, 0, 0, 0, &mut a) };
        assert_eq!(rc, 0, "{}", last_error());
        a.ptr
    };
    let free = |ptr: *mut c_void| {
        let mut f = QuiltFreed::default();
        // SAFETY: `f` is a writable `QuiltFreed`.
        let rc = unsafe { quilt_torch_free(ptr, &mut f) };
        (rc, f)
    };
    let device_stats = |device: i32| {
        let mut s = QuiltDeviceStats::default();
        // SAFETY: `s` is a writable `QuiltDeviceStats`.
        assert_eq!(unsafe { quilt_device_stats(device, &mut s) }, 0);
        s
    };
    let a = malloc(1000, 0, 0x30);
    let b = malloc(3 * MIB, 1, 0x40);
    assert_eq!(device_stats(1).allocation.current, 1);
    let mut size = 0u64;
    // SAFETY: `size` is a writable `uint64_t`.
    assert_eq!(unsafe { quilt_torch_block_size(b, &mut size) }, 0);
    assert_eq!(size, 3 * MIB as u64);
    assert_eq!(
        free(b),
        (
            0,
            QuiltFreed {
                size: 3 * MIB as u64,
                stream: 0x40,
                seq: 0,
                device: 1,
                kept_by_pool: 0
            }
        )
    );
    assert_eq!(free(a).1.device, 0);
    assert_eq!(device_stats(0).allocation.current, 0);
    assert_eq!(device_stats(1).allocated_bytes.current, 0);
    // A pointer that is no live block: an error, nothing written.
    let (rc, f) = free(a);
    assert_eq!((rc, f), (1, QuiltFreed::default()));
    assert!(last_error().contains("no live block"), "{}", last_error());
    assert_eq!(free(std::ptr::null_mut()).0, 1);
    assert!(last_error().contains("null"));
    // SAFETY: `size` is a writable `uint64_t`.
    assert_eq!(unsafe { quilt_torch_block_size(a, &mut size) }, 1);
}
