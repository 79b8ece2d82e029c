//! Quilt's snapshots in PyTorch's own browser viewer (`MemoryViz.js`), in
//! headless Chromium, through `scripts/viewer-check/check.mjs`: every
//! snapshot, every device the viewer offers, each of its three views with no
//! script error, and in "Allocator State History" every event selected back
//! to the first.
//!
//! The snapshots: `quilt_torch.dump_snapshot` through `libquilt_torch.so` on
//! the host backend after churn on one stream and on four, with
//! `empty_cache`, `reclaim:always`, an out of memory, two devices and a
//! history cut short (`scripts/viewer-check/make_snapshots.py`); what
//! `quilt-bench ab --export-snapshot` writes (its code, through quilt-bench's
//! library) for two workloads and three allocators; and any listed in
//! `$QUILT_VIEWER_SNAPSHOTS` (paths separated by `:`, e.g. torch's own
//! `_dump_snapshot` under Quilt).
//!
//! PyTorch's viewer is not in the repository (it is PyTorch's code): where
//! it, Chromium, node, python3 or the node modules were missing when
//! quilt-torch was built, `build.rs` sets `cfg(quilt_no_viewer)` and says
//! which as a build warning, and the test is ignored; where they were there
//! then but the check cannot run now, it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::path::{Path, PathBuf};
use std::process::Command;

use quilt_bench::ab::{measure_all, Plan};
use quilt_bench::replay::ReplayConfig;
use quilt_bench::workloads;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `quilt_torch.dump_snapshot` snapshots of every scenario of
/// make_snapshots.py, written into `out`.
fn quilt_torch_snapshots(out: &Path) -> Vec<PathBuf> {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().join("libquilt_torch.so");
    assert!(lib.exists(), "{} was not built", lib.display());
    let made = Command::new("python3")
        .arg(repo().join("scripts/viewer-check/make_snapshots.py"))
        .arg(out)
        .env("QUILT_TORCH_LIBRARY", &lib)
        .env_remove("QUILT_ALLOC_CONF")
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&made.stdout).to_string();
    assert!(
        made.status.success(),
        "make_snapshots.py failed:\n{text}{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let paths: Vec<PathBuf> = text.lines().map(PathBuf::from).collect();
    assert!(paths.len() >= 10, "{text}");
    paths
}

/// What `quilt-bench ab --export-snapshot` writes, for two workloads (one
/// stream; three streams) and three allocators.
fn exported_snapshots(out: &Path) -> Vec<PathBuf> {
    let traces: Vec<_> = ["model-switch", "mixed-vision-language"]
        .iter()
        .map(|n| (workloads::find(n).expect(n).generate)(workloads::DEFAULT_SEED))
        .collect();
    let specs: Vec<String> = ["quilt", "quilt:reclaim=always", "expandable"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let config = ReplayConfig::default();
    let plan = Plan {
        traces: &traces,
        specs: &specs,
        capacity: 80 << 30,
        config: &config,
        no_bisect: true,
        jobs: None,
        export_snapshot: Some(out),
    };
    let outcomes = measure_all(&plan).unwrap();
    assert_eq!(outcomes.len(), traces.len() * specs.len());
    let mut paths: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "pickle"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), traces.len() * specs.len(), "{paths:?}");
    paths
}

#[test]
#[cfg_attr(
    quilt_no_viewer,
    ignore = "needs PyTorch's MemoryViz.js in third_party/viz, Chromium, node, python3 and npm ci in scripts/viewer-check (missing when quilt-torch was built; see the build warning)"
)]
fn snapshots_open_in_every_view_of_pytorchs_viewer() {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("viewer-check");
    let _ = std::fs::remove_dir_all(&tmp);
    let mut snapshots = quilt_torch_snapshots(&tmp.join("quilt_torch"));
    snapshots.extend(exported_snapshots(&tmp.join("export")));
    if let Some(more) = std::env::var_os("QUILT_VIEWER_SNAPSHOTS") {
        snapshots.extend(std::env::split_paths(&more));
    }
    let checked = Command::new("node")
        .arg(repo().join("scripts/viewer-check/check.mjs"))
        .args(&snapshots)
        .output()
        .expect("node runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );
    assert!(
        checked.status.success(),
        "PyTorch's viewer failed on a snapshot (exit {:?}):\n{text}",
        checked.status.code()
    );
    // Every snapshot, in three views on each of its devices, with every
    // event of the state history selected.
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with('{')).collect();
    assert!(lines.len() >= 3 * snapshots.len(), "{text}");
    for s in &snapshots {
        let name = s.to_string_lossy();
        let views = lines
            .iter()
            .filter(|l| l.contains(&format!("\"snapshot\":{:?}", name.as_ref())))
            .count();
        assert!(
            views >= 3 && views % 3 == 0,
            "{name}: {views} views\n{text}"
        );
    }
    for l in &lines {
        assert!(l.contains("\"ok\":true"), "{l}");
        if l.contains("Allocator State History") {
            let events = number(l, "\"events\":");
            let selected = number(l, "\"selected\":");
            assert_eq!(events, selected, "{l}");
        }
    }
    let histories = lines
        .iter()
        .filter(|l| l.contains("Allocator State History") && number(l, "\"events\":") > 100)
        .count();
    assert!(histories >= 10, "too few histories replayed:\n{text}");
    eprintln!("{text}");
}

/// The number after `key` in the JSON line `l`.
fn number(l: &str, key: &str) -> u64 {
    let at = l.find(key).unwrap_or_else(|| panic!("{key} in {l}")) + key.len();
    l[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .unwrap()
}
