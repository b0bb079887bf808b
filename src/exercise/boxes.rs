//! The book's task boxes, written from the exercise tables: `book/src/chNN/tasks.md` holds one
//! anchored box per task, and the chapter's pages include each where the text reaches it
//! (`{{#include tasks.md:task_1_2}}`).

use std::fmt::Write;
use std::path::Path;

use anyhow::{Result, bail};

use super::copy::write_if_changed;
use super::table::{self, Chapter};

/// The boxes of one chapter, as markdown with an mdBook anchor around each.
pub fn render(chapter: &Chapter) -> String {
    let tables: Vec<String> = chapter
        .crates
        .iter()
        .map(|c| format!("{}/exercises.toml", c.dir.display()))
        .collect();
    let mut md = format!(
        "<!-- Written by `kiln exercise boxes` from {}: edit {}, not this. -->\n",
        tables.join(" and "),
        if tables.len() == 1 { "that" } else { "those" }
    );
    let n = chapter.number;
    for (k, task) in (1..).zip(&chapter.tasks) {
        let refs = task.test_refs();
        let tests: Vec<String> = refs
            .iter()
            .map(|t| match t.target.as_str() {
                "lib" => format!("`{}` (unit test)", t.name),
                file => format!("`{}` (tests/{file}.rs)", t.name),
            })
            .collect();
        let anchor = task.anchor();
        writeln!(md, "\n<!-- ANCHOR: {anchor} -->").unwrap();
        writeln!(
            md,
            "> **{}: {}.** In `{}`, write the body of `{}`: {}",
            task.label(),
            task.name,
            task.source().display(),
            task.function,
            task.does
        )
        .unwrap();
        writeln!(md, ">\n> Tests: {}.", tests.join(", ")).unwrap();
        if k > 1 {
            // `verify` proves each task in number order, with the earlier ones written.
            let earlier = if k == 2 {
                format!("task {n}.1")
            } else {
                format!("tasks {n}.1 to {n}.{}", k - 1)
            };
            writeln!(
                md,
                ">\n> Write {earlier} first, wherever this page shows them: these tests may run \
                 their code."
            )
            .unwrap();
        }
        writeln!(md, ">\n> ```bash\n> just exercise {n}   # once: the learner copy, learner/, with chapter {n}'s bodies as todo!\n> just check {n} {k}\n> ```").unwrap();
        writeln!(md, "<!-- ANCHOR_END: {anchor} -->").unwrap();
    }
    md
}

pub fn boxes(root: &Path, check: bool) -> Result<()> {
    let mut stale = Vec::new();
    for chapter in table::load_all(root)? {
        let dir = root.join(format!("book/src/ch{:02}", chapter.number));
        let path = dir.join("tasks.md");
        let md = render(&chapter);
        if check {
            if std::fs::read_to_string(&path).ok().as_deref() != Some(md.as_str()) {
                stale.push(format!(
                    "{} is out of date: run `kiln exercise boxes`",
                    path.display()
                ));
            }
        } else if write_if_changed(&path, &md)? {
            println!("wrote {}", path.display());
        }
        let mut pages = String::new();
        for entry in std::fs::read_dir(&dir)? {
            let p = entry?.path();
            if p.extension().is_some_and(|e| e == "md") && p != path {
                pages += &std::fs::read_to_string(&p)?;
            }
        }
        for task in &chapter.tasks {
            let include = format!("{{{{#include tasks.md:{}}}}}", task.anchor());
            let times = pages.matches(&include).count();
            if times != 1 {
                stale.push(format!(
                    "{}: the pages include {include} {times} times (once is right)",
                    dir.display()
                ));
            }
        }
    }
    if !stale.is_empty() {
        bail!("{}", stale.join("\n"));
    }
    Ok(())
}
