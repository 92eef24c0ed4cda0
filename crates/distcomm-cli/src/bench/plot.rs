//! `--plot FILE.svg`: bandwidth against message size through `plotters` (SVG backend), one
//! chart per kind of op — point-to-point (bandwidth of one message) apart from the collectives
//! (bus bandwidth) — one line with markers per op, under a title that says what ran where.
//!
//! Owns: the SVG's layout. Must not know: how anything was measured, nor any suite: it draws
//! [`Record`]s, whatever made them.

use plotters::coord::Shift;
use plotters::prelude::*;

use distcomm::{Error, Result};

use super::record::{Record, Title};

/// Distinct colours, enough for every op of `bench all` (12): Tableau's 10 and two more.
const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 128),
    RGBColor(0, 0, 0),
];

/// One chart: which records, and what its y axis shows.
struct Chart<'a> {
    caption: &'static str,
    y_desc: &'static str,
    records: Vec<&'a Record>,
    /// Bus bandwidth (collectives) or bandwidth (point-to-point).
    bus: bool,
}

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::Config(format!("plot: {e}"))
}

/// The SVG of `records` and a description of its charts (for the "wrote" line).
pub fn svg(records: &[Record], title: &Title) -> Result<(String, String)> {
    let sized: Vec<&Record> = records.iter().filter(|r| r.bytes > 0).collect();
    let mut charts = Vec::new();
    let p2p: Vec<&Record> = sized.iter().copied().filter(|r| r.point_to_point).collect();
    let coll: Vec<&Record> = sized
        .iter()
        .copied()
        .filter(|r| !r.point_to_point)
        .collect();
    if !p2p.is_empty() {
        charts.push(Chart {
            caption: "point-to-point: ranks 0 and 1",
            y_desc: "bandwidth (GB/s)",
            records: p2p,
            bus: false,
        });
    }
    if !coll.is_empty() {
        charts.push(Chart {
            caption: "collectives",
            y_desc: "bus bandwidth (GB/s)",
            records: coll,
            bus: true,
        });
    }
    let described = charts
        .iter()
        .map(|c| format!("{}: {} ops", c.caption, ops_of(&c.records).len()))
        .collect::<Vec<_>>()
        .join("; ");
    let mut out = String::new();
    {
        let height = 80 + 460 * charts.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut out, (960, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let root = root
            .titled(&title.line(), ("sans-serif", 22))
            .map_err(plot_error)?;
        if charts.is_empty() {
            root.draw(&Text::new(
                "no sized results to draw",
                (40, 40),
                ("sans-serif", 16),
            ))
            .map_err(plot_error)?;
        }
        for (area, chart) in root
            .split_evenly((charts.len().max(1), 1))
            .iter()
            .zip(&charts)
        {
            draw_chart(area, chart)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok((out, described))
}

/// The ops of `records` in order of appearance.
fn ops_of(records: &[&Record]) -> Vec<&'static str> {
    let mut ops: Vec<&'static str> = Vec::new();
    for r in records {
        if !ops.contains(&r.op) {
            ops.push(r.op);
        }
    }
    ops
}

fn draw_chart(area: &DrawingArea<SVGBackend<'_>, Shift>, chart: &Chart<'_>) -> Result<()> {
    let xs = chart.records.iter().map(|r| pos(r.bytes));
    let (xmin, xmax) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (xmin, xmax) = (xmin - 0.6, xmax + 0.6);
    let labelled = ticks(&chart.records);
    let y = |r: &Record| if chart.bus { r.busbw_gbs } else { r.algbw_gbs };
    let ymax = chart
        .records
        .iter()
        .map(|r| y(r))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.08;
    let mut ctx = ChartBuilder::on(area)
        .caption(chart.caption, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(xmin..xmax, 0.0..ymax)
        .map_err(plot_error)?;
    ctx.configure_mesh()
        .x_desc("message size (bytes, log scale)")
        .y_desc(chart.y_desc)
        // A grid line per octave; labels at the sizes measured (thinned out, see `ticks`).
        .x_labels((xmax - xmin).ceil() as usize + 1)
        .x_label_formatter(&|v| match labelled.iter().any(|t| (t - v).abs() < 1e-6) {
            true => human(2f64.powf(*v).round() as usize),
            false => String::new(),
        })
        .y_label_formatter(&|v| format!("{v:.1}"))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(200, 200, 200))
        .label_style(("sans-serif", 13))
        .axis_desc_style(("sans-serif", 15))
        .draw()
        .map_err(plot_error)?;
    for (k, op) in ops_of(&chart.records).into_iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = chart
            .records
            .iter()
            .filter(|r| r.op == op)
            .map(|r| (pos(r.bytes), y(r)))
            .collect();
        ctx.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(op)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
        // Markers vary with the colour's turn, so lines stay apart in grey print too.
        let style = color.filled();
        match k % 3 {
            0 => ctx.draw_series(pts.iter().map(|&p| Circle::new(p, 4, style))),
            1 => ctx.draw_series(pts.iter().map(|&p| TriangleMarker::new(p, 5, style))),
            _ => ctx.draw_series(pts.iter().map(|&p| Cross::new(p, 4, color.stroke_width(2)))),
        }
        .map_err(plot_error)?;
    }
    ctx.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(plot_error)
}

/// Where `bytes` sits on the x axis.
fn pos(bytes: usize) -> f64 {
    (bytes.max(1) as f64).log2()
}

/// The labelled x ticks: the sizes measured, from the largest down, each at least 1.5 octaves below
/// the last one kept (the sweep's 32M goes, so that 64M gets a readable label).
fn ticks(records: &[&Record]) -> Vec<f64> {
    let mut sizes: Vec<f64> = records.iter().map(|r| pos(r.bytes)).collect();
    sizes.sort_by(|a, b| b.total_cmp(a));
    let mut kept: Vec<f64> = Vec::new();
    for x in sizes {
        if kept.last().is_none_or(|&last| last - x >= 1.5) {
            kept.push(x);
        }
    }
    kept.reverse();
    kept
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{human, pos};

    #[test]
    fn tick_labels() {
        assert_eq!(human(8), "8");
        assert_eq!(human(8 << 10), "8K");
        assert_eq!(human(100_000), "100000");
        assert_eq!(human(2f64.powf(pos(64 << 20)).round() as usize), "64M");
    }
}
