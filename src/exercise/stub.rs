//! Task bodies in the source: finding them by their markers and replacing them.
//!
//! A task's body sits between two comment lines inside its function:
//!
//! ```text
//! pub fn softmax_in_place(row: &mut [f32]) {
//!     // ANCHOR: task_1_1
//!     ... the reference body ...
//!     // ANCHOR_END: task_1_1
//! }
//! ```
//!
//! They are mdBook anchors, so the book's `{{#include}}` of the surrounding code drops them. A
//! task may have several such regions (chapter 3's `fork` and `free`), in one file.

use anyhow::{Result, ensure};

use super::table::Task;

/// What replaces a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stub {
    /// The learner's starting point: `todo!("Task N.k: ...")`.
    Todo,
    /// CI's: the reference body when the task's id is in the comma-separated environment
    /// variable [`DONE_VAR`], else the same `todo!`, so that one build can play a learner at
    /// any point of a chapter.
    Switch,
}

/// The environment variable of [`Stub::Switch`]: the ids of the tasks to treat as done.
pub const DONE_VAR: &str = "KILN_EXERCISE_DONE";

/// One marked region: the marker lines' indices (the body lies strictly between them).
#[derive(Debug, Clone, Copy)]
struct Region {
    begin: usize,
    end: usize,
}

fn regions(lines: &[&str], task: &Task) -> Result<Vec<Region>> {
    let (open, close) = (
        format!("// ANCHOR: {}", task.anchor()),
        format!("// ANCHOR_END: {}", task.anchor()),
    );
    let mut found = Vec::new();
    let mut begin = None;
    for (i, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line == open {
            ensure!(
                begin.is_none(),
                "{}: nested `{open}` at line {}",
                task.id,
                i + 1
            );
            begin = Some(i);
        } else if line == close {
            let Some(b) = begin.take() else {
                anyhow::bail!(
                    "{}: `{close}` without its opening at line {}",
                    task.id,
                    i + 1
                );
            };
            found.push(Region { begin: b, end: i });
        }
    }
    ensure!(begin.is_none(), "{}: `{open}` is never closed", task.id);
    ensure!(
        !found.is_empty(),
        "{}: no `{open}` marker in {}",
        task.id,
        task.file.display()
    );
    Ok(found)
}

fn indent(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

/// The bodies of `task`'s regions in `text`, one string per region.
pub fn bodies(text: &str, task: &Task) -> Result<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    Ok(regions(&lines, task)?
        .into_iter()
        .map(|r| lines[r.begin + 1..r.end].join("\n"))
        .collect())
}

/// `text` with every region of `task` holding `new_bodies` (one per region, in order).
pub fn replace_bodies(text: &str, task: &Task, new_bodies: &[String]) -> Result<String> {
    let lines: Vec<&str> = text.lines().collect();
    let found = regions(&lines, task)?;
    ensure!(
        found.len() == new_bodies.len(),
        "{}: region count changed",
        task.id
    );
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut next = 0;
    for (region, body) in found.iter().zip(new_bodies) {
        out.extend(lines[next..=region.begin].iter().map(|l| l.to_string()));
        if !body.is_empty() {
            out.push(body.clone());
        }
        next = region.end;
    }
    out.extend(lines[next..].iter().map(|l| l.to_string()));
    let mut joined = out.join("\n");
    if text.ends_with('\n') {
        joined.push('\n');
    }
    Ok(joined)
}

/// The stubbed bodies of `task`'s regions in `text` (the reference).
pub fn stub_bodies(text: &str, task: &Task, stub: Stub) -> Result<Vec<String>> {
    let lines: Vec<&str> = text.lines().collect();
    Ok(regions(&lines, task)?
        .into_iter()
        .map(|r| {
            let pad = indent(lines[r.begin]);
            // A statement, so that code after a region that is not a whole body still parses.
            let todo = format!("{pad}{};", task.todo());
            let body = lines[r.begin + 1..r.end].join("\n");
            match stub {
                Stub::Todo => todo,
                // `kiln_task_done` reads DONE_VAR where a CUDA kernel runs on CPU threads
                // (kernels/emulation), and is true on a GPU.
                Stub::Switch if task.is_cuda() => format!(
                    "{pad}if (kiln_task_done({:?})) {{\n{body}\n{pad}}} else {{\n    {todo}\n{pad}}}",
                    task.id
                ),
                Stub::Switch => format!(
                    "{pad}if ::std::env::var({DONE_VAR:?}).is_ok_and(|done| done.split(',').any(|t| t == {:?})) {{\n{body}\n{pad}}} else {{\n    {todo}\n{pad}}}",
                    task.id
                ),
            }
        })
        .collect())
}

/// `text` with every region of `task` stubbed.
pub fn stub(text: &str, task: &Task, stub: Stub) -> Result<String> {
    replace_bodies(text, task, &stub_bodies(text, task, stub)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task() -> Task {
        Task {
            id: "1.1".into(),
            name: "softmax".into(),
            file: "src/attention.rs".into(),
            function: "softmax_in_place".into(),
            does: "normalise the row".into(),
            tests: vec!["properties::softmax".into()],
            krate: Default::default(),
        }
    }

    const SOURCE: &str = "fn f(x: u32) -> u32 {\n    // ANCHOR: task_1_1\n    let y = x + 1;\n    y * 2\n    // ANCHOR_END: task_1_1\n}\n";

    #[test]
    fn a_todo_stub_replaces_the_body_and_keeps_the_markers() {
        let stubbed = stub(SOURCE, &task(), Stub::Todo).unwrap();
        assert_eq!(
            stubbed,
            "fn f(x: u32) -> u32 {\n    // ANCHOR: task_1_1\n    todo!(\"Task 1.1: normalise the row\");\n    // ANCHOR_END: task_1_1\n}\n"
        );
        // The learner's body goes back in the same place.
        let restored = replace_bodies(&stubbed, &task(), &bodies(SOURCE, &task()).unwrap());
        assert_eq!(restored.unwrap(), SOURCE);
    }

    #[test]
    fn a_switch_stub_keeps_the_reference_behind_the_done_variable() {
        let stubbed = stub(SOURCE, &task(), Stub::Switch).unwrap();
        assert!(stubbed.contains("t == \"1.1\""), "{stubbed}");
        assert!(
            stubbed.contains("    let y = x + 1;\n    y * 2\n    } else {"),
            "{stubbed}"
        );
        assert!(
            stubbed.contains("todo!(\"Task 1.1: normalise the row\");"),
            "{stubbed}"
        );
    }

    #[test]
    fn a_cuda_task_stubs_with_kiln_todo() {
        let task = Task {
            file: "../../kernels/decode.cu".into(),
            ..task()
        };
        let source = "__device__ void f() {\n    // ANCHOR: task_1_1\n    int y = 1;\n    // ANCHOR_END: task_1_1\n}\n";
        let stubbed = stub(source, &task, Stub::Todo).unwrap();
        assert!(
            stubbed.contains("    KILN_TODO(\"Task 1.1: normalise the row\");\n"),
            "{stubbed}"
        );
        let switch = stub(source, &task, Stub::Switch).unwrap();
        assert!(
            switch.contains("    if (kiln_task_done(\"1.1\")) {\n    int y = 1;\n    } else {"),
            "{switch}"
        );
    }

    #[test]
    fn missing_or_unbalanced_markers_are_errors() {
        let none = stub("fn f() {}\n", &task(), Stub::Todo).unwrap_err();
        assert!(
            none.to_string().contains("no `// ANCHOR: task_1_1`"),
            "{none}"
        );
        let open = stub("// ANCHOR: task_1_1\n", &task(), Stub::Todo).unwrap_err();
        assert!(open.to_string().contains("never closed"), "{open}");
        let close = stub("// ANCHOR_END: task_1_1\n", &task(), Stub::Todo).unwrap_err();
        assert!(close.to_string().contains("without its opening"), "{close}");
    }
}
