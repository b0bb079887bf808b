//! `kiln exercise`: the learner's path. Each chapter names its tasks in `exercises.toml`;
//! `new N` makes a copy of the repository under `learner/` in which chapter N's task bodies are
//! `todo!("Task N.k: ...")`; `check N [k]` runs the tasks' tests against that copy; `verify`
//! (CI) proves every task's tests fail without its body and pass with it; `boxes` writes the
//! book's task boxes from the same tables.

mod boxes;
mod copy;
mod deps;
mod run;
mod stub;
mod table;
mod verify;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Subcommand;

use stub::Stub;
use table::Chapter;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Action,
}

#[derive(Subcommand)]
enum Action {
    /// Make (or update) the learner copy `learner/` with chapter N's task bodies as `todo!`.
    /// Bodies you have already changed there are kept.
    New {
        chapter: u32,
        /// Put the `todo!` back in task K (or every task of the chapter with `--reset 0`),
        /// throwing away what you wrote there.
        #[arg(long, value_name = "K")]
        reset: Option<u32>,
    },
    /// Run the tests of chapter N's tasks (or of task K only) against the learner copy.
    Check { chapter: u32, task: Option<u32> },
    /// CI: every copy compiles with its bodies stubbed; without task K's body its tests fail,
    /// each with task K's own `todo!`; with tasks 1..=K done they pass.
    Verify {
        /// Only these chapters (default: every chapter with exercises).
        #[arg(long, value_delimiter = ',')]
        chapters: Vec<u32>,
        /// Skip the compile check of the copy with every task of every chapter stubbed.
        #[arg(long)]
        no_check: bool,
    },
    /// Write the book's task boxes (`book/src/chNN/tasks.md`) from the tables; with `--check`,
    /// fail if they or the pages' includes of them are out of date.
    Boxes {
        #[arg(long)]
        check: bool,
    },
}

/// The reference repository: where this binary was built from.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The reference's build directory, which the copies share (their own crates build apart, as
/// packages at another path; the dependencies are not built again).
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
}

fn learner_dir(root: &Path) -> PathBuf {
    root.join("learner")
}

pub fn run(args: Args) -> Result<()> {
    let root = root();
    match args.command {
        Action::New { chapter, reset } => new(&root, chapter, reset),
        Action::Check { chapter, task } => check(&root, chapter, task),
        Action::Verify { chapters, no_check } => verify::verify(&root, &chapters, !no_check),
        Action::Boxes { check } => boxes::boxes(&root, check),
    }
}

/// `kiln exercise new N`.
fn new(root: &Path, n: u32, reset: Option<u32>) -> Result<()> {
    let chapter = table::load_chapter(root, n)?;
    if let Some(r) = reset
        && r as usize > chapter.tasks.len()
    {
        bail!(
            "--reset {r}: chapter {n} has tasks 1 to {} (0 resets them all)",
            chapter.tasks.len()
        );
    }
    let learner = learner_dir(root);
    let fresh = !learner.exists();
    let added = copy::sync(root, &learner, "learner", false, &Default::default())?;
    let mut copied = copy::Copied::load(&learner);
    copied.record(&learner, &added)?;
    if fresh {
        println!("made the learner copy {}", learner.display());
    } else if !added.is_empty() {
        println!(
            "{} new files from the reference copied into learner/",
            added.len()
        );
    }
    for (k, task) in (1..).zip(&chapter.tasks) {
        let rel = task.source();
        let reference = std::fs::read_to_string(root.join(&rel))?;
        let forced = matches!(reset, Some(r) if r == 0 || r == k);
        let state = hand_out(&learner, &mut copied, &reference, task, forced)?;
        println!(
            "  {} {:<24} {}: {}",
            task.label(),
            task.name,
            rel.display(),
            state
        );
    }
    println!(
        "\nwrite the bodies in learner/, then `just check {n}` (or `just check {n} K` for task K)"
    );
    Ok(())
}

/// Makes `task`'s body in the learner copy a `todo!` unless the learner has written it, and
/// says which. `reference`: the task's file in the reference. The body is blanked when
/// `forced` (`--reset`), when kiln wrote the whole file as it is now (the reference's body as
/// copied, or as kiln blanked it before the reference moved on), or when it is the reference's
/// body in a task kiln never handed out (the learner touched the file elsewhere). Once handed
/// out, a body other than the `todo!` is the learner's, even one equal to the reference's (the
/// book's listing pasted in): kept.
fn hand_out(
    learner: &Path,
    copied: &mut copy::Copied,
    reference: &str,
    task: &table::Task,
    forced: bool,
) -> Result<&'static str> {
    let rel = task.source();
    let path = learner.join(&rel);
    let mine = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    let stubbed = stub::stub_bodies(reference, task, Stub::Todo)?;
    let theirs = stub::bodies(&mine, task)?;
    let kilns = copied.untouched(&rel, &mine)
        || (!copied.handed_out(&task.id) && theirs == stub::bodies(reference, task)?);
    Ok(if theirs == stubbed {
        copied.hand_out(&task.id)?;
        "a todo!, yours to write"
    } else if forced || kilns {
        copy::write_if_changed(&path, &stub::replace_bodies(&mine, task, &stubbed)?)?;
        // Blanked by kiln, not written by the learner: still untouched.
        copied.record(learner, std::slice::from_ref(&rel))?;
        copied.hand_out(&task.id)?;
        "now a todo!"
    } else {
        "kept: your own code (--reset to start it again)"
    })
}

/// `kiln exercise check N [K]`.
fn check(root: &Path, n: u32, k: Option<u32>) -> Result<()> {
    let chapter = table::load_chapter(root, n)?;
    // The task number first: an error in the command line before one about the copy.
    let tasks: Vec<&table::Task> = match k {
        Some(k) => vec![chapter.task(k)?],
        None => chapter.tasks.iter().collect(),
    };
    let learner = learner_dir(root);
    if !learner.exists() {
        bail!("no learner copy yet: run `just exercise {n}` first");
    }
    // One `cargo test` per crate the tasks are in (chapter 8 spans two); each crate's results
    // apart, as two crates may have tests of the same name.
    let (target, mut results) = (target_dir(root), Results::new());
    let config = run::light_profile(&table::load_all(root)?);
    for krate in &chapter.crates {
        let tests: Vec<table::TestRef> = tasks
            .iter()
            .filter(|t| t.krate == *krate)
            .flat_map(|t| t.test_refs())
            .collect();
        if !tests.is_empty() {
            let ran = run::run_tests(&learner, &target, &krate.package, &tests, &[], &config)?;
            results.insert(krate.package.clone(), ran);
        }
    }
    report(&chapter, &tasks, &results)
}

/// Test results by crate (package name), then by test name.
type Results =
    std::collections::BTreeMap<String, std::collections::BTreeMap<String, run::TestResult>>;

/// Prints each task's tests, with the panic of each failure, and fails if one did.
fn report(chapter: &Chapter, tasks: &[&table::Task], results: &Results) -> Result<()> {
    let mut failed = 0;
    println!();
    for task in tasks {
        let results = &results[&task.krate.package];
        let refs = task.test_refs();
        let ok = refs.iter().filter(|t| results[&t.name].passed).count();
        let mark = if ok == refs.len() { "ok  " } else { "FAIL" };
        println!(
            "{mark} {} {} ({}): {ok} of {} tests pass",
            task.label(),
            task.name,
            task.function,
            refs.len()
        );
        for t in refs {
            let r = &results[&t.name];
            if !r.passed {
                failed += 1;
                println!(
                    "    ✗ {} ({}):\n      {}",
                    t.name,
                    t.target,
                    run::summary(&r.output, 12)
                );
            }
        }
    }
    if failed > 0 {
        bail!(
            "{failed} test(s) of chapter {} fail (the whole output is above)",
            chapter.number
        );
    }
    println!("\nchapter {}: every test checked passes", chapter.number);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str) -> table::Task {
        table::Task {
            id: id.into(),
            name: "add".into(),
            file: "src/a.rs".into(),
            function: "f".into(),
            does: "add one".into(),
            tests: vec!["lib::t".into()],
            krate: table::Crate {
                dir: "chapters/ch01-x".into(),
                package: "ch01-x".into(),
            },
        }
    }

    /// Tasks 1.1 and 1.2 in one file, as the reference holds it.
    const REFERENCE: &str = "fn f(x: u32) -> u32 {\n    // ANCHOR: task_1_1\n    x + 1\n    // ANCHOR_END: task_1_1\n}\n\nfn g() -> u32 {\n    // ANCHOR: task_1_2\n    2\n    // ANCHOR_END: task_1_2\n}\n";

    /// A learner copy of REFERENCE's file, recorded as kiln copied it.
    fn copy() -> (tempfile::TempDir, PathBuf) {
        let learner = tempfile::tempdir().unwrap();
        let rel = task("1.1").source();
        let path = learner.path().join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, REFERENCE).unwrap();
        copy::Copied::load(learner.path())
            .record(learner.path(), &[rel])
            .unwrap();
        (learner, path)
    }

    /// A body the learner wrote after kiln handed it out is kept on the next `new`, even when
    /// it is the reference's own (the book's listing pasted in); `--reset` still blanks it.
    #[test]
    fn a_finished_body_equal_to_the_reference_is_kept() {
        let (learner, path) = copy();
        let dir = learner.path();
        let t = task("1.1");
        let mut copied = copy::Copied::load(dir);
        assert_eq!(
            hand_out(dir, &mut copied, REFERENCE, &t, false).unwrap(),
            "now a todo!"
        );
        assert!(
            std::fs::read_to_string(&path)
                .unwrap()
                .contains("todo!(\"Task 1.1: add one\")")
        );
        // The learner pastes the reference's body back in; a later `new` runs.
        let pasted = REFERENCE;
        std::fs::write(&path, pasted).unwrap();
        let mut copied = copy::Copied::load(dir);
        assert_eq!(
            hand_out(dir, &mut copied, REFERENCE, &t, false).unwrap(),
            "kept: your own code (--reset to start it again)"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), pasted);
        assert_eq!(
            hand_out(dir, &mut copied, REFERENCE, &t, true).unwrap(),
            "now a todo!"
        );
    }

    /// A task kiln never handed out still holds the body kiln copied, though the learner has
    /// changed its file elsewhere (another task's body): it is blanked, the other body kept.
    #[test]
    fn a_task_never_handed_out_is_blanked_in_a_file_the_learner_changed() {
        let (learner, path) = copy();
        let dir = learner.path();
        let mut copied = copy::Copied::load(dir);
        hand_out(dir, &mut copied, REFERENCE, &task("1.1"), false).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let mine = text.replace("    todo!(\"Task 1.1: add one\");\n", "    1 + x\n");
        std::fs::write(&path, &mine).unwrap();
        let mut copied = copy::Copied::load(dir);
        assert_eq!(
            hand_out(dir, &mut copied, REFERENCE, &task("1.2"), false).unwrap(),
            "now a todo!"
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains("    1 + x\n"), "{text}");
        assert!(text.contains("todo!(\"Task 1.2: add one\")"), "{text}");
    }
}
