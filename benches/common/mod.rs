//! What the benchmarks share: opening the GPU (or saying why not), the results folder, progress
//! bars, CSV/JSON output and the two kinds of picture (line charts on log axes, tile heat maps).
//! Pictures are SVG: their text needs no font files, so they render on machines without fonts.

#![allow(dead_code)] // each bench uses part of this

use std::path::{Path, PathBuf};

use attn_host::Context;
use indicatif::{ProgressBar, ProgressStyle};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Where every bench writes its files (git-ignored).
pub const RESULTS: &str = "bench-results";

/// The GPU, or `None` after printing a visible skip line (a bench without a GPU exits 0).
pub fn open_gpu(bench: &str) -> Option<Context> {
    match Context::new(0) {
        Ok(ctx) => {
            println!("device: {}", ctx.device());
            Some(ctx)
        }
        Err(e) => {
            println!("{bench}: skipped: no CUDA device ({e})");
            None
        }
    }
}

/// `bench-results/<name>`, creating the folder.
pub fn result_path(name: &str) -> PathBuf {
    std::fs::create_dir_all(RESULTS).expect("bench-results/ can be created");
    Path::new(RESULTS).join(name)
}

/// A progress bar of `total` steps that shows its message (the step running now).
pub fn progress(total: usize) -> ProgressBar {
    ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("{msg:40} [{bar:40}] {pos}/{len}, {elapsed} (eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    )
}

/// Writes `rows` (already comma-joined) under `header` to `bench-results/<name>` and says so.
pub fn write_csv(name: &str, header: &str, rows: &[String]) {
    let path = result_path(name);
    let mut text = format!("{header}\n");
    for row in rows {
        text.push_str(row);
        text.push('\n');
    }
    std::fs::write(&path, text).expect("bench-results/ is writable");
    println!("wrote {}", path.display());
}

/// Writes `value` as pretty JSON to `bench-results/<name>` and says so.
pub fn write_json(name: &str, value: &serde_json::Value) {
    let path = result_path(name);
    std::fs::write(&path, serde_json::to_string_pretty(value).expect("JSON")).expect("bench-results/ is writable");
    println!("wrote {}", path.display());
}

/// Seconds since the Unix epoch, for the JSON files.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_secs())
}

/// One line of a chart: its legend label and (x, y) points (y > 0).
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of a figure.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    /// Logarithmic y axis (x is always logarithmic: sizes grow in powers of two).
    pub log_y: bool,
    pub series: Vec<Series>,
}

/// Colours that stay apart in print and for the common colour-vision deficiencies (Okabe–Ito).
const PALETTE: [RGBColor; 7] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
];

/// Draws `charts` side by side under `title` into `bench-results/<name>` (SVG) and says so.
pub fn line_charts(name: &str, title: &str, charts: &[Chart]) {
    let path = result_path(name);
    let root = SVGBackend::new(&path, (560 * charts.len() as u32, 440)).into_drawing_area();
    root.fill(&WHITE).expect("SVG");
    let root = root.titled(title, ("sans-serif", 20)).expect("SVG");
    for (area, chart) in root.split_evenly((1, charts.len())).iter().zip(charts) {
        draw_line_chart(area, chart).expect("SVG");
    }
    root.present().expect("SVG written");
    println!("wrote {}", path.display());
}

fn draw_line_chart(area: &DrawingArea<SVGBackend, Shift>, chart: &Chart) -> Result<(), Box<dyn std::error::Error>> {
    let points = chart.series.iter().flat_map(|s| s.points.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in points {
        (x_min, x_max, y_min, y_max) = (x_min.min(x), x_max.max(x), y_min.min(y), y_max.max(y));
    }
    if x_min > x_max {
        return Ok(()); // nothing measured
    }
    let (y_lo, y_hi) = if chart.log_y { (y_min / 1.5, y_max * 1.5) } else { (0.0, y_max * 1.1) };
    let mut builder = ChartBuilder::on(area);
    builder.caption(chart.title, ("sans-serif", 16)).margin(12).x_label_area_size(40).y_label_area_size(64);
    let x_axis = (x_min / 1.2..x_max * 1.2).log_scale();
    // The two y scales are different types; one macro body draws both.
    macro_rules! draw {
        ($y:expr) => {{
            let mut ctx = builder.build_cartesian_2d(x_axis, $y)?;
            ctx.configure_mesh()
                .x_desc(chart.x_label)
                .y_desc(chart.y_label)
                .x_label_formatter(&|x| power_of_two(*x))
                .y_label_formatter(&|y| short_number(*y))
                .light_line_style(WHITE.mix(0.0))
                .draw()?;
            for (i, series) in chart.series.iter().enumerate() {
                let color = PALETTE[i % PALETTE.len()];
                ctx.draw_series(LineSeries::new(series.points.iter().copied(), color.stroke_width(2)))?
                    .label(&series.label)
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
                ctx.draw_series(series.points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
            }
            ctx.configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.3))
                .draw()?;
        }};
    }
    if chart.log_y {
        draw!((y_lo..y_hi).log_scale());
    } else {
        draw!(y_lo..y_hi);
    }
    Ok(())
}

/// "2^k" for a power of two, else the number.
fn power_of_two(x: f64) -> String {
    let k = x.log2().round();
    if (x - k.exp2()).abs() < 1e-6 * x { format!("2^{k}") } else { short_number(x) }
}

/// 3 significant digits without trailing noise: 0.0123, 4.5, 1200, 3.2e6.
fn short_number(y: f64) -> String {
    if y == 0.0 {
        "0".into()
    } else if !(1e-3..1e5).contains(&y.abs()) {
        format!("{y:.1e}")
    } else {
        let digits = (2 - y.abs().log10().floor() as i32).max(0) as usize;
        let text = format!("{y:.digits$}");
        if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_string() } else { text }
    }
}

/// One panel of a heat map: cells at (row value, column value), `None` where nothing ran.
pub struct HeatPanel {
    pub title: String,
    pub rows: Vec<usize>,
    pub columns: Vec<usize>,
    /// `values[r][c]`: the cell's number (shown and coloured).
    pub values: Vec<Vec<Option<f64>>>,
}

/// Draws `panels` in a grid of `columns` panels per row into `bench-results/<name>` (SVG): each
/// cell coloured by its value relative to the panel's best (viridis: yellow is fastest), the
/// value written in it, the best cell outlined.
pub fn heat_maps(name: &str, title: &str, row_label: &str, column_label: &str, columns: usize, panels: &[HeatPanel]) {
    let path = result_path(name);
    let grid_rows = panels.len().div_ceil(columns);
    let root = SVGBackend::new(&path, (300 * columns as u32, 250 * grid_rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).expect("SVG");
    let root = root.titled(title, ("sans-serif", 20)).expect("SVG");
    for (area, panel) in root.split_evenly((grid_rows, columns)).iter().zip(panels) {
        draw_heat_panel(area, panel, row_label, column_label).expect("SVG");
    }
    root.present().expect("SVG written");
    println!("wrote {}", path.display());
}

fn draw_heat_panel(
    area: &DrawingArea<SVGBackend, Shift>,
    panel: &HeatPanel,
    row_label: &str,
    column_label: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let (nr, nc) = (panel.rows.len(), panel.columns.len());
    let best = panel.values.iter().flatten().flatten().copied().fold(f64::MIN, f64::max);
    let worst = panel.values.iter().flatten().flatten().copied().fold(f64::MAX, f64::min);
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(34)
        .y_label_area_size(44)
        // A segmented range `0..n` has segments 0 to n inclusive: end it at the last cell.
        .build_cartesian_2d((0..nc - 1).into_segmented(), (0..nr - 1).into_segmented())?;
    let label = |values: &[usize], v: &SegmentValue<usize>| match v {
        SegmentValue::CenterOf(i) => values.get(*i).map_or(String::new(), ToString::to_string),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_mesh()
        .x_labels(nc + 1)
        .y_labels(nr + 1)
        .x_label_formatter(&|v| label(&panel.columns, v))
        .y_label_formatter(&|v| label(&panel.rows, v))
        .x_desc(column_label)
        .y_desc(row_label)
        .draw()?;
    for (r, row) in panel.values.iter().enumerate() {
        for (c, value) in row.iter().enumerate() {
            let cell = [
                (SegmentValue::Exact(c), SegmentValue::Exact(r)),
                (SegmentValue::Exact(c + 1), SegmentValue::Exact(r + 1)),
            ];
            let center = (SegmentValue::CenterOf(c), SegmentValue::CenterOf(r));
            let Some(value) = *value else {
                chart.draw_series([Rectangle::new(cell, RGBColor(235, 235, 235).filled())])?;
                continue;
            };
            let t = if best > worst { (value - worst) / (best - worst) } else { 1.0 };
            chart.draw_series([Rectangle::new(cell.clone(), ViridisRGB::get_color(t).filled())])?;
            if value == best {
                chart.draw_series([Rectangle::new(cell, BLACK.stroke_width(3))])?;
            }
            let text_color = if t > 0.6 { BLACK } else { WHITE };
            let style = ("sans-serif", 13).into_font().color(&text_color).pos(Pos::new(HPos::Center, VPos::Center));
            chart.draw_series([Text::new(format!("{value:.0}"), center, style)])?;
        }
    }
    Ok(())
}
