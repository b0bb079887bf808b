//! A markdown table writer for benchmark results: readable as plain text on stdout, rendered
//! as a table by mdBook.
//!
//! ```text
//! let mut table = Table::new(["T", "ms per token"]);
//! table.row(["16", "1.25"]);
//! table.to_markdown()
//!
//! |  T | ms per token |
//! |---:|-------------:|
//! | 16 |         1.25 |
//! ```
//!
//! Columns are right-aligned unless [`Table::align`] says otherwise (benchmarks are mostly
//! numbers), padded to a common width, and `|` inside a cell is escaped.

/// Column alignment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table of string cells. Invariant: every row has one cell per header.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<String>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: ToString>(headers: impl IntoIterator<Item = S>) -> Self {
        let headers: Vec<String> = headers
            .into_iter()
            .map(|h| escape(&h.to_string()))
            .collect();
        Table {
            align: vec![Align::Right; headers.len()],
            headers,
            rows: Vec::new(),
        }
    }

    /// Sets the alignment of column `column` (0-based).
    pub fn align(mut self, column: usize, align: Align) -> Self {
        self.align[column] = align;
        self
    }

    /// Appends a row. Panics if it does not have one cell per column.
    pub fn row<S: ToString>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Self {
        let cells: Vec<String> = cells.into_iter().map(|c| escape(&c.to_string())).collect();
        assert_eq!(
            cells.len(),
            self.headers.len(),
            "a row needs one cell per column"
        );
        self.rows.push(cells);
        self
    }

    /// The table as GitHub-flavoured markdown, one line per row, ending in a newline.
    pub fn to_markdown(&self) -> String {
        let width = |i: usize| {
            self.rows
                .iter()
                .map(|r| r[i].chars().count())
                .chain([self.headers[i].chars().count(), 3])
                .max()
                .unwrap_or(3)
        };
        let widths: Vec<usize> = (0..self.headers.len()).map(width).collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = cells
                .iter()
                .zip(&widths)
                .zip(&self.align)
                .map(|((cell, &w), align)| match align {
                    Align::Left => format!("{cell:<w$}"),
                    Align::Right => format!("{cell:>w$}"),
                })
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        let rule: Vec<String> = widths
            .iter()
            .zip(&self.align)
            .map(|(&w, align)| match align {
                Align::Left => format!(":{}", "-".repeat(w + 1)),
                Align::Right => format!("{}:", "-".repeat(w + 1)),
            })
            .collect();
        let mut out = line(&self.headers);
        out.push_str(&format!("|{}|\n", rule.join("|")));
        for row in &self.rows {
            out.push_str(&line(row));
        }
        out
    }
}

/// A `|` would end the cell, a newline the row.
fn escape(cell: &str) -> String {
    cell.replace('|', "\\|").replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned_markdown() {
        let mut table = Table::new(["model", "T", "ms"]).align(0, Align::Left);
        table
            .row(["gqa", "16", "1.25"])
            .row(["shakespeare-small", "512", "210.5"]);
        assert_eq!(
            table.to_markdown(),
            "\
| model             |   T |    ms |
|:------------------|----:|------:|
| gqa               |  16 |  1.25 |
| shakespeare-small | 512 | 210.5 |
"
        );
    }

    #[test]
    fn every_line_has_the_same_number_of_cells() {
        let mut table = Table::new(["a|b", "c"]);
        table.row(["x|y", "multi\nline"]);
        let markdown = table.to_markdown();
        for line in markdown.lines() {
            let unescaped_bars = line.matches('|').count() - line.matches("\\|").count();
            assert_eq!(unescaped_bars, 3, "{line}");
        }
    }

    #[test]
    #[should_panic(expected = "one cell per column")]
    fn rejects_a_short_row() {
        Table::new(["a", "b"]).row(["only one"]);
    }
}
