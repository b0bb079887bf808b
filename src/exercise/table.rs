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
//! `lib` for the crate's unit tests (then the name is the full path, `module::tests::name`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use serde::Deserialize;

/// One chapter's tasks, in the order a learner does them.
#[derive(Debug, Clone)]
pub struct Chapter {
    pub number: u32,
    /// The crate's directory relative to the repository root (`chapters/ch01-naive-attention`).
    pub dir: PathBuf,
    /// The crate's package name (its directory name).
    pub package: String,
    pub tasks: Vec<Task>,
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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    task: Vec<Task>,
}

impl Chapter {
    /// The file of `task` relative to the repository root, `..` resolved: a task's file may lie
    /// outside its crate (chapter 7's CUDA kernels are in `kernels/`).
    pub fn source(&self, task: &Task) -> PathBuf {
        let mut path = PathBuf::new();
        for part in self.dir.join(&task.file).components() {
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

/// Every chapter with an `exercises.toml`, by number.
pub fn load_all(root: &Path) -> Result<Vec<Chapter>> {
    let mut chapters = Vec::new();
    for entry in std::fs::read_dir(root.join("chapters")).context("reading chapters/")? {
        let dir = entry?.path();
        let table = dir.join("exercises.toml");
        if table.is_file() {
            chapters.push(load(root, &dir, &table)?);
        }
    }
    chapters.sort_by_key(|c| c.number);
    Ok(chapters)
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

fn load(root: &Path, dir: &Path, table: &Path) -> Result<Chapter> {
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
    for (i, task) in file.task.iter().enumerate() {
        let expected = format!("{number}.{}", i + 1);
        ensure!(
            task.id == expected,
            "{}: task {} should be numbered {expected} (in order, from 1)",
            table.display(),
            task.id
        );
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
    }
    Ok(Chapter {
        number,
        dir: dir.strip_prefix(root).unwrap_or(dir).to_path_buf(),
        package,
        tasks: file.task,
    })
}
