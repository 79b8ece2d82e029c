//! The `quilt-bench` binary, run as a user runs it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{temp_dir, text};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_quilt-bench"))
}

#[test]
fn ab_on_a_tiny_trace_writes_json_and_charts() {
    let dir = temp_dir("ab");
    let trace = dir.join("tiny.trace");
    // Pre-existing 4 MiB (declared in stats.json beside it), then a step.
    std::fs::write(
        &trace,
        "a 0 4194304 0\na 1 3145728 0\na 2 100 1\nf 1\na 3 25165824 0\nf 3\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("stats.json"),
        r#"[{"file": "tiny.trace", "preexisting_allocs": 1}]"#,
    )
    .unwrap();
    let json = dir.join("out.json");
    let svg = dir.join("charts");
    let out = bin()
        .args(["ab", "--trace"])
        .arg(&trace)
        .args([
            "--allocators",
            "classic,quilt",
            "--capacity",
            "1GiB",
            "--iterations",
            "2",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("tiny") && stdout.contains("classic") && stdout.contains("quilt"));

    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let parameters = &report["parameters"];
    assert_eq!(
        parameters["allocators"],
        serde_json::json!(["classic", "quilt"])
    );
    assert_eq!(parameters["workloads"], serde_json::json!(["tiny"]));
    assert_eq!(parameters["capacity_bytes"], 1u64 << 30);
    assert_eq!(parameters["iterations"], 2);
    assert_eq!(parameters["bisection"], true);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, allocator) in rows.iter().zip(["classic", "quilt"]) {
        assert_eq!(row["workload"], "tiny");
        assert_eq!(row["allocator"], allocator);
        assert_eq!(row["completed"], true);
        assert_eq!(row["capacity_bytes"], 1u64 << 30);
        // One pre-existing event, then the 5-event body twice.
        assert_eq!(row["events"], 1 + 2 * 5);
        assert_eq!(row["peak_live_bytes"], 4194304 + 100 + 25165824);
        let min = row["min_capacity_bytes"].as_u64().unwrap();
        assert!(min >= 4194304 + 100 + 25165824 && min % (2 << 20) == 0);
    }
    for chart in ["tiny.svg", "min-capacity.svg"] {
        let body = std::fs::read_to_string(svg.join(chart)).unwrap();
        assert!(
            body.starts_with("<svg") && body.contains("</svg>"),
            "{chart}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn min_capacity_chart_is_wide_enough_for_long_workload_names() {
    let dir = temp_dir("names");
    let mut traces = Vec::new();
    for i in 0..7 {
        let t = dir.join(format!("a_rather_long_workload_name_number_{i}.trace"));
        std::fs::write(&t, "a 0 4194304 0\na 1 25165824 0\nf 1\nf 0\n").unwrap();
        traces.push(t);
    }
    let svg = dir.join("charts");
    let out = bin()
        .args([
            "ab",
            "--allocators",
            "classic",
            "--capacity",
            "1GiB",
            "--trace",
        ])
        .args(&traces)
        .arg("--svg")
        .arg(&svg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let body = std::fs::read_to_string(svg.join("min-capacity.svg")).unwrap();
    let width: u32 = body
        .strip_prefix("<svg width=\"")
        .and_then(|r| r.split('"').next())
        .and_then(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no width in {}", &body[..80.min(body.len())]));
    // 36 characters per name at about 7 px each, seven groups side by side.
    assert!(
        width >= 7 * 36 * 7,
        "{width} px for seven 36-character names"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let dir = temp_dir("bad");
    let missing = dir.join("missing.trace");
    let bad_trace = dir.join("bad.trace");
    std::fs::write(&bad_trace, "a 0 100 0\nf 7\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["ab".into(), "--trace".into(), missing.display().to_string()],
            "missing.trace",
        ),
        (
            vec![
                "ab".into(),
                "--snapshot".into(),
                missing.display().to_string(),
            ],
            "missing.trace",
        ),
        (
            vec![
                "ab".into(),
                "--trace".into(),
                bad_trace.display().to_string(),
            ],
            "line 2",
        ),
        (
            vec![
                "ab".into(),
                "--workload".into(),
                "train-varlen".into(),
                "--capacity".into(),
                "80XB".into(),
            ],
            "bad size `80XB`",
        ),
        (
            vec!["ab".into(), "--workload".into(), "nope".into()],
            "unknown workload `nope`",
        ),
        (
            vec![
                "ab".into(),
                "--workload".into(),
                "train-varlen".into(),
                "--allocators".into(),
                "classic,foo".into(),
            ],
            "unknown allocator `foo`",
        ),
        (vec!["frobnicate".into()], "frobnicate"),
        (
            vec![
                "ab".into(),
                "--workload".into(),
                "train-varlen".into(),
                "--sync-cost-us=-1".into(),
            ],
            "--sync-cost-us must be",
        ),
        (
            vec![
                "ab".into(),
                "--workload".into(),
                "train-varlen".into(),
                "--sync-cost-us".into(),
                "NaN".into(),
            ],
            "--sync-cost-us must be",
        ),
        (
            vec![
                "ab".into(),
                "--workload".into(),
                "train-varlen".into(),
                "--gpu-lag-ops".into(),
                "many".into(),
            ],
            "--gpu-lag-ops",
        ),
    ];
    for (args, needle) in cases {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(needle),
            "{args:?}: stderr lacks `{needle}`: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn list_names_every_workload() {
    let out = bin().arg("list").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for name in [
        "train-varlen",
        "llm-serving",
        "model-switch",
        "mixed-vision-language",
    ] {
        assert!(stdout.contains(name), "{stdout}");
    }
}

/// `../shared/traces/converted`, the real traces beside the clone.
fn shared_converted() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/converted"
    ))
}

#[test]
#[cfg_attr(
    not(has_shared_traces),
    ignore = "needs ../shared/traces/converted (absent when built)"
)]
fn converted_traces_take_their_prefix_from_stats_json() {
    let dir = shared_converted();
    // stats.json lists 396 pre-existing allocations for this trace.
    let n = quilt_bench::cli::preexisting_from_stats(&dir.join("bert_large_infer.trace")).unwrap();
    assert_eq!(n, Some(396));
    assert_eq!(
        quilt_bench::cli::preexisting_from_stats(&dir.join("not-listed.trace")).unwrap(),
        None
    );
}

#[test]
fn repeated_names_are_made_unique() {
    let args = quilt_bench::cli::AbArgs {
        workloads: vec!["train-varlen".into(), "train-varlen".into()],
        traces: vec![],
        snapshots: vec![],
        allocators: Some(vec!["classic".into()]),
        allocator_specs: vec![],
        export_snapshot: None,
        check_every: None,
        run: quilt_bench::cli::RunArgs {
            capacity: "80GiB".into(),
            iterations: 1,
            json: None,
            svg: None,
            wide: false,
            no_bisect: true,
            seed: 1,
            jobs: Some(1),
            gpu_lag_ops: 64,
            sync_cost_us: 100.0,
        },
    };
    let traces = quilt_bench::cli::collect_traces(&args).unwrap();
    let names: Vec<&str> = traces.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["train-varlen", "train-varlen-2"]);
}

/// `ab` on `trace` with `extra` arguments; the JSON rows.
fn ab_rows(
    dir: &std::path::Path,
    trace: &std::path::Path,
    tag: &str,
    extra: &[&str],
) -> (String, Vec<serde_json::Value>) {
    let json = dir.join(format!("{tag}.json"));
    let out = bin()
        .args(["ab", "--trace"])
        .arg(trace)
        .args([
            "--allocators",
            "classic,quilt",
            "--capacity",
            "1GiB",
            "--iterations",
            "2",
            "--no-bisect",
        ])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        report["rows"].as_array().unwrap().clone(),
    )
}

#[test]
fn gpu_lag_and_sync_cost_flags_reach_the_report() {
    let dir = temp_dir("lag");
    let trace = dir.join("two.trace");
    std::fs::write(
        &trace,
        "a 0 4194304 0\na 1 3145728 1\nf 0\na 2 25165824 1\nf 1\na 3 100 0\nf 2\nf 3\n",
    )
    .unwrap();
    let (stdout, default) = ab_rows(&dir, &trace, "default", &["--wide"]);
    for column in ["syncs", "syncs after 1st", "waits"] {
        assert!(stdout.contains(column), "no `{column}` column: {stdout}");
    }
    assert!(
        stdout.contains("GPU 64 ops behind the host, 100 us per sync"),
        "{stdout}"
    );
    let (stdout, free) = ab_rows(
        &dir,
        &trace,
        "free",
        &["--gpu-lag-ops", "0", "--sync-cost-us", "0"],
    );
    assert!(
        stdout.contains("GPU 0 ops behind the host, 0 us per sync"),
        "{stdout}"
    );
    let (_, dear) = ab_rows(
        &dir,
        &trace,
        "dear",
        &["--gpu-lag-ops=0", "--sync-cost-us=2500.5"],
    );
    let keys = [
        "synchronize",
        "wait_event",
        "event_record",
        "event_query",
        "event_destroy",
        "is_capturing",
    ];
    for ((d, f), x) in default.iter().zip(&free).zip(&dear) {
        for field in ["stream_calls", "stream_calls_after_first_iteration"] {
            let object = f[field].as_object().unwrap();
            assert_eq!(object.len(), keys.len(), "{field}");
            for k in keys {
                assert!(object[k].is_u64(), "{field}.{k}");
            }
        }
        // The sync cost enters the modelled driver time, and only it.
        let syncs = x["stream_calls"]["synchronize"].as_u64().unwrap() as f64;
        let extra =
            x["modelled_driver_us"].as_f64().unwrap() - f["modelled_driver_us"].as_f64().unwrap();
        assert!((extra - syncs * 2500.5).abs() < 1e-3, "{x} vs {f}");
        assert_eq!(x["stream_calls"], f["stream_calls"]);
        if f["allocator"] == "classic" {
            // A baseline's figures do not depend on the lag (it orders no work
            // with events in a replay), nor, without syncs, on their cost.
            let mut d = d.clone();
            let mut f = f.clone();
            for row in [&mut d, &mut f] {
                row.as_object_mut().unwrap().remove("cpu_ns_per_op");
            }
            assert_eq!(d, f);
            assert_eq!(syncs, 0.0);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn allocator_specs_are_experiments_reported_as_given() {
    let dir = temp_dir("specs");
    // A small churn of mixed sizes.
    let mut t = String::new();
    for i in 0..40u64 {
        t += &format!("a {i} {} 0\n", (3 + i % 5) << 20);
        if i >= 4 {
            t += &format!("f {}\n", i - 4);
        }
    }
    for i in 36..40 {
        t += &format!("f {i}\n");
    }
    let trace = dir.join("churn.trace");
    std::fs::write(&trace, t).unwrap();
    let json = dir.join("specs.json");
    let out = bin()
        .args(["ab", "--trace"])
        .arg(&trace)
        .args([
            "--allocator",
            "quilt",
            "--allocator",
            "quilt:reclaim=always",
            "--allocator",
            "gmlake:frag_limit=4MiB,reuse_limit=2",
            "--iterations",
            "3",
            "--no-bisect",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let names: Vec<&str> = rows["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["allocator"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "quilt",
            "quilt:reclaim=always",
            "gmlake:frag_limit=4MiB,reuse_limit=2"
        ],
        "only the specs given, as given"
    );
    // A changed setting changes the result: GMLake's fragment limit on a
    // serving workload.
    let json = dir.join("gmlake.json");
    let out = bin()
        .args(["ab", "--workload", "llm-serving", "--no-bisect"])
        .args([
            "--allocator",
            "gmlake:frag_limit=32MiB",
            "--allocator",
            "gmlake",
        ])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let reserved: Vec<u64> = rows["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["peak_reserved_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(reserved.len(), 2);
    assert_ne!(reserved[0], reserved[1], "frag_limit changed nothing");
    // A bad key, a bad value, a dead knob: exit 2, naming what is valid.
    for (spec, expect) in [
        ("quilt:colour=blue", "valid keys: page_size, reclaim"),
        ("quilt:reclaim=sometimes", "when_full, always"),
        ("quilt:cached_permille=5", "reclaim=cached_above"),
        ("classic:max_split_size=huge", "max_split_size=huge"),
    ] {
        let out = bin()
            .args([
                "ab",
                "--workload",
                "llm-serving",
                "--no-bisect",
                "--allocator",
                spec,
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{spec}: {}", text(&out));
        assert!(text(&out).contains(expect), "{spec}: {}", text(&out));
    }
}

#[test]
fn export_snapshot_writes_pytorch_layout_pickles_that_add_up() {
    use serde_pickle::{HashableValue, Value};
    let dir = temp_dir("export");
    let out = bin()
        .args(["ab", "--workload", "llm-serving", "--no-bisect"])
        .args([
            "--allocators",
            "quilt,classic,expandable",
            "--export-snapshot",
        ])
        .arg(dir.join("snaps"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let get = |v: &Value, k: &str| -> Value {
        match v {
            Value::Dict(d) => d[&HashableValue::String(k.into())].clone(),
            _ => panic!("not a dict"),
        }
    };
    let int = |v: Value| match v {
        Value::I64(i) => i as u64,
        other => panic!("{other:?}"),
    };
    let list = |v: Value| match v {
        Value::List(l) => l,
        other => panic!("{other:?}"),
    };
    for allocator in ["quilt", "classic", "expandable"] {
        let path = dir
            .join("snaps")
            .join(format!("llm-serving__{allocator}.pickle"));
        let bytes = std::fs::read(&path).unwrap();
        let v = serde_pickle::value_from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap();
        let segments = list(get(&v, "segments"));
        assert!(!segments.is_empty(), "{allocator}");
        for s in &segments {
            let sizes: u64 = list(get(s, "blocks"))
                .iter()
                .map(|b| int(get(b, "size")))
                .sum();
            assert_eq!(sizes, int(get(s, "total_size")), "{allocator}: blocks tile");
        }
        // The snapshot reads back through Quilt's importer.
        quilt_bench::snapshot_import::import_snapshot(&bytes, allocator, 0).unwrap();
    }
}

#[test]
fn sweep_writes_one_row_per_value_and_a_chart() {
    let dir = temp_dir("sweep");
    let json = dir.join("sweep.json");
    let out = bin()
        .args([
            "sweep",
            "--workload",
            "llm-serving",
            "--allocator",
            "gmlake",
        ])
        .args([
            "--vary",
            "frag_limit=0,32MiB,512MiB",
            "--no-bisect",
            "--json",
        ])
        .arg(&json)
        .arg("--svg")
        .arg(dir.join("charts"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["parameters"]["vary"], "frag_limit");
    let rows = report["rows"].as_array().unwrap();
    let values: Vec<&str> = rows.iter().map(|r| r["value"].as_str().unwrap()).collect();
    assert_eq!(values, ["0", "32MiB", "512MiB"]);
    assert_eq!(rows[1]["allocator"], "gmlake:frag_limit=32MiB");
    assert!(rows.iter().all(|r| r["efficiency"].as_f64().unwrap() > 0.0));
    let reserved: Vec<u64> = rows
        .iter()
        .map(|r| r["peak_reserved_bytes"].as_u64().unwrap())
        .collect();
    assert_ne!(reserved[0], reserved[2], "the knob changed nothing");
    let svg = std::fs::read_to_string(dir.join("charts").join("sweep-frag_limit.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("512MiB"));
    // Bad usage: no trace, a malformed --vary, a bad value.
    for args in [
        &["sweep", "--vary", "frag_limit=0"][..],
        &["sweep", "--workload", "llm-serving", "--vary", "frag_limit"],
        &[
            "sweep",
            "--workload",
            "llm-serving",
            "--vary",
            "candidates=0",
            "--no-bisect",
        ],
    ] {
        let out = bin().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
    }
}

#[test]
fn scale_reports_one_point_per_allocator_live_count_and_streams() {
    let dir = temp_dir("scale");
    let json = dir.join("scale.json");
    let out = bin()
        .args(["scale", "--allocators", "quilt,classic", "--live", "50,200"])
        .args([
            "--streams",
            "1,4",
            "--steps",
            "300",
            "--repeat",
            "3",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    // One table line per point, each against its allocator's one-stream point.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().map(str::trim).collect();
    assert!(lines[1].starts_with("allocator"), "{}", lines[1]);
    assert!(lines[1].ends_with("/fewest"), "{}", lines[1]);
    assert_eq!(lines.iter().filter(|l| l.ends_with("1.00x")).count(), 4);
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 8);
    for r in rows {
        for key in ["allocator", "live", "streams"] {
            assert!(!r[key].is_null(), "{r}");
        }
        // The reported figure is the median of the three runs.
        let mut runs: Vec<f64> = r["runs_ns_per_op"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(runs.len(), 3, "{r}");
        assert!(runs.iter().all(|&ns| ns > 0.0), "{r}");
        runs.sort_by(f64::total_cmp);
        assert_eq!(r["ns_per_op"].as_f64().unwrap(), runs[1], "{r}");
        // The simulated driver's own time is taken out of the host figure:
        // in every run, so in the medians too.
        let (host, sim, wall) = (
            r["ns_per_op"].as_f64().unwrap(),
            r["sim_ns_per_op"].as_f64().unwrap(),
            r["wall_ns_per_op"].as_f64().unwrap(),
        );
        assert!(host <= wall && sim >= 0.0 && sim < wall, "{r}");
        // What the driver charges is reported too: Quilt orders its streams
        // with events once there are several, classic never calls them.
        assert!(r["driver_ns_per_op"].as_f64().unwrap() >= 0.0, "{r}");
        let calls = r["stream_calls_per_op"].as_f64().unwrap();
        let events = &r["stream_calls"];
        let sum: u64 = [
            "synchronize",
            "wait_event",
            "event_record",
            "event_query",
            "event_destroy",
            "is_capturing",
        ]
        .iter()
        .map(|k| events[k].as_u64().unwrap())
        .sum();
        assert!((calls - sum as f64 / 600.0).abs() < 1e-9, "{r}");
        match (
            r["allocator"].as_str().unwrap(),
            r["streams"].as_u64().unwrap(),
        ) {
            ("quilt", 4) => assert!(events["event_record"].as_u64().unwrap() > 0, "{r}"),
            ("classic", _) => assert_eq!(sum, 0, "{r}"),
            _ => {}
        }
    }
    for bad in ["--live", "--repeat"] {
        let out = bin().args(["scale", bad, "0"]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", text(&out));
    }
    let out = bin()
        .args(["scale", "--allocators", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn sizes_reports_one_point_per_allocator_and_size_against_the_smallest() {
    let dir = temp_dir("sizes");
    let json = dir.join("sizes.json");
    let out = bin()
        .args([
            "sizes",
            "--allocators",
            "quilt,classic",
            "--sizes",
            "2MiB,64MiB",
        ])
        .args(["--live", "4", "--steps", "200", "--repeat", "3", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = stdout.lines().map(str::trim).collect();
    assert!(lines[1].starts_with("allocator"), "{}", lines[1]);
    assert!(lines[1].contains("/smallest"), "{}", lines[1]);
    // Each allocator's 2 MiB point is its own reference.
    let points: Vec<&&str> = lines.iter().filter(|l| l.contains(" MiB ")).collect();
    assert_eq!(points.len(), 4, "{stdout}");
    assert_eq!(
        points
            .iter()
            .filter(|l| l.contains("2 MiB") && l.contains(" 1.00x"))
            .count(),
        2,
        "{stdout}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    let mut seen: Vec<(String, u64)> = rows
        .iter()
        .map(|r| {
            (
                r["allocator"].as_str().unwrap().to_string(),
                r["size_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort();
    let want = |a: &str, s: u64| (a.to_string(), s);
    assert_eq!(
        seen,
        vec![
            want("classic", 2 << 20),
            want("classic", 64 << 20),
            want("quilt", 2 << 20),
            want("quilt", 64 << 20),
        ]
    );
    for r in rows {
        assert_eq!(r["live"].as_u64(), Some(4), "{r}");
        assert_eq!(r["runs_ns_per_op"].as_array().unwrap().len(), 3, "{r}");
        // Blocks of one size reuse the place freed just before: once the
        // live set is built, Quilt makes no driver call.
        if r["allocator"] == "quilt" {
            assert_eq!(r["vmm_calls_per_op"].as_f64(), Some(0.0), "{r}");
        }
    }
    for bad in [["--sizes", "0"], ["--sizes", "12XB"], ["--live", "0"]] {
        let out = bin().arg("sizes").args(bad).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", text(&out));
    }
}

/// The lines of `text` wider than `width` characters.
fn wider_than(text: &str, width: usize) -> Vec<&str> {
    text.lines().filter(|l| l.chars().count() > width).collect()
}

#[test]
fn the_main_command_fits_100_columns_with_a_legend_and_a_summary() {
    // The README's main command, as it stands: every built-in workload,
    // every allocator, one iteration, bisection.
    let out = bin().arg("ab").output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(wider_than(&stdout, 100), Vec::<&str>::new(), "{stdout}");
    assert!(
        stdout.starts_with("device 80 GiB (simulated), 1 iteration,"),
        "{stdout}"
    );
    // The claims' columns, each in the legend.
    for column in [
        "min cap GiB",
        "min cap/ideal",
        "eff.",
        "driver ms",
        "calls after 1st",
        "syncs",
        "waits",
    ] {
        assert!(
            stdout.contains(&format!("  {column}: ")),
            "no legend of `{column}`: {stdout}"
        );
    }
    // One iteration: no steady state to report, said as such.
    assert!(stdout.contains("-: one iteration ran"), "{stdout}");
    assert!(
        stdout.contains("calls after 1st (fewest): - (one iteration ran"),
        "{stdout}"
    );
    // The summary names a winner per column.
    let summary = stdout.split("best per column").nth(1).unwrap();
    for line in [
        "min cap GiB (lowest): ",
        "eff. (highest): ",
        "driver ms (lowest): ",
    ] {
        let l = summary
            .lines()
            .find(|l| l.trim_start().starts_with(line))
            .unwrap();
        let winner = l.split(':').nth(1).unwrap().trim();
        assert!(
            ["quilt", "classic", "expandable", "gmlake", "offset"]
                .iter()
                .any(|a| winner.starts_with(a)),
            "{l}"
        );
    }
    // A row per workload and allocator, each with its figures.
    let rows = stdout
        .lines()
        .filter(|l| l.starts_with("  quilt ") && l.contains(" yes "))
        .count();
    assert_eq!(rows, quilt_bench::workloads::WORKLOADS.len(), "{stdout}");
}

#[test]
fn wide_prints_every_column_and_json_dash_keeps_stdout_for_the_json() {
    let out = bin()
        .args(["ab", "--workload", "train-varlen", "--iterations", "2"])
        .args(["--allocators", "quilt,classic", "--no-bisect", "--wide"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for column in [
        "peak live GiB",
        "peak reserved GiB",
        "ideal GiB",
        "VMM calls",
        "calls after 1st",
        "syncs after 1st",
        "time/classic",
        "flat-create ms",
        "CPU ns/op",
    ] {
        assert!(stdout.contains(column), "no `{column}`: {stdout}");
    }
    let out = bin()
        .args(["ab", "--workload", "train-varlen", "--iterations", "2"])
        .args([
            "--allocators",
            "quilt,classic",
            "--no-bisect",
            "--json",
            "-",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not the JSON alone: {e}: {}", text(&out)));
    let p = &report["parameters"];
    assert!(p["version"]
        .as_str()
        .unwrap()
        .starts_with(env!("CARGO_PKG_VERSION")));
    assert_eq!(p["allocators"], serde_json::json!(["quilt", "classic"]));
    assert_eq!(p["capacity_bytes"], 80u64 << 30);
    assert_eq!(p["iterations"], 2);
    assert_eq!(p["seed"], 42);
    assert_eq!(p["bisection"], false);
    assert_eq!(p["cost_model"]["gpu_lag_ops"], 64);
    assert_eq!(p["cost_model"]["sync_us"], 100.0);
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r["completed"], true);
        assert!(r["oom"].is_null());
        assert!(r["vmm_calls_after_first_iteration"].is_object(), "{r}");
    }
    // The table went to standard error.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("train-varlen: peak live") && stderr.contains("best per column"));
}

/// A 24 MiB step after 4 MiB.
fn step_trace(dir: &std::path::Path) -> PathBuf {
    let trace = dir.join("step.trace");
    std::fs::write(&trace, "a 0 4194304 0\na 1 25165824 0\nf 1\nf 0\n").unwrap();
    trace
}

#[test]
fn a_failing_allocator_is_reported_in_its_row_and_the_others_go_on() {
    let dir = temp_dir("failing");
    let trace = step_trace(&dir);
    let json = dir.join("out.json");
    let out = bin()
        .args(["ab", "--trace"])
        .arg(&trace)
        .args(["--allocators", "quilt,classic", "--capacity", "1GiB"])
        // Parses, but its page size is not a multiple of the granularity.
        .args(["--allocator", "quilt:page_size=3MiB", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("step / quilt:page_size=3MiB: FAILED: building allocator"),
        "{stdout}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("1 of 3"),
        "{}",
        text(&out)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["completed"], true);
    assert_eq!(rows[1]["completed"], true);
    assert!(rows[0]["min_capacity_bytes"].as_u64().unwrap() >= 28 << 20);
    assert_eq!(rows[2]["allocator"], "quilt:page_size=3MiB");
    assert_eq!(rows[2]["completed"], false);
    assert!(
        rows[2]["error"].as_str().unwrap().contains("page size"),
        "{}",
        rows[2]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_allocator_out_of_memory_exits_1_and_each_oom_is_told_once() {
    let dir = temp_dir("oom");
    let trace = step_trace(&dir);
    let json = dir.join("out.json");
    let out = bin()
        .args(["ab", "--trace"])
        .arg(&trace)
        .args(["--allocators", "quilt,classic", "--capacity", "16MiB"])
        .arg("--json")
        .arg(&json)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("every allocator ran out of memory on step at 16.00 MiB")
            && stderr.contains("give a larger --capacity (at least 2"),
        "{stderr}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    for allocator in ["quilt", "classic"] {
        let note = format!("step / {allocator}: out of memory after ");
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&note))
            .unwrap_or_else(|| {
                panic!("no `{note}`: {stdout}");
            });
        assert!(line.ends_with("verdict: capacity"), "{line}");
        assert_eq!(line.matches(allocator).count(), 1, "{line}");
    }
    // The report's figures, as the allocator gave them, in the row: Quilt
    // fails on the 24 MiB step with 4 MiB live; classic already on the 4 MiB
    // block, whose 20 MiB segment (PyTorch's size for it) the device lacks.
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    for (row, (asked, new, live)) in rows.iter().zip([
        (24u64 << 20, 24u64 << 20, 4u64 << 20),
        (4 << 20, 20 << 20, 0),
    ]) {
        let oom = &row["oom"];
        assert_eq!(oom["verdict"], "capacity", "{row}");
        let r = &oom["report"];
        assert_eq!(r["requested"], asked, "{row}");
        assert_eq!(r["needed"], asked, "{row}");
        assert_eq!(r["needed_unbacked"], new, "{row}");
        assert_eq!(r["capacity"], 16u64 << 20, "{row}");
        assert_eq!(r["allocated"], live, "{row}");
        assert_eq!(r["device_free"], (16u64 << 20) - live, "{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inputs_that_cannot_be_replayed_name_the_file_and_what_to_do() {
    let dir = temp_dir("inputs");
    let stats = dir.join("stats.json");
    std::fs::write(&stats, r#"[{"file": "x.trace", "preexisting_allocs": 0}]"#).unwrap();
    let pickle = dir.join("snap.pickle");
    std::fs::write(
        &pickle,
        serde_pickle::to_vec(&vec![1u8, 2], Default::default()).unwrap(),
    )
    .unwrap();
    let empty = dir.join("empty.trace");
    std::fs::write(&empty, "\n\n").unwrap();
    let text_trace = step_trace(&dir);
    let history = dir.join("history.pickle");
    std::fs::write(&history, no_history_snapshot()).unwrap();
    let p = |path: &PathBuf| path.display().to_string();
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec!["--capacity".into(), "1.5".into()],
            vec!["--capacity 1.5: give a unit".into(), "1.5GiB".into()],
        ),
        (
            vec!["--capacity".into(), "4096".into()],
            vec!["--capacity 4096: give a unit".into(), "4096B".into()],
        ),
        (
            vec!["--trace".into(), p(&stats)],
            vec![
                format!("{}: not a trace", p(&stats)),
                "--trace DIR/*.trace".into(),
            ],
        ),
        (
            vec!["--trace".into(), p(&pickle)],
            vec![format!("{}: a pickle", p(&pickle)), "--snapshot".into()],
        ),
        (
            vec!["--snapshot".into(), p(&text_trace)],
            vec![
                format!("{}: a text trace", p(&text_trace)),
                "--trace".into(),
            ],
        ),
        (
            vec!["--trace".into(), p(&empty)],
            vec![format!("{}: no allocation", p(&empty))],
        ),
        (
            vec!["--snapshot".into(), p(&history)],
            vec![
                format!(
                    "{}: the snapshot recorded no allocation history",
                    p(&history)
                ),
                "_record_memory_history".into(),
            ],
        ),
    ];
    for (args, needles) in cases {
        let out = bin()
            .arg("ab")
            .args(&args)
            .arg("--no-bisect")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        for needle in needles {
            assert!(
                stderr.contains(&needle),
                "{args:?}: no `{needle}`: {stderr}"
            );
        }
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out));
    }
    // `1.5GiB` and `4096B` are sizes.
    for capacity in ["1.5GiB", "4096B"] {
        let out = bin()
            .args(["ab", "--trace"])
            .arg(&text_trace)
            .args([
                "--capacity",
                capacity,
                "--no-bisect",
                "--allocators",
                "classic",
            ])
            .output()
            .unwrap();
        assert_ne!(out.status.code(), Some(2), "{capacity}: {}", text(&out));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A snapshot pickle in PyTorch's layout with a segment but no trace
/// entries (history was not recorded).
fn no_history_snapshot() -> Vec<u8> {
    use serde_pickle::{HashableValue, Value};
    let s = |t: &str| HashableValue::String(t.into());
    let dict = |items: Vec<(&str, Value)>| {
        Value::Dict(items.into_iter().map(|(k, v)| (s(k), v)).collect())
    };
    let block = dict(vec![
        ("address", Value::I64(1 << 30)),
        ("size", Value::I64(2 << 20)),
        ("requested_size", Value::I64(2 << 20)),
        ("state", Value::String("active_allocated".into())),
    ]);
    let segment = dict(vec![
        ("device", Value::I64(0)),
        ("address", Value::I64(1 << 30)),
        ("total_size", Value::I64(2 << 20)),
        ("allocated_size", Value::I64(2 << 20)),
        ("active_size", Value::I64(2 << 20)),
        ("requested_size", Value::I64(2 << 20)),
        ("stream", Value::I64(0)),
        ("segment_type", Value::String("large".into())),
        ("blocks", Value::List(vec![block])),
    ]);
    let top = dict(vec![
        ("segments", Value::List(vec![segment])),
        ("device_traces", Value::List(vec![Value::List(vec![])])),
    ]);
    serde_pickle::value_to_vec(&top, serde_pickle::SerOptions::new()).unwrap()
}

#[test]
fn a_reader_that_stops_reading_ends_the_report_quietly() {
    // `quilt-bench ab | head -1`: the pipe closes after the first line.
    let mut child = bin()
        .args(["ab", "--workload", "train-varlen", "--no-bisect"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
}
