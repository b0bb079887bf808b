//! `kiln bench ch04 --only llama-cpp`: continuous batching against llama.cpp's own batched
//! benchmark, side by side in one run, on the same weights and the same work.
//!
//! ```text
//! work:    B sequences, each a prompt of P tokens that then generates G tokens, all at once
//! kiln:    the engine at max_num_seqs B, 512 tokens a step (chunked prefill), f32 weights,
//!          an f32 KV pool, then a bf16 one
//! llama:   llama-batched-bench -npl B -npp P -ntg G -ub 512 on the F32 GGUF (the same weights),
//!          an F32 KV cache, then its default F16 one
//! figure:  output tokens / wall time, prefill included, for both; each row over the
//!          llama.cpp cache of as many bytes per value (f32 over F32, bf16 over F16), and every
//!          row over llama.cpp's default F16 cache
//! ```
//!
//! `llama-batched-bench` prefills the B prompts, then decodes the B sequences in lock step: a
//! static batch of equal lengths, the best case for static batching. Its decode-phase rate (its
//! `S_TG`) is shown too, beside its whole-run figure.

use ch01::Llama;
use ch04::EngineConfig;
use ch07::AttentionKind;

use half::bf16;

use super::Run;
use super::serve::{self, Summary, median_summary};
use super::static_batch::{Arrival, WallClock};
use super::{measured, pool_for, workload};
use crate::bench::bars::BarChart;
use crate::bench::ch02::references::{BatchedRun, fixtures, llama_batched_bench};
use crate::bench::table::{Align, Table};
use ch03::KvElement;

/// The work both engines do.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub sequences: usize,
    pub prompt: usize,
    pub output: usize,
}

impl Shape {
    pub fn new(quick: bool) -> Self {
        if quick {
            Shape {
                sequences: 4,
                prompt: 16,
                output: 8,
            }
        } else {
            Shape {
                sequences: 32,
                prompt: 128,
                output: 128,
            }
        }
    }
}

/// Both engines on `shape` in `reps` rounds; the table (markdown) and the plot (SVG). Without
/// llama.cpp (not built, or not SmolLM2) only kiln's two rows are measured, and the table says
/// why; a llama.cpp run that fails drops every llama.cpp run and ratio, and the table says where.
#[allow(clippy::too_many_arguments)]
pub fn run(
    model: &Llama,
    model_name: &str,
    corpus: &[u32],
    shape: Shape,
    reps: usize,
    block_size: usize,
    attention: AttentionKind,
    caption: &str,
) -> anyhow::Result<(String, String)> {
    let max_len = model.config.max_position_embeddings;
    anyhow::ensure!(
        shape.prompt + shape.output <= max_len && shape.prompt <= corpus.len(),
        "the llama-cpp workload does not fit the model's context of {max_len} tokens"
    );
    let arrivals = workload::at_once(corpus, shape.sequences, shape.prompt, shape.output, 0x11a3a);
    let config = EngineConfig {
        max_num_seqs: shape.sequences,
        max_num_batched_tokens: 512,
        ..EngineConfig::default()
    };
    // The pool is made (and its memory backed) before each run's clock starts, as llama.cpp
    // makes and clears its KV buffers before its timer.
    fn engine<K: KvElement>(
        model: &Llama,
        block_size: usize,
        arrivals: &[Arrival],
        config: EngineConfig,
        attention: AttentionKind,
    ) -> anyhow::Result<Run> {
        let pool = pool_for::<K>(model, block_size, arrivals)?;
        serve::continuous(
            model,
            pool,
            config,
            attention,
            arrivals,
            &WallClock::start(),
        )
    }
    // Rounds, each engine once per round in the same order, rather than each engine's runs in a
    // block: the machine's pace drifts by a quarter within minutes, and a round's ratio compares
    // runs a minute apart. Each kiln pool runs beside llama.cpp with a cache of as many bytes per
    // value: kiln's f32 pool beside llama.cpp's F32 cache, its bf16 pool beside llama.cpp's
    // default F16 cache. The table gives each engine's median run and the rounds' median ratios.
    let gguf = fixtures().join(".cache/llama.cpp/SmolLM2-135M-Instruct-F32.gguf");
    let mut failed: Option<String> = (!model_name.starts_with("SmolLM2-135M")).then(|| {
        format!("llama.cpp's GGUF files are made for SmolLM2-135M only, not {model_name}")
    });
    let mut pairs = [Pair::new("f32", "F32"), Pair::new("bf16", "F16")];
    for round in 1..=reps {
        eprintln!("   round {round} of {reps}");
        for pair in &mut pairs {
            let label = format!("kiln, continuous batching, {} KV", pair.kiln_kv);
            pair.kiln.push(measured(&label, 1, || match pair.kiln_kv {
                "f32" => engine::<f32>(model, block_size, &arrivals, config, attention),
                _ => engine::<bf16>(model, block_size, &arrivals, config, attention),
            })?);
            if failed.is_some() {
                continue;
            }
            let threads = rayon::current_num_threads();
            let (b, p, g) = (shape.sequences, shape.prompt, shape.output);
            let kv = pair.llama_kv.to_lowercase();
            match llama_batched_bench(&gguf, threads, b, p, g, &kv) {
                Ok(run) => {
                    eprintln!(
                        "   llama-batched-bench, {} KV: {:.1} output tok/s, S_TG {:.1}, {:.1} s",
                        pair.llama_kv,
                        run.output_tok_s(),
                        run.decode_tok_s,
                        run.seconds
                    );
                    pair.llama.push(run);
                }
                Err(e) => {
                    failed = Some(format!(
                        "it failed in round {round} ({} KV): {e:#}",
                        pair.llama_kv
                    ))
                }
            }
        }
    }
    let measured_llama = failed.is_none();

    let mut table = Table::new([
        "engine",
        "sequences × (prompt + output)",
        "wall s",
        "output tok/s",
        "decode-phase tok/s",
        "× llama.cpp, same KV bytes",
        "× llama.cpp, F16 KV",
    ])
    .align(0, Align::Left);
    let work = format!(
        "{} × ({} + {})",
        shape.sequences, shape.prompt, shape.output
    );
    let against = |ratios: Option<RoundRatios>| match ratios {
        Some(r) if reps > 1 => format!("{:.2}× ({:.2}–{:.2})", r.median, r.low, r.high),
        Some(r) => format!("{:.2}×", r.median),
        None => "-".into(),
    };
    // The cache `llama-batched-bench` runs when no type is named.
    let f16 = &(pairs.iter().find(|p| p.llama_kv == "F16"))
        .expect("a pair with llama.cpp's default cache")
        .llama;
    let mut bars = Vec::new();
    let mut verdicts = Vec::new();
    for pair in &pairs {
        let kiln = median_summary(&pair.kiln);
        let same = measured_llama.then(|| RoundRatios::of(&pair.kiln, &pair.llama));
        let default = measured_llama.then(|| RoundRatios::of(&pair.kiln, f16));
        table.row([
            format!(
                "kiln, continuous batching (max_num_seqs {}), {} KV",
                shape.sequences, pair.kiln_kv
            ),
            work.clone(),
            format!("{:.2}", kiln.makespan),
            format!("{:.1}", kiln.throughput),
            "-".into(),
            against(same),
            against(default),
        ]);
        bars.push((format!("kiln, {} KV", pair.kiln_kv), kiln.throughput));
        if !measured_llama {
            continue;
        }
        let l = BatchedRun::median(&pair.llama);
        table.row([
            format!(
                "llama.cpp {}, llama-batched-bench, {} KV",
                l.build, pair.llama_kv
            ),
            work.clone(),
            format!("{:.2}", l.seconds),
            format!("{:.1}", l.output_tok_s()),
            format!("{:.1}", l.decode_tok_s),
            "1.00×".into(),
            match pair.llama_kv {
                "F16" => "1.00×".into(),
                _ => against(Some(RoundRatios::of_llama(&pair.llama, f16))),
            },
        ]);
        bars.push((format!("llama.cpp, {} KV", pair.llama_kv), l.output_tok_s()));
        if let Some(same) = same {
            let met = if same.median >= 1.5 { "met" } else { "not met" };
            verdicts.push(format!(
                "**{:.2}×** llama.cpp's with the {} pool against llama.cpp's {} cache ({met})",
                same.median, pair.kiln_kv, pair.llama_kv
            ));
        }
    }
    let verdict = match &failed {
        None => format!(
            "kiln's output tokens per second on the same work were {}; the target is at least \
             1.5× llama.cpp's with a cache of as many bytes per value.",
            verdicts.join(" and ")
        ),
        Some(why) => format!("llama.cpp was not measured: {why}."),
    };
    let (b, p, g) = (shape.sequences, shape.prompt, shape.output);
    let rounds = if reps > 1 && measured_llama {
        format!(
            "The engines ran in {reps} rounds, each round kiln with the f32 pool, llama.cpp with \
             an F32 cache, kiln with the bf16 pool, then llama.cpp with its F16 one: the times \
             and rates are each engine's median run, and each × entry is the median of the \
             rounds' ratios, each run over the run of the same round with the column's \
             llama.cpp cache (their range in brackets). "
        )
    } else {
        String::new()
    };
    let md = format!(
        "{}\n{b} sequences of {p} prompt tokens (windows of Hamlet), each generating exactly {g} \
         tokens, all submitted at once. Output tok/s: generated tokens over the wall time from \
         submission to the last token, prefill included, for both engines. Decode-phase tok/s: \
         llama-batched-bench's S_TG, its lock-step decode after every prompt is in. \
         llama.cpp runs the F32 GGUF of the same weights with `-npl {b} -npp {p} -ntg {g} -ub \
         512` and as many threads as kiln, once with an F32 KV cache (`-ctk f32 -ctv f32`) and \
         once with its default F16 one; kiln its engine with max_num_seqs {b} and 512 tokens a \
         step, once with an f32 KV pool and once with a bf16 one (the weights f32 in both). \
         Each engine makes its KV memory before its clock starts (llama.cpp clears its buffers, \
         kiln populates its pool). {rounds}{verdict}\n\n{caption}\n",
        table.to_markdown(),
    );
    let svg = BarChart::new(format!(
        "{} sequences at once: kiln against llama.cpp, {model_name}",
        shape.sequences
    ))
    .x_label("output tokens/s (prefill included)")
    .group(format!("{work} tokens"), &bars)
    .to_svg();
    Ok((md, svg))
}

/// A kiln pool and the llama.cpp cache of as many bytes per value, with each one's runs.
struct Pair {
    kiln_kv: &'static str,
    llama_kv: &'static str,
    kiln: Vec<Summary>,
    llama: Vec<BatchedRun>,
}

impl Pair {
    fn new(kiln_kv: &'static str, llama_kv: &'static str) -> Self {
        Pair {
            kiln_kv,
            llama_kv,
            kiln: Vec::new(),
            llama: Vec::new(),
        }
    }
}

/// The median and range of the rounds' ratios, each run over llama.cpp's run of its round.
#[derive(Debug, Clone, Copy)]
struct RoundRatios {
    median: f64,
    low: f64,
    high: f64,
}

impl RoundRatios {
    /// kiln's output rate over llama.cpp's, round by round.
    fn of(kiln: &[Summary], llama: &[BatchedRun]) -> Self {
        Self::from_rates(kiln.iter().map(|k| k.throughput), llama)
    }

    /// One llama.cpp cache's output rate over another's, round by round.
    fn of_llama(runs: &[BatchedRun], over: &[BatchedRun]) -> Self {
        Self::from_rates(runs.iter().map(BatchedRun::output_tok_s), over)
    }

    /// `rates` and `over` hold one run per round, in the order of the rounds.
    fn from_rates(rates: impl ExactSizeIterator<Item = f64>, over: &[BatchedRun]) -> Self {
        assert_eq!(rates.len(), over.len(), "a run per round on both sides");
        let ratios: Vec<f64> = (rates.zip(over))
            .map(|(rate, l)| rate / l.output_tok_s())
            .collect();
        let (low, high) = ratios
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| {
                (lo.min(r), hi.max(r))
            });
        RoundRatios {
            median: serve::percentile(&ratios, 50.0),
            low,
            high,
        }
    }
}
