//! The exercise tables: one `exercises.toml` per chapter crate, read by the tool, the book's
//! task boxes and CI alike.
//!
//! ```toml
//! [[task]]
//! id = "1.1"                               # chapter.k, k counting from 1 in learning order
//! name = "softmax"
//! file = "src/attention.rs"                # relative to the chapter crate
//! function = "softmax_in_place"
//! does = "what the body must do, one or two sentences"
//! tests = ["properties::softmax_rows_sum_to_one"]   # test target :: exact test name
//! ```
//!
//! A test target is an integration test's file stem (`tests/properties.rs` → `properties`) or
//! `lib` for the crate's unit tests (then the name is the full path, `module::tests::name`), in
//! the crate whose table names the task.
//!
//! A chapter may span several crates (chapter 8: `ch08-server`, then `ch08-tensor-parallel`):
//! their tables join in the order of the crates' directory names, and the numbering runs on
//! across them (8.1 and 8.2 in the server's table, 8.3 in the next).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;

/// One chapter's tasks, in the order a learner does them.
#[derive(Debug, Clone)]
pub struct Chapter {
    pub number: u32,
    /// The crates whose tables hold its tasks, in order.
    pub crates: Vec<Crate>,
    pub tasks: Vec<Task>,
}

/// A chapter crate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Crate {
    /// Its directory relative to the repository root (`chapters/ch01-naive-attention`).
    pub dir: PathBuf,
    /// Its package name (the directory's name).
    pub package: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Task {
    pub id: String,
    pub name: String,
    pub file: PathBuf,
    pub function: String,
    pub does: String,
    pub tests: Vec<String>,
    /// The crate whose table names the task: where `file` is relative to, and whose tests
    /// `tests` are.
    #[serde(skip)]
    pub krate: Crate,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    task: Vec<Task>,
}

impl Task {
    /// The task's file relative to the repository root, `..` resolved: a task's file may lie
    /// outside its crate (chapter 7's CUDA kernels are in `kernels/`).
    pub fn source(&self) -> PathBuf {
        let mut path = PathBuf::new();
        for part in self.krate.dir.join(&self.file).components() {
            match part {
                std::path::Component::ParentDir => {
                    path.pop();
                }
                other => path.push(other),
            }
        }
        path
    }
}

/// One test of a task: which test binary, and the test's exact name in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestRef {
    pub target: String,
    pub name: String,
}

impl Task {
    /// `Task 1.2`, the words every stub's panic message starts with.
    pub fn label(&self) -> String {
        format!("Task {}", self.id)
    }

    /// The anchor name of the task's marker lines (`// ANCHOR: task_1_2`): an mdBook anchor,
    /// so that the book's includes of the same code drop the markers.
    pub fn anchor(&self) -> String {
        format!("task_{}", self.id.replace('.', "_"))
    }

    /// The body a learner starts from: a panic that says what to write (in a CUDA source,
    /// `KILN_TODO`, which stops the kernel; on CPU threads it prints the same words).
    pub fn todo(&self) -> String {
        let what = format!("{}: {}", self.label(), self.does);
        if self.is_cuda() {
            format!("KILN_TODO({what:?})")
        } else {
            format!("todo!({what:?})")
        }
    }

    /// Whether the task's file is a CUDA source (`.cu` or `.cuh`) rather than Rust.
    pub fn is_cuda(&self) -> bool {
        self.file
            .extension()
            .is_some_and(|e| e == "cu" || e == "cuh")
    }

    pub fn test_refs(&self) -> Vec<TestRef> {
        self.tests
            .iter()
            .map(|t| {
                let (target, name) = t.split_once("::").expect("checked by load");
                TestRef {
                    target: target.to_string(),
                    name: name.to_string(),
                }
            })
            .collect()
    }
}

impl Chapter {
    /// The task numbered `k` (1-based).
    pub fn task(&self, k: u32) -> Result<&Task> {
        let n = self.tasks.len();
        k.checked_sub(1)
            .and_then(|i| self.tasks.get(i as usize))
            .with_context(|| format!("chapter {} has tasks 1 to {n}, not {k}", self.number))
    }
}

/// Every chapter with an `exercises.toml`, by number; the tables of one chapter's crates
/// joined in the order of their directory names.
pub fn load_all(root: &Path) -> Result<Vec<Chapter>> {
    let mut tables = Vec::new();
    for entry in std::fs::read_dir(root.join("chapters")).context("reading chapters/")? {
        let dir = entry?.path();
        let table = dir.join("exercises.toml");
        if table.is_file() {
            tables.push(load(root, &dir, &table)?);
        }
    }
    tables.sort_by(|a, b| (a.0, &a.1.dir).cmp(&(b.0, &b.1.dir)));
    let mut chapters: Vec<Chapter> = Vec::new();
    for (number, krate, tasks) in tables {
        match chapters.last_mut() {
            Some(last) if last.number == number => {
                last.crates.push(krate);
                last.tasks.extend(tasks);
            }
            _ => chapters.push(Chapter {
                number,
                crates: vec![krate],
                tasks,
            }),
        }
    }
    for chapter in &chapters {
        check_numbering(chapter)?;
    }
    Ok(chapters)
}

/// Tasks numbered `N.1`, `N.2`, ... in order across the chapter's crates.
fn check_numbering(chapter: &Chapter) -> Result<()> {
    for (i, task) in chapter.tasks.iter().enumerate() {
        let expected = format!("{}.{}", chapter.number, i + 1);
        ensure!(
            task.id == expected,
            "{}/exercises.toml: task {} should be numbered {expected} (in order, from 1, \
             running on across a chapter's crates)",
            task.krate.dir.display(),
            task.id
        );
    }
    Ok(())
}

/// Chapter `n`'s table, or an error that lists the chapters that have exercises.
pub fn load_chapter(root: &Path, n: u32) -> Result<Chapter> {
    let all = load_all(root)?;
    let have: Vec<String> = all.iter().map(|c| c.number.to_string()).collect();
    all.into_iter().find(|c| c.number == n).with_context(|| {
        format!(
            "chapter {n} has no exercises (chapters with exercises: {})",
            have.join(", ")
        )
    })
}

/// One crate's table: its chapter number, the crate, and its tasks (each told its crate).
fn load(root: &Path, dir: &Path, table: &Path) -> Result<(u32, Crate, Vec<Task>)> {
    let package = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("chapter directory name")?
        .to_string();
    let number: u32 = package
        .strip_prefix("ch")
        .and_then(|rest| rest.get(..2))
        .and_then(|digits| digits.parse().ok())
        .with_context(|| format!("{package}: chapter directories are named chNN-..."))?;
    let text = std::fs::read_to_string(table)?;
    let file: File = toml::from_str(&text).with_context(|| format!("{}", table.display()))?;
    let krate = Crate {
        dir: dir.strip_prefix(root).unwrap_or(dir).to_path_buf(),
        package,
    };
    let mut tasks = file.task;
    for task in &mut tasks {
        ensure!(
            !task.tests.is_empty(),
            "{}: task {} names no test",
            table.display(),
            task.id
        );
        for test in &task.tests {
            if !matches!(test.split_once("::"), Some((t, n)) if !t.is_empty() && !n.is_empty()) {
                bail!(
                    "{}: task {}: test {test:?} is not `target::name`",
                    table.display(),
                    task.id
                );
            }
        }
        ensure!(
            !task.does.contains('"') && !task.does.contains('\n'),
            "{}: task {}: `does` is one line without double quotes",
            table.display(),
            task.id
        );
        task.krate = krate.clone();
    }
    Ok((number, krate, tasks))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// One `[[task]]` entry of an exercise table, with placeholder fields but `id`.
    pub(in crate::exercise) fn task(id: &str) -> String {
        format!(
            "[[task]]\nid = \"{id}\"\nname = \"n\"\nfile = \"src/lib.rs\"\nfunction = \"f\"\n\
             does = \"d\"\ntests = [\"lib::t\"]\n"
        )
    }

    /// A root with `chapters/{dir}/exercises.toml` holding `tables`.
    fn root(tables: &[(&str, String)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (dir, table) in tables {
            let dir = root.path().join("chapters").join(dir);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("exercises.toml"), table).unwrap();
        }
        root
    }

    #[test]
    fn a_chapters_crates_join_in_directory_order_and_number_on() {
        let root = root(&[
            ("ch08-zeta", task("8.2") + &task("8.3")),
            ("ch08-alpha", task("8.1")),
            ("ch01-one", task("1.1")),
        ]);
        let chapters = load_all(root.path()).unwrap();
        let numbers: Vec<u32> = chapters.iter().map(|c| c.number).collect();
        assert_eq!(numbers, [1, 8]);
        let eight = &chapters[1];
        let packages: Vec<&str> = eight.crates.iter().map(|c| c.package.as_str()).collect();
        assert_eq!(packages, ["ch08-alpha", "ch08-zeta"]);
        let tasks: Vec<(&str, &str)> = eight
            .tasks
            .iter()
            .map(|t| (t.id.as_str(), t.krate.package.as_str()))
            .collect();
        assert_eq!(
            tasks,
            [
                ("8.1", "ch08-alpha"),
                ("8.2", "ch08-zeta"),
                ("8.3", "ch08-zeta")
            ]
        );
        assert_eq!(
            eight.tasks[2].source(),
            PathBuf::from("chapters/ch08-zeta/src/lib.rs")
        );
    }

    /// A task's file may lie in another crate (`..`): resolved from its own crate's directory.
    #[test]
    fn a_file_outside_its_crate_resolves_from_that_crate() {
        let outside = task("8.1").replace("src/lib.rs", "../ch01-one/src/shard.rs");
        let root = root(&[("ch08-alpha", outside), ("ch01-one", task("1.1"))]);
        let chapters = load_all(root.path()).unwrap();
        assert_eq!(
            chapters[1].tasks[0].source(),
            PathBuf::from("chapters/ch01-one/src/shard.rs")
        );
    }

    #[test]
    fn numbering_that_restarts_in_a_second_crate_is_an_error() {
        let root = root(&[("ch08-alpha", task("8.1")), ("ch08-zeta", task("8.1"))]);
        let err = load_all(root.path()).unwrap_err().to_string();
        assert!(err.contains("should be numbered 8.2"), "{err}");
    }
}
