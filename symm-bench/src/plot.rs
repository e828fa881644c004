//! latency.png: log-log latency against size, one panel per (dtype, mode), one line per
//! algorithm, and the empty-kernel floor. Text is drawn with an embedded DejaVu Sans
//! (plotters' `ab_glyph` backend), so no system font is needed.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::args::Mode;
use crate::report::Row;

const PANEL: (u32, u32) = (680, 460);
const FONT: &str = "sans-serif";

fn register_embedded_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // DejaVu Sans is a valid TrueType font; a failure would only mean text-less output,
        // and the draw below would then report the missing font.
        let _ = register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

fn colour(algo: &str) -> RGBColor {
    match algo {
        "one_shot" => RGBColor(31, 119, 180),
        "two_shot" => RGBColor(214, 39, 40),
        "auto" => RGBColor(44, 160, 44),
        "nccl" => RGBColor(20, 20, 20),
        "nccl_symm" => RGBColor(127, 127, 127),
        "low_latency" => RGBColor(148, 103, 189),
        "symmetric" => RGBColor(255, 127, 14),
        "pool" => RGBColor(23, 190, 207),
        _ => RGBColor(140, 86, 75),
    }
}

/// Compact byte label for log-axis ticks: 1000 -> "1000", 1048576 -> "1M", 10000 -> "9.8K".
pub fn short_bytes(v: f64) -> String {
    let (div, unit) = if v >= (1u64 << 30) as f64 {
        ((1u64 << 30) as f64, "G")
    } else if v >= (1u64 << 20) as f64 {
        ((1u64 << 20) as f64, "M")
    } else if v >= 1024.0 {
        (1024.0, "K")
    } else {
        (1.0, "")
    };
    let x = v / div;
    if (x - x.round()).abs() < 0.05 {
        format!("{:.0}{unit}", x)
    } else {
        format!("{x:.1}{unit}")
    }
}

/// Draws `rows` into `path`. `title` goes above every panel's mode and dtype.
pub fn latency_png(path: &Path, rows: &[Row], title: &str) -> Result<(), String> {
    register_embedded_font();
    let mut dtypes: Vec<&str> = Vec::new();
    for r in rows {
        if !dtypes.contains(&r.dtype.as_str()) {
            dtypes.push(&r.dtype);
        }
    }
    let modes: Vec<Mode> = Mode::ALL
        .into_iter()
        .filter(|m| rows.iter().any(|r| r.mode == *m))
        .collect();
    if dtypes.is_empty() || modes.is_empty() {
        return Err("no rows to plot".into());
    }
    let size = (PANEL.0 * modes.len() as u32, PANEL.1 * dtypes.len() as u32 + 40);
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(title, (FONT, 22).into_font().style(FontStyle::Bold))
        .map_err(|e| e.to_string())?;
    let panels = root.split_evenly((dtypes.len(), modes.len()));
    for (i, panel) in panels.iter().enumerate() {
        let dtype = dtypes[i / modes.len()];
        let mode = modes[i % modes.len()];
        let here: Vec<&Row> = rows
            .iter()
            .filter(|r| r.dtype == dtype && r.mode == mode)
            .collect();
        draw_panel(panel, &here, dtype, mode)?;
    }
    root.present().map_err(|e| e.to_string())
}

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    rows: &[&Row],
    dtype: &str,
    mode: Mode,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    if rows.is_empty() {
        return Ok(());
    }
    let floor = empty_floor(rows);
    let (mut x0, mut x1) = (f64::MAX, 0f64);
    let (mut y0, mut y1) = (f64::MAX, 0f64);
    let times = rows.iter().map(|r| (r.size_bytes as f64, r.time_us));
    for (x, y) in times.chain(floor.iter().copied()) {
        x0 = x0.min(x);
        x1 = x1.max(x);
        y0 = y0.min(y);
        y1 = y1.max(y);
    }
    let mut chart = ChartBuilder::on(area)
        .caption(format!("{dtype}, {}", mode.name()), (FONT, 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(
            (x0 / 1.5..x1 * 1.5).log_scale().base(4.0),
            (y0.max(1e-3) / 1.3..y1 * 1.3).log_scale(),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("message size per rank (bytes)")
        .y_desc("time per all-reduce (µs)")
        .x_label_formatter(&|v| short_bytes(*v))
        .y_label_formatter(&|v| format!("{v}"))
        .label_style((FONT, 12))
        .axis_desc_style((FONT, 13))
        .draw()
        .map_err(err)?;

    let mut algos: Vec<&str> = Vec::new();
    for r in rows {
        if !algos.contains(&r.algo.as_str()) {
            algos.push(&r.algo);
        }
    }
    for algo in algos {
        let mut pts: Vec<(f64, f64)> = rows
            .iter()
            .filter(|r| r.algo == algo)
            .map(|r| (r.size_bytes as f64, r.time_us))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let c = colour(algo);
        // NCCL's world may differ from ours (one GPU: NCCL runs a world of one).
        let label = match rows.iter().find(|r| r.algo == algo) {
            Some(r) if algo == "nccl" || algo == "nccl_symm" => format!("{algo} (world {})", r.world),
            _ => algo.to_string(),
        };
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(err)?;
    }
    if !floor.is_empty() {
        let grey = RGBColor(150, 150, 150);
        chart
            .draw_series(LineSeries::new(floor, grey.stroke_width(1)))
            .map_err(err)?
            .label("empty kernel (floor)")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], grey.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 12))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)
}

/// Per size, the lowest `empty_us` among the rows (the launch floor).
fn empty_floor(rows: &[&Row]) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = Vec::new();
    for r in rows {
        let Some(e) = r.empty_us else { continue };
        let x = r.size_bytes as f64;
        match pts.iter_mut().find(|p| p.0 == x) {
            Some(p) => p.1 = p.1.min(e),
            None => pts.push((x, e)),
        }
    }
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::row;

    #[test]
    fn tick_labels() {
        assert_eq!(short_bytes(1000.0), "1000");
        assert_eq!(short_bytes(1024.0), "1K");
        assert_eq!(short_bytes(10000.0), "9.8K");
        assert_eq!(short_bytes((64u64 << 20) as f64), "64M");
        assert_eq!(short_bytes((1u64 << 30) as f64), "1G");
    }

    #[test]
    fn renders_a_png_with_text() {
        let mut rows = Vec::new();
        for dtype in ["bf16", "f32"] {
            for mode in Mode::ALL {
                for (k, algo) in ["one_shot", "two_shot", "auto", "nccl"].into_iter().enumerate() {
                    for p in 10..=28 {
                        let size = 1usize << p;
                        let mut r = row(algo, mode, size, 4.0 + k as f64 + size as f64 / 2e5);
                        r.dtype = dtype.into();
                        rows.push(r);
                    }
                }
            }
        }
        let dir = std::env::temp_dir().join(format!("symm-bench-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("latency.png");
        latency_png(&path, &rows, "synthetic").unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
        std::fs::remove_dir_all(&dir).unwrap();

        assert!(latency_png(&path, &[], "none").is_err());
    }
}
