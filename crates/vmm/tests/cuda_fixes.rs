//! The CUDA backend's answers to issue 22's first-contact defects, over the
//! CUDA driver double (each test reruns itself in a child process over
//! `libquilt_cuda_double.so`; `QUILT_CUDA_TESTS=real` runs them on a GPU):
//! per-thread default streams are one stream per thread and the legacy
//! stream is the default stream; a forgotten stream is refused; exhausted
//! address space is not out of memory; creates use the granularity of their
//! own properties; an import's size is checked against the memory.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use quilt_vmm::cuda::{CudaVmm, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD};
use quilt_vmm::{CreateProps, HandleKind, HandleTypes, StreamId, Vmm, VmmError};

const MIB: u64 = 1 << 20;

fn gpu() -> CudaVmm {
    match CudaVmm::new(0) {
        Ok(v) => v,
        Err(e) => panic!("this test needs CUDA device 0: {e}"),
    }
}

fn is_invalid(r: &quilt_vmm::Result<impl std::fmt::Debug>, argument: &str) -> bool {
    matches!(r, Err(VmmError::InvalidArgument { argument: a, .. }) if *a == argument)
}

#[test]
fn per_thread_default_streams_are_one_stream_per_thread() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return;
    }
    let v = gpu();
    // The legacy stream, by either name, is the default stream.
    assert_eq!(v.adopt_stream(0), StreamId::DEFAULT);
    assert_eq!(v.adopt_stream(CU_STREAM_LEGACY), StreamId::DEFAULT);
    let mine = v.adopt_stream(CU_STREAM_PER_THREAD);
    assert_eq!(
        v.adopt_stream(CU_STREAM_PER_THREAD),
        mine,
        "stable per thread"
    );
    assert_ne!(mine, StreamId(CU_STREAM_PER_THREAD));
    assert_eq!(v.per_thread_owner(mine), Some(std::thread::current().id()));
    let theirs = std::thread::scope(|s| {
        s.spawn(|| {
            let theirs = v.adopt_stream(CU_STREAM_PER_THREAD);
            // On its own thread: the calls go to `0x2`, this thread's stream.
            let e = v.event_record(theirs).unwrap();
            v.stream_synchronize(theirs).unwrap();
            assert!(v.event_query(e).unwrap());
            v.event_destroy(e).unwrap();
            // From here, `mine` is another thread's stream: each call falls
            // back to something that covers it, never to this thread's stream.
            let e = v.event_record(mine).unwrap();
            v.stream_wait_event(mine, e).unwrap();
            v.stream_synchronize(mine).unwrap();
            assert!(v.event_query(e).unwrap(), "recorded after a context sync");
            v.event_record_on(e, mine).unwrap();
            assert!(!v.stream_is_capturing(mine).unwrap());
            v.event_destroy(e).unwrap();
            theirs
        })
        .join()
        .unwrap()
    });
    assert_ne!(
        theirs, mine,
        "two threads' per-thread streams are two streams"
    );
    // Calls from the owner thread on the other thread's stream fall back too.
    let e = v.event_record(theirs).unwrap();
    v.stream_synchronize(theirs).unwrap();
    assert!(v.event_query(e).unwrap());
    v.event_destroy(e).unwrap();
    assert!(!v.stream_is_capturing(mine).unwrap());
    assert!(!v.stream_is_capturing(StreamId::DEFAULT).unwrap());

    // Forgotten: never passed to the driver again.
    v.forget_stream(mine).unwrap();
    assert!(is_invalid(&v.event_record(mine), "stream"));
    assert!(is_invalid(&v.stream_synchronize(mine), "stream"));
    assert!(is_invalid(&v.forget_stream(mine), "stream"));
    let again = v.adopt_stream(CU_STREAM_PER_THREAD);
    assert_ne!(again, mine, "adopted again: a new id");
    v.stream_synchronize(again).unwrap();
    // The default stream and our own streams cannot be forgotten.
    assert!(v.forget_stream(StreamId::DEFAULT).is_err());
    let own = v.create_stream().unwrap();
    assert!(v.forget_stream(own).is_err());
    v.destroy_stream(own).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn an_adopted_stream_is_refused_once_forgotten() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return;
    }
    let v = gpu();
    let made = v.create_stream().unwrap();
    // Adopt a stream the backend did not make (here: one it made, seen
    // through a second backend of the same device).
    let other = gpu();
    let adopted = other.adopt_stream(made.0);
    let e = other.event_record(adopted).unwrap();
    other.forget_stream(adopted).unwrap();
    assert!(is_invalid(&other.event_record(adopted), "stream"));
    assert!(is_invalid(&other.stream_wait_event(adopted, e), "stream"));
    assert!(is_invalid(&other.stream_is_capturing(adopted), "stream"));
    other.event_destroy(e).unwrap();
    v.destroy_stream(made).unwrap();
}

#[test]
fn exhausted_address_space_is_not_out_of_memory() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[(
        "QUILT_CUDA_DOUBLE_ADDRESS_SPACE",
        "64MiB",
    )]) {
        return;
    }
    let v = gpu();
    let g = v.granularity();
    let a = v.reserve(32 * MIB, 0).unwrap();
    let err = v.reserve(64 * MIB, 0).unwrap_err();
    assert!(
        matches!(err, VmmError::AddressSpaceExhausted { requested, .. } if requested == 64 * MIB),
        "{err}"
    );
    assert!(!err.is_out_of_memory());
    // Device memory is still there.
    let h = v.create(g).unwrap();
    v.release(h).unwrap();
    v.address_free(a, 32 * MIB).unwrap();
}

#[test]
fn creates_are_checked_against_the_granularity_of_their_properties() {
    if !quilt_cuda_double::harness::rerun_over_double_with(&[(
        "QUILT_CUDA_DOUBLE_SHAREABLE_GRANULARITY",
        "8MiB",
    )]) {
        return;
    }
    let v = gpu();
    let g = v.granularity();
    let shareable = CreateProps {
        handle_types: HandleTypes {
            posix_fd: true,
            fabric: false,
        },
        gpu_direct_rdma: false,
    };
    assert_eq!(v.granularity_for(CreateProps::default()).unwrap(), g);
    assert_eq!(v.granularity_for(shareable).unwrap(), 8 * MIB);
    assert!(g < 8 * MIB);
    assert!(is_invalid(&v.create_with(g, shareable), "size"));
    let h = v.create_with(8 * MIB, shareable).unwrap();
    v.release(h).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

#[test]
fn an_import_is_checked_against_the_size_of_the_memory() {
    if !quilt_cuda_double::harness::rerun_over_double() {
        return;
    }
    let v = gpu();
    let g = v.granularity();
    let props = CreateProps {
        handle_types: HandleTypes {
            posix_fd: true,
            fabric: false,
        },
        gpu_direct_rdma: false,
    };
    let h = v.create_with(2 * g, props).unwrap();
    let shared = v.export_handle(h, HandleKind::PosixFd).unwrap();
    // The caller's word is not taken: a larger size is refused.
    assert!(is_invalid(&v.import_handle(&shared, 4 * g), "size"));
    assert!(is_invalid(&v.import_handle(&shared, g), "size"));
    let imported = v.import_handle(&shared, 2 * g).unwrap();
    let va = v.reserve(2 * g, 0).unwrap();
    v.map(va, 2 * g, imported, 0).unwrap();
    v.set_access(va, 2 * g).unwrap();
    v.unmap(va, 2 * g).unwrap();
    v.address_free(va, 2 * g).unwrap();
    v.release(imported).unwrap();
    v.release(h).unwrap();
    assert!(v.leak_report().is_clean(), "{}", v.leak_report());
}

/// Set in the child of [`a_driver_lacking_symbols_is_unavailable_not_a_panic`].
const FAKE_LIBCUDA_ENV: &str = "QUILT_TEST_LIBCUDA_WITHOUT_SYMBOLS";

#[test]
fn a_driver_lacking_symbols_is_unavailable_not_a_panic() {
    if std::env::var_os(FAKE_LIBCUDA_ENV).is_some() {
        // In the child, `libcuda.so` is the C maths library: it loads, and
        // exports none of the driver's symbols. cudarc would panic at the
        // first call (and again in a destructor, aborting the process).
        match CudaVmm::new(0) {
            Err(VmmError::Unavailable { reason }) => {
                for name in ["cuInit", "cuMemCreate", "cuStreamIsCapturing"] {
                    assert!(
                        matches!(&reason, quilt_vmm::Unavailability::MissingSymbols { missing } if missing.contains(&name)),
                        "{name} not named: {reason}"
                    );
                }
            }
            other => panic!("expected Unavailable naming the missing symbols, got {other:?}"),
        }
        return;
    }
    let libm = [
        "/lib/x86_64-linux-gnu/libm.so.6",
        "/usr/lib/x86_64-linux-gnu/libm.so.6",
        "/lib/aarch64-linux-gnu/libm.so.6",
        "/usr/lib/aarch64-linux-gnu/libm.so.6",
        "/usr/lib64/libm.so.6",
        "/lib64/libm.so.6",
    ]
    .into_iter()
    .find(|p| std::path::Path::new(p).exists())
    .expect("a libm.so.6 to stand for a libcuda without the driver's symbols");
    let dir = std::env::temp_dir().join(format!(
        "quilt-libcuda-without-symbols-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for name in ["libcuda.so", "libcuda.so.1"] {
        let link = dir.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(libm, &link).unwrap();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "a_driver_lacking_symbols_is_unavailable_not_a_panic",
            "--exact",
            "--nocapture",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env(FAKE_LIBCUDA_ENV, "1")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "the child failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1 passed"),
        "the child ran no test: {stdout}"
    );
}
