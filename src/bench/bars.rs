//! Horizontal grouped bar charts, drawn by plotters' SVG backend, for benchmarks that compare a
//! few engines (or settings) on a few workloads.
//!
//! ```text
//! BarChart::new("Decode speed, SmolLM2-135M, 2 threads")
//!     .x_label("tokens/s")                                   the value axis (horizontal)
//!     .group("f32", &[("kiln", 31.2), ("llama.cpp", 28.0)])  one block of bars per group
//!     .group("bf16 / F16", &[("kiln", 50.1), ("llama.cpp", 43.0)])
//!     .reference("bandwidth limit f32", 29.3)                vertical dashed line
//!     .to_svg()                                              -> String
//! ```
//!
//! Same conventions as [`LinePlot`](super::svg::LinePlot), whose palette, fonts and legend this
//! file reuses: deterministic output (same chart, same bytes), legend on the right. A bar label
//! keeps one colour in every group (the palette order is the order labels first appear, skipped
//! values included, so a missing measurement does not recolour the others). The value axis is
//! linear from 0, far enough right that every bar's value label (three significant digits)
//! fits inside the plot area. Values that cannot be drawn (non-finite or negative) leave their
//! slot in the group empty: no bar, no label. The height follows from the number of bars; only
//! the width is set by the caller.

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::svg::{
    Area, GRID, LEGEND_WIDTH, PALETTE, Swatch, font, format_tick, legend, legend_width, tick_count,
    title_font,
};

#[derive(Debug, Clone)]
struct Group {
    name: String,
    bars: Vec<(String, f64)>,
}

/// One bar as laid out: `top` in layout pixels from the top.
struct Bar<'a> {
    label: &'a str,
    value: f64,
    top: f64,
}

/// A horizontal grouped bar chart with a title, a value-axis label, optional reference lines and
/// a legend.
#[derive(Debug, Clone)]
pub struct BarChart {
    title: String,
    x_label: String,
    width: u32,
    groups: Vec<Group>,
    references: Vec<(String, f64)>,
}

// The vertical layout, in pixels (plotters scales it to the plot area, which is about as tall).
const BAR_HEIGHT: f64 = 18.0;
const BAR_GAP: f64 = 3.0; // between bars of one group
const GROUP_GAP: f64 = 18.0; // between groups, and around the first and last
const LEGEND_ROW: f64 = 22.0; // as in svg::legend
/// Above the plot area (the title) and below it (tick labels and the axis label).
const TITLE_HEIGHT: u32 = 40;
const AXIS_HEIGHT: u32 = 55;
/// The group names' column: at least this wide; the plot keeps at least `MIN_PLOT_WIDTH`.
const MIN_NAMES_WIDTH: u32 = 80;
const MIN_PLOT_WIDTH: u32 = 160;
const VALUE_FONT: f64 = 11.0;

impl BarChart {
    /// An empty chart, 760 pixels wide.
    pub fn new(title: impl Into<String>) -> Self {
        BarChart {
            title: title.into(),
            x_label: String::new(),
            width: 760,
            groups: Vec::new(),
            references: Vec::new(),
        }
    }

    /// The label of the value axis, under the chart.
    pub fn x_label(mut self, label: impl Into<String>) -> Self {
        self.x_label = label.into();
        self
    }

    /// Overall width in pixels, legend included (default 760); the height follows from the bars.
    pub fn width(mut self, width: u32) -> Self {
        self.width = width.max(20 + MIN_NAMES_WIDTH + LEGEND_WIDTH + MIN_PLOT_WIDTH);
        self
    }

    /// Adds a block of bars, one per `(label, value)`, drawn top to bottom in this order.
    pub fn group<S: AsRef<str>>(mut self, name: impl Into<String>, bars: &[(S, f64)]) -> Self {
        self.groups.push(Group {
            name: name.into(),
            bars: bars
                .iter()
                .map(|(label, v)| (label.as_ref().to_string(), *v))
                .collect(),
        });
        self
    }

    /// Adds a vertical dashed line at `value` across every group (for example a roofline), named
    /// in the legend.
    pub fn reference(mut self, name: impl Into<String>, value: f64) -> Self {
        self.references.push((name.into(), value));
        self
    }

    /// Bar labels in order of first appearance: a label's index is its palette colour.
    fn labels(&self) -> Vec<&str> {
        let mut labels: Vec<&str> = Vec::new();
        for (label, _) in self.groups.iter().flat_map(|g| &g.bars) {
            if !labels.contains(&label.as_str()) {
                labels.push(label);
            }
        }
        labels
    }

    /// In layout pixels from the top: every bar, the middle of every group, and the height of it
    /// all.
    fn layout(&self) -> (Vec<Bar<'_>>, Vec<f64>, f64) {
        let (mut bars, mut middles) = (Vec::new(), Vec::new());
        let mut y = GROUP_GAP;
        for group in &self.groups {
            let block = (group.bars.len() as f64 * (BAR_HEIGHT + BAR_GAP) - BAR_GAP).max(0.0);
            middles.push(y + block / 2.0);
            for (k, (label, v)) in group.bars.iter().enumerate() {
                let top = y + k as f64 * (BAR_HEIGHT + BAR_GAP);
                bars.push(Bar {
                    label,
                    value: *v,
                    top,
                });
            }
            y += block + GROUP_GAP;
        }
        let legend = LEGEND_ROW * (self.labels().len() + self.references.len()) as f64;
        (
            bars,
            middles,
            y.max(legend).max(2.0 * GROUP_GAP + BAR_HEIGHT),
        )
    }

    /// Renders the chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        self.render().expect("drawing into a String cannot fail").0
    }

    /// The document and where its plot area is.
    fn render(&self) -> anyhow::Result<(String, Area)> {
        let (bars, middles, height) = self.layout();
        // Layout pixels count down from the top; the y axis counts up from the bottom.
        let y = |top: f64| height - top;
        let labels = self.labels();
        let size = (self.width, height as u32 + TITLE_HEIGHT + AXIS_HEIGHT);
        let mut svg = String::new();
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE)?;

        // The title across the figure; under it, columns: margin, group names, plot, legend.
        let legend_names = labels.iter().copied();
        let legend_names = legend_names.chain(self.references.iter().map(|r| r.0.as_str()));
        let legend_w = legend_width(&root, legend_names)?;
        let mut names_w = MIN_NAMES_WIDTH;
        for group in &self.groups {
            names_w = names_w.max(root.estimate_text_size(&group.name, &font(12.0))?.0 + 20);
        }
        let names_w = names_w.min(self.width.saturating_sub(20 + legend_w + MIN_PLOT_WIDTH));
        let plot_w = f64::from(self.width.saturating_sub(20 + names_w + legend_w).max(1));

        // The value axis ends where the bar that reaches furthest, with its label, ends.
        let value_font = font(VALUE_FONT).pos(Pos::new(HPos::Left, VPos::Center));
        let mut hi: f64 = 0.0;
        for v in bars.iter().map(|b| b.value).filter(|&v| shown(v)) {
            let label_w = f64::from(root.estimate_text_size(&format_value(v), &value_font)?.0);
            // v / hi * plot_w + label_w + 10 <= plot_w
            hi = hi.max(v * plot_w / (plot_w - label_w - 10.0).max(plot_w * 0.5));
        }
        for v in self.references.iter().map(|r| r.1).filter(|&v| shown(v)) {
            hi = hi.max(v);
        }
        let hi = if hi > 0.0 { hi } else { 1.0 }; // nothing above zero: show 0..1

        let body = root.titled(&self.title, title_font())?;
        let (plot, legend_column) = body.split_horizontally(self.width - legend_w);
        let mut chart = ChartBuilder::on(&plot)
            .margin(10)
            .x_label_area_size(AXIS_HEIGHT - 10)
            .y_label_area_size(names_w)
            .build_cartesian_2d(0.0..hi, 0.0..height)?;
        chart
            .configure_mesh()
            .bold_line_style(GRID)
            .max_light_lines(0)
            .x_labels(tick_count(plot_w as u32, 70))
            .disable_y_mesh()
            .y_labels(0)
            .label_style(font(12.0))
            .x_desc(&self.x_label)
            .x_label_formatter(&|v| format_tick(*v))
            .draw()?;

        // Group names left of their bars.
        let name_font = font(12.0).pos(Pos::new(HPos::Right, VPos::Center));
        for (group, &middle) in self.groups.iter().zip(&middles) {
            let at = EmptyElement::at((0.0, y(middle)));
            chart
                .plotting_area()
                .draw(&(at + Text::new(group.name.clone(), (-8, 0), &name_font)))?;
        }

        // One series per bar label, then the reference lines over the bars.
        let mut entries = Vec::new();
        for (i, &label) in labels.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let rects = bars
                .iter()
                .filter(|b| b.label == label && shown(b.value))
                .map(|b| {
                    Rectangle::new(
                        [(0.0, y(b.top)), (b.value, y(b.top + BAR_HEIGHT))],
                        color.filled(),
                    )
                });
            chart.draw_series(rects)?;
            entries.push((label, Swatch::Bar(color)));
        }
        for (i, (name, v)) in self.references.iter().enumerate() {
            let color = PALETTE[(labels.len() + i) % PALETTE.len()];
            if shown(*v) {
                let points = [(*v, 0.0), (*v, height)];
                chart.draw_series(DashedLineSeries::new(points, 6, 4, color.stroke_width(2)))?;
            }
            entries.push((name.as_str(), Swatch::Dashed(color)));
        }

        // Each bar's value at its end, on white so that a reference line does not cross it.
        for &Bar { value: v, top, .. } in bars.iter().filter(|b| shown(b.value)) {
            let text = format_value(v);
            let (w, h) = root.estimate_text_size(&text, &value_font)?;
            let (w, h) = (w as i32, h as i32);
            let backing = Rectangle::new([(2, -h / 2 - 1), (w + 6, h / 2 + 1)], WHITE.filled());
            let at = EmptyElement::at((v, y(top + BAR_HEIGHT / 2.0)));
            let label = at + backing + Text::new(text, (4, 0), &value_font);
            chart.plotting_area().draw(&label)?;
        }
        let area = chart.plotting_area().get_pixel_range();
        legend(&legend_column, area.1.start, &entries)?;
        root.present()?;
        drop((chart, plot, legend_column, body, root));
        Ok((svg, area))
    }
}

/// Whether a bar of this value can be drawn.
fn shown(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

/// A bar's value with three significant digits (`31.2`, `8.50`, `0.0123`), as an integer from
/// 100 up (`143`, `2048`), in scientific notation from 1e6 (`1.23e6`).
fn format_value(v: f64) -> String {
    // Rounded to three significant digits first, so that 9.996 counts as 10.0.
    let rounded: f64 = format!("{v:.2e}").parse().unwrap_or(v);
    if rounded == 0.0 {
        "0".to_string()
    } else if rounded >= 1e6 {
        format!("{v:.2e}")
    } else if rounded >= 100.0 {
        format!("{v:.0}")
    } else {
        let decimals = (2 - rounded.log10().floor() as i32).max(0) as usize;
        format!("{rounded:.decimals$}")
    }
}

#[cfg(test)]
mod tests {
    use super::super::svg::read::*;
    use super::*;

    fn sample() -> BarChart {
        BarChart::new("Decode <speed> & \"friends\"")
            .x_label("tokens/s")
            .group(
                "f32",
                &[("kiln", 31.2), ("transformers", 8.5), ("llama.cpp", 28.0)],
            )
            .group(
                "bf16 / F16",
                &[("kiln", 50.1), ("transformers", 15.0), ("llama.cpp", 43.0)],
            )
            .reference("bandwidth limit f32", 29.3)
    }

    /// (x, y, width, height, fill) of every bar: the palette-filled rectangles left of the
    /// legend.
    fn bars(svg: &str, area: &Area) -> Vec<(f64, f64, f64, f64, String)> {
        let palette: Vec<String> = PALETTE.iter().map(|&c| hex(c)).collect();
        elements(svg, "rect")
            .into_iter()
            .filter(|e| palette.iter().any(|c| c == attr(e, "fill")))
            .map(|e| {
                let (x, y) = (num(e, "x"), num(e, "y"));
                (
                    x,
                    y,
                    num(e, "width"),
                    num(e, "height"),
                    attr(e, "fill").to_string(),
                )
            })
            .filter(|b| b.0 < f64::from(area.0.end))
            .collect()
    }

    /// (x, text) of every value label, in document order.
    fn value_labels(svg: &str) -> Vec<(f64, String)> {
        let size = format!("{}", VALUE_FONT * 1.24 / 1.24);
        texts(svg)
            .into_iter()
            .filter(|t| attr(t.0, "font-size") == size)
            .map(|t| (num(t.0, "x"), t.1.to_string()))
            .collect()
    }

    #[test]
    fn output_is_deterministic() {
        assert_eq!(sample().to_svg(), sample().to_svg());
    }

    #[test]
    fn document_is_well_formed_and_text_is_escaped() {
        let svg = sample()
            .group("<b>", &[("a&b", 1.0)])
            .reference("x > y", 2.0)
            .to_svg();
        assert_well_formed(&svg);
        let texts: Vec<&str> = texts(&svg).into_iter().map(|t| t.1).collect();
        for text in [
            "Decode &lt;speed&gt; &amp; &quot;friends&quot;",
            "&lt;b&gt;",
            "a&amp;b",
            "x &gt; y",
            "tokens/s",
            "bf16 / F16",
        ] {
            assert!(texts.contains(&text), "{text} missing from {texts:?}");
        }
        assert!(!svg.contains("<speed>") && !svg.contains("<b>") && !svg.contains("a&b"));
    }

    #[test]
    fn bars_and_value_labels_lie_inside_the_plot_area() {
        for chart in [
            sample(),
            BarChart::new("one").group("g", &[("a", 7.0)]),
            BarChart::new("zero").group("g", &[("a", 0.0), ("b", 0.0)]),
            BarChart::new("tiny and huge")
                .group("g", &[("a", 1e-4), ("b", 3e7)])
                .reference("r", 9e7),
            BarChart::new("narrow")
                .width(300)
                .group("a long group name", &[("a", 999.9)]),
        ] {
            let (svg, area) = chart.render().unwrap();
            let (xs, ys) = (&area.0, &area.1);
            let bars = bars(&svg, &area);
            let drawable = chart
                .groups
                .iter()
                .flat_map(|g| &g.bars)
                .filter(|b| shown(b.1));
            assert_eq!(bars.len(), drawable.count());
            for (x, y, w, h, _) in bars {
                assert_eq!(x as i32, xs.start, "a bar starts at 0, the left edge");
                assert!(
                    (x + w) as i32 <= xs.end,
                    "bar [{x}, {}] outside {xs:?}",
                    x + w
                );
                assert!(
                    y as i32 >= ys.start && (y + h) as i32 <= ys.end,
                    "bar {y} outside {ys:?}"
                );
            }
            let value_font = font(VALUE_FONT);
            let mut scratch = String::new();
            let root = SVGBackend::with_string(&mut scratch, (1, 1)).into_drawing_area();
            for (x, text) in value_labels(&svg) {
                let end = x as i32 + root.estimate_text_size(&text, &value_font).unwrap().0 as i32;
                assert!(end <= xs.end, "label {text} ends at {end}, past {xs:?}");
            }
            // Reference lines: in the plot, or (their legend swatch) right of it.
            let palette: Vec<String> = PALETTE.iter().map(|&c| hex(c)).collect();
            for line in elements(&svg, "polyline") {
                if !palette.iter().any(|c| c == attr(line, "stroke")) {
                    continue; // an axis
                }
                for pair in attr(line, "points").split_whitespace() {
                    let x: i32 = pair.split_once(',').unwrap().0.parse().unwrap();
                    assert!(xs.contains(&x) || x >= xs.end + 10, "a dash at {x}, {xs:?}");
                }
            }
        }
    }

    #[test]
    fn every_bar_has_its_value_label_and_colour() {
        let (svg, area) = sample().render().unwrap();
        let texts: Vec<String> = value_labels(&svg).into_iter().map(|l| l.1).collect();
        assert_eq!(texts, ["31.2", "8.50", "28.0", "50.1", "15.0", "43.0"]);
        // One series per label, in order of first appearance: kiln, transformers, llama.cpp,
        // the same colour in both groups.
        let fills: Vec<String> = bars(&svg, &area).into_iter().map(|b| b.4).collect();
        let expected: Vec<String> = [0, 0, 1, 1, 2, 2]
            .iter()
            .map(|&i| hex(PALETTE[i]))
            .collect();
        assert_eq!(fills, expected);
        // The reference line is in the next colour.
        let reference = format!("stroke=\"{}\"", hex(PALETTE[3]));
        assert!(svg.contains(&reference));
    }

    #[test]
    fn bar_length_is_proportional_to_value_from_zero() {
        let chart = BarChart::new("p").group("g", &[("a", 10.0), ("b", 20.0), ("c", 0.0)]);
        let (svg, area) = chart.render().unwrap();
        let widths: Vec<f64> = bars(&svg, &area).iter().map(|b| b.2).collect();
        assert!((widths[1] - 2.0 * widths[0]).abs() <= 1.0, "{widths:?}");
        assert_eq!(widths[2], 0.0);
        let texts: Vec<&str> = texts(&svg).into_iter().map(|t| t.1).collect();
        assert!(texts.contains(&"0"), "the axis starts at 0");
    }

    #[test]
    fn undrawable_values_are_skipped() {
        let chart = BarChart::new("skips")
            .group(
                "g",
                &[
                    ("a", f64::NAN),
                    ("b", f64::INFINITY),
                    ("c", -1.0),
                    ("d", 2.0),
                ],
            )
            .reference("r", f64::NAN)
            .reference("s", -3.0);
        let (svg, area) = chart.render().unwrap();
        let bars = bars(&svg, &area);
        assert_eq!(bars.len(), 1);
        assert_eq!(value_labels(&svg).len(), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf") && !svg.contains("width=\"-"));
        // No reference line in the plot: the only dashes are the legend's, right of it.
        let dashes = elements(&svg, "polyline").into_iter();
        let dashes: Vec<&str> = dashes.filter(|l| attr(l, "stroke") != "#000000").collect();
        assert!(!dashes.is_empty());
        for line in dashes {
            let x: i32 = attr(line, "points")
                .split(',')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(x > area.0.end, "a dash at {x}");
        }
        // The kept bar still has the colour of its label's position (the 4th label).
        assert_eq!(bars[0].4, hex(PALETTE[3]));
    }

    #[test]
    fn empty_chart_is_valid() {
        for chart in [
            BarChart::new("empty"),
            BarChart::new("empty group").group::<&str>("g", &[]),
        ] {
            let (svg, area) = chart.render().unwrap();
            assert_well_formed(&svg);
            assert!(bars(&svg, &area).is_empty());
            assert!(!svg.contains("NaN") && !svg.contains("inf"));
        }
    }

    #[test]
    fn values_have_three_significant_digits() {
        let cases = [
            (31.24, "31.2"),
            (8.5, "8.50"),
            (143.4, "143"),
            (2048.0, "2048"),
            (0.012345, "0.0123"),
            (9.996, "10.0"),
            (99.96, "100"),
            (0.0, "0"),
            (1.234e7, "1.23e7"),
            (9.996e6, "1.00e7"),
        ];
        for (v, text) in cases {
            assert_eq!(format_value(v), text, "{v}");
        }
    }
}
