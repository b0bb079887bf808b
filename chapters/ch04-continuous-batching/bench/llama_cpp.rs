//! `kiln bench ch04 --only llama-cpp`: continuous batching against llama.cpp's own batched
//! benchmark, side by side in one run, on the same weights and the same work.
//!
//! ```text
//! work:    B sequences, each a prompt of P tokens that then generates G tokens, all at once
//! kiln:    the engine at max_num_seqs B, 512 tokens a step (chunked prefill), f32 weights,
//!          an f32 KV pool, then a bf16 one
//! llama:   llama-batched-bench -npl B -npp P -ntg G -ub 512 on the F32 GGUF (the same weights),
//!          its default F16 KV cache
//! figure:  output tokens / wall time, prefill included, for both
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
/// llama.cpp (not built, or not SmolLM2) only kiln's row is measured, and the table says why.
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
    // runs a minute apart. The table gives each engine's median run and the rounds' median ratio.
    let gguf = fixtures().join(".cache/llama.cpp/SmolLM2-135M-Instruct-F32.gguf");
    let mut llama: Result<Vec<BatchedRun>, String> = if model_name.starts_with("SmolLM2-135M") {
        Ok(Vec::new())
    } else {
        Err(format!(
            "llama.cpp's GGUF files are made for SmolLM2-135M only, not {model_name}"
        ))
    };
    let (mut kiln, mut kiln_bf16) = (Vec::new(), Vec::new());
    for round in 1..=reps {
        eprintln!("   round {round} of {reps}");
        kiln.push(measured("kiln, continuous batching, f32 KV", 1, || {
            engine::<f32>(model, block_size, &arrivals, config, attention)
        })?);
        kiln_bf16.push(measured("kiln, continuous batching, bf16 KV", 1, || {
            engine::<bf16>(model, block_size, &arrivals, config, attention)
        })?);
        if let Ok(runs) = &mut llama {
            let threads = rayon::current_num_threads();
            let (b, p, g) = (shape.sequences, shape.prompt, shape.output);
            match llama_batched_bench(&gguf, threads, b, p, g) {
                Ok(run) => {
                    eprintln!(
                        "   llama-batched-bench: {:.1} output tok/s, S_TG {:.1}, {:.1} s",
                        run.output_tok_s(),
                        run.decode_tok_s,
                        run.seconds
                    );
                    runs.push(run);
                }
                Err(e) => llama = Err(format!("it failed in round {round}: {e:#}")),
            }
        }
    }
    // Per engine: the median of the rounds' ratios to llama.cpp's run of the same round, and
    // their range.
    let ratios = |kiln: &[Summary]| -> Option<(f64, f64, f64)> {
        let runs = llama.as_ref().ok()?;
        let mut r: Vec<f64> = (kiln.iter().zip(runs))
            .map(|(k, l)| k.throughput / l.output_tok_s())
            .collect();
        r.sort_by(f64::total_cmp);
        let (&low, &high) = (r.first()?, r.last()?);
        Some((serve::percentile(&r, 50.0), low, high))
    };
    let (f32_ratios, bf16_ratios) = (ratios(&kiln), ratios(&kiln_bf16));
    let (kiln, kiln_bf16) = (median_summary(&kiln), median_summary(&kiln_bf16));
    let llama = llama.map(|runs| BatchedRun::median(&runs));

    let mut table = Table::new([
        "engine",
        "sequences × (prompt + output)",
        "wall s",
        "output tok/s",
        "decode-phase tok/s",
        "× llama.cpp",
    ])
    .align(0, Align::Left);
    let work = format!(
        "{} × ({} + {})",
        shape.sequences, shape.prompt, shape.output
    );
    let against = |ratios: Option<(f64, f64, f64)>| match ratios {
        Some((median, low, high)) if reps > 1 => {
            format!("{median:.2}× ({low:.2}–{high:.2})")
        }
        Some((median, ..)) => format!("{median:.2}×"),
        None => "-".into(),
    };
    let kilns = [
        ("f32", &kiln, f32_ratios),
        ("bf16", &kiln_bf16, bf16_ratios),
    ];
    for (kv, run, ratios) in kilns {
        table.row([
            format!(
                "kiln, continuous batching (max_num_seqs {}), {kv} KV",
                shape.sequences
            ),
            work.clone(),
            format!("{:.2}", run.makespan),
            format!("{:.1}", run.throughput),
            "-".into(),
            against(ratios),
        ]);
    }
    let mut bars: Vec<(String, f64)> = kilns
        .iter()
        .map(|(kv, run, _)| (format!("kiln, {kv} KV"), run.throughput))
        .collect();
    let verdict = match &llama {
        Ok(l) => {
            table.row([
                format!("llama.cpp {}, llama-batched-bench", l.build),
                work.clone(),
                format!("{:.2}", l.seconds),
                format!("{:.1}", l.output_tok_s()),
                format!("{:.1}", l.decode_tok_s),
                "1.00×".into(),
            ]);
            bars.push(("llama.cpp, F16 KV".into(), l.output_tok_s()));
            let median = |r: Option<(f64, f64, f64)>| r.map_or(f64::NAN, |(m, ..)| m);
            let (f32_kv, bf16_kv) = (median(f32_ratios), median(bf16_ratios));
            let verdict = |r: f64| if r >= 1.5 { "met" } else { "not met" };
            format!(
                "kiln served **{bf16_kv:.2}×** llama.cpp's output tokens per second on the same \
                 work with a 16-bit KV cache like llama.cpp's (target: at least 1.5×, {}), and \
                 {f32_kv:.2}× with an f32 one ({}).",
                verdict(bf16_kv),
                verdict(f32_kv)
            )
        }
        Err(why) => format!("llama.cpp was not measured: {why}."),
    };
    let (b, p, g) = (shape.sequences, shape.prompt, shape.output);
    let rounds = if reps > 1 && llama.is_ok() {
        format!(
            "The engines ran in {reps} rounds, each round kiln with the f32 pool, kiln with the \
             bf16 pool, then llama.cpp: the times and rates are each engine's median run, and \
             × llama.cpp is the median of the rounds' ratios, each kiln run over llama.cpp's run \
             of its round (their range in brackets). "
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
         512` and as many threads as kiln, with its default F16 KV cache; kiln its engine with \
         max_num_seqs {b} and 512 tokens a step, once with an f32 KV pool and once with a bf16 \
         one (the weights f32 in both). Each engine makes its KV memory before its clock starts \
         (llama.cpp clears its buffers, kiln populates its pool). {rounds}{verdict}\n\n{caption}\n",
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
