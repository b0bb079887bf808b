//! `kiln exercise verify`: the exercises are honest.
//!
//! 1. A copy with every task of every chapter stubbed (`todo!`) compiles, tests included.
//! 2. In a copy whose bodies switch between the reference and the `todo!` at run time
//!    ([`Stub::Switch`]), built once, each task K of a chapter is played as a learner meets
//!    it: with tasks 1..K done (and every other chapter's), its tests pass; with tasks 1..K-1
//!    done, every one of them fails, and each failure is task K's own `todo!` panic, not
//!    another task's and not some unrelated error.
//!
//! The reference passing the same tests is the normal suite's job.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use super::stub::{DONE_VAR, Stub};
use super::table::{self, Chapter};
use super::{copy, run, stub, target_dir};

pub fn verify(root: &Path, only: &[u32], compile_check: bool) -> Result<()> {
    let all = table::load_all(root)?;
    for n in only {
        ensure!(
            all.iter().any(|c| c.number == *n),
            "chapter {n} has no exercises"
        );
    }
    let target = target_dir(root);
    let base = target.join("exercise-verify");
    let start = Instant::now();
    if compile_check {
        let dir = base.join("todo");
        prepare(root, &dir, &all, Stub::Todo)?;
        println!("== every task stubbed: cargo check --workspace --tests");
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&dir)
            .args(["check", "-q", "--workspace", "--tests", "--target-dir"])
            .arg(&target)
            .status()
            .context("running cargo check")?;
        ensure!(
            status.success(),
            "the learner copy with every task stubbed does not compile"
        );
        println!("   compiles ({:.0}s)", start.elapsed().as_secs_f64());
    }
    let dir = base.join("switch");
    prepare(root, &dir, &all, Stub::Switch)?;
    let config = run::light_profile(&all);
    let mut problems = Vec::new();
    for chapter in all
        .iter()
        .filter(|c| only.is_empty() || only.contains(&c.number))
    {
        println!("== chapter {}: each task played in order", chapter.number);
        let mut done: Vec<String> = all
            .iter()
            .filter(|c| c.number != chapter.number)
            .flat_map(|c| c.tasks.iter().map(|t| t.id.clone()))
            .collect();
        for task in &chapter.tasks {
            let refs = task.test_refs();
            let package = &task.krate.package;
            let play = |done: &[String]| {
                let env = [(DONE_VAR, done.join(","))];
                run::run_tests(&dir, &target, package, &refs, &env, &config)
            };
            let before = play(&done)?;
            done.push(task.id.clone());
            let after = play(&done)?;
            let mut bad = Vec::new();
            for t in &refs {
                let (b, a) = (&before[&t.name], &after[&t.name]);
                let labels = run::task_labels(&b.output);
                if b.passed {
                    bad.push(format!("{} passes without the body", t.name));
                } else if labels != [task.label()] {
                    bad.push(format!(
                        "{} fails without the body, but its panics name {labels:?}:\n      {}",
                        t.name,
                        run::summary(&b.output, 8)
                    ));
                }
                if !a.passed {
                    bad.push(format!(
                        "{} fails with the reference body:\n      {}",
                        t.name,
                        run::summary(&a.output, 8)
                    ));
                }
            }
            let verdict = if bad.is_empty() { "ok" } else { "FAIL" };
            println!(
                "   {verdict:<4} {} {}: {} tests fail with its todo!, pass with its body ({:.0}s)",
                task.label(),
                task.name,
                refs.len(),
                start.elapsed().as_secs_f64()
            );
            for b in &bad {
                println!("        {b}");
            }
            problems.extend(bad.into_iter().map(|b| format!("{}: {b}", task.label())));
        }
    }
    if !problems.is_empty() {
        bail!(
            "{} exercise check(s) failed:\n{}",
            problems.len(),
            problems.join("\n")
        );
    }
    println!("exercises honest ({:.0}s)", start.elapsed().as_secs_f64());
    Ok(())
}

/// Writes a copy of the reference at `dir` with every task of `chapters` stubbed as `stub`
/// (unchanged files are left alone, so a second run rebuilds nothing).
fn prepare(root: &Path, dir: &Path, chapters: &[Chapter], stub: Stub) -> Result<()> {
    let mut replaced: HashMap<PathBuf, String> = HashMap::new();
    for chapter in chapters {
        for task in &chapter.tasks {
            let rel = task.source();
            let text = match replaced.remove(&rel) {
                Some(text) => text,
                None => std::fs::read_to_string(root.join(&rel))
                    .with_context(|| format!("{}", rel.display()))?,
            };
            replaced.insert(rel, stub::stub(&text, task, stub)?);
        }
    }
    let tag = match stub {
        Stub::Todo => "todo",
        Stub::Switch => "switch",
    };
    copy::sync(root, dir, tag, true, &replaced)?;
    Ok(())
}
