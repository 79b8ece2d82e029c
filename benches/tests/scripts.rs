//! The Python scripts a user runs beside `quilt-bench`:
//! `scripts/multistream-traces.py --family` (its traces replay, and the
//! same seed draws the same trace) and `scripts/promise-check.py` (each
//! broken promise reported, exit status 1; every promise kept, 0; bad input,
//! 2). Ignored where no `python3` ran when the crate was built.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{temp_dir, text};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python(script: &str, args: &[&str]) -> Output {
    Command::new("python3")
        .arg(repo().join("scripts").join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("python3 cannot be run here ({e}); {script} did not run"))
}

fn family(dir: &Path, count: &str, first: &str) -> Output {
    python(
        "multistream-traces.py",
        &[dir.to_str().unwrap(), "--family", count, first],
    )
}

#[test]
#[cfg_attr(
    no_python3,
    ignore = "needs python3 on the PATH (none ran when quilt-bench was built)"
)]
fn family_traces_are_drawn_per_seed_and_replay() {
    let dir = temp_dir("family");
    let out = family(&dir, "2", "7");
    assert!(out.status.success(), "{}", text(&out));
    let drawn: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("family.json")).unwrap()).unwrap();
    let names: Vec<&str> = drawn
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["family-007", "family-008"]);
    let many = std::fs::read_to_string(dir.join("family-008.trace")).unwrap();
    let one = std::fs::read_to_string(dir.join("family-008-one.trace")).unwrap();
    let streams = |t: &str| {
        let mut s: Vec<&str> = t
            .lines()
            .filter(|l| l.starts_with('a'))
            .map(|l| l.split(' ').nth(3).unwrap())
            .collect();
        s.sort_unstable();
        s.dedup();
        s.len()
    };
    assert!(streams(&many) >= 2, "family-008 draws several streams");
    assert_eq!(streams(&one), 1);
    assert_eq!(many.lines().count(), one.lines().count());
    // The same seed draws the same trace, whatever the others drawn.
    let again = temp_dir("family-again");
    assert!(family(&again, "1", "8").status.success());
    assert_eq!(
        std::fs::read_to_string(again.join("family-008.trace")).unwrap(),
        many
    );
    // Every drawn trace replays through Quilt and a baseline.
    let json = dir.join("ab.json");
    let out = Command::new(env!("CARGO_BIN_EXE_quilt-bench"))
        .args(["ab", "--iterations", "2", "--jobs", "1", "--no-bisect"])
        .args(["--allocators", "quilt,expandable", "--json"])
        .arg(&json)
        .arg("--trace")
        .args(
            [
                "family-007",
                "family-007-one",
                "family-008",
                "family-008-one",
            ]
            .map(|n| dir.join(format!("{n}.trace"))),
        )
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8);
    assert!(rows.iter().all(|r| r["completed"] == true), "{report}");
    // The check reads that report: no minimum capacity was measured, which
    // it says rather than counting as kept.
    let out = python("promise-check.py", &[json.to_str().unwrap()]);
    let said = text(&out);
    assert!(said.contains("4 workloads checked"), "{said}");
    assert!(said.contains("not checked: no minimum capacity"), "{said}");
    for bad in [
        vec!["--family"],
        vec!["--family", "0"],
        vec!["--family", "two"],
    ] {
        let mut args = vec![dir.to_str().unwrap()];
        args.extend(bad.iter().copied());
        let out = python("multistream-traces.py", &args);
        assert_eq!(out.status.code(), Some(1), "{}", text(&out));
        assert!(
            text(&out).contains("--family takes COUNT"),
            "{}",
            text(&out)
        );
    }
}

/// One row of an `ab` report with the fields the check reads.
fn row(workload: &str, allocator: &str, min_cap_mib: u64, efficiency: f64, waits: u64) -> String {
    format!(
        r#"{{"workload": "{workload}", "allocator": "{allocator}", "completed": true,
        "events": 2000, "ideal_bytes": {ideal}, "min_capacity_bytes": {cap},
        "efficiency": {efficiency}, "grows": 0, "modelled_driver_us": 100.0,
        "stream_calls": {{"synchronize": 0, "wait_event": {waits}}},
        "vmm_calls_after_first_iteration": {{"create": 0, "map": 0}}}}"#,
        ideal = 100u64 << 20,
        cap = min_cap_mib << 20,
    )
}

#[test]
#[cfg_attr(
    no_python3,
    ignore = "needs python3 on the PATH (none ran when quilt-bench was built)"
)]
fn promise_check_reports_each_broken_promise() {
    let dir = temp_dir("promises");
    let write = |name: &str, rows: &[String]| {
        let path = dir.join(name);
        std::fs::write(&path, format!(r#"{{"rows": [{}]}}"#, rows.join(","))).unwrap();
        path
    };
    let kept = write(
        "kept.json",
        &[
            row("w", "quilt", 100, 0.99, 10),
            row("w", "classic", 120, 0.90, 0),
            row("w", "expandable", 110, 0.95, 0),
        ],
    );
    let out = python("promise-check.py", &[kept.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("1 workloads checked: every promise kept"),
        "{}",
        text(&out)
    );
    // 200 waits over 1,000 allocations; 4 MiB above classic's minimum
    // capacity, which classic reaches at a higher efficiency.
    let broken = write(
        "broken.json",
        &[
            row("w", "quilt", 104, 0.95, 200),
            row("w", "classic", 100, 0.99, 0),
            row("w", "expandable", 110, 0.95, 0),
        ],
    );
    let out = python("promise-check.py", &[broken.to_str().unwrap()]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("w: waits: 0.200 waits per allocation"),
        "{said}"
    );
    assert!(
        said.contains("w: min-baseline: 104 MiB against classic's 100 MiB"),
        "{said}"
    );
    assert!(said.contains("w: dominated: by classic"), "{said}");
    assert!(!said.contains("expandable's"), "{said}");
    // The same rows, Quilt and classic reusing memory unordered: Quilt's
    // races break a promise; classic is no comparison (no domination, no
    // minimum capacity against it).
    let races = |r: String, n: u32| {
        r.replacen(
            r#""completed": true"#,
            &format!(r#""completed": true, "races": {n}"#),
            1,
        )
    };
    let racing = write(
        "races.json",
        &[
            races(row("w", "quilt", 104, 0.95, 0), 2),
            races(row("w", "classic", 100, 0.99, 0), 5),
            row("w", "expandable", 110, 0.95, 0),
        ],
    );
    let out = python("promise-check.py", &[racing.to_str().unwrap()]);
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.contains("w: races: 2 allocations reuse memory"),
        "{said}"
    );
    assert!(
        said.contains("w: not checked: classic not compared"),
        "{said}"
    );
    assert!(
        !said.contains("by classic") && !said.contains("classic's"),
        "{said}"
    );
    for (args, why) in [
        (
            vec![dir.join("absent.json").to_str().unwrap().to_string()],
            "reading",
        ),
        (
            vec![
                kept.to_str().unwrap().to_string(),
                "--quilt".into(),
                "gmlake".into(),
            ],
            "no `gmlake` row",
        ),
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = python("promise-check.py", &args);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains(why), "{}", text(&out));
    }
}
