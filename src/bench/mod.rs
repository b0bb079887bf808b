//! `kiln bench`: the benchmarks behind every speed claim in the book.
//!
//! Each chapter's benchmark lives beside its chapter, in `chapters/chNN-*/bench/` (a reader of
//! chapter 3 finds how chapter 3 was measured next to its code), and is compiled into this
//! binary, which only dispatches: a benchmark drives later chapters' machinery (llama.cpp
//! runs, the plots, anyhow) that no chapter crate should depend on. Each one prints a markdown
//! table to stdout and writes it, with an SVG plot, into the chapter's book folder
//! (`book/src/chNN/`), where the chapter page includes them. [`svg`], [`bars`] and [`table`]
//! are the shared writers.

pub mod alloc;
#[path = "../../chapters/ch01-naive-attention/bench/mod.rs"]
pub mod ch01;
#[path = "../../chapters/ch02-kv-cache/bench/mod.rs"]
pub mod ch02;
#[path = "../../chapters/ch03-paged-blocks/bench/mod.rs"]
pub mod ch03;
#[path = "../../chapters/ch04-continuous-batching/bench/mod.rs"]
pub mod ch04;
#[path = "../../chapters/ch05-quantization/bench/mod.rs"]
pub mod ch05;
#[path = "../../chapters/ch06-speculative-decoding/bench/mod.rs"]
pub mod ch06;
#[path = "../../chapters/ch07-flash-attention/bench/mod.rs"]
pub mod ch07;
#[path = "../../chapters/ch08-tensor-parallel/bench/mod.rs"]
pub mod ch08_tp;
#[path = "../../chapters/ch08-server/bench/serve/mod.rs"]
pub mod serve;
#[path = "../../chapters/ch08-server/bench/structured.rs"]
pub mod structured;

/// Where each `kiln bench` subcommand's source lives, relative to the repository root (the
/// `#[path]`s above; `kiln figures` looks there for the figures a command writes).
pub const SOURCES: &[(&str, &str)] = &[
    ("ch01", "chapters/ch01-naive-attention/bench"),
    ("ch02", "chapters/ch02-kv-cache/bench"),
    ("ch03", "chapters/ch03-paged-blocks/bench"),
    ("ch04", "chapters/ch04-continuous-batching/bench"),
    ("ch05", "chapters/ch05-quantization/bench"),
    ("ch06", "chapters/ch06-speculative-decoding/bench"),
    ("ch07", "chapters/ch07-flash-attention/bench"),
    ("ch08-tp", "chapters/ch08-tensor-parallel/bench"),
    ("structured", "chapters/ch08-server/bench/structured.rs"),
    ("serve", "chapters/ch08-server/bench/serve"),
];
// Shared by every chapter's benchmark; not all of their API is used by chapter 1.
#[allow(dead_code)]
pub mod bars;
#[allow(dead_code)]
pub mod svg;
#[allow(dead_code)]
pub mod table;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ::ch01::Llama;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    chapter: Chapter,
}

#[derive(clap::Subcommand, Debug)]
enum Chapter {
    /// Chapter 1: the cost of recomputing the whole sequence for every token.
    Ch01(ch01::Args),
    /// Chapter 2: cached decode vs recompute, kiln vs other engines, the roofline, KV waste.
    Ch02(ch02::Args),
    /// Chapter 3: KV memory contiguous vs paged, sharing, the cost of paging.
    Ch03(ch03::Args),
    /// Chapter 4: sequential vs static vs continuous batching, chunked prefill, max_num_seqs.
    Ch04(ch04::Args),
    /// Chapter 5: llama.cpp's block formats: speed and perplexity beside llama.cpp, batching.
    Ch05(ch05::Args),
    /// Chapter 6: speculative decoding: acceptance per drafter, tokens per step, speed-ups.
    Ch06(ch06::Args),
    /// Chapter 7: flash vs naive attention: memory, the IO model's traffic, prefill and split-K decode time.
    Ch07(ch07::Args),
    /// Chapter 8, part 2: tensor parallelism: all-reduce latency, TP=N vs TP=1, the cost model.
    #[command(name = "ch08-tp")]
    Ch08Tp(ch08_tp::Args),
    /// Chapter 8: the cost of a structured output's token mask, per token.
    Structured(structured::Args),
    /// The server (chapter 8): a load generator against a running `kiln serve`, like `vllm bench serve`.
    Serve(serve::Args),
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // The CPU chapters accept the model options, `--device` among them: a GPU asked of one is
    // an error before anything is measured, never a CPU run reported as if it were the GPU's.
    let model = match &args.chapter {
        Chapter::Ch01(a) => Some(&a.model),
        Chapter::Ch02(a) => Some(&a.model),
        Chapter::Ch03(a) => Some(&a.model),
        Chapter::Ch04(a) => Some(&a.model),
        Chapter::Ch06(a) => Some(&a.model),
        Chapter::Ch08Tp(a) => Some(&a.model),
        _ => None,
    };
    if let Some(model) = model {
        model.check_runs_on_cpu()?;
    }
    match args.chapter {
        Chapter::Ch01(args) => ch01::run(args),
        Chapter::Ch02(args) => ch02::run(args),
        Chapter::Ch03(args) => ch03::run(args),
        Chapter::Ch04(args) => ch04::run(args),
        Chapter::Ch05(args) => ch05::run(args),
        Chapter::Ch06(args) => ch06::run(args),
        Chapter::Ch07(args) => ch07::run(args),
        Chapter::Ch08Tp(args) => ch08_tp::run(args),
        Chapter::Structured(args) => structured::run(args),
        Chapter::Serve(args) => serve::run(args),
    }
}

/// Where a benchmark writes and how long it runs: the options every chapter's benchmark shares.
#[derive(clap::Args, Debug)]
pub struct Output {
    /// Where to write the tables and plots [default: the chapter's folder under book/src, or a
    /// temporary directory with --quick].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// CI smoke run: small sizes, one repetition, output to a temporary directory.
    #[arg(long)]
    pub quick: bool,
    /// Timed repetitions; medians are reported [default: the chapter's, 1 with --quick].
    #[arg(long, value_name = "N")]
    pub reps: Option<usize>,
}

impl Output {
    /// The folder to write into: `--out`, else a temporary one with `--quick`, else the book's.
    pub fn dir(&self, chapter: &str) -> PathBuf {
        match (&self.out, self.quick) {
            (Some(dir), _) => dir.clone(),
            (None, true) => {
                std::env::temp_dir().join(format!("kiln-bench-{chapter}-{}", std::process::id()))
            }
            (None, false) => book_dir(chapter),
        }
    }

    /// `--reps`, else `default` (1 with `--quick`); at least 1.
    pub fn reps(&self, default: usize) -> anyhow::Result<usize> {
        let reps = self.reps.unwrap_or(if self.quick { 1 } else { default });
        anyhow::ensure!(reps >= 1, "--reps must be at least 1");
        Ok(reps)
    }
}

/// Writes each figure into `out` (created if missing): `{stem}.md`, a table that is also
/// printed to stdout, when there is one, and `{stem}.svg`, described as written by this
/// command line (what `kiln figures` checks).
pub fn write_figures(out: &Path, figures: &[(&str, Option<&str>, &str)]) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let command = command_line();
    for &(stem, markdown, svg) in figures {
        let svg = describe_svg(svg, &command);
        if let Some(markdown) = markdown {
            let md_path = out.join(format!("{stem}.md"));
            std::fs::write(&md_path, markdown)
                .with_context(|| format!("writing {}", md_path.display()))?;
            println!("{markdown}");
        }
        let svg_path = out.join(format!("{stem}.svg"));
        std::fs::write(&svg_path, &svg)
            .with_context(|| format!("writing {}", svg_path.display()))?;
    }
    eprintln!(
        "wrote the tables (.md) and plots (.svg) to {}",
        out.display()
    );
    Ok(())
}

/// `svg` with a `<desc>` naming `command` right after its opening tag (unchanged if it has no
/// `<svg …>` tag).
pub fn describe_svg(svg: &str, command: &str) -> String {
    let Some(end) = svg
        .find("<svg")
        .and_then(|at| svg[at..].find('>').map(|e| at + e + 1))
    else {
        return svg.to_string();
    };
    let escaped = command
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    let desc = crate::figures::DESC;
    format!("{}\n{desc}{escaped}</desc>{}", &svg[..end], &svg[end..])
}

/// The command line as typed, with the program name shortened to `kiln`.
pub fn command_line() -> String {
    std::iter::once("kiln".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The book folder of a chapter, e.g. `book/src/ch01` in this repository.
pub fn book_dir(chapter: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("book/src")
        .join(chapter)
}

/// Facts about the machine and the run, for a benchmark's caption.
pub struct RunFacts {
    /// `nproc`: logical CPUs available to this process.
    pub nproc: usize,
    /// `model name` from /proc/cpuinfo, when there is one.
    pub cpu: Option<String>,
    /// Today, UTC, as YYYY-MM-DD.
    pub date: String,
    /// The command line as typed, with the program name shortened to `kiln`.
    pub command: String,
}

impl RunFacts {
    pub fn collect() -> Self {
        let nproc = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|info| {
                info.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, name)| name.split_whitespace().collect::<Vec<_>>().join(" "))
            });
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let (y, m, d) = civil_from_days((secs / 86_400) as i64);
        RunFacts {
            nproc,
            cpu,
            date: format!("{y:04}-{m:02}-{d:02}"),
            command: command_line(),
        }
    }

    /// `N threads on CPU (n CPUs), date`: where and when a benchmark ran, for its caption.
    pub fn machine(&self, threads: usize) -> String {
        format!(
            "{threads} threads on {} ({} CPUs), {}",
            self.cpu.as_deref().unwrap_or("an unknown CPU"),
            self.nproc,
            self.date
        )
    }
}

/// `one run` or `medians of N runs`, for a caption.
pub fn runs(reps: usize) -> String {
    if reps == 1 {
        "one run".to_string()
    } else {
        format!("medians of {reps} runs")
    }
}

/// Days since 1970-01-01 → (year, month, day) in the proleptic Gregorian calendar
/// (the civil-from-days algorithm: 400-year eras of 146,097 days).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // [0, 146096]
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // [0, 399]
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // [0, 365]
    let mp = (5 * doy + 2) / 153; // [0, 11], March = 0
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Runs `f` once and returns its wall time.
pub fn time<T, E>(f: impl FnOnce() -> Result<T, E>) -> Result<Duration, E> {
    let start = Instant::now();
    std::hint::black_box(f()?);
    Ok(start.elapsed())
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// BOS (when the tokenizer has one) followed by a fixed pseudo-random walk over the vocabulary.
/// The forward's cost does not depend on which ids it sees, only on how many.
pub fn bench_tokens(len: usize, vocab_size: usize, bos: Option<u32>) -> Vec<u32> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut tokens: Vec<u32> = bos.into_iter().collect();
    while tokens.len() < len {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        tokens.push(((state >> 33) % vocab_size as u64) as u32);
    }
    tokens.truncate(len);
    tokens
}

/// The model directory's name, e.g. `shakespeare-small`.
pub fn model_name(dir: &Path) -> String {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    dir.file_name().map_or_else(
        || dir.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Parameters implied by the config (tied embeddings counted once).
pub fn parameter_count(model: &Llama) -> usize {
    let c = &model.config;
    let (h, q, kv, i) = (
        c.hidden_size,
        c.num_attention_heads * c.head_dim,
        c.num_key_value_heads * c.head_dim,
        c.intermediate_size,
    );
    let mut attn = h * q + 2 * h * kv + q * h;
    if c.qkv_bias {
        attn += q + 2 * kv;
    }
    if c.o_bias {
        attn += h;
    }
    let mut mlp = 3 * h * i;
    if c.mlp_bias {
        mlp += 2 * i + h;
    }
    let layer = attn + mlp + 2 * h;
    let head = if c.tie_word_embeddings {
        0
    } else {
        c.vocab_size * h
    };
    c.vocab_size * h + c.num_hidden_layers * layer + h + head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_from_days() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(11_017), (2000, 3, 1));
        assert_eq!(civil_from_days(20_000), (2024, 10, 4));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn every_benchmark_names_where_its_source_lives() {
        use clap::Subcommand;
        let commands: Vec<String> = Chapter::augment_subcommands(clap::Command::new("bench"))
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .collect();
        let named: Vec<String> = SOURCES.iter().map(|(c, _)| c.to_string()).collect();
        assert_eq!(
            commands, named,
            "SOURCES lists every `kiln bench` subcommand, in order"
        );
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for (command, source) in SOURCES {
            assert!(root.join(source).exists(), "{command}: no {source}");
        }
    }
}
