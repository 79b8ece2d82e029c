//! Sleep and wake through the C functions, called as C would call them, in
//! one process configured by `QUILT_ALLOC_CONF` (host backend, 64 MiB, real
//! bytes): allocations made under `quilt_set_tag` carry the tag; a sleep
//! frees their pages for other allocations while their addresses stay; the
//! wake puts every byte back at the same address. One test: the library
//! reads its configuration once per process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::ffi::{c_char, c_void, CString};

use quilt_torch::ffi::{
    quilt_clear_tag, quilt_current_tag, quilt_free, quilt_is_asleep, quilt_last_error,
    quilt_malloc, quilt_set_tag, quilt_sleep, quilt_stats_json, quilt_wake,
};

const MIB: usize = 1 << 20;

fn read(f: impl Fn(*mut c_char, usize) -> usize) -> String {
    let n = f(std::ptr::null_mut(), 0);
    let mut buf = vec![0u8; n + 1];
    assert_eq!(f(buf.as_mut_ptr().cast(), buf.len()), n);
    String::from_utf8(buf[..n].to_vec()).unwrap()
}

fn last_error() -> String {
    // SAFETY: `read` passes null with 0, or a buffer of the length it gives.
    read(|b, l| unsafe { quilt_last_error(b, l) })
}

fn current_tag() -> String {
    // SAFETY: as in `last_error`.
    read(|b, l| unsafe { quilt_current_tag(b, l) })
}

fn stats() -> serde_json::Value {
    // SAFETY: as in `last_error`.
    serde_json::from_str(&read(|b, l| unsafe { quilt_stats_json(0, b, l) })).unwrap()
}

fn c(text: &str) -> CString {
    CString::new(text).unwrap()
}

fn set_tag(tag: &str) -> i32 {
    // SAFETY: a `CString`'s pointer, alive for the call.
    unsafe { quilt_set_tag(c(tag).as_ptr()) }
}

fn sleep(tag: &str, flags: i32) -> i32 {
    // SAFETY: as in `set_tag`.
    unsafe { quilt_sleep(c(tag).as_ptr(), flags) }
}

fn wake(tag: &str) -> i32 {
    // SAFETY: as in `set_tag`.
    unsafe { quilt_wake(c(tag).as_ptr()) }
}

fn is_asleep(tag: &str) -> i32 {
    // SAFETY: as in `set_tag`.
    unsafe { quilt_is_asleep(c(tag).as_ptr()) }
}

fn malloc(size: usize) -> *mut c_void {
    let p = quilt_malloc(size, 0, std::ptr::null_mut());
    assert!(!p.is_null(), "malloc({size}): {}", last_error());
    p
}

fn free(p: *mut c_void, size: usize) {
    quilt_free(p, size, 0, std::ptr::null_mut());
}

/// A byte pattern distinct per seed and offset.
fn byte(seed: usize, i: usize) -> u8 {
    (i.wrapping_mul(131) ^ seed.wrapping_mul(29) ^ (i >> 11)) as u8
}

fn fill(p: *mut c_void, size: usize, seed: usize) {
    let bytes: Vec<u8> = (0..size).map(|i| byte(seed, i)).collect();
    // SAFETY: `p` is a live, awake host-backend block of at least `size` bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.cast::<u8>(), size) };
}

fn holds(p: *mut c_void, size: usize, seed: usize) -> bool {
    // SAFETY: as in `fill`.
    let got = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), size) };
    got.iter().enumerate().all(|(i, &b)| b == byte(seed, i))
}

#[test]
fn sleep_wake_through_the_c_functions() {
    std::env::set_var("QUILT_ALLOC_CONF", "backend:host,capacity:64MiB");
    assert_eq!(current_tag(), "");

    // The model's weights, under a tag; one block that is not a member.
    assert_eq!(set_tag("weights"), 0, "{}", last_error());
    assert_eq!(current_tag(), "weights");
    let sizes = [5 * MIB, 3 * MIB + 7, 20 * MIB];
    let weights: Vec<*mut c_void> = sizes.iter().map(|&s| malloc(s)).collect();
    assert_eq!(quilt_clear_tag(), 0);
    assert_eq!(current_tag(), "");
    let other = malloc(8 * MIB);
    for (k, (&p, &s)) in weights.iter().zip(&sizes).enumerate() {
        fill(p, s, k);
    }
    fill(other, 8 * MIB, 99);
    assert_eq!(is_asleep("weights"), 0);

    // 40 MiB more do not fit beside 8 + 28 MiB in 64 MiB.
    assert!(quilt_malloc(40 * MIB, 0, std::ptr::null_mut()).is_null());
    assert!(last_error().contains("out of memory"), "{}", last_error());

    // Asleep: the weights' pages serve another allocation.
    assert_eq!(sleep("weights", 0), 0, "{}", last_error());
    assert_eq!(is_asleep("weights"), 1);
    let allocated = stats()["allocated_bytes"]["current"].as_u64().unwrap();
    assert!(
        allocated >= (8 + 28) as u64 * MIB as u64,
        "sleeping blocks stay allocated"
    );
    let big = malloc(40 * MIB);
    fill(big, 40 * MIB, 7);
    // A member freed while asleep is taken (torch's deleter runs whenever
    // a tensor dies): it stays allocated until the wake, which frees it.
    let before = stats()["allocated_bytes"]["current"].as_u64().unwrap();
    free(weights[0], sizes[0]);
    assert_eq!(
        stats()["allocated_bytes"]["current"].as_u64().unwrap(),
        before
    );
    assert!(holds(big, 40 * MIB, 7));
    free(big, 40 * MIB);
    // Untagged allocations go on as usual while the tag sleeps.
    assert!(holds(other, 8 * MIB, 99));

    // Awake: same addresses, every byte back; the freed member is gone.
    let before = stats()["allocated_bytes"]["current"].as_u64().unwrap();
    assert_eq!(wake("weights"), 0, "{}", last_error());
    assert_eq!(is_asleep("weights"), 0);
    assert_eq!(
        stats()["allocated_bytes"]["current"].as_u64().unwrap(),
        before - sizes[0] as u64
    );
    for (k, (&p, &s)) in weights.iter().zip(&sizes).enumerate().skip(1) {
        assert!(holds(p, s, k), "member {k} at {p:?}");
    }
    assert!(holds(other, 8 * MIB, 99));

    // Discard and release to the device: the pages leave Quilt's pool.
    assert_eq!(set_tag("kv"), 0);
    let kv = malloc(10 * MIB);
    assert_eq!(quilt_clear_tag(), 0);
    fill(kv, 10 * MIB, 3);
    let reserved = stats()["reserved_bytes"]["current"].as_u64().unwrap();
    assert_eq!(sleep("kv", 1 | 2), 0, "{}", last_error());
    let after = stats()["reserved_bytes"]["current"].as_u64().unwrap();
    assert!(
        after + 10 * MIB as u64 <= reserved,
        "released: {reserved} -> {after}"
    );
    assert_eq!(wake("kv"), 0, "{}", last_error());
    fill(kv, 10 * MIB, 4); // mapped again, at the same address
    assert!(holds(kv, 10 * MIB, 4));

    // The tag is per thread: another thread's tag is not this one's.
    let theirs = std::thread::spawn(|| {
        assert_eq!(current_tag(), "");
        assert_eq!(set_tag("theirs"), 0);
        let p = malloc(MIB);
        assert_eq!(quilt_clear_tag(), 0);
        p as usize
    })
    .join()
    .unwrap() as *mut c_void;
    assert_eq!(current_tag(), "");
    assert_eq!(sleep("theirs", 1), 0, "{}", last_error());
    assert_eq!(is_asleep("weights"), 0, "only the named tag sleeps");
    assert_eq!(wake("theirs"), 0);

    // Errors: a status and a message, nothing changed.
    assert_eq!(set_tag("weights"), 0);
    // SAFETY: null is allowed (an error).
    assert_ne!(unsafe { quilt_set_tag(std::ptr::null()) }, 0);
    assert!(last_error().contains("null"), "{}", last_error());
    let not_utf8 = [0xffu8, 0xfe, 0];
    // SAFETY: a NUL-terminated byte string.
    assert_ne!(unsafe { quilt_set_tag(not_utf8.as_ptr().cast()) }, 0);
    assert!(last_error().contains("UTF-8"), "{}", last_error());
    assert_ne!(set_tag(""), 0);
    assert!(last_error().contains("empty"), "{}", last_error());
    assert_eq!(current_tag(), "weights", "a refused tag changes nothing");
    assert_eq!(quilt_clear_tag(), 0);
    // SAFETY: null is allowed (an error).
    unsafe {
        assert_ne!(quilt_sleep(std::ptr::null(), 0), 0);
        assert_ne!(quilt_wake(std::ptr::null()), 0);
        assert_eq!(quilt_is_asleep(std::ptr::null()), -1);
        assert_ne!(quilt_sleep(not_utf8.as_ptr().cast(), 0), 0);
    }
    assert_ne!(sleep("nobody", 0), 0);
    assert!(last_error().contains("unknown tag"), "{}", last_error());
    assert_eq!(is_asleep("nobody"), -1);
    assert_ne!(sleep("weights", 4), 0);
    assert!(last_error().contains("flags"), "{}", last_error());
    assert_eq!(is_asleep("weights"), 0, "bad flags put nothing to sleep");
    assert_ne!(wake("weights"), 0);
    assert!(last_error().contains("awake"), "{}", last_error());
    assert_eq!(sleep("weights", 0), 0);
    assert_ne!(sleep("weights", 0), 0);
    assert!(last_error().contains("already asleep"), "{}", last_error());
    // A new member of a sleeping tag is refused.
    assert_eq!(set_tag("weights"), 0);
    assert!(quilt_malloc(MIB, 0, std::ptr::null_mut()).is_null());
    assert!(last_error().contains("asleep"), "{}", last_error());
    assert_eq!(quilt_clear_tag(), 0);
    assert_eq!(wake("weights"), 0);
    for (k, (&p, &s)) in weights.iter().zip(&sizes).enumerate().skip(1) {
        assert!(holds(p, s, k), "member {k} after a second sleep");
    }

    for (&p, &s) in weights.iter().zip(&sizes).skip(1) {
        free(p, s);
    }
    free(other, 8 * MIB);
    free(kv, 10 * MIB);
    free(theirs, MIB);
    assert_eq!(stats()["allocated_bytes"]["current"], 0, "{}", last_error());
}

/// The library's safe core from eight threads at once, each with its own
/// tag: allocations, sleeps and wakes interleave with the other threads'
/// allocations in the pages sleeping tags gave back; every thread finds its
/// bytes at its addresses after each wake.
#[test]
fn sleep_wake_from_eight_threads_each_with_its_own_tag() {
    use quilt_alloc::quilt::{SleepMode, SleepPages};
    use quilt_torch::library::{Library, SLEEP_DISCARD};
    let lib = std::sync::Arc::new(Library::new("backend:host,capacity:160MiB"));
    let threads: Vec<_> = (0..8usize)
        .map(|t| {
            let lib = lib.clone();
            std::thread::spawn(move || {
                let tag = format!("model-{t}");
                let sizes = [3 * MIB + 100 * t, 5 * MIB, 4096];
                let blocks: Vec<u64> = sizes
                    .iter()
                    .map(|&s| lib.malloc_tagged(s as u64, 0, 0, Some(&tag)).unwrap())
                    .collect();
                for round in 0..4 {
                    let seed = t * 16 + round;
                    for (&p, &s) in blocks.iter().zip(&sizes) {
                        fill(p as *mut c_void, s, seed);
                    }
                    let (mode, pages) = if round % 2 == 0 {
                        (SleepMode::Offload, SleepPages::KeepInPool)
                    } else {
                        (SleepMode::Offload, SleepPages::ReleaseToDevice)
                    };
                    lib.sleep(&tag, mode, pages).unwrap();
                    assert!(lib.is_asleep(&tag).unwrap());
                    // Others' memory while ours sleeps: written and freed.
                    let other = lib.malloc(6 * MIB as u64, 0, t as u64).unwrap();
                    fill(other as *mut c_void, 6 * MIB, 255 - seed);
                    lib.free(other, 6 * MIB as u64, 0, t as u64).unwrap();
                    lib.wake(&tag).unwrap();
                    for (&p, &s) in blocks.iter().zip(&sizes) {
                        assert!(holds(p as *mut c_void, s, seed), "thread {t} round {round}");
                    }
                }
                // Discard: the bytes are not kept, the addresses are.
                let (mode, pages) = quilt_torch::library::sleep_options(SLEEP_DISCARD).unwrap();
                lib.sleep(&tag, mode, pages).unwrap();
                lib.wake(&tag).unwrap();
                for (&p, &s) in blocks.iter().zip(&sizes) {
                    fill(p as *mut c_void, s, 7);
                    assert!(holds(p as *mut c_void, s, 7));
                    lib.free(p, s as u64, 0, 0).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats: serde_json::Value = serde_json::from_str(&lib.stats_json(0).unwrap()).unwrap();
    assert_eq!(stats["allocated_bytes"]["current"], 0);
    assert!(lib
        .sleep("model-0", SleepMode::Offload, SleepPages::KeepInPool)
        .is_ok());
    assert!(lib
        .sleep("model-9", SleepMode::Offload, SleepPages::KeepInPool)
        .is_err());
}
