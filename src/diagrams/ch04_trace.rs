//! Chapter 4's worked trace as a Gantt chart (`book/src/ch04/trace.svg`): one lane per request,
//! one column per engine step, each cell what the request ran in that step (a prefill chunk,
//! the prefill that sampled, a decode, a recomputation after preemption), preemptions marked,
//! and a strip of the KV cache's use under the lanes. It is drawn from the `--trace` lines of
//! the chapter's demo, run here through this same binary; `--check` (CI) runs it again and
//! fails if the committed figure, or the step lines of the chapter's printed trace, differ.

use std::fmt::Write;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// The demo of `just chapter 4`: six prompts, 16 tokens a step, a KV cache of 9 blocks.
const DEMO: &[&str] = &[
    "generate",
    "--prompts-file",
    "fixtures/prompts/demo.txt",
    "--max-tokens",
    "24",
    "--temperature",
    "0",
    "--max-num-batched-tokens",
    "16",
    "--kv-cache-memory",
    "432KiB",
    "--trace",
];

/// Draws the figure (or, with `check`, compares it and the page's printed trace with this run);
/// returns what is out of date.
pub fn run(root: &Path, check: bool) -> Result<Vec<String>> {
    let lines = demo_trace(root)?;
    let steps: Vec<Step> = lines.iter().map(|l| parse_step(l)).collect::<Result<_>>()?;
    let svg = crate::bench::describe_svg(&gantt(&steps), super::COMMAND);
    let figure = root.join("book/src/ch04/trace.svg");
    let page = root.join("book/src/ch04/scheduler.md");
    let printed = printed_steps(&std::fs::read_to_string(&page)?);
    let mut stale = Vec::new();
    if check {
        if std::fs::read_to_string(&figure).ok().as_deref() != Some(svg.as_str()) {
            stale.push(format!(
                "{} is out of date: run `kiln diagrams`",
                figure.display()
            ));
        }
        if printed != lines {
            stale.push(format!(
                "the worked trace in {} is not what the demo prints now ({} step lines there, {} now)",
                page.display(),
                printed.len(),
                lines.len()
            ));
        }
        if stale.is_empty() {
            println!(
                "chapter 4's trace figure is up to date ({} steps)",
                steps.len()
            );
        }
    } else {
        std::fs::write(&figure, &svg).with_context(|| format!("writing {}", figure.display()))?;
        println!("wrote {} ({} steps)", figure.display(), steps.len());
        if printed != lines {
            println!(
                "note: the worked trace printed in {} differs from this run's; paste the new one",
                page.display()
            );
        }
    }
    Ok(stale)
}

/// The `step N: ...` lines the demo writes on stderr.
fn demo_trace(root: &Path) -> Result<Vec<String>> {
    let exe = std::env::current_exe().context("this binary's path")?;
    let out = Command::new(exe)
        .current_dir(root)
        .args(DEMO)
        .output()
        .context("running the chapter 4 demo")?;
    ensure!(
        out.status.success(),
        "the chapter 4 demo failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<String> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(str::to_string)
        .collect();
    ensure!(!lines.is_empty(), "the demo printed no trace");
    Ok(lines)
}

/// The step lines of the page's worked trace.
fn printed_steps(page: &str) -> Vec<String> {
    let Some(at) = page.find("## A worked trace") else {
        return Vec::new();
    };
    page[at..]
        .lines()
        .skip_while(|l| !l.starts_with("```text"))
        .skip(1)
        .take_while(|l| !l.starts_with("```"))
        .filter(|l| l.starts_with("step "))
        .map(str::to_string)
        .collect()
}

/// What a request ran in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// A prompt chunk that did not reach the prompt's end (no token sampled).
    Chunk,
    /// The rest of the prompt, and the first token sampled.
    Prefill,
    Decode,
    /// A preempted request's tokens computed again (a chunk, or the last of them).
    Recompute,
}

#[derive(Debug, Clone, PartialEq)]
struct Step {
    runs: Vec<(usize, Run, usize)>,
    preempted: Vec<usize>,
    /// The KV cache's use, 0..=100 (%).
    kv: u32,
}

/// One trace line: `step 3: run [0] prefill 16 (chunk), [1] decode 1 | admitted [1] |
/// preempted [2] | KV 94%, 1 waiting`.
fn parse_step(line: &str) -> Result<Step> {
    let bad = || format!("an unexpected trace line: {line}");
    let rest = line.split_once(": run ").with_context(bad)?.1;
    let mut step = Step {
        runs: Vec::new(),
        preempted: Vec::new(),
        kv: 0,
    };
    for (i, part) in rest.split(" | ").enumerate() {
        if i == 0 {
            for run in part.split(", ").filter(|r| !r.is_empty()) {
                let (id, what) = run
                    .strip_prefix('[')
                    .and_then(|r| r.split_once("] "))
                    .with_context(bad)?;
                let id: usize = id.parse().with_context(bad)?;
                let mut words = what.split(' ');
                let kind = words.next().with_context(bad)?;
                let n: usize = words
                    .next()
                    .and_then(|n| n.split('+').next())
                    .and_then(|n| n.parse().ok())
                    .with_context(bad)?;
                let chunk = what.ends_with("(chunk)");
                let run = match (kind, chunk) {
                    ("decode", _) => Run::Decode,
                    ("prefill", true) => Run::Chunk,
                    ("prefill", false) => Run::Prefill,
                    ("recompute", _) => Run::Recompute,
                    _ => bail!("{}", bad()),
                };
                step.runs.push((id, run, n));
            }
        } else if let Some(ids) = part.strip_prefix("preempted ") {
            for id in ids.split(' ') {
                let id = id.trim_start_matches('[').trim_end_matches(']');
                step.preempted.push(id.parse().with_context(bad)?);
            }
        } else if let Some(kv) = part.strip_prefix("KV ") {
            let pct = kv.split('%').next().with_context(bad)?;
            step.kv = pct.parse().with_context(bad)?;
        }
    }
    Ok(step)
}

const CELL: usize = 14; // px per step
const LANE: usize = 18; // px per request
const LEFT: usize = 44;
const TOP: usize = 28;
const STRIP: usize = 40; // the KV strip's height

fn colour(run: Run) -> &'static str {
    match run {
        Run::Chunk => "#f6c28b",
        Run::Prefill => "#e8702a",
        Run::Decode => "#4a7fb5",
        Run::Recompute => "#9b59b6",
    }
}

/// The Gantt chart as an SVG document (deterministic: the same steps, the same bytes).
fn gantt(steps: &[Step]) -> String {
    let requests = steps
        .iter()
        .flat_map(|s| {
            s.runs
                .iter()
                .map(|r| r.0)
                .chain(s.preempted.iter().copied())
        })
        .max()
        .map_or(0, |m| m + 1);
    let width = LEFT + steps.len() * CELL + 110;
    let lanes_bottom = TOP + requests * LANE;
    let strip_top = lanes_bottom + 22;
    let legend_y = strip_top + STRIP + 34;
    let height = legend_y + 20;
    let mut svg = String::new();
    writeln!(
        svg,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"##
    )
    .unwrap();
    writeln!(
        svg,
        r##"<rect width="{width}" height="{height}" fill="white"/>"##
    )
    .unwrap();
    writeln!(
        svg,
        r##"<text x="{LEFT}" y="16" font-size="12">chapter 4's demo, step by step (kiln diagrams, from kiln generate --trace)</text>"##
    )
    .unwrap();
    // Lanes: one per request; a preempted request is shaded until it runs again.
    for r in 0..requests {
        let y = TOP + r * LANE;
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="end">[{r}]</text>"##,
            LEFT - 6,
            y + LANE / 2 + 4
        )
        .unwrap();
        let mut out = false;
        for (s, step) in steps.iter().enumerate() {
            let x = LEFT + s * CELL;
            let ran = step.runs.iter().find(|run| run.0 == r);
            if ran.is_some() {
                out = false;
            }
            if let Some(&(_, run, n)) = ran {
                writeln!(
                    svg,
                    r##"<rect x="{x}" y="{}" width="{}" height="{}" fill="{}"><title>step {}: [{r}] {run:?} {n}</title></rect>"##,
                    y + 2,
                    CELL - 1,
                    LANE - 4,
                    colour(run),
                    s + 1
                )
                .unwrap();
            } else if out {
                writeln!(
                    svg,
                    r##"<rect x="{x}" y="{}" width="{}" height="{}" fill="#f2d7d5"/>"##,
                    y + 2,
                    CELL - 1,
                    LANE - 4
                )
                .unwrap();
            }
            if step.preempted.contains(&r) {
                out = true;
                let (cx, cy) = (x + CELL / 2, y + LANE / 2);
                writeln!(
                    svg,
                    r##"<path d="M{} {} L{} {} M{} {} L{} {}" stroke="#c0392b" stroke-width="2"><title>step {}: [{r}] preempted</title></path>"##,
                    cx - 4,
                    cy - 4,
                    cx + 4,
                    cy + 4,
                    cx - 4,
                    cy + 4,
                    cx + 4,
                    cy - 4,
                    s + 1
                )
                .unwrap();
            }
        }
    }
    // Step numbers every 5 steps.
    writeln!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="end" fill="#555">step</text>"##,
        LEFT - 6,
        lanes_bottom + 13
    )
    .unwrap();
    for s in (0..steps.len()).filter(|s| (s + 1) % 5 == 0 || *s == 0) {
        writeln!(
            svg,
            r##"<text x="{}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
            LEFT + s * CELL + CELL / 2,
            lanes_bottom + 13,
            s + 1
        )
        .unwrap();
    }
    // The KV strip: the share of blocks in use after each step.
    writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{strip_top}" width="{}" height="{STRIP}" fill="none" stroke="#999"/>"##,
        steps.len() * CELL
    )
    .unwrap();
    writeln!(
        svg,
        r##"<text x="{}" y="{}" text-anchor="end">KV</text>"##,
        LEFT - 6,
        strip_top + STRIP / 2 + 4
    )
    .unwrap();
    for (s, step) in steps.iter().enumerate() {
        let h = step.kv as usize * STRIP / 100;
        writeln!(
            svg,
            r##"<rect x="{}" y="{}" width="{}" height="{h}" fill="#7f8c8d"><title>step {}: KV {}%</title></rect>"##,
            LEFT + s * CELL,
            strip_top + STRIP - h,
            CELL - 1,
            s + 1,
            step.kv
        )
        .unwrap();
    }
    writeln!(
        svg,
        r##"<text x="{}" y="{}" fill="#555">100% of the blocks</text>"##,
        LEFT + steps.len() * CELL + 4,
        strip_top + 9
    )
    .unwrap();
    // Legend.
    let mut x = LEFT;
    let items = [
        (colour(Run::Chunk), "prefill chunk"),
        (colour(Run::Prefill), "prefill, first token"),
        (colour(Run::Decode), "decode"),
        (colour(Run::Recompute), "recompute"),
        ("#f2d7d5", "preempted, waiting"),
    ];
    for (fill, label) in items {
        writeln!(
            svg,
            r##"<rect x="{x}" y="{}" width="12" height="12" fill="{fill}"/><text x="{}" y="{}">{label}</text>"##,
            legend_y - 10,
            x + 16,
            legend_y
        )
        .unwrap();
        x += 24 + 7 * label.len();
    }
    writeln!(
        svg,
        r##"<path d="M{} {} L{} {} M{} {} L{} {}" stroke="#c0392b" stroke-width="2"/><text x="{}" y="{legend_y}">preempted</text>"##,
        x + 2,
        legend_y - 10,
        x + 10,
        legend_y - 2,
        x + 2,
        legend_y - 2,
        x + 10,
        legend_y - 10,
        x + 16
    )
    .unwrap();
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_lines_parse_into_runs_preemptions_and_kv() {
        let step = parse_step(
            "step 12: run [0] decode 1, [1] prefill 8, [3] prefill 2 (chunk), [4] recompute 9 (chunk) | admitted [2] [3] | preempted [5] | KV 67%, 2 waiting",
        )
        .unwrap();
        assert_eq!(
            step.runs,
            [
                (0, Run::Decode, 1),
                (1, Run::Prefill, 8),
                (3, Run::Chunk, 2),
                (4, Run::Recompute, 9)
            ]
        );
        assert_eq!(step.preempted, [5]);
        assert_eq!(step.kv, 67);
        let spec = parse_step("step 2: run [0] decode 1+4 drafts (2 accepted) | KV 10%").unwrap();
        assert_eq!(spec.runs, [(0, Run::Decode, 1)]);
        assert!(parse_step("step 3 nothing").is_err());
    }

    #[test]
    fn the_page_trace_is_read_between_its_fences() {
        let page = "x\n### A worked trace\n\ntext\n\n```text\nstep 1: run [0] decode 1 | KV 1%\nrequests: 1\n```\nstep 9: outside\n";
        assert_eq!(printed_steps(page), ["step 1: run [0] decode 1 | KV 1%"]);
    }
}
