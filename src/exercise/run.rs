//! Running a chapter's task tests in a copy with `cargo test`, and reading the results.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use super::table::{Chapter, TestRef};

/// What one test did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestResult {
    pub passed: bool,
    /// Its captured output when it failed (the panic messages).
    pub output: String,
}

/// The workspace's root package, the `kiln` binary.
const ROOT_PACKAGE: &str = env!("CARGO_PKG_NAME");

/// Runs `tests` of the crate `package` in the workspace at `copy`, building into `target_dir`
/// (the reference's, so the dependencies are not built again), with `env` set. Every test must
/// have run: a name that matched nothing is an error, not a pass. `config` are cargo's
/// `--config` settings for the run (see [`light_profile`]).
pub fn run_tests(
    copy: &Path,
    target_dir: &Path,
    package: &str,
    tests: &[TestRef],
    env: &[(&str, String)],
    config: &[String],
) -> Result<BTreeMap<String, TestResult>> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(copy)
        .arg("test")
        // The README's test profile: the dependencies are the release build's.
        .arg("--release")
        .args(config.iter().flat_map(|setting| ["--config", setting]))
        .arg("--no-fail-fast")
        .arg("--target-dir")
        .arg(target_dir)
        // The root package beside the chapter's: it depends on every chapter, so cargo resolves
        // the dependencies' features (and the chapter's own, e.g. ch07's `cuda`) nearly as for
        // the whole workspace, and reuses the README's build of them; `-p` alone rebuilt the
        // dozens whose features the chapter leaves off. (Other chapters' dev-dependencies still
        // count only in a `--workspace` build.) The root has no library and no test target named
        // as a chapter's, so it adds nothing to build or run: keep its test names apart.
        .args(["-p", ROOT_PACKAGE, "-p", package]);
    let mut targets: Vec<&str> = tests.iter().map(|t| t.target.as_str()).collect();
    targets.sort_unstable();
    targets.dedup();
    for target in targets {
        match target {
            "lib" => cmd.arg("--lib"),
            test => cmd.args(["--test", test]),
        };
    }
    cmd.args(["--", "--exact"]);
    cmd.args(tests.iter().map(|t| &t.name));
    // One line per panic: a backtrace would bury the message.
    cmd.env("RUST_BACKTRACE", "0");
    // A task's test must run: the CUDA ones (run on CPU threads, built with g++) may not skip.
    cmd.env("KILN_REQUIRE_GXX", "1");
    for (key, value) in env {
        cmd.env(key, value);
    }
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut results = parse(&stdout);
    borrow_worker_panics(&stdout, &mut results);
    let missing: Vec<&str> = tests
        .iter()
        .map(|t| t.name.as_str())
        .filter(|name| !results.contains_key(*name))
        .collect();
    if !missing.is_empty() {
        if !out.status.success() && results.is_empty() {
            bail!("cargo test failed before running any test (see above)\n{stdout}");
        }
        if !out.status.success() {
            // Some tests reported and these did not: their binary stopped under them.
            bail!(
                "{} did not report (its test binary crashed: a stack overflow, an abort, a \
                 signal; see above), or no test of {} has that name\n{stdout}",
                missing.join(", "),
                package
            );
        }
        bail!(
            "no test of {} is named {} (names are exact; unit tests need their module path)",
            package,
            missing.join(", ")
        );
    }
    Ok(results)
}

/// `--config` settings that compile the chapter crates of `chapters` at opt-level 1 in the
/// release profile, and nothing else differently. A copy's chapter crates are compiled anew
/// (their sources differ from the reference's) and opt-level 1 compiles them in about half the
/// time, while whether a task's tests pass does not depend on how hard the compiler optimised.
/// Their dependencies keep the reference's release settings, so cargo reuses its build of
/// them. (Lowering the profile's own opt-level and setting the dependencies' `"*"` back to 3
/// would not do: `"*"` outranks the build-override that builds proc macros and build scripts at
/// opt-level 0, so they, and everything that uses them, would be built again.)
pub fn light_profile(chapters: &[Chapter]) -> Vec<String> {
    let mut packages: Vec<&str> = (chapters.iter())
        .flat_map(|c| c.crates.iter().map(|k| k.package.as_str()))
        .collect();
    packages.sort_unstable();
    packages.dedup();
    (packages.iter())
        .map(|package| format!("profile.release.package.{package}.opt-level=1"))
        .collect()
}

/// Reads libtest's plain output: `test NAME ... ok|FAILED` lines, then one `---- NAME stdout
/// ----` section per failure.
pub fn parse(stdout: &str) -> BTreeMap<String, TestResult> {
    let mut results = BTreeMap::new();
    let mut section: Option<(String, Vec<&str>)> = None;
    let finish = |section: &mut Option<(String, Vec<&str>)>,
                  results: &mut BTreeMap<String, TestResult>| {
        if let Some((name, lines)) = section.take()
            && let Some(r) = results.get_mut(&name)
        {
            r.output = lines.join("\n");
        }
    };
    for line in stdout.lines() {
        if let Some(rest) = line.strip_prefix("---- ")
            && let Some(name) = rest.strip_suffix(" stdout ----")
        {
            finish(&mut section, &mut results);
            section = Some((name.to_string(), Vec::new()));
            continue;
        }
        if line == "failures:" || line.starts_with("test result:") {
            finish(&mut section, &mut results);
            continue;
        }
        if let Some((_, lines)) = &mut section {
            lines.push(line);
            continue;
        }
        if let Some(rest) = line.strip_prefix("test ")
            && let Some((name, status)) = rest.rsplit_once(" ... ")
        {
            let passed = match status {
                "ok" => true,
                "FAILED" => false,
                _ => continue, // ignored
            };
            results.insert(
                name.to_string(),
                TestResult {
                    passed,
                    output: String::new(),
                },
            );
        }
    }
    finish(&mut section, &mut results);
    results
}

/// A panic on a rayon worker reaches the test as a bare unwind: its message went to the output
/// of the test that happened to start the thread pool (threads inherit the capture of the
/// thread that spawned them), or nowhere. A failure whose own output names no task gets the
/// run's task panics appended, marked as such, so that it still says which `todo!` it hit.
fn borrow_worker_panics(stdout: &str, results: &mut BTreeMap<String, TestResult>) {
    let mut seen = std::collections::HashSet::new();
    let panics: Vec<&str> = stdout
        .lines()
        .filter(|l| !task_labels(l).is_empty() && seen.insert(l.trim()))
        .collect();
    if panics.is_empty() {
        return;
    }
    for r in results.values_mut() {
        if !r.passed && task_labels(&r.output).is_empty() {
            r.output.push_str(
                "\n(its panic came from another thread; the panics of this run's tests:)\n",
            );
            r.output.push_str(&panics.join("\n"));
        }
    }
}

/// The task labels (`Task 1.2`) that a failure's output names in its panic messages.
pub fn task_labels(output: &str) -> Vec<String> {
    let mut labels: Vec<String> = output
        .match_indices("Task ")
        .filter_map(|(i, _)| {
            let rest = &output[i + 5..];
            let id: String = rest
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            (id.contains('.') && rest[id.len()..].starts_with(':')).then(|| format!("Task {id}"))
        })
        .collect();
    labels.sort();
    labels.dedup();
    labels
}

/// A failure's output for a reader: its distinct lines, at most `max` of them.
pub fn summary(output: &str, max: usize) -> String {
    let mut seen = std::collections::HashSet::new();
    let lines: Vec<&str> = output
        .lines()
        .filter(|l| !l.trim().is_empty() && seen.insert(*l))
        .collect();
    let mut text = lines[..lines.len().min(max)].join("\n      ");
    if lines.len() > max {
        text += &format!("\n      ... ({} more lines)", lines.len() - max);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const OUTPUT: &str = "\nrunning 2 tests\ntest a ... ok\ntest m::b ... FAILED\n\nfailures:\n\n---- m::b stdout ----\nthread 'm::b' panicked at src/x.rs:3:5:\nnot yet implemented: Task 1.2: do it\n\nfailures:\n    m::b\n\ntest result: FAILED. 1 passed; 1 failed\n";

    #[test]
    fn libtest_output_gives_each_test_and_its_failure() {
        let results = parse(OUTPUT);
        assert_eq!(results.len(), 2);
        assert!(results["a"].passed);
        assert!(!results["m::b"].passed);
        assert!(results["m::b"].output.contains("Task 1.2: do it"));
        assert_eq!(task_labels(&results["m::b"].output), ["Task 1.2"]);
    }

    #[test]
    fn a_failure_without_its_own_panic_borrows_the_runs() {
        let stdout = "test a ... FAILED\ntest b ... FAILED\n\nfailures:\n\n---- a stdout ----\nthread '<unnamed>' panicked at src/x.rs:3:5:\nnot yet implemented: Task 7.3: tile it\n\n---- b stdout ----\n\nfailures:\n    a\n    b\n\ntest result: FAILED. 0 passed; 2 failed\n";
        let mut results = parse(stdout);
        borrow_worker_panics(stdout, &mut results);
        assert_eq!(task_labels(&results["a"].output), ["Task 7.3"]);
        assert!(!results["a"].output.contains("another thread"));
        assert_eq!(task_labels(&results["b"].output), ["Task 7.3"]);
        assert!(results["b"].output.contains("another thread"));
    }

    #[test]
    fn labels_need_a_number_and_a_colon() {
        assert_eq!(
            task_labels("Task 3.1: x; Task 2.10: y; Task 4 z; Task 3.1: again"),
            ["Task 2.10", "Task 3.1"]
        );
    }
}
