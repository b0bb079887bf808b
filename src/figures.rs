//! `kiln figures`: every figure the book shows was written by a command of this repository,
//! and says which.
//!
//! A figure is a plot or screenshot a page shows (`![..](memory.svg)`) or a table it includes
//! whole (`{{#include memory.md}}`; task boxes and code excerpts are not figures). For each one
//! the check finds the command that wrote it:
//! - a table names it in its caption (the first `` `kiln …` `` or `` `fixtures/scripts/….sh` ``);
//! - a plot names it in its description, `<desc>command: kiln …</desc>` (which
//!   `write_figures` puts in every plot it writes), or else is the plot of the table beside it: the table of the
//!   same stem, or of the longest stem it extends (`serve-latency.svg` is `serve.md`'s);
//! - a screenshot is named in the paragraph that shows it.
//!
//! and fails unless that command parses as a kiln command line today (so a renamed flag
//! fails), it is one that writes figures (`kiln bench …`, `kiln diagrams`, or a script under
//! `fixtures/scripts/`), and its source names the figure (the stem as a string literal in the
//! benchmark's module, or the file name in the script). It also fails on a plot that draws a
//! cited figure (a number this repository did not measure belongs in the text, with its
//! source), and on a figure file in a chapter's folder that no page shows (a stale output).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Parser;

#[derive(clap::Args)]
pub struct Args {}

/// A figure the book shows, and the pages that show it.
struct Figure {
    /// Relative to `book/src`, e.g. `ch03/memory.svg`.
    path: PathBuf,
    pages: BTreeSet<PathBuf>,
    /// The text of the pages that show it (a screenshot's script is named there).
    context: String,
}

pub fn run(_args: Args) -> Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let book = root.join("book/src");
    let figures = collect(&book)?;
    let mut problems = Vec::new();
    let mut rows = Vec::new();
    for figure in figures.values() {
        match check(&root, &book, figure, &figures) {
            Ok(command) => rows.push((figure.path.display().to_string(), command)),
            Err(e) => problems.push(format!("{}: {e:#}", figure.path.display())),
        }
    }
    problems.extend(orphans(&book, &figures)?);
    for (path, command) in &rows {
        println!("{path:32} {command}");
    }
    if !problems.is_empty() {
        bail!(
            "{} of the book's figures fail the provenance check:\n  {}",
            problems.len(),
            problems.join("\n  ")
        );
    }
    println!(
        "all {} figures the book shows name the command that wrote them",
        rows.len()
    );
    Ok(())
}

/// Every figure referenced by a page under `book`.
fn collect(book: &Path) -> Result<BTreeMap<PathBuf, Figure>> {
    let mut figures: BTreeMap<PathBuf, Figure> = BTreeMap::new();
    for page in markdown_files(book)? {
        let text = std::fs::read_to_string(&page)?;
        let dir = page.parent().expect("a page is in a folder");
        for line in text.lines() {
            for target in figure_refs(line) {
                let path = normalise(&dir.join(target));
                let Ok(rel) = path.strip_prefix(book) else {
                    continue;
                };
                let figure = figures.entry(rel.to_path_buf()).or_insert_with(|| Figure {
                    path: rel.to_path_buf(),
                    pages: BTreeSet::new(),
                    context: String::new(),
                });
                figure
                    .pages
                    .insert(page.strip_prefix(book).unwrap_or(&page).to_path_buf());
                figure.context.push_str(&text);
            }
        }
    }
    Ok(figures)
}

/// The figure files one line of a page refers to: images, and tables included whole.
fn figure_refs(line: &str) -> Vec<&str> {
    let mut refs = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let Some(end) = after.find(')') else { break };
        let target = &after[..end];
        let is_image = rest[..at].contains("![");
        if is_image && !target.contains("://") {
            refs.push(target);
        }
        rest = &after[end..];
    }
    let mut rest = line;
    while let Some(at) = rest.find("{{#include ") {
        let after = &rest[at + "{{#include ".len()..];
        let Some(end) = after.find("}}") else { break };
        let target = after[..end].trim();
        // A whole generated table: a .md file with no anchor, not the task boxes.
        let is_table = target.ends_with(".md")
            && !target.contains(':')
            && !target.ends_with("tasks.md")
            && !target.contains("chapters/");
        if is_table {
            refs.push(target);
        }
        rest = &after[end..];
    }
    refs
}

/// Which command wrote `figure`, checked as the module doc says.
fn check(
    root: &Path,
    book: &Path,
    figure: &Figure,
    figures: &BTreeMap<PathBuf, Figure>,
) -> Result<String> {
    let file = book.join(&figure.path);
    let name = figure
        .path
        .file_name()
        .and_then(|n| n.to_str())
        .context("a figure has a file name")?;
    let extension = figure.path.extension().and_then(|e| e.to_str());
    let command = match extension {
        Some("md") => {
            let text = std::fs::read_to_string(&file).context("missing")?;
            named_command(&text).context("its caption names no `kiln …` command")?
        }
        Some("svg") => {
            let text = std::fs::read_to_string(&file).context("missing")?;
            if text.to_lowercase().contains("cited") {
                bail!("the plot draws a cited figure: plot only what this repository measured");
            }
            match svg_command(&text) {
                Some(command) => command,
                None => {
                    let table = paired_table(&figure.path, figures).context(
                        "names no command (<desc>command: …</desc>) and has no table beside it",
                    )?;
                    let text = std::fs::read_to_string(book.join(&table))?;
                    named_command(&text).with_context(|| {
                        format!("its table {} names no command", table.display())
                    })?
                }
            }
        }
        _ => {
            anyhow::ensure!(file.exists(), "missing");
            scripts(&figure.context)
                .find(|s| {
                    std::fs::read_to_string(root.join(s)).is_ok_and(|text| text.contains(name))
                })
                .context("no script named on its page writes it")?
                .to_string()
        }
    };
    let stem = name.rsplit_once('.').map_or(name, |(stem, _)| stem);
    verify(root, &command, stem, name).with_context(|| format!("`{command}`"))?;
    Ok(command)
}

/// The command a caption names: the one after `Command:`, else the first `` `kiln …` `` or
/// `` `fixtures/scripts/….sh` `` between backticks.
fn named_command(text: &str) -> Option<String> {
    if let Some(at) = text.find("Command: `") {
        let rest = &text[at + "Command: `".len()..];
        return Some(rest[..rest.find('`')?].trim().to_string());
    }
    quoted(text)
        .find(|s| s.starts_with("kiln ") || is_script(s))
        .map(str::to_string)
}

/// Every `` `fixtures/scripts/….sh` `` between backticks in `text`.
fn scripts(text: &str) -> impl Iterator<Item = &str> {
    quoted(text).filter(|s| is_script(s))
}

/// The strings between backticks in `text`.
fn quoted(text: &str) -> impl Iterator<Item = &str> {
    text.split('`').skip(1).step_by(2).map(str::trim)
}

fn is_script(s: &str) -> bool {
    s.starts_with("fixtures/scripts/") && s.ends_with(".sh") && !s.contains(' ')
}

/// The command of a plot's `<desc>command: …</desc>`.
fn svg_command(svg: &str) -> Option<String> {
    let at = svg.find(DESC)?;
    let rest = &svg[at + DESC.len()..];
    let escaped = rest[..rest.find("</desc>")?].trim();
    Some(
        escaped
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&amp;", "&"),
    )
}

/// How a plot's description names its command (an XML comment could not: `--` may not occur
/// in one).
pub const DESC: &str = "<desc>command: ";

/// The table a plot belongs to: the one of the same stem in its folder, else the one whose stem
/// is the longest that the plot's extends with a `-`.
fn paired_table(plot: &Path, figures: &BTreeMap<PathBuf, Figure>) -> Option<PathBuf> {
    let dir = plot.parent()?;
    let stem = plot.file_stem()?.to_str()?;
    figures
        .keys()
        .filter(|p| p.parent() == Some(dir) && p.extension().is_some_and(|e| e == "md"))
        .filter_map(|p| {
            let table = p.file_stem()?.to_str()?;
            let extends = stem == table || stem.starts_with(&format!("{table}-"));
            extends.then(|| (table.len(), p.clone()))
        })
        .max()
        .map(|(_, p)| p)
}

/// `command` parses today, writes figures, and its source names this one.
fn verify(root: &Path, command: &str, stem: &str, name: &str) -> Result<()> {
    if is_script(command) {
        let script = std::fs::read_to_string(root.join(command)).context("no such script")?;
        anyhow::ensure!(script.contains(name), "the script never names {name}");
        return Ok(());
    }
    let words: Vec<&str> = command.split_whitespace().collect();
    if let Err(e) = crate::Cli::try_parse_from(&words) {
        let first = e.to_string();
        bail!(
            "does not parse as a kiln command: {}",
            first.lines().next().unwrap_or_default()
        );
    }
    let position = |word: &str| words.iter().position(|w| *w == word);
    let sources = if let Some(at) = position("bench") {
        let chapter = words.get(at + 1).context("bench names no chapter")?;
        let (_, source) = crate::bench::SOURCES
            .iter()
            .find(|(name, _)| name == chapter)
            .with_context(|| format!("no benchmark source for `kiln bench {chapter}`"))?;
        vec![root.join(source)]
    } else if position("diagrams").is_some() {
        vec![root.join("src/diagrams.rs"), root.join("src/diagrams")]
    } else {
        bail!("not a command that writes figures (kiln bench …, kiln diagrams)");
    };
    let (quoted, file) = (format!("\"{stem}\""), format!("{name}\""));
    for source in sources.iter().flat_map(|s| rust_files(s)) {
        let text = std::fs::read_to_string(&source)?;
        if text.contains(&quoted) || text.contains(&file) {
            return Ok(());
        }
    }
    bail!("its source never names {stem} (looked in {})", {
        let shown: Vec<_> = sources
            .iter()
            .filter(|s| s.exists())
            .map(|s| s.strip_prefix(root).unwrap_or(s).display().to_string())
            .collect();
        shown.join(", ")
    })
}

/// Figure files in a chapter's folder that no page shows.
fn orphans(book: &Path, figures: &BTreeMap<PathBuf, Figure>) -> Result<Vec<String>> {
    let summary = std::fs::read_to_string(book.join("SUMMARY.md"))?;
    let mut found = Vec::new();
    for entry in std::fs::read_dir(book)? {
        let dir = entry?.path();
        if !dir.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&dir)? {
            let path = file?.path();
            let rel = path.strip_prefix(book).unwrap_or(&path).to_path_buf();
            let name = rel.to_string_lossy().to_string();
            let is_figure = match path.extension().and_then(|e| e.to_str()) {
                Some("svg" | "png") => true,
                // A markdown file that is no page of the book and no task boxes: a table.
                Some("md") => {
                    !summary.contains(&format!("({name})")) && !name.ends_with("tasks.md")
                }
                _ => false,
            };
            if is_figure && !figures.contains_key(&rel) {
                found.push(format!(
                    "{name}: no page shows it (a stale output? delete it)"
                ));
            }
        }
    }
    Ok(found)
}

/// `path` with its `..` and `.` components resolved, without touching the file system.
fn normalise(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

fn markdown_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            files.extend(markdown_files(&path)?);
        } else if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// `path` itself if it is a `.rs` file, every `.rs` file under it if it is a folder.
fn rust_files(path: &Path) -> Vec<PathBuf> {
    if path.is_file() {
        return vec![path.to_path_buf()];
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| rust_files(&e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_images_and_whole_tables_but_not_task_boxes_or_code() {
        let line =
            "![a](x.svg) and [a link](y.html) {{#include t.md}} {{#include tasks.md:task_1_1}}";
        assert_eq!(figure_refs(line), ["x.svg", "t.md"]);
        assert!(figure_refs("{{#include ../../../chapters/ch01/src/lib.rs:x}}").is_empty());
        assert!(figure_refs("![remote](https://example.org/a.png)").is_empty());
    }

    #[test]
    fn a_caption_names_the_first_kiln_command_or_script() {
        let caption =
            "_`kiln quantize` files, `Llama::forward`. Command: `kiln bench ch03 --quick`._";
        assert_eq!(
            named_command(caption).as_deref(),
            Some("kiln bench ch03 --quick")
        );
        let caption = "_2 threads, `Llama::forward`, measured with `kiln bench ch01`._";
        assert_eq!(named_command(caption).as_deref(), Some("kiln bench ch01"));
        let shot = "(`kiln serve`, `fixtures/scripts/dashboard_check.sh` took both)";
        assert_eq!(
            scripts(shot).collect::<Vec<_>>(),
            ["fixtures/scripts/dashboard_check.sh"]
        );
        assert_eq!(named_command("no command here, `x`"), None);
    }

    #[test]
    fn a_plot_belongs_to_the_table_whose_stem_it_extends() {
        let figure = |p: &str| {
            (
                PathBuf::from(p),
                Figure {
                    path: p.into(),
                    pages: BTreeSet::new(),
                    context: String::new(),
                },
            )
        };
        let figures: BTreeMap<_, _> = ["ch08/serve.md", "ch08/serve-abuse.md", "ch07/traffic.md"]
            .into_iter()
            .map(figure)
            .collect();
        let pair = |p: &str| paired_table(Path::new(p), &figures);
        assert_eq!(pair("ch08/serve-latency.svg"), Some("ch08/serve.md".into()));
        assert_eq!(
            pair("ch08/serve-abuse-p99.svg"),
            Some("ch08/serve-abuse.md".into())
        );
        assert_eq!(pair("ch07/traffic.svg"), Some("ch07/traffic.md".into()));
        assert_eq!(pair("ch07/trafficking.svg"), None);
        assert_eq!(pair("ch03/serve.svg"), None);
    }

    #[test]
    fn a_command_must_parse_and_its_source_must_name_the_figure() {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        verify(&root, "kiln bench ch03 --quick", "memory", "memory.svg").unwrap();
        let err = verify(
            &root,
            "kiln bench ch03 --no-such-flag",
            "memory",
            "memory.svg",
        );
        assert!(format!("{:#}", err.unwrap_err()).contains("does not parse"));
        let err = verify(
            &root,
            "kiln bench ch03",
            "no-such-figure",
            "no-such-figure.svg",
        );
        assert!(format!("{:#}", err.unwrap_err()).contains("never names"));
        let err = verify(&root, "kiln generate --prompt x", "memory", "memory.svg");
        assert!(format!("{:#}", err.unwrap_err()).contains("not a command that writes"));
    }
}
