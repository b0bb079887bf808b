//! A small SVG line-plot writer: every benchmark plot in the book is drawn by this file.
//!
//! ```text
//! LinePlot::new("title")
//!     .x_label("sequence length T").y_label("ms").log_x().log_y()
//!     .series("measured", &[(16.0, 1.2), (32.0, 2.3)])     solid line with markers
//!     .reference("slope 1", &[(16.0, 1.2), (32.0, 2.4)])   dashed line, no markers
//!     .to_svg()                                            -> String
//! ```
//!
//! The output is deterministic (same plot, same bytes): fixed palette, fixed layout, coordinates
//! printed with two decimals. The axis ranges cover every point of every series, so every point
//! lands inside the plot area. Points that an axis cannot show (non-finite values, and values
//! `<= 0` on a log axis) are skipped.

use std::fmt::Write;

/// How values map to pixels along one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scale {
    Linear,
    /// Base-10 logarithmic; only positive values are shown.
    Log,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    /// Solid line with a marker on every point: measured data.
    Measured,
    /// Dashed line without markers: a guide such as "slope 2".
    Reference,
}

#[derive(Debug, Clone)]
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    style: Style,
}

/// A line plot with a title, axis labels, linear or log axes and a legend.
#[derive(Debug, Clone)]
pub struct LinePlot {
    title: String,
    x_label: String,
    y_label: String,
    x_scale: Scale,
    y_scale: Scale,
    width: f64,
    height: f64,
    series: Vec<Series>,
}

/// Line colours, in the order series are added (then repeating).
pub(super) const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];
const MARGIN_LEFT: f64 = 80.0;
pub(super) const MARGIN_RIGHT: f64 = 200.0; // the legend lives here
pub(super) const MARGIN_TOP: f64 = 50.0;
pub(super) const MARGIN_BOTTOM: f64 = 60.0;

impl LinePlot {
    /// An empty 760 × 460 plot with linear axes.
    pub fn new(title: impl Into<String>) -> Self {
        LinePlot {
            title: title.into(),
            x_label: String::new(),
            y_label: String::new(),
            x_scale: Scale::Linear,
            y_scale: Scale::Linear,
            width: 760.0,
            height: 460.0,
            series: Vec::new(),
        }
    }

    pub fn x_label(mut self, label: impl Into<String>) -> Self {
        self.x_label = label.into();
        self
    }

    pub fn y_label(mut self, label: impl Into<String>) -> Self {
        self.y_label = label.into();
        self
    }

    pub fn log_x(mut self) -> Self {
        self.x_scale = Scale::Log;
        self
    }

    pub fn log_y(mut self) -> Self {
        self.y_scale = Scale::Log;
        self
    }

    /// Overall size in pixels, legend included (default 760 × 460).
    pub fn size(mut self, width: u32, height: u32) -> Self {
        self.width = f64::from(width.max(MARGIN_LEFT as u32 + MARGIN_RIGHT as u32 + 50));
        self.height = f64::from(height.max(MARGIN_TOP as u32 + MARGIN_BOTTOM as u32 + 50));
        self
    }

    /// Adds measured data: a solid line with a marker on each point, in the next palette colour.
    pub fn series(self, name: impl Into<String>, points: &[(f64, f64)]) -> Self {
        self.push(name.into(), points, Style::Measured)
    }

    /// Adds a guide line (for example `y ∝ x²`): dashed, no markers.
    pub fn reference(self, name: impl Into<String>, points: &[(f64, f64)]) -> Self {
        self.push(name.into(), points, Style::Reference)
    }

    fn push(mut self, name: String, points: &[(f64, f64)], style: Style) -> Self {
        self.series.push(Series {
            name,
            points: points.to_vec(),
            style,
        });
        self
    }

    /// The plot area: (left, top, right, bottom) in pixels.
    fn area(&self) -> (f64, f64, f64, f64) {
        (
            MARGIN_LEFT,
            MARGIN_TOP,
            self.width - MARGIN_RIGHT,
            self.height - MARGIN_BOTTOM,
        )
    }

    /// The x and y axes fitted to every drawable point.
    fn axes(&self) -> (Axis, Axis) {
        let (left, top, right, bottom) = self.area();
        let drawable = |p: &&(f64, f64)| shown(self.x_scale, p.0) && shown(self.y_scale, p.1);
        let points: Vec<(f64, f64)> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().filter(drawable).copied())
            .collect();
        let xs: Vec<f64> = points.iter().map(|p| p.0).collect();
        let ys: Vec<f64> = points.iter().map(|p| p.1).collect();
        (
            Axis::fit(self.x_scale, &xs, left, right),
            Axis::fit(self.y_scale, &ys, bottom, top), // pixel y grows downwards
        )
    }

    /// Renders the plot as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let (w, h) = (self.width, self.height);
        let (left, top, right, bottom) = self.area();
        let (x_axis, y_axis) = self.axes();
        let mut s = String::new();
        // Writing into a String cannot fail, so the `fmt::Result`s below are ignored.
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w:.0}" height="{h:.0}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="28" text-anchor="middle" font-size="16" font-weight="bold">{}</text>"#,
            (left + right) / 2.0,
            escape(&self.title)
        );

        // Grid lines and tick labels.
        let _ = writeln!(s, r#"<g class="x-ticks">"#);
        for tick in x_axis.ticks() {
            let x = x_axis.to_px(tick);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.2}" y1="{top:.2}" x2="{x:.2}" y2="{bottom:.2}" stroke="#e5e5e5"/>"##
            );
            let _ = writeln!(
                s,
                r##"<line x1="{x:.2}" y1="{bottom:.2}" x2="{x:.2}" y2="{:.2}" stroke="black"/>"##,
                bottom + 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
                bottom + 19.0,
                format_tick(tick)
            );
        }
        let _ = writeln!(s, "</g>");
        let _ = writeln!(s, r#"<g class="y-ticks">"#);
        for tick in y_axis.ticks() {
            let y = y_axis.to_px(tick);
            let _ = writeln!(
                s,
                r##"<line x1="{left:.2}" y1="{y:.2}" x2="{right:.2}" y2="{y:.2}" stroke="#e5e5e5"/>"##
            );
            let _ = writeln!(
                s,
                r##"<line x1="{:.2}" y1="{y:.2}" x2="{left:.2}" y2="{y:.2}" stroke="black"/>"##,
                left - 5.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"#,
                left - 8.0,
                y + 4.0,
                format_tick(tick)
            );
        }
        let _ = writeln!(s, "</g>");
        let _ = writeln!(
            s,
            r#"<rect class="plot-area" x="{left:.2}" y="{top:.2}" width="{:.2}" height="{:.2}" fill="none" stroke="black"/>"#,
            right - left,
            bottom - top
        );

        // Axis labels.
        let _ = writeln!(
            s,
            r#"<text x="{:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            (left + right) / 2.0,
            h - 16.0,
            escape(&self.x_label)
        );
        let (label_x, label_y) = (20.0, (top + bottom) / 2.0);
        let _ = writeln!(
            s,
            r#"<text x="{label_x:.2}" y="{label_y:.2}" text-anchor="middle" transform="rotate(-90 {label_x:.2} {label_y:.2})">{}</text>"#,
            escape(&self.y_label)
        );

        // The series, then the legend.
        for (i, series) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let pixels: Vec<(f64, f64)> = series
                .points
                .iter()
                .filter(|p| shown(self.x_scale, p.0) && shown(self.y_scale, p.1))
                .map(|&(x, y)| (x_axis.to_px(x), y_axis.to_px(y)))
                .collect();
            let _ = writeln!(s, r#"<g class="series">"#);
            let coords: Vec<String> = pixels
                .iter()
                .map(|(x, y)| format!("{x:.2},{y:.2}"))
                .collect();
            let dash = match series.style {
                Style::Measured => "",
                Style::Reference => r#" stroke-dasharray="6 4""#,
            };
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
                coords.join(" ")
            );
            if series.style == Style::Measured {
                for (x, y) in &pixels {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x:.2}" cy="{y:.2}" r="3.5" fill="{color}"/>"#
                    );
                }
            }
            let _ = writeln!(s, "</g>");
        }
        let _ = writeln!(s, r#"<g class="legend">"#);
        for (i, series) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let y = top + 10.0 + 22.0 * i as f64;
            let x = right + 16.0;
            let dash = match series.style {
                Style::Measured => "",
                Style::Reference => r#" stroke-dasharray="6 4""#,
            };
            let _ = writeln!(
                s,
                r#"<line x1="{x:.2}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="{color}" stroke-width="2"{dash}/>"#,
                x + 28.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.2}" y="{:.2}">{}</text>"#,
                x + 36.0,
                y + 4.0,
                escape(&series.name)
            );
        }
        let _ = writeln!(s, "</g>");
        s.push_str("</svg>\n");
        s
    }
}

/// Whether `v` can be drawn on an axis of this scale.
fn shown(scale: Scale, v: f64) -> bool {
    v.is_finite() && (scale == Scale::Linear || v > 0.0)
}

/// One axis: a value range mapped linearly (in value or log10-value space) onto a pixel range.
#[derive(Debug, Clone, Copy)]
pub(super) struct Axis {
    scale: Scale,
    /// Range in transformed space (log10 of the value on a log axis).
    lo: f64,
    hi: f64,
    /// Pixels of `lo` and `hi` (for y, `px_lo` is the bottom, the larger pixel value).
    px_lo: f64,
    px_hi: f64,
}

impl Axis {
    /// An axis that covers every value (all already drawable on `scale`).
    pub(super) fn fit(scale: Scale, values: &[f64], px_lo: f64, px_hi: f64) -> Self {
        let t = |v: f64| match scale {
            Scale::Linear => v,
            Scale::Log => v.log10(),
        };
        let min = values.iter().map(|&v| t(v)).fold(f64::INFINITY, f64::min);
        let max = values
            .iter()
            .map(|&v| t(v))
            .fold(f64::NEG_INFINITY, f64::max);
        let (mut lo, mut hi) = if min.is_finite() {
            (min, max)
        } else {
            (0.0, 1.0) // nothing to draw
        };
        if hi - lo < 1e-12 {
            let pad = match scale {
                Scale::Linear => lo.abs().max(1.0) * 0.1,
                Scale::Log => 0.3, // a factor of 2 either side
            };
            (lo, hi) = (lo - pad, hi + pad);
        }
        match scale {
            // Extend to whole tick steps, so the axis starts and ends on a labelled value.
            Scale::Linear => {
                let step = nice_step((hi - lo) / 5.0);
                (lo, hi) = ((lo / step).floor() * step, (hi / step).ceil() * step);
            }
            // A little air around the extreme points.
            Scale::Log => {
                let pad = (hi - lo) * 0.04;
                (lo, hi) = (lo - pad, hi + pad);
            }
        }
        Axis {
            scale,
            lo,
            hi,
            px_lo,
            px_hi,
        }
    }

    /// Value → pixel.
    pub(super) fn to_px(self, v: f64) -> f64 {
        let t = match self.scale {
            Scale::Linear => v,
            Scale::Log => v.log10(),
        };
        self.px_lo + (t - self.lo) / (self.hi - self.lo) * (self.px_hi - self.px_lo)
    }

    /// Tick values inside the range, in increasing order.
    pub(super) fn ticks(&self) -> Vec<f64> {
        let eps = (self.hi - self.lo) * 1e-9;
        match self.scale {
            Scale::Linear => {
                let step = nice_step((self.hi - self.lo) / 5.0);
                let first = (self.lo / step - 1e-9).ceil() as i64;
                let last = (self.hi / step + 1e-9).floor() as i64;
                (first..=last).map(|i| i as f64 * step).collect()
            }
            Scale::Log => {
                let first = (self.lo - eps).floor() as i32;
                let last = (self.hi + eps).ceil() as i32;
                let in_range = |mantissas: &[f64], every: i32| -> Vec<f64> {
                    let mut ticks = Vec::new();
                    for decade in (first..=last).filter(|d| d.rem_euclid(every) == 0) {
                        for &m in mantissas {
                            let v = m * 10f64.powi(decade);
                            let t = v.log10();
                            if t >= self.lo - eps && t <= self.hi + eps {
                                ticks.push(v);
                            }
                        }
                    }
                    ticks
                };
                let decades = in_range(&[1.0], 1);
                if decades.len() > 8 {
                    let every = (decades.len() as i32 + 5) / 6;
                    in_range(&[1.0], every)
                } else if decades.len() >= 3 {
                    decades
                } else {
                    let ticks = in_range(&[1.0, 2.0, 5.0], 1);
                    if ticks.len() >= 3 {
                        ticks
                    } else {
                        in_range(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 1)
                    }
                }
            }
        }
    }
}

/// The smallest of 1, 2, 5 × 10^k that is at least `raw` (> 0).
fn nice_step(raw: f64) -> f64 {
    let raw = if raw.is_finite() && raw > 0.0 {
        raw
    } else {
        1.0
    };
    let magnitude = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&step| step >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude)
}

/// A tick label: plain decimals with trailing zeros trimmed, scientific notation when very
/// large or very small (`2e6`, `5e-5`).
pub(super) fn format_tick(v: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    let a = v.abs();
    if !(1e-3..1e6).contains(&a) {
        let exp = a.log10().floor() as i32;
        let mantissa = trim(format!("{:.3}", v / 10f64.powi(exp)));
        return format!("{mantissa}e{exp}");
    }
    trim(format!("{v:.6}"))
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// Escapes text for SVG element content and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> LinePlot {
        LinePlot::new("Latency <ch01> & friends")
            .x_label("sequence length T")
            .y_label("ms per token")
            .log_x()
            .log_y()
            .series("measured", &[(16.0, 1.5), (64.0, 5.0), (512.0, 90.0)])
            .reference("slope 2", &[(16.0, 1.5), (512.0, 1.5 * 1024.0)])
    }

    /// Every `points="..."` and `cx=/cy=` pair in the document.
    fn drawn_points(svg: &str) -> Vec<(f64, f64)> {
        let mut out = Vec::new();
        for part in svg.split("points=\"").skip(1) {
            let list = &part[..part.find('"').unwrap()];
            for pair in list.split_whitespace() {
                let (x, y) = pair.split_once(',').unwrap();
                out.push((x.parse().unwrap(), y.parse().unwrap()));
            }
        }
        for part in svg.split("<circle cx=\"").skip(1) {
            let x: f64 = part[..part.find('"').unwrap()].parse().unwrap();
            let rest = &part[part.find("cy=\"").unwrap() + 4..];
            let y: f64 = rest[..rest.find('"').unwrap()].parse().unwrap();
            out.push((x, y));
        }
        out
    }

    #[test]
    fn document_is_well_formed() {
        let svg = sample().to_svg();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>\n"));
        for tag in ["text", "g"] {
            let open =
                svg.matches(&format!("<{tag} ")).count() + svg.matches(&format!("<{tag}>")).count();
            let close = svg.matches(&format!("</{tag}>")).count();
            assert_eq!(open, close, "<{tag}> opened {open} times, closed {close}");
        }
        // Every other element is self-closing.
        for tag in ["line", "rect", "polyline", "circle"] {
            for element in svg.split(&format!("<{tag} ")).skip(1) {
                let end = element.find('>').unwrap();
                assert!(element[..end].ends_with('/'), "<{tag}> not self-closed");
            }
        }
        // Text is escaped: no raw `<` or `&` from the title leaks into the markup.
        assert!(svg.contains("Latency &lt;ch01&gt; &amp; friends"));
        assert!(!svg.contains("<ch01>"));
        assert!(svg.contains(">measured</text>") && svg.contains(">slope 2</text>"));
        assert!(svg.contains(">sequence length T</text>") && svg.contains(">ms per token</text>"));
    }

    #[test]
    fn output_is_deterministic() {
        assert_eq!(sample().to_svg(), sample().to_svg());
    }

    #[test]
    fn points_map_inside_the_plot_area() {
        for plot in [
            sample(),
            LinePlot::new("linear")
                .series("a", &[(-3.0, 0.5), (0.0, -2.0), (7.5, 11.0)])
                .series("b", &[(1.0, 1.0)]),
            LinePlot::new("one point")
                .log_x()
                .log_y()
                .series("a", &[(4.0, 4.0)]),
        ] {
            let (left, top, right, bottom) = plot.area();
            let points = drawn_points(&plot.to_svg());
            assert!(!points.is_empty());
            for (x, y) in points {
                assert!(x >= left && x <= right, "x {x} outside [{left}, {right}]");
                assert!(y >= top && y <= bottom, "y {y} outside [{top}, {bottom}]");
            }
        }
    }

    #[test]
    fn undrawable_points_are_skipped() {
        let plot = LinePlot::new("log").log_y().series(
            "a",
            &[
                (1.0, 0.0),
                (2.0, -1.0),
                (3.0, f64::NAN),
                (4.0, 10.0),
                (5.0, 100.0),
            ],
        );
        assert_eq!(drawn_points(&plot.to_svg()).len(), 2 * 2); // polyline + circles
        let empty = LinePlot::new("empty").series("a", &[]).to_svg();
        assert!(empty.ends_with("</svg>\n"));
    }

    #[test]
    fn log_scale_is_monotone_and_equal_ratios_are_equal_distances() {
        let (x_axis, y_axis) = sample().axes();
        let values = [16.0, 32.0, 64.0, 128.0, 256.0, 512.0];
        let xs: Vec<f64> = values.iter().map(|&v| x_axis.to_px(v)).collect();
        let ys: Vec<f64> = values.iter().map(|&v| y_axis.to_px(v)).collect();
        for w in xs.windows(2) {
            assert!(w[1] > w[0], "x pixels must grow with the value");
        }
        for w in ys.windows(2) {
            assert!(
                w[1] < w[0],
                "y pixels must go up (decrease) as the value grows"
            );
        }
        // Each doubling moves the same distance.
        let step = xs[1] - xs[0];
        for w in xs.windows(2) {
            assert!((w[1] - w[0] - step).abs() < 1e-9);
        }
    }

    #[test]
    fn linear_scale_maps_proportionally() {
        let axis = Axis::fit(Scale::Linear, &[0.0, 10.0], 100.0, 300.0);
        assert_eq!((axis.lo, axis.hi), (0.0, 10.0));
        assert!((axis.to_px(5.0) - 200.0).abs() < 1e-9);
        assert_eq!(axis.ticks(), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
    }

    #[test]
    fn log_ticks_are_inside_the_range_and_increasing() {
        let axis = Axis::fit(Scale::Log, &[16.0, 512.0], 0.0, 100.0);
        let ticks = axis.ticks();
        assert_eq!(ticks, vec![20.0, 50.0, 100.0, 200.0, 500.0]);
        let wide = Axis::fit(Scale::Log, &[1e-3, 1e12], 0.0, 100.0).ticks();
        assert!(wide.len() >= 3 && wide.len() <= 8, "{wide:?}");
        for axis_ticks in [ticks, wide] {
            for w in axis_ticks.windows(2) {
                assert!(w[1] > w[0]);
            }
        }
    }

    #[test]
    fn tick_labels_are_short() {
        assert_eq!(format_tick(0.0), "0");
        assert_eq!(format_tick(0.30000000000000004), "0.3");
        assert_eq!(format_tick(500.0), "500");
        assert_eq!(format_tick(2e6), "2e6");
        assert_eq!(format_tick(5e-5), "5e-5");
        assert_eq!(format_tick(-1.25), "-1.25");
    }
}
