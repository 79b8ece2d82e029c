//! `quilt-bench sweep`: one knob of one allocator spec, one replay (and
//! bisection) per value, on one trace or workload: the usual report columns
//! per value, JSON rows with the value ([`crate::report::sweep_json`]), and a
//! chart of minimum capacity, efficiency and modelled driver time against it.

use std::path::Path;

use plotters::prelude::*;

use crate::report::Outcome;

/// The spec `base` with `key` set to `value` (replacing a setting of the same
/// key): `gmlake:frag_limit=32MiB` + `reuse_limit=4` gives
/// `gmlake:frag_limit=32MiB,reuse_limit=4`.
pub fn with_setting(base: &str, key: &str, value: &str) -> String {
    let (name, rest) = match base.split_once(':') {
        Some((n, r)) => (n, r),
        None => (base, ""),
    };
    let mut parts: Vec<String> = rest
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .filter(|p| p.split_once('=').map(|(k, _)| k.trim()) != Some(key))
        .map(str::to_string)
        .collect();
    parts.push(format!("{key}={value}"));
    format!("{name}:{}", parts.join(","))
}

/// `KEY=V1,V2,...` as the key and its values, or why not.
pub fn parse_vary(text: &str) -> Result<(String, Vec<String>), String> {
    let Some((key, values)) = text.split_once('=') else {
        return Err(format!("--vary `{text}`: expected KEY=V1,V2,..."));
    };
    let key = key.trim();
    let values: Vec<String> = values
        .split(',')
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if key.is_empty() || values.is_empty() {
        return Err(format!("--vary `{text}`: expected KEY=V1,V2,..."));
    }
    Ok((key.to_string(), values))
}

/// The chart `DIR/sweep-KEY.svg`: minimum capacity (GiB), efficiency at the
/// main capacity and modelled driver time (ms), each against the value (a
/// value whose pair failed has no point).
pub fn write_chart(
    dir: &Path,
    key: &str,
    values: &[String],
    outcomes: &[Outcome],
) -> Result<String, String> {
    let workload = outcomes
        .iter()
        .map(|o| match o {
            Ok(m) => m.row.workload.as_str(),
            Err(f) => f.workload.as_str(),
        })
        .next()
        .unwrap_or_default();
    let measurements: Vec<Option<&crate::report::Measurement>> =
        outcomes.iter().map(|o| o.as_ref().ok()).collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let safe: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let path = dir.join(format!("sweep-{safe}.svg"));
    let gib = (1u64 << 30) as f64;
    let panels: [(&str, Vec<Option<f64>>); 3] = [
        (
            "minimum capacity (GiB)",
            measurements
                .iter()
                .map(|m| {
                    m.and_then(|m| m.row.min_capacity_bytes)
                        .map(|b| b as f64 / gib)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code
    use super::*;

    #[test]
    fn settings_are_added_or_replaced() {
        assert_eq!(
            with_setting("quilt", "reclaim", "always"),
            "quilt:reclaim=always"
        );
        assert_eq!(
            with_setting("gmlake:frag_limit=32MiB", "reuse_limit", "4"),
            "gmlake:frag_limit=32MiB,reuse_limit=4"
        );
        assert_eq!(
            with_setting(
                "gmlake:frag_limit=32MiB,reuse_limit=2",
                "frag_limit",
                "64MiB"
            ),
            "gmlake:reuse_limit=2,frag_limit=64MiB"
        );
        assert_eq!(
            parse_vary("page_size=2MiB,20MiB").unwrap(),
            (
                "page_size".to_string(),
                vec!["2MiB".to_string(), "20MiB".to_string()]
            )
        );
        assert!(parse_vary("page_size").is_err());
        assert!(parse_vary("page_size=").is_err());
    }
}
