//! The book's task boxes, written from the exercise tables: `book/src/chNN/tasks.md` holds one
//! anchored box per task, and the chapter's pages include each where the text reaches it
//! (`{{#include tasks.md:task_1_2}}`).

use std::fmt::Write;
use std::path::Path;

use anyhow::{Result, bail};

use super::copy::write_if_changed;
use super::deps::Graph;
use super::table::{self, Chapter};

/// The boxes of one chapter, as markdown with an mdBook anchor around each. `graph`: the
/// chapter's crates and their dependencies, which say which earlier tasks' code a task's
/// tests can run.
pub fn render(chapter: &Chapter, graph: &Graph) -> String {
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
        // `verify` proves each task in number order, with the earlier ones written; of those,
        // only tasks whose code is in a crate this task's tests build can matter.
        let reach = graph.reach(&task.krate.dir);
        let earlier: Vec<usize> = (1..k)
            .filter(|&j| {
                let before = &chapter.tasks[j - 1];
                let source = before.source();
                let owner = graph.owner(&source).unwrap_or(&before.krate.dir);
                reach.contains(owner)
            })
            .collect();
        if let Some(earlier) = task_list(n, &earlier) {
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

/// Tasks `n.k` for `k` in `ks` (ascending), as the boxes name them: `task 8.1`, `tasks 8.1 and
/// 8.2`, `tasks 8.1 to 8.3` for a longer run, `tasks 8.1, 8.3 and 8.4` otherwise; `None` for
/// none.
fn task_list(n: u32, ks: &[usize]) -> Option<String> {
    let (&first, &last) = (ks.first()?, ks.last()?);
    Some(match ks.len() {
        1 => format!("task {n}.{first}"),
        2 => format!("tasks {n}.{first} and {n}.{last}"),
        len if last - first + 1 == len => format!("tasks {n}.{first} to {n}.{last}"),
        len => {
            let init: Vec<String> = ks[..len - 1].iter().map(|k| format!("{n}.{k}")).collect();
            format!("tasks {} and {n}.{last}", init.join(", "))
        }
    })
}

pub fn boxes(root: &Path, check: bool) -> Result<()> {
    let mut stale = Vec::new();
    for chapter in table::load_all(root)? {
        let dir = root.join(format!("book/src/ch{:02}", chapter.number));
        let path = dir.join("tasks.md");
        let graph = Graph::load(root, chapter.crates.iter().map(|c| c.dir.clone()))?;
        let md = render(&chapter, &graph);
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

#[cfg(test)]
mod tests {
    use super::super::table::tests::task;
    use super::*;

    /// The box of task `id` in `md`.
    fn boxed<'a>(md: &'a str, id: &str) -> &'a str {
        let anchor = format!("task_{}", id.replace('.', "_"));
        let start = md.find(&format!("ANCHOR: {anchor} ")).unwrap();
        let end = md.find(&format!("ANCHOR_END: {anchor} ")).unwrap();
        &md[start..end]
    }

    /// Chapter 8 of two crates, `ch08-b` depending on `ch08-a` or not: a task's box asks for
    /// the earlier tasks whose code its tests can run, and only those.
    #[test]
    fn a_box_asks_first_for_the_earlier_tasks_its_crate_depends_on() {
        for depends in [false, true] {
            let root = tempfile::tempdir().unwrap();
            let write = |rel: &str, text: &str| {
                let path = root.path().join(rel);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, text).unwrap();
            };
            write(
                "Cargo.toml",
                "[workspace.dependencies]\na = { path = \"chapters/ch08-a\", package = \"ch08-a\" }\n",
            );
            write(
                "chapters/ch08-a/Cargo.toml",
                "[package]\nname = \"ch08-a\"\n",
            );
            let deps = if depends {
                "[dev-dependencies]\na.workspace = true\n"
            } else {
                ""
            };
            write(
                "chapters/ch08-b/Cargo.toml",
                &format!("[package]\nname = \"ch08-b\"\n{deps}"),
            );
            write("chapters/ch08-a/exercises.toml", &task("8.1"));
            write(
                "chapters/ch08-b/exercises.toml",
                &(task("8.2") + &task("8.3")),
            );
            let chapter = table::load_chapter(root.path(), 8).unwrap();
            let graph =
                Graph::load(root.path(), chapter.crates.iter().map(|c| c.dir.clone())).unwrap();
            let md = render(&chapter, &graph);
            assert!(!boxed(&md, "8.1").contains("first"), "{md}");
            if depends {
                assert!(boxed(&md, "8.2").contains("Write task 8.1 first"), "{md}");
                assert!(
                    boxed(&md, "8.3").contains("Write tasks 8.1 and 8.2 first"),
                    "{md}"
                );
            } else {
                assert!(!boxed(&md, "8.2").contains("first"), "{md}");
                assert!(boxed(&md, "8.3").contains("Write task 8.2 first"), "{md}");
            }
        }
        assert_eq!(task_list(8, &[1, 3, 4]).unwrap(), "tasks 8.1, 8.3 and 8.4");
        assert_eq!(task_list(8, &[]), None);
    }
}
