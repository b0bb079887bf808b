//! Line plots, drawn by plotters' SVG backend: every benchmark plot in the book but the bar
//! charts ([`bars`](super::bars)) comes from this file.
//!
//! ```text
//! LinePlot::new("title")
//!     .x_label("sequence length T").y_label("ms").log_x().log_y()
//!     .series("measured", &[(16.0, 1.2), (32.0, 2.3)])     solid line with markers
//!     .reference("slope 1", &[(16.0, 1.2), (32.0, 2.4)])   dashed line, no markers
//!     .to_svg()                                            -> String
//! ```
//!
//! The output is deterministic (same plot, same bytes): fixed palette, fixed layout, no fonts
//! read (plotters estimates text sizes). The axis ranges cover every point of every series, so
//! every point lands inside the plot area. Points that an axis cannot show (non-finite values,
//! and values `<= 0` on a log axis) are skipped. The legend sits right of the plot, so it never
//! hides a point.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Line (and bar) colours, in the order series are added (then repeating).
pub(super) const PALETTE: [RGBColor; 8] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
];
/// The legend's column, right of the plot: at least this wide, wider for long names.
pub(super) const LEGEND_WIDTH: u32 = 200;
/// Grid lines.
pub(super) const GRID: RGBColor = RGBColor(0xe5, 0xe5, 0xe5);

/// The plot area in pixels: (x range, y range), as plotters laid it out.
pub(super) type Area = (Range<i32>, Range<i32>);

#[derive(Debug, Clone)]
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    /// A guide such as "slope 2": dashed, no markers. Otherwise measured: solid, with markers.
    reference: bool,
}

/// A line plot with a title, axis labels, linear or log axes and a legend.
#[derive(Debug, Clone)]
pub struct LinePlot {
    title: String,
    x_label: String,
    y_label: String,
    log_x: bool,
    log_y: bool,
    size: (u32, u32),
    series: Vec<Series>,
}

impl LinePlot {
    /// An empty 760 × 460 plot with linear axes.
    pub fn new(title: impl Into<String>) -> Self {
        LinePlot {
            title: title.into(),
            x_label: String::new(),
            y_label: String::new(),
            log_x: false,
            log_y: false,
            size: (760, 460),
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
        self.log_x = true;
        self
    }

    pub fn log_y(mut self) -> Self {
        self.log_y = true;
        self
    }

    /// Overall size in pixels, legend included (default 760 × 460).
    pub fn size(mut self, width: u32, height: u32) -> Self {
        self.size = (width.max(LEGEND_WIDTH + 200), height.max(200));
        self
    }

    /// Adds measured data: a solid line with a marker on each point, in the next palette colour.
    pub fn series(self, name: impl Into<String>, points: &[(f64, f64)]) -> Self {
        self.push(name.into(), points, false)
    }

    /// Adds a guide line (for example `y ∝ x²`): dashed, no markers.
    pub fn reference(self, name: impl Into<String>, points: &[(f64, f64)]) -> Self {
        self.push(name.into(), points, true)
    }

    fn push(mut self, name: String, points: &[(f64, f64)], reference: bool) -> Self {
        self.series.push(Series {
            name,
            points: points.to_vec(),
            reference,
        });
        self
    }

    /// Renders the plot as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        self.render().expect("drawing into a String cannot fail").0
    }

    /// The points an axis can show, of one series or (`None`) of all.
    fn drawable(&self, series: Option<&Series>) -> Vec<(f64, f64)> {
        let all = series.map_or(&self.series[..], std::slice::from_ref);
        all.iter()
            .flat_map(|s| &s.points)
            .filter(|&&(x, y)| shown(self.log_x, x) && shown(self.log_y, y))
            .copied()
            .collect()
    }

    /// The document and where its plot area is.
    fn render(&self) -> anyhow::Result<(String, Area)> {
        let points = self.drawable(None);
        let x = fit(self.log_x, points.iter().map(|p| p.0));
        let y = fit(self.log_y, points.iter().map(|p| p.1));
        let log = |r: Range<f64>| {
            let ticks = log_ticks(&r);
            r.log_scale().with_key_points(ticks)
        };
        match (self.log_x, self.log_y) {
            (false, false) => self.draw(RangedCoordf64::from(x), RangedCoordf64::from(y)),
            (true, false) => self.draw(log(x), RangedCoordf64::from(y)),
            (false, true) => self.draw(RangedCoordf64::from(x), log(y)),
            (true, true) => self.draw(log(x), log(y)),
        }
    }

    fn draw<X, Y>(&self, x: X, y: Y) -> anyhow::Result<(String, Area)>
    where
        X: Ranged<ValueType = f64> + ValueFormatter<f64>,
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        let mut svg = String::new();
        let root = SVGBackend::with_string(&mut svg, self.size).into_drawing_area();
        root.fill(&WHITE)?;
        let names = self.series.iter().map(|s| s.name.as_str());
        let legend_w = legend_width(&root, names)?;
        // The title across the figure, then the plot and the legend's column side by side.
        let body = root.titled(&self.title, title_font())?;
        let (plot, legend_column) = body.split_horizontally(self.size.0 - legend_w);
        let mut chart = ChartBuilder::on(&plot)
            .margin(10)
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(x, y)?;
        let (plot_w, plot_h) = chart.plotting_area().dim_in_pixel();
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .max_light_lines(0)
            .x_labels(tick_count(plot_w, 70))
            .y_labels(tick_count(plot_h, 40))
            .label_style(font(12.0))
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&|v| format_tick(*v))
            .y_label_formatter(&|v| format_tick(*v))
            .draw()?;
        let mut entries = Vec::new();
        for (i, series) in self.series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let line = color.stroke_width(2);
            let points = self.drawable(Some(series));
            if series.reference {
                chart.draw_series(DashedLineSeries::new(points, 6, 4, line))?;
                entries.push((series.name.as_str(), Swatch::Dashed(color)));
            } else {
                chart.draw_series(LineSeries::new(points, line.filled()).point_size(3))?;
                entries.push((series.name.as_str(), Swatch::Marked(color)));
            }
        }
        let area = chart.plotting_area().get_pixel_range();
        legend(&legend_column, area.1.start, &entries)?;
        root.present()?;
        drop((chart, plot, legend_column, body, root));
        Ok((svg, area))
    }
}

/// How a legend entry shows its series.
#[derive(Debug, Clone, Copy)]
pub(super) enum Swatch {
    /// A solid line with a marker: measured data.
    Marked(RGBColor),
    /// A dashed line: a reference.
    Dashed(RGBColor),
    /// A bar's colour.
    Bar(RGBColor),
}

/// The legend, one row per entry from `top` (pixels from the figure's top) down, in the column
/// right of the plot. (plotters' own legend is drawn inside the plot area, where it can hide
/// data.)
pub(super) fn legend(
    column: &DrawingArea<SVGBackend, Shift>,
    top: i32,
    entries: &[(&str, Swatch)],
) -> anyhow::Result<()> {
    let text = font(12.0).pos(Pos::new(HPos::Left, VPos::Center));
    for (row, &(name, swatch)) in entries.iter().enumerate() {
        let (x, y) = (10, top - column.get_base_pixel().1 + 10 + 22 * row as i32);
        let line = vec![(x, y), (x + 24, y)];
        match swatch {
            Swatch::Marked(c) => {
                column.draw(&PathElement::new(line, c.stroke_width(2)))?;
                column.draw(&Circle::new((x + 12, y), 3, c.filled()))?;
            }
            Swatch::Dashed(c) => {
                column.draw(&DashedPathElement::new(line, 6, 4, c.stroke_width(2)))?
            }
            Swatch::Bar(c) => column.draw(&Rectangle::new(
                [(x + 2, y - 6), (x + 22, y + 6)],
                c.filled(),
            ))?,
        }
        column.draw(&Text::new(name, (x + 32, y), &text))?;
    }
    Ok(())
}

/// The legend column's width: [`LEGEND_WIDTH`], or more to fit the longest name, up to 45% of
/// the figure.
pub(super) fn legend_width<'a>(
    root: &DrawingArea<SVGBackend, Shift>,
    names: impl Iterator<Item = &'a str>,
) -> anyhow::Result<u32> {
    let mut longest = 0;
    for name in names {
        longest = longest.max(root.estimate_text_size(name, &font(12.0))?.0);
    }
    let width = root.dim_in_pixel().0;
    Ok((longest + 52).clamp(LEGEND_WIDTH, (width * 45 / 100).max(LEGEND_WIDTH)))
}

/// How many ticks a linear axis of `pixels` gets: one per `spacing` pixels, 3 to 7.
pub(super) fn tick_count(pixels: u32, spacing: u32) -> usize {
    (pixels / spacing).clamp(3, 7) as usize
}

/// A sans-serif font whose SVG `font-size` is `px` (plotters writes a size divided by 1.24).
pub(super) fn font(px: f64) -> TextStyle<'static> {
    FontDesc::new(FontFamily::SansSerif, px * 1.24, FontStyle::Normal).into()
}

pub(super) fn title_font() -> TextStyle<'static> {
    FontDesc::new(FontFamily::SansSerif, 16.0 * 1.24, FontStyle::Bold).into()
}

/// Whether `v` can be drawn on a (log) axis.
fn shown(log: bool, v: f64) -> bool {
    v.is_finite() && (!log || v > 0.0)
}

/// An axis range over `values` (all drawable), with 4% of the span to spare either side; a
/// single value gets ±10% (a factor of 2 on a log axis), none gets 0..1 (1..10).
fn fit(log: bool, values: impl Iterator<Item = f64>) -> Range<f64> {
    let t = |v: f64| if log { v.log10() } else { v };
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(t(v)), hi.max(t(v)))
    });
    let (lo, hi) = if !lo.is_finite() {
        (0.0, 1.0)
    } else if hi - lo < 1e-12 {
        let pad = if log { 0.3 } else { lo.abs().max(1.0) * 0.1 };
        (lo - pad, hi + pad)
    } else {
        let pad = (hi - lo) * 0.04;
        (lo - pad, hi + pad)
    };
    if log {
        10f64.powf(lo)..10f64.powf(hi)
    } else {
        lo..hi
    }
}

/// Ticks for a log axis (plotters' own start at the first whole decade and skip what lies below
/// it): every decade (every n-th past eight), or 1-2-5 (then 1…9) per decade when fewer than
/// three decades show.
fn log_ticks(range: &Range<f64>) -> Vec<f64> {
    let (lo, hi) = (range.start.log10() - 1e-9, range.end.log10() + 1e-9);
    let ticks = |mantissas: &[f64], every: i32| -> Vec<f64> {
        let decades = (lo.floor() as i32..=hi.ceil() as i32).filter(|d| d.rem_euclid(every) == 0);
        decades
            .flat_map(|d| mantissas.iter().map(move |m| m * 10f64.powi(d)))
            .filter(|v| (lo..=hi).contains(&v.log10()))
            .collect()
    };
    let decades = ticks(&[1.0], 1);
    if decades.len() > 8 {
        return ticks(&[1.0], (decades.len() as i32 + 5) / 6);
    }
    if decades.len() >= 3 {
        return decades;
    }
    let one_two_five = ticks(&[1.0, 2.0, 5.0], 1);
    if one_two_five.len() >= 3 {
        return one_two_five;
    }
    ticks(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], 1)
}

/// A tick label: plain decimals with trailing zeros trimmed, scientific notation when very
/// large or very small (`2e6`, `5e-5`).
pub(super) fn format_tick(v: f64) -> String {
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    let a = v.abs();
    if a < 1e-12 {
        return "0".to_string();
    }
    if !(1e-3..1e6).contains(&a) {
        let exp = a.log10().floor() as i32;
        let mantissa = trim(format!("{:.3}", v / 10f64.powi(exp)));
        return format!("{mantissa}e{exp}");
    }
    trim(format!("{v:.6}"))
}

/// Reading plotters' SVG back, for the tests of both plot kinds.
#[cfg(test)]
pub(super) mod read {
    /// The attributes of every `<tag …>` element, each from the space before the first.
    pub fn elements<'a>(svg: &'a str, tag: &str) -> Vec<&'a str> {
        let open = format!("<{tag} ");
        svg.match_indices(&open)
            .map(|(i, _)| &svg[i + open.len() - 1..])
            .map(|e| &e[..e.find('>').unwrap()])
            .collect()
    }

    /// The value of attribute `name` in an element's attributes.
    pub fn attr<'a>(element: &'a str, name: &str) -> &'a str {
        let key = format!(" {name}=\"");
        let start = element
            .find(&key)
            .unwrap_or_else(|| panic!("no {name} in {element}"));
        let rest = &element[start + key.len()..];
        &rest[..rest.find('"').unwrap()]
    }

    pub fn num(element: &str, name: &str) -> f64 {
        attr(element, name).parse().unwrap()
    }

    /// (attributes, text) of every `<text>`.
    pub fn texts(svg: &str) -> Vec<(&str, &str)> {
        svg.match_indices("<text ")
            .map(|(i, open)| {
                let (tag, rest) = svg[i + open.len() - 1..].split_once('>').unwrap();
                (tag, rest[..rest.find("</text>").unwrap()].trim())
            })
            .collect()
    }

    /// `#RRGGBB`, as plotters writes a colour.
    pub fn hex(c: plotters::style::RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    /// One `<svg>` root, every tag closed in order, text holds no raw `<` or `>`, every `&`
    /// starts an entity.
    pub fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg ") && svg.contains(r#"xmlns="http://www.w3.org/2000/svg""#));
        assert!(svg.ends_with("</svg>\n"));
        let mut open: Vec<&str> = Vec::new();
        for (i, chunk) in svg.split('<').skip(1).enumerate() {
            let (tag, text) = chunk.split_once('>').expect("unclosed tag");
            assert!(!text.contains('>'), "raw '>' in text after <{tag}>");
            for entity in text.split('&').skip(1) {
                let name = entity.split(';').next().unwrap();
                let known = ["amp", "lt", "gt", "quot", "apos"].contains(&name);
                assert!(known, "&{entity}");
            }
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name), "</{name}> closes the wrong element");
            } else if !tag.ends_with('/') {
                assert!(i == 0 || !open.is_empty(), "a second root element <{tag}>");
                open.push(tag.split(' ').next().unwrap());
            }
        }
        assert!(open.is_empty(), "unclosed: {open:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::read::*;
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

    /// Every vertex of every polyline in `color` and every marker centre, in the plot area;
    /// the rest (the legend's swatch) must lie in the legend column, right of it.
    fn drawn_points(svg: &str, area: &Area, color: RGBColor) -> [Vec<(i32, i32)>; 2] {
        let (xs, ys) = area;
        let inside = |&(x, y): &(i32, i32)| {
            if x > xs.end {
                assert!(
                    x >= xs.end + 10,
                    "({x}, {y}) in neither the plot nor the legend"
                );
                return false;
            }
            let fits = xs.start <= x && x <= xs.end && ys.start <= y && y <= ys.end;
            assert!(fits, "({x}, {y}) outside the plot area {area:?}");
            true
        };
        let lines = elements(svg, "polyline")
            .into_iter()
            .filter(|e| attr(e, "stroke") == hex(color))
            .flat_map(|e| {
                attr(e, "points").split_whitespace().map(|pair| {
                    let (x, y) = pair.split_once(',').unwrap();
                    (x.parse().unwrap(), y.parse().unwrap())
                })
            });
        let markers = elements(svg, "circle")
            .into_iter()
            .filter(|e| attr(e, "fill") == hex(color))
            .map(|e| (num(e, "cx") as i32, num(e, "cy") as i32));
        [
            lines.filter(inside).collect(),
            markers.filter(inside).collect(),
        ]
    }

    #[test]
    fn document_is_well_formed_and_text_escaped() {
        let svg = sample().to_svg();
        assert_well_formed(&svg);
        let texts: Vec<&str> = texts(&svg).into_iter().map(|t| t.1).collect();
        assert!(texts.contains(&"Latency &lt;ch01&gt; &amp; friends"));
        assert!(!svg.contains("<ch01>"));
        for label in ["measured", "slope 2", "sequence length T", "ms per token"] {
            assert!(texts.contains(&label), "{label} missing from {texts:?}");
        }
    }

    #[test]
    fn output_is_deterministic() {
        assert_eq!(sample().to_svg(), sample().to_svg());
    }

    #[test]
    fn the_command_goes_right_after_the_svg_tag() {
        // What `kiln figures` reads back (`write_figures` inserts it).
        let svg = super::super::describe_svg(&sample().to_svg(), "kiln bench ch01 --x <y>");
        let (tag, rest) = svg.split_once(">\n").unwrap();
        assert!(tag.starts_with("<svg "), "{tag}");
        assert!(rest.starts_with("<desc>command: kiln bench ch01 --x &lt;y&gt;</desc>\n"));
        assert_well_formed(&svg);
    }

    #[test]
    fn points_land_inside_the_plot_area() {
        for plot in [
            sample(),
            LinePlot::new("linear")
                .series("a", &[(-3.0, 0.5), (0.0, -2.0), (7.5, 11.0)])
                .series("b", &[(1.0, 1.0)]),
            LinePlot::new("one point")
                .log_x()
                .log_y()
                .series("a", &[(4.0, 4.0)]),
            LinePlot::new("small")
                .size(400, 200)
                .series("a", &[(1e-6, 3e9), (2e-6, 1.0)]),
        ] {
            let (svg, area) = plot.render().unwrap();
            for (i, series) in plot.series.iter().enumerate() {
                let [line, markers] = drawn_points(&svg, &area, PALETTE[i]);
                let expected = series.points.len();
                assert!(line.len() >= expected, "{}: {line:?}", series.name);
                assert_eq!(markers.len(), if series.reference { 0 } else { expected });
            }
        }
    }

    #[test]
    fn undrawable_points_are_skipped() {
        let points = [
            (1.0, 0.0),
            (2.0, -1.0),
            (3.0, f64::NAN),
            (4.0, 10.0),
            (5.0, 100.0),
        ];
        let (svg, area) = LinePlot::new("log")
            .log_y()
            .series("a", &points)
            .render()
            .unwrap();
        let [line, markers] = drawn_points(&svg, &area, PALETTE[0]);
        assert_eq!((line.len(), markers.len()), (2, 2));
        assert!(!svg.contains("NaN") && !svg.contains("inf"));
        for empty in [
            LinePlot::new("empty").series("a", &[]),
            LinePlot::new("empty log")
                .log_x()
                .log_y()
                .reference("r", &[(0.0, -1.0)]),
        ] {
            assert_well_formed(&empty.to_svg());
        }
    }

    #[test]
    fn log_axis_is_monotone_and_equal_ratios_are_equal_distances() {
        // One point per doubling on both log axes: the markers are evenly spaced, rising.
        let points: Vec<(f64, f64)> = (4..10).map(|i| (2f64.powi(i), 2f64.powi(i))).collect();
        let plot = LinePlot::new("log").log_x().log_y().series("a", &points);
        let (svg, area) = plot.render().unwrap();
        let [_, markers] = drawn_points(&svg, &area, PALETTE[0]);
        assert_eq!(markers.len(), points.len());
        let step = (markers[1].0 - markers[0].0, markers[1].1 - markers[0].1);
        assert!(step.0 > 0 && step.1 < 0, "right and up: {step:?}");
        for w in markers.windows(2) {
            let d = (w[1].0 - w[0].0, w[1].1 - w[0].1);
            let even = (d.0 - step.0).abs() <= 1 && (d.1 - step.1).abs() <= 1;
            assert!(even, "{markers:?}");
        }
    }

    #[test]
    fn log_ticks_are_inside_the_range_and_increasing() {
        assert_eq!(log_ticks(&(14.0..600.0)), [20.0, 50.0, 100.0, 200.0, 500.0]);
        assert_eq!(log_ticks(&(1.5..8.0)), [2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
        assert_eq!(log_ticks(&(0.9..2e4)), [1.0, 10.0, 100.0, 1e3, 1e4]);
        let wide = log_ticks(&(1e-3..1e12));
        assert!(wide.len() >= 3 && wide.len() <= 8, "{wide:?}");
        for w in wide.windows(2) {
            assert!(w[1] > w[0]);
        }
        // And they are the ones drawn: each tick's label is on the axis.
        let svg = sample().to_svg();
        let labels: Vec<&str> = texts(&svg).into_iter().map(|t| t.1).collect();
        for tick in ["20", "50", "100", "200", "500", "10", "1000"] {
            assert!(
                labels.contains(&tick),
                "tick {tick} missing from {labels:?}"
            );
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
