//! `--plot FILE.svg`: bus bandwidth against message size, one line per op.

use crate::bench::Record;

const COLORS: [&str; 10] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

/// An SVG chart: x = log2(size), y = busbw in GB/s.
pub fn svg(records: &[Record]) -> String {
    let (w, h, m) = (720.0, 420.0, 60.0);
    let pts: Vec<&Record> = records.iter().filter(|r| r.bytes > 0).collect();
    let xmin = pts
        .iter()
        .map(|r| (r.bytes as f64).log2())
        .fold(f64::INFINITY, f64::min);
    let xmax = pts
        .iter()
        .map(|r| (r.bytes as f64).log2())
        .fold(f64::NEG_INFINITY, f64::max);
    let ymax = pts
        .iter()
        .map(|r| r.busbw_gbs)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.1;
    let sx = |b: usize| m + ((b as f64).log2() - xmin) / (xmax - xmin).max(1.0) * (w - 2.0 * m);
    let sy = |v: f64| h - m - v / ymax * (h - 2.0 * m);
    let mut ops: Vec<&str> = Vec::new();
    for r in &pts {
        if !ops.contains(&r.op) {
            ops.push(r.op);
        }
    }
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <line x1=\"{m}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{y0}\" stroke=\"black\"/>\n\
         <text x=\"{cx}\" y=\"{yl}\" text-anchor=\"middle\">message size (bytes, log scale)</text>\n\
         <text x=\"15\" y=\"{cy}\" transform=\"rotate(-90 15 {cy})\" text-anchor=\"middle\">bus bandwidth (GB/s)</text>\n",
        y0 = h - m,
        x1 = w - m,
        cx = w / 2.0,
        yl = h - 15.0,
        cy = h / 2.0,
    );
    for i in 0..=4 {
        let v = ymax * i as f64 / 4.0;
        out += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{v:.2}</text>\n",
            m - 5.0,
            sy(v) + 4.0
        );
    }
    for r in pts.iter().filter(|r| r.op == pts[0].op) {
        out += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            sx(r.bytes),
            h - m + 15.0,
            human(r.bytes)
        );
    }
    for (k, op) in ops.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let line: Vec<String> = pts
            .iter()
            .filter(|r| r.op == *op)
            .map(|r| format!("{:.1},{:.1}", sx(r.bytes), sy(r.busbw_gbs)))
            .collect();
        out += &format!(
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>\n\
             <text x=\"{}\" y=\"{}\" fill=\"{color}\">{op}</text>\n",
            line.join(" "),
            m + 10.0,
            m + 15.0 * k as f64
        );
    }
    out + "</svg>\n"
}

fn human(b: usize) -> String {
    match b {
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}
