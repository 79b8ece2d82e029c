//! The chart of a live run (SVG, plotters, as `ab`'s charts in
//! [`crate::report::charts`]): per allocator, the peak reserved bytes on the
//! largest device, the smallest device, and, with `--record`, the smallest
//! device the replay predicts; a line at the peak allocated bytes.

use std::path::Path;

use plotters::prelude::*;

use super::record::Recorded;
use super::Row;
use crate::report::charts::file_safe;

const MIB: f64 = (1u64 << 20) as f64;

/// The bars of each allocator: name and colour.
const SERIES: [(&str, RGBColor); 3] = [
    ("peak reserved, largest device", RGBColor(31, 119, 180)),
    ("smallest device, live", RGBColor(214, 39, 40)),
    ("smallest device, replay", RGBColor(255, 127, 14)),
];

/// Write `DIR/<program>-live.svg` (`DIR` created if needed); the file.
pub fn write_chart(
    dir: &Path,
    program: &str,
    rows: &[Row],
    recorded: Option<&Recorded>,
) -> Result<String, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{}-live.svg", file_safe(program, "-_.")));
    draw(&path, program, rows, recorded).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path.display().to_string())
}

/// The figures of one allocator's bars, MiB (`None`: no bar).
fn bars(r: &Row, recorded: Option<&Recorded>) -> [Option<f64>; 3] {
    let mib = |b: u64| b as f64 / MIB;
    [
        r.largest
            .completed
            .then(|| mib(r.largest.figures.peak_reserved_bytes)),
        r.smallest_device_bytes.map(mib),
        recorded
            .and_then(|rec| rec.replayed(&r.allocator))
            .and_then(|m| m.row.min_capacity_bytes)
            .map(mib),
    ]
}

fn draw(
    path: &Path,
    program: &str,
    rows: &[Row],
    recorded: Option<&Recorded>,
) -> Result<(), String> {
    let alloc = rows
        .iter()
        .map(|r| r.largest.figures.peak_allocated_bytes)
        .max()
        .unwrap_or(0) as f64
        / MIB;
    let values: Vec<f64> = rows
        .iter()
        .flat_map(|r| bars(r, recorded))
        .flatten()
        .collect();
    let y_max = values.iter().copied().fold(alloc, f64::max).max(1.0) * 1.12;
    // The axis starts below the lowest bar (each bar carries its value), so
    // that differences of a few percent are visible.
    let lowest = values.iter().copied().fold(alloc, f64::min);
    let y_min = (lowest * 0.8 / 100.0).floor() * 100.0;
    let width = (rows.len().max(1) as u32 * 220 + 120).max(800);
    let root = SVGBackend::new(path, (width, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let groups = rows.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{program} on the simulated GPU: memory per allocator"),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..groups, y_min..y_max)
        .map_err(|e| e.to_string())?;
    let names: Vec<String> = rows.iter().map(|r| r.allocator.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(names.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let frac = x - x.floor();
            if (frac - 0.5).abs() < 1e-6 {
                names.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc(format!("MiB (axis from {y_min:.0})"))
        .draw()
        .map_err(|e| e.to_string())?;
    let shown = if recorded.is_some() { 3 } else { 2 };
    let w = 0.8 / shown as f64;
    for (s, (label, color)) in SERIES.iter().take(shown).enumerate() {
        let color = *color;
        let rects: Vec<Rectangle<(f64, f64)>> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                let v = bars(r, recorded)[s]?;
                let x0 = i as f64 + 0.1 + s as f64 * w;
                Some(Rectangle::new(
                    [(x0, y_min), (x0 + w * 0.9, v)],
                    color.filled(),
                ))
            })
            .collect();
        let labels: Vec<Text<(f64, f64), String>> = rows
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                let v = bars(r, recorded)[s]?;
                let x0 = i as f64 + 0.1 + s as f64 * w;
                let at = (x0 + w * 0.15, v + (y_max - y_min) * 0.02);
                Some(Text::new(format!("{v:.0}"), at, ("sans-serif", 13)))
            })
            .collect();
        chart.draw_series(labels).map_err(|e| e.to_string())?;
        chart
            .draw_series(rects)
            .map_err(|e| e.to_string())?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            [(0.0, alloc), (groups, alloc)],
            BLACK.stroke_width(2),
        ))
        .map_err(|e| e.to_string())?
        .label("peak allocated")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
