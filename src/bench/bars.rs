//! A small SVG bar-chart writer: horizontal grouped bars, for benchmarks that compare a few
//! engines (or settings) on a few workloads.
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
//! Same conventions as [`LinePlot`](super::svg::LinePlot), whose axis, palette and escaping this
//! file reuses: deterministic output (same chart, same bytes), fixed layout, legend on the right.
//! A bar label keeps one colour in every group (the palette order is the order labels first
//! appear, skipped values included, so a missing measurement does not recolour the others). The
//! value axis is linear from 0 and ends on a tick, far enough right that every bar's value label
//! (three significant digits) fits inside the plot area. Values that cannot be drawn (non-finite
//! or negative) leave their slot in the group empty: no bar, no label. The height follows from
//! the number of bars; only the width is set by the caller.

use std::fmt::Write;

use super::svg::{
    Axis, MARGIN_BOTTOM, MARGIN_RIGHT, MARGIN_TOP, PALETTE, Scale, escape, format_tick,
};

#[derive(Debug, Clone)]
struct Group {
    name: String,
    bars: Vec<(String, f64)>,
}

/// A horizontal grouped bar chart with a title, a value-axis label, optional reference lines and
/// a legend.
#[derive(Debug, Clone)]
pub struct BarChart {
    title: String,
    x_label: String,
    width: f64,
    groups: Vec<Group>,
    references: Vec<(String, f64)>,
}

const MIN_MARGIN_LEFT: f64 = 80.0; // widened to fit the group names
const MIN_PLOT_WIDTH: f64 = 160.0; // the group names give way first
const BAR_HEIGHT: f64 = 18.0;
const BAR_GAP: f64 = 3.0; // between bars of one group
const GROUP_GAP: f64 = 18.0; // between groups, and around the first and last
const LEGEND_ROW: f64 = 22.0;
/// Rough advance of one character, in ems, to size margins and value labels without a font.
const CHAR_EM: f64 = 0.62;
const FONT: f64 = 12.0;
const VALUE_FONT: f64 = 11.0;

impl BarChart {
    /// An empty chart, 760 pixels wide.
    pub fn new(title: impl Into<String>) -> Self {
        BarChart {
            title: title.into(),
            x_label: String::new(),
            width: 760.0,
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
        let min = MIN_MARGIN_LEFT + MARGIN_RIGHT + MIN_PLOT_WIDTH;
        self.width = f64::from(width).max(min);
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

    /// The plot area: (left, top, right, bottom) in pixels.
    fn area(&self) -> (f64, f64, f64, f64) {
        let longest = self
            .groups
            .iter()
            .map(|g| g.name.chars().count())
            .max()
            .unwrap_or(0);
        let left = (text_width(longest, FONT) + 20.0)
            .max(MIN_MARGIN_LEFT)
            .min(self.width - MARGIN_RIGHT - MIN_PLOT_WIDTH);
        let legend = LEGEND_ROW * (self.labels().len() + self.references.len()) as f64;
        let height = self
            .content_height()
            .max(legend)
            .max(2.0 * GROUP_GAP + BAR_HEIGHT);
        (
            left,
            MARGIN_TOP,
            self.width - MARGIN_RIGHT,
            MARGIN_TOP + height,
        )
    }

    /// The value axis: from 0 to a tick past every reference line and every bar's end plus its
    /// value label.
    fn axis(&self) -> Axis {
        let (left, _, right, _) = self.area();
        let plot_width = right - left;
        let mut values = vec![0.0];
        for &(_, v) in self
            .groups
            .iter()
            .flat_map(|g| &g.bars)
            .filter(|b| shown(b.1))
        {
            // The label fits when v / hi * plot_width + label width <= plot_width.
            let room = plot_width - text_width(format_value(v).len(), VALUE_FONT) - 6.0;
            values.push(v * plot_width / room.max(plot_width * 0.5));
        }
        values.extend(self.references.iter().map(|r| r.1).filter(|&v| shown(v)));
        if values.iter().all(|&v| v == 0.0) {
            values.push(1.0); // nothing above zero: show 0..1
        }
        Axis::fit(Scale::Linear, &values, left, right)
    }

    /// Renders the chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        let (left, top, right, bottom) = self.area();
        let (w, h) = (self.width, bottom + MARGIN_BOTTOM);
        let axis = self.axis();
        let labels = self.labels();
        let mut s = String::new();
        // Writing into a String cannot fail, so the `fmt::Result`s below are ignored.
        let _ = write!(
            s,
            concat!(
                r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" "#,
                r#"viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="12">"#,
                "\n",
                r#"<rect width="{w:.0}" height="{h:.0}" fill="white"/>"#,
                "\n",
                r#"<text x="{mid:.2}" y="28" text-anchor="middle" font-size="16" "#,
                r#"font-weight="bold">{title}</text>"#,
                "\n",
                r#"<text x="{mid:.2}" y="{label_y:.2}" text-anchor="middle">{x_label}</text>"#,
                "\n",
            ),
            w = w,
            h = h,
            mid = (left + right) / 2.0,
            title = escape(&self.title),
            label_y = h - 16.0,
            x_label = escape(&self.x_label),
        );

        // Value ticks: a grid line across the plot, a tick mark and a label under it.
        let _ = writeln!(s, r#"<g class="x-ticks">"#);
        for tick in axis.ticks() {
            let _ = write!(
                s,
                concat!(
                    r##"<line x1="{x:.2}" y1="{top:.2}" x2="{x:.2}" y2="{bottom:.2}" stroke="#e5e5e5"/>"##,
                    "\n",
                    r#"<line x1="{x:.2}" y1="{bottom:.2}" x2="{x:.2}" y2="{mark:.2}" stroke="black"/>"#,
                    "\n",
                    r#"<text x="{x:.2}" y="{text_y:.2}" text-anchor="middle">{text}</text>"#,
                    "\n",
                ),
                x = axis.to_px(tick),
                top = top,
                bottom = bottom,
                mark = bottom + 5.0,
                text_y = bottom + 19.0,
                text = format_tick(tick),
            );
        }
        let _ = write!(
            s,
            concat!(
                "</g>\n",
                r#"<rect class="plot-area" x="{left:.2}" y="{top:.2}" width="{width:.2}" "#,
                r#"height="{height:.2}" fill="none" stroke="black"/>"#,
                "\n",
            ),
            left = left,
            top = top,
            width = right - left,
            height = bottom - top,
        );

        // The groups: name on the left, bars top to bottom. Each bar's value, at its end, is
        // written last, over the reference lines, with a white halo.
        let mut values = String::new();
        let mut y = top + (bottom - top - self.content_height()) / 2.0 + GROUP_GAP;
        for group in &self.groups {
            let _ = writeln!(s, r#"<g class="group">"#);
            let _ = writeln!(
                s,
                r#"<text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"#,
                left - 8.0,
                y + block_height(group.bars.len()) / 2.0 + 4.0,
                escape(&group.name)
            );
            for (label, v) in &group.bars {
                if shown(*v) {
                    let color = PALETTE[color_index(&labels, label) % PALETTE.len()];
                    let end = axis.to_px(*v);
                    let _ = writeln!(
                        s,
                        r#"<rect class="bar" x="{left:.2}" y="{y:.2}" width="{:.2}" height="{BAR_HEIGHT:.2}" fill="{color}"/>"#,
                        end - left
                    );
                    let _ = writeln!(
                        values,
                        r#"<text class="value" x="{:.2}" y="{:.2}" font-size="{VALUE_FONT}" stroke="white" stroke-width="3" paint-order="stroke">{}</text>"#,
                        end + 4.0,
                        y + BAR_HEIGHT / 2.0 + 4.0,
                        format_value(*v)
                    );
                }
                y += BAR_HEIGHT + BAR_GAP;
            }
            y += GROUP_GAP - BAR_GAP;
            let _ = writeln!(s, "</g>");
        }

        // Reference lines over the bars, the values, then the legend: bar labels, references.
        let reference_color = |i: usize| PALETTE[(labels.len() + i) % PALETTE.len()];
        for (i, &(_, v)) in self.references.iter().enumerate() {
            if shown(v) {
                let x = axis.to_px(v);
                let _ = writeln!(
                    s,
                    r#"<line class="reference" x1="{x:.2}" y1="{top:.2}" x2="{x:.2}" y2="{bottom:.2}" stroke="{}" stroke-width="2" stroke-dasharray="6 4"/>"#,
                    reference_color(i)
                );
            }
        }
        let _ = writeln!(s, r#"<g class="values">"#);
        s.push_str(&values);
        let _ = writeln!(s, "</g>");
        let _ = writeln!(s, r#"<g class="legend">"#);
        let x = right + 16.0;
        let names = labels.iter().copied().map(escape);
        let reference_names = self.references.iter().map(|r| escape(&r.0));
        for (row, name) in names.chain(reference_names).enumerate() {
            let y = top + 10.0 + LEGEND_ROW * row as f64;
            let swatch = if row < labels.len() {
                let color = PALETTE[row % PALETTE.len()];
                format!(
                    r#"<rect x="{:.2}" y="{:.2}" width="20" height="12" fill="{color}"/>"#,
                    x + 4.0,
                    y - 6.0
                )
            } else {
                let color = reference_color(row - labels.len());
                format!(
                    r#"<line x1="{x:.2}" y1="{y:.2}" x2="{:.2}" y2="{y:.2}" stroke="{color}" stroke-width="2" stroke-dasharray="6 4"/>"#,
                    x + 28.0
                )
            };
            let (text_x, text_y) = (x + 36.0, y + 4.0);
            let _ = writeln!(
                s,
                "{swatch}\n<text x=\"{text_x:.2}\" y=\"{text_y:.2}\">{name}</text>"
            );
        }
        let _ = writeln!(s, "</g>");
        s.push_str("</svg>\n");
        s
    }

    /// Height of the bars and the gaps around every group.
    fn content_height(&self) -> f64 {
        let bars: f64 = self.groups.iter().map(|g| block_height(g.bars.len())).sum();
        bars + GROUP_GAP * (self.groups.len() + 1) as f64
    }
}

/// Whether a bar of this value can be drawn.
fn shown(v: f64) -> bool {
    v.is_finite() && v >= 0.0
}

fn color_index(labels: &[&str], label: &str) -> usize {
    labels.iter().position(|l| *l == label).unwrap_or(0)
}

/// Height of one group's bars.
fn block_height(bars: usize) -> f64 {
    (bars as f64 * (BAR_HEIGHT + BAR_GAP) - BAR_GAP).max(0.0)
}

/// Estimated width in pixels of `chars` characters at font size `font`.
fn text_width(chars: usize, font: f64) -> f64 {
    chars as f64 * font * CHAR_EM
}

/// A bar's value with three significant digits (`31.2`, `8.50`, `0.0123`), as an integer from
/// 100 up (`143`, `2048`), in scientific notation from 1e6 (`1.23e6`).
fn format_value(v: f64) -> String {
    if v == 0.0 {
        return "0".to_string();
    }
    if v.abs() >= 1e6 {
        let mut exp = v.abs().log10().floor() as i32;
        if (v.abs() / 10f64.powi(exp) * 100.0).round() >= 1000.0 {
            exp += 1; // 9.996e6 rounds to 1.00e7
        }
        return format!("{:.2}e{exp}", v / 10f64.powi(exp));
    }
    let magnitude = v.abs().log10().floor() as i32;
    let decimals = (2 - magnitude).max(0) as usize;
    let text = format!("{v:.decimals$}");
    // Rounding may carry into the next power of ten (9.996 → "10.00"): one decimal fewer.
    let carried: f64 = text.parse().unwrap_or(v);
    if decimals > 0 && carried.abs() >= 10f64.powi(magnitude + 1) {
        format!("{v:.prec$}", prec = decimals - 1)
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
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

    /// The value of attribute `name` in `element` (the text after `<tag `).
    fn attr(element: &str, name: &str) -> f64 {
        let start = element.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        let rest = &element[start..];
        rest[..rest.find('"').unwrap()].parse().unwrap()
    }

    /// (x, y, width, height) of every bar.
    fn bars(svg: &str) -> Vec<(f64, f64, f64, f64)> {
        svg.split(r#"<rect class="bar""#)
            .skip(1)
            .map(|e| {
                (
                    attr(e, "x"),
                    attr(e, "y"),
                    attr(e, "width"),
                    attr(e, "height"),
                )
            })
            .collect()
    }

    /// (x, text) of every value label.
    fn value_labels(svg: &str) -> Vec<(f64, String)> {
        svg.split(r#"<text class="value""#)
            .skip(1)
            .map(|e| {
                let text = &e[e.find('>').unwrap() + 1..e.find("</text>").unwrap()];
                (attr(e, "x"), text.to_string())
            })
            .collect()
    }

    /// Every tag is closed in order, text holds no raw `<` or `>`, every `&` starts an entity,
    /// and the document is one `<svg>` element.
    fn assert_well_formed(svg: &str) {
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>\n"));
        let mut open: Vec<&str> = Vec::new();
        for (i, chunk) in svg.split('<').skip(1).enumerate() {
            let (tag, text) = chunk.split_once('>').expect("unclosed tag");
            assert!(!text.contains('>'), "raw '>' in text after <{tag}>");
            for entity in text.split('&').skip(1) {
                let name = entity.split(';').next().unwrap();
                assert!(
                    ["amp", "lt", "gt", "quot", "apos"].contains(&name),
                    "&{entity}"
                );
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
        assert!(svg.contains(">Decode &lt;speed&gt; &amp; &quot;friends&quot;</text>"));
        assert!(svg.contains(">&lt;b&gt;</text>") && svg.contains(">a&amp;b</text>"));
        assert!(svg.contains(">x &gt; y</text>"));
        assert!(!svg.contains("<speed>") && !svg.contains("<b>") && !svg.contains("a&b"));
        assert!(svg.contains(">tokens/s</text>") && svg.contains(">bf16 / F16</text>"));
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
            let (left, top, right, bottom) = chart.area();
            let svg = chart.to_svg();
            let bars = bars(&svg);
            let labels = value_labels(&svg);
            assert!(!bars.is_empty());
            for (x, y, w, h) in bars {
                // Coordinates are printed with two decimals.
                let (left, top, right, bottom) =
                    (left - 0.01, top - 0.01, right + 0.01, bottom + 0.01);
                assert!(x >= left && x + w <= right, "bar [{x}, {}] outside", x + w);
                assert!(
                    y >= top && y + h <= bottom,
                    "bar [{y}, {}] outside [{top}, {bottom}]",
                    y + h
                );
            }
            for (x, text) in labels {
                let end = x + text_width(text.len(), VALUE_FONT);
                assert!(end <= right + 0.01, "label {text} ends at {end} > {right}");
            }
            for element in svg.split(r#"<line class="reference""#).skip(1) {
                let x = attr(element, "x1");
                assert!(x >= left - 0.01 && x <= right + 0.01);
            }
        }
    }

    #[test]
    fn every_bar_has_its_value_label_and_colour() {
        let svg = sample().to_svg();
        let texts: Vec<String> = value_labels(&svg).into_iter().map(|l| l.1).collect();
        assert_eq!(texts, ["31.2", "8.50", "28.0", "50.1", "15.0", "43.0"]);
        assert_eq!(bars(&svg).len(), 6);
        // The same label has the same colour in both groups: kiln, transformers, llama.cpp.
        let fills: Vec<&str> = svg
            .split(r#"<rect class="bar""#)
            .skip(1)
            .map(|e| {
                e.split("fill=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
            })
            .collect();
        assert_eq!(fills[..3], fills[3..]);
        assert_eq!(fills[..3], PALETTE[..3]);
        // Legend: three swatches, then the reference line in the next colour.
        assert!(svg.contains(&format!("stroke=\"{}\"", PALETTE[3])));
    }

    #[test]
    fn bar_length_is_proportional_to_value_from_zero() {
        let svg = BarChart::new("p")
            .group("g", &[("a", 10.0), ("b", 20.0), ("c", 0.0)])
            .to_svg();
        let widths: Vec<f64> = bars(&svg).iter().map(|b| b.2).collect();
        assert!((widths[1] - 2.0 * widths[0]).abs() < 0.02, "{widths:?}");
        assert_eq!(widths[2], 0.0);
        assert!(svg.contains(">0</text>"), "the axis starts at 0");
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
        let svg = chart.to_svg();
        assert_eq!(bars(&svg).len(), 1);
        assert_eq!(value_labels(&svg).len(), 1);
        assert!(!svg.contains("NaN") && !svg.contains("inf") && !svg.contains("=\"-"));
        assert!(!svg.contains(r#"<line class="reference""#));
        // The kept bar still has the colour of its label's position (the 4th label).
        let (_, svg_bar) = svg.split_once(r#"<rect class="bar""#).unwrap();
        assert!(svg_bar.contains(&format!("fill=\"{}\"", PALETTE[3])));
    }

    #[test]
    fn empty_chart_is_valid() {
        for chart in [
            BarChart::new("empty"),
            BarChart::new("empty group").group::<&str>("g", &[]),
        ] {
            let svg = chart.to_svg();
            assert_well_formed(&svg);
            assert!(bars(&svg).is_empty());
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
