//! `kiln bench ch04 --only kv-dtype`: the KV cache's storage dtype (`--kv-cache-dtype`), f32
//! against bf16, on the same requests: the tokens a fixed memory holds, and the engine's speed
//! with short and with long contexts (where attention reads more K/V than the weights).
//!
//! ```text
//! memory:  bytes per token = 2 (K, V) · layers · kv_heads · head_dim · element size
//! speed:   the same requests, all at time 0, through the engine with an f32 pool, then bf16
//! ```

use ch01::Llama;
use ch03::{KvDtype, KvElement, KvPool};
use ch04::EngineConfig;
use ch07::AttentionKind;
use half::bf16;

use super::serve::{self, Summary};
use super::static_batch::{Arrival, WallClock};
use super::{measured, pool_for, workload};
use crate::bench::bars::BarChart;
use crate::bench::table::{Align, Table};

/// One workload: `requests` prompts of `prompt` tokens, each generating `output` tokens, all
/// submitted at time 0.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub label: &'static str,
    pub requests: usize,
    pub prompt: usize,
    pub output: usize,
}

/// The workloads of a full run, or of `--quick`.
pub fn shapes(quick: bool) -> [Shape; 2] {
    if quick {
        [
            Shape {
                label: "short context",
                requests: 8,
                prompt: 16,
                output: 8,
            },
            Shape {
                label: "long context",
                requests: 2,
                prompt: 128,
                output: 8,
            },
        ]
    } else {
        [
            Shape {
                label: "short context",
                requests: 32,
                prompt: 64,
                output: 64,
            },
            Shape {
                label: "long context",
                requests: 8,
                prompt: 1024,
                output: 64,
            },
        ]
    }
}

/// The memory the `--kv-cache-memory` default holds, for the table.
const MEMORY: u64 = 512 << 20;

/// Measures every shape with both dtypes; the table (markdown) and the plot (SVG).
pub fn run(
    model: &Llama,
    corpus: &[u32],
    quick: bool,
    reps: usize,
    block_size: usize,
    attention: AttentionKind,
    caption: &str,
) -> anyhow::Result<(String, String)> {
    let max_len = model.config.max_position_embeddings;
    let mut rows = Vec::new();
    for shape in shapes(quick) {
        anyhow::ensure!(
            shape.prompt + shape.output <= max_len && shape.prompt <= corpus.len(),
            "the kv-dtype workload does not fit the model's context of {max_len} tokens"
        );
        let arrivals =
            workload::at_once(corpus, shape.requests, shape.prompt, shape.output, 0x6b76);
        let config = EngineConfig {
            max_num_seqs: shape.requests,
            max_num_batched_tokens: 512.max(shape.prompt),
            ..EngineConfig::default()
        };
        let f32 = serve_with::<f32>(model, &arrivals, config, block_size, reps, shape, attention)?;
        let bf16 =
            serve_with::<bf16>(model, &arrivals, config, block_size, reps, shape, attention)?;
        rows.push((shape, f32, bf16));
    }

    let token_bytes = |dtype: KvDtype| dtype.bytes_per_token(&model.config);
    let mut memory =
        Table::new(["KV dtype", "bytes per token", "tokens in 512 MiB"]).align(0, Align::Left);
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let bytes = token_bytes(dtype);
        memory.row([
            dtype.to_string(),
            bytes.to_string(),
            (MEMORY / bytes).to_string(),
        ]);
    }
    let mut speed = Table::new([
        "workload",
        "f32 KV: output tok/s",
        "bf16 KV: output tok/s",
        "bf16 / f32",
        "f32 KV: TPOT p50 (ms)",
        "bf16 KV: TPOT p50 (ms)",
    ])
    .align(0, Align::Left);
    let mut chart = BarChart::new("Engine throughput by KV cache dtype").x_label("output tokens/s");
    for (shape, f, b) in &rows {
        let label = format!(
            "{}: {} × ({} prompt + {} output)",
            shape.label, shape.requests, shape.prompt, shape.output
        );
        speed.row([
            label.clone(),
            format!("{:.1}", f.throughput),
            format!("{:.1}", b.throughput),
            format!("{:.2}", b.throughput / f.throughput),
            format!("{:.1}", 1e3 * f.tpot.p50),
            format!("{:.1}", 1e3 * b.tpot.p50),
        ]);
        chart = chart.group(
            label,
            &[("f32 KV", f.throughput), ("bf16 KV", b.throughput)],
        );
    }
    let markdown = format!(
        "{}\n{}\nEvery request is submitted at time 0 and generates exactly its output length \
         (EOS ignored), greedy; prompts are windows of Hamlet. The pool holds every request at \
         once (no preemption). Output tok/s: output tokens over the time from submission to \
         the last token, prefills included. Weights are f32 in both runs; attention computes in \
         f32 and widens bf16 K/V as it reads them.\n\n{caption}\n",
        memory.to_markdown(),
        speed.to_markdown(),
    );
    Ok((markdown, chart.to_svg()))
}

/// Serves `arrivals` `reps` times with a pool of `K`; the median summary.
fn serve_with<K: KvElement>(
    model: &Llama,
    arrivals: &[Arrival],
    config: EngineConfig,
    block_size: usize,
    reps: usize,
    shape: Shape,
    attention: AttentionKind,
) -> anyhow::Result<Summary> {
    let label = format!("{}, {} KV", shape.label, K::DTYPE);
    measured(&label, reps, || {
        let pool: KvPool<K> = pool_for(model, block_size, arrivals)?;
        serve::continuous(
            model,
            pool,
            config,
            attention,
            arrivals,
            &WallClock::start(),
        )
    })
}
