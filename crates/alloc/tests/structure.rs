//! The structure of `src/quilt/`, from the code's imports (`docs/design.md`
//! §1): dependencies point one way — the allocator, its features, the
//! stitching core, the pure pieces — so no file imports one above it, no
//! import circle joins two files or more, no file reaches up into `mod.rs`,
//! and nothing public hands out the page pool around the allocator's lock.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layer of each file, bottom up.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "pure pieces",
        &[
            "gap_index",
            "tiling",
            "page_table",
            "arena",
            "streams",
            "config",
        ],
    ),
    (
        "the stitching core",
        &[
            "stitch",
            "placement",
            "backing",
            "reclaim",
            "own",
            "solo",
            "pressure",
            "held",
        ],
    ),
    (
        "features",
        &[
            "growable",
            "sleep",
            "offload",
            "export",
            "segments",
            "invariants",
        ],
    ),
    (
        "the allocator",
        &[
            "ahead",
            "allocator",
            "serving",
            "peers",
            "growable_buffer",
            "mod",
        ],
    ),
];

/// The imports of each file: the sibling files it names.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Each file's imports of its siblings (`super::x` and `crate::quilt::x`
/// outside comments), and every path that names something of `mod.rs`
/// itself (`super::Name`).
fn imports() -> (Graph, Vec<(String, String)>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/quilt");
    let files: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".rs").map(str::to_string)
        })
        .collect();
    let mut graph = BTreeMap::new();
    let mut up = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(dir.join(format!("{f}.rs"))).unwrap();
        let mut deps = BTreeSet::new();
        for line in text.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for prefix in ["super::", "crate::quilt::"] {
                for (at, _) in line.match_indices(prefix) {
                    let rest = &line[at + prefix.len()..];
                    let name: String = rest
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if files.contains(&name) {
                        deps.insert(name);
                    } else if !name.is_empty() && f != "mod" {
                        up.push((f.clone(), name));
                    }
                }
            }
        }
        graph.insert(f.clone(), deps);
    }
    (graph, up)
}

fn layer_of(file: &str) -> usize {
    LAYERS
        .iter()
        .position(|(_, files)| files.contains(&file))
        .unwrap_or_else(|| panic!("src/quilt/{file}.rs is in no layer of this test: add it"))
}

#[test]
fn no_import_runs_back_up_and_no_circle() {
    let (graph, up) = imports();
    assert!(
        up.is_empty(),
        "files reach up into mod.rs (or to something that is not a sibling): {up:?}"
    );
    for (file, deps) in &graph {
        for dep in deps {
            assert!(
                layer_of(dep) <= layer_of(file),
                "{file}.rs ({}) imports {dep}.rs ({}), a layer above it",
                LAYERS[layer_of(file)].0,
                LAYERS[layer_of(dep)].0
            );
        }
    }
    // No circle at all: a walk from each file never comes back to it.
    for start in graph.keys() {
        let mut seen = BTreeSet::new();
        let mut todo: Vec<&String> = graph[start].iter().collect();
        while let Some(f) = todo.pop() {
            assert_ne!(f, start, "an import circle runs through {start}.rs");
            if seen.insert(f.clone()) {
                todo.extend(graph[f].iter());
            }
        }
    }
}

#[test]
fn the_stitching_core_knows_no_feature() {
    let (graph, _) = imports();
    let features = LAYERS[2].1;
    for core in LAYERS[1].1.iter().chain(LAYERS[0].1) {
        let reached: Vec<&String> = graph[*core]
            .iter()
            .filter(|d| features.contains(&d.as_str()))
            .collect();
        assert!(reached.is_empty(), "{core}.rs imports features {reached:?}");
    }
}

#[test]
fn nothing_public_hands_out_the_pool() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/quilt");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for line in text.lines() {
            let l = line.trim_start();
            assert!(
                !(l.starts_with("pub fn") && l.contains("PagePool")),
                "{}: a public function names the pool: {l}",
                path.display()
            );
        }
    }
}
