//! The chart outputs (SVG, plotters): an A/B run's memory over each replay
//! and minimum capacities ([`write_charts`]), and a sweep's figures against
//! the swept value ([`write_sweep_chart`]).

use std::path::Path;

use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use crate::report::rows::{distinct, workload_of, Measurement, Outcome};

/// A chart could not be written.
#[derive(Debug, thiserror::Error)]
#[error("writing chart {path}: {message}")]
pub struct ChartError {
    /// The file.
    pub path: String,
    /// What went wrong.
    pub message: String,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Write the charts into `dir` (created if needed): per workload
/// `<workload>.svg` (live memory and each allocator's reserved memory over the
/// replay, Quilt drawn last and thicker, the device and `iterations` in the
/// title), and, when a bisection ran, `min-capacity.svg` (minimum capacity
/// over peak live, by workload and allocator). Returns the files written.
pub fn write_charts(
    dir: &Path,
    measurements: &[Measurement],
    iterations: u32,
) -> Result<Vec<String>, ChartError> {
    let fail = |path: &Path, message: String| ChartError {
        path: path.display().to_string(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| fail(dir, e.to_string()))?;
    let workloads = distinct(measurements.iter().map(|m| m.row.workload.as_str()));
    let mut written = Vec::new();
    for w in &workloads {
        let path = dir.join(format!("{}.svg", file_safe(w, "-_")));
        let rows: Vec<&Measurement> = measurements
            .iter()
            .filter(|m| m.row.workload == *w)
            .collect();
        memory_chart(&path, w, &rows, iterations).map_err(|e| fail(&path, e))?;
        written.push(path.display().to_string());
    }
    // No bisection (`--no-bisect`), no minimum-capacity chart.
    if measurements
        .iter()
        .any(|m| m.row.min_capacity_bytes.is_some())
    {
        let path = dir.join("min-capacity.svg");
        min_capacity_chart(&path, &workloads, measurements).map_err(|e| fail(&path, e))?;
        written.push(path.display().to_string());
    }
    Ok(written)
}

/// `name` as a file name: every character other than an ASCII letter or
/// digit and those of `keep` becomes `_`.
pub fn file_safe(name: &str, keep: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || keep.contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

const GIB: f64 = (1u64 << 30) as f64;

fn iterations_note(iterations: u32) -> String {
    if iterations > 1 {
        format!(", {iterations} iterations")
    } else {
        String::new()
    }
}

fn memory_chart(
    path: &Path,
    workload: &str,
    rows: &[&Measurement],
    iterations: u32,
) -> Result<(), String> {
    let root = SVGBackend::new(path, (1100, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let x_max = rows
        .iter()
        .flat_map(|m| m.series.last().map(|p| p.event))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let y_max = rows
        .iter()
        .flat_map(|m| m.series.iter().map(|p| p.reserved_bytes.max(p.live_bytes)))
        .max()
        .unwrap_or(1) as f64
        / GIB
        * 1.08;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "{workload}: live and reserved memory, {} GiB device{}",
                rows.first()
                    .map(|m| m.row.capacity_bytes as f64 / GIB)
                    .map_or_else(String::new, |g| format!("{g:.0}")),
                iterations_note(iterations),
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max.max(0.001))
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("events replayed")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_desc("GiB")
        .draw()
        .map_err(|e| e.to_string())?;
    if let Some(first) = rows.iter().max_by_key(|m| m.series.len()) {
        let live: Vec<(f64, f64)> = first
            .series
            .iter()
            .map(|p| (p.event as f64, p.live_bytes as f64 / GIB))
            .collect();
        chart
            .draw_series(LineSeries::new(live, BLACK.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("live (requested)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    }
    // The allocator under study (Quilt) last and thicker, so that no other
    // line hides it.
    let mut order: Vec<(usize, &&Measurement)> = rows.iter().enumerate().collect();
    order.sort_by_key(|(_, m)| m.subject);
    for (i, m) in order {
        let color = COLORS[i % COLORS.len()];
        let width = if m.subject { 3 } else { 1 };
        let points: Vec<(f64, f64)> = m
            .series
            .iter()
            .map(|p| (p.event as f64, p.reserved_bytes as f64 / GIB))
            .collect();
        let label = if m.row.completed {
            format!("{} reserved", m.row.allocator)
        } else {
            format!("{} reserved (OOM)", m.row.allocator)
        };
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(width)))
            .map_err(|e| e.to_string())?
            .label(label)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present().map_err(|e| e.to_string())
}

fn min_capacity_chart(
    path: &Path,
    workloads: &[&str],
    measurements: &[Measurement],
) -> Result<(), String> {
    let allocators = distinct(measurements.iter().map(|m| m.row.allocator.as_str()));
    let ratio_of = |m: &Measurement| -> Option<f64> {
        let cap = m.row.min_capacity_bytes?;
        (m.row.peak_live_bytes > 0).then(|| cap as f64 / m.row.peak_live_bytes as f64)
    };
    let y_max = measurements
        .iter()
        .filter_map(ratio_of)
        .fold(1.1f64, f64::max)
        * 1.05;
    // Wide enough that each workload's name fits under its group: about
    // 7 px per character of the 12 px label font, and a gap between names.
    let longest = workloads
        .iter()
        .map(|w| w.chars().count())
        .max()
        .unwrap_or(0);
    let per_group = (longest as u32 * 7 + 24).max(140);
    let width = (workloads.len().max(1) as u32 * per_group + 100).max(1100);
    let root = SVGBackend::new(path, (width, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let groups = workloads.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "minimum capacity / peak live bytes (1.0 = no overhead)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..groups, 1f64..y_max)
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = workloads.iter().map(|w| w.to_string()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            let frac = x - x.floor();
            if (frac - 0.5).abs() < 1e-6 {
                names.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("min capacity / peak live")
        .draw()
        .map_err(|e| e.to_string())?;
    let n = allocators.len().max(1) as f64;
    let width = 0.8 / n;
    for (ai, a) in allocators.iter().enumerate() {
        let color = COLORS[ai % COLORS.len()];
        let mut bars = Vec::new();
        for (wi, w) in workloads.iter().enumerate() {
            let found = measurements
                .iter()
                .find(|m| m.row.workload == *w && m.row.allocator == *a);
            if let Some(r) = found.and_then(ratio_of) {
                let x0 = wi as f64 + 0.1 + ai as f64 * width;
                bars.push(Rectangle::new(
                    [(x0, 1.0), (x0 + width * 0.9, r)],
                    color.filled(),
                ));
            }
        }
        chart
            .draw_series(bars)
            .map_err(|e| e.to_string())?
            .label(a.to_string())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
    root.present().map_err(|e| e.to_string())
}

/// The legend of `chart`'s series at `position`, on a light box.
fn draw_legend<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>,
    position: SeriesLabelPosition,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())
}

/// The chart `DIR/sweep-KEY.svg`: minimum capacity (GiB), efficiency at the
/// main capacity and modelled driver time (ms), each against the value (a
/// value whose pair failed has no point).
pub fn write_sweep_chart(
    dir: &Path,
    key: &str,
    values: &[String],
    outcomes: &[Outcome],
) -> Result<String, String> {
    let workload = outcomes.first().map(workload_of).unwrap_or_default();
    let measurements: Vec<Option<&Measurement>> =
        outcomes.iter().map(|o| o.as_ref().ok()).collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("sweep-{}.svg", file_safe(key, "")));
    let panels: [(&str, Vec<Option<f64>>); 3] = [
        (
            "minimum capacity (GiB)",
            measurements
                .iter()
                .map(|m| {
                    m.and_then(|m| m.row.min_capacity_bytes)
                        .map(|b| b as f64 / GIB)
                })
                .collect(),
        ),
        (
            "efficiency (peak live / peak reserved)",
            measurements
                .iter()
                .map(|m| m.map(|m| m.row.efficiency))
                .collect(),
        ),
        (
            "modelled driver time (ms)",
            measurements
                .iter()
                .map(|m| m.map(|m| m.row.modelled_driver_us / 1000.0))
                .collect(),
        ),
    ];
    let root = SVGBackend::new(&path, (900, 900)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(&format!("{workload}: sweep of {key}"), ("sans-serif", 22))
        .map_err(|e| e.to_string())?;
    let areas = root.split_evenly((3, 1));
    let n = values.len().max(1);
    for (area, (title, ys)) in areas.iter().zip(panels.iter()) {
        let known: Vec<f64> = ys.iter().flatten().copied().collect();
        let lo = known.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = known.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = if known.is_empty() {
            (0.0, 1.0)
        } else if hi - lo < 1e-9 {
            (lo - 0.5 * lo.abs().max(1e-3), hi + 0.5 * hi.abs().max(1e-3))
        } else {
            (lo - 0.08 * (hi - lo), hi + 0.08 * (hi - lo))
        };
        let mut chart = ChartBuilder::on(area)
            .caption(*title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), lo..hi)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_labels(n)
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    values.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .x_desc(key)
            .draw()
            .map_err(|e| e.to_string())?;
        let points: Vec<(f64, f64)> = ys
            .iter()
            .enumerate()
            .filter_map(|(i, y)| y.map(|y| (i as f64, y)))
            .collect();
        let color = RGBColor(31, 119, 180);
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?;
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(path.display().to_string())
}
