//! Fidelity of the PyTorch baselines: replaying a real trace on an 80 GiB
//! simulated device must reserve, at its peak, exactly what PyTorch reserved
//! (`torch_reserved_peak_bytes` in `../shared/traces/converted/stats.json`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quilt_alloc::baselines::classic::{ClassicAllocator, ClassicConfig};
use quilt_alloc::baselines::expandable::{ExpandableAllocator, ExpandableConfig};
use quilt_alloc::baselines::offset::{OffsetAllocator, OffsetConfig};
use quilt_alloc::DeviceAllocator;
use quilt_bench::trace::{load_trace, Event};
use quilt_vmm::sim::SimVmm;
use quilt_vmm::{StreamId, Vmm};

const CAPACITY: u64 = 80 << 30;

fn traces_dir() -> Option<PathBuf> {
    let dir = Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/converted"
    ));
    if dir.is_dir() {
        Some(dir.to_path_buf())
    } else {
        eprintln!("skipping: {} is absent", dir.display());
        None
    }
}

/// `torch_reserved_peak_bytes` of `name` in stats.json.
fn expected_peak(dir: &Path, name: &str) -> u64 {
    let text = std::fs::read_to_string(dir.join("stats.json")).unwrap();
    let stats: serde_json::Value = serde_json::from_str(&text).unwrap();
    stats
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .and_then(|t| t["torch_reserved_peak_bytes"].as_u64())
        .unwrap_or_else(|| panic!("{name} not in stats.json"))
}

/// Replay the trace `name` and return the allocator's peak reserved bytes.
fn replay(dir: &Path, name: &str, a: &dyn DeviceAllocator) -> u64 {
    let trace = load_trace(&dir.join(format!("{name}.trace"))).unwrap();
    let mut live = HashMap::new();
    for (i, event) in trace.events.iter().enumerate() {
        match *event {
            Event::Alloc { id, size, stream } => {
                let x = a
                    .allocate(size, StreamId(stream))
                    .unwrap_or_else(|e| panic!("{name} event {i}: {e}"));
                live.insert(id, x.ptr);
            }
            Event::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
        }
        if i % 997 == 0 {
            a.check_invariants().unwrap();
        }
    }
    a.check_invariants().unwrap();
    a.stats().reserved_bytes.peak
}

fn classic() -> ClassicAllocator {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(CAPACITY).unwrap());
    ClassicAllocator::new(vmm, ClassicConfig::default()).unwrap()
}

fn expandable() -> ExpandableAllocator {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(CAPACITY).unwrap());
    ExpandableAllocator::new(vmm, ExpandableConfig::default()).unwrap()
}

fn offset() -> OffsetAllocator {
    let vmm: Arc<dyn Vmm> = Arc::new(SimVmm::with_capacity(CAPACITY).unwrap());
    OffsetAllocator::new(vmm, OffsetConfig::default()).unwrap()
}

fn check_classic(name: &str) {
    let Some(dir) = traces_dir() else { return };
    let got = replay(&dir, name, &classic());
    let want = expected_peak(&dir, name);
    eprintln!("classic {name}: peak reserved {got}, PyTorch {want}");
    assert_eq!(got, want, "classic on {name}");
}

#[test]
fn classic_opt_zo_fedlearn_finetune() {
    check_classic("opt_zo_fedlearn_finetune");
}

#[test]
fn classic_cnn_counterfactual_eor() {
    check_classic("cnn_counterfactual_eor");
}

#[test]
fn classic_cs336_lm_ctx128_train() {
    check_classic("cs336_lm_ctx128_train");
}

#[test]
fn classic_cs336_lm_ctx512_fwd_amp() {
    check_classic("cs336_lm_ctx512_fwd_amp");
}

#[test]
fn expandable_qwen3_graph_train_expandable_dev0() {
    let Some(dir) = traces_dir() else { return };
    let name = "qwen3_graph_train_expandable_dev0";
    let got = replay(&dir, name, &expandable());
    let want = expected_peak(&dir, name);
    eprintln!("expandable {name}: peak reserved {got}, PyTorch {want}");
    assert_eq!(got, want, "expandable on {name}");
}

/// `stats.json`'s entry for `name`.
fn entry(dir: &Path, name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("stats.json")).unwrap();
    let stats: serde_json::Value = serde_json::from_str(&text).unwrap();
    stats
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .cloned()
        .unwrap()
}

/// Replay the first `n` events and return reserved bytes then.
fn reserved_after(dir: &Path, name: &str, n: usize, a: &dyn DeviceAllocator) -> u64 {
    let trace = load_trace(&dir.join(format!("{name}.trace"))).unwrap();
    let mut live = HashMap::new();
    for event in trace.events.iter().take(n) {
        match *event {
            Event::Alloc { id, size, stream } => {
                live.insert(id, a.allocate(size, StreamId(stream)).unwrap().ptr);
            }
            Event::Free { id } => a.free(live.remove(&id).unwrap()).unwrap(),
        }
    }
    a.stats().reserved_bytes.current
}

/// Every trace: print the classic, expandable and offset peaks next to PyTorch's, and
/// the reserved bytes after the pre-existing prefix next to PyTorch's reserved
/// bytes at the window's start (memory PyTorch had cached before the recorded
/// window is what makes the other traces differ).
#[test]
fn report_all_traces() {
    let Some(dir) = traces_dir() else { return };
    for name in [
        "cs336_lm_ctx128_train",
        "cs336_lm_ctx512_train",
        "cs336_lm_ctx512_fwd_amp",
        "bert_large_infer",
        "opt_zo_fedlearn_finetune",
        "cnn_counterfactual_eor",
        "qwen3_graph_train_expandable_dev0",
    ] {
        let e = entry(&dir, name);
        let pre = e["preexisting_allocs"].as_u64().unwrap() as usize;
        let c = replay(&dir, name, &classic());
        let x = replay(&dir, name, &expandable());
        let o = replay(&dir, name, &offset());
        let c0 = reserved_after(&dir, name, pre, &classic());
        eprintln!(
            "{name}: peak reserved classic {c}, expandable {x}, offset {o}, PyTorch {}; \
             after the {pre} pre-existing allocations classic holds {c0}, PyTorch held {}",
            e["torch_reserved_peak_bytes"], e["torch_reserved_start_bytes"]
        );
    }
}
