//! `kiln bench ch05 --only kv-cache`: the KV cache's dtype (`--kv-cache-dtype`), f32, bf16 and
//! chapter 5's FP8 E4M3 and int8 (with one scale per position and KV head), on SmolLM2-135M:
//!
//! ```text
//! memory      bytes per token and the tokens 512 MiB holds, from each executor's KV layout
//! pressure    the same requests through the engine with a --kv-cache-memory that holds a
//!             quarter of them in f32: preemption (recompute) where the pool is too small
//! perplexity  Hamlet in chunks of 512 through the executor: each chunk's K/V stored, then read
//! ```
//! With `--quick` (a smoke run) the default model, small workloads and two chunks of 64.

use std::time::Duration;

use ch01::Llama;
use ch02::workload::WorkloadRng;
use ch03::{KvDtype, KvElement, KvPool};
use ch04::{CacheConfig, EngineConfig};
use ch05::fp8::F8E4M3;
use ch05::kv_cache::KvInt8;
use ch07::AttentionKind;
use half::bf16;

use super::super::ch04::serve::{self, Summary};
use super::super::ch04::static_batch::{Arrival, WallClock};
use super::super::ch04::{measured, workload};
use super::super::{RunFacts, write_figures};
use super::part2_shared;
use crate::bench::bars::BarChart;
use crate::bench::table::{Align, Table};
use crate::commands::perplexity::perplexity_through_kv;

const BLOCK_SIZE: usize = 16;
/// The `--kv-cache-memory` default: the memory table's budget.
const MEMORY: u64 = 512 << 20;

/// The workload under pressure: `requests` prompts of `prompt` tokens, `output` tokens each,
/// all at time 0.
struct Pressure {
    requests: usize,
    prompt: usize,
    output: usize,
}

/// One dtype's measurements.
struct Row {
    dtype: KvDtype,
    bytes_per_token: u64,
    tokens_in_memory: usize,
    tokens_under_pressure: usize,
    serve: Summary,
    perplexity: f64,
}

pub fn run(
    quick: bool,
    reps: usize,
    chunks: usize,
    out: &std::path::Path,
    facts: &RunFacts,
) -> anyhow::Result<()> {
    let args = part2_shared::model(quick)?;
    let loaded = args.load()?;
    let model = &loaded.model;
    let (corpus, bos) = part2_shared::hamlet(&loaded)?;
    let (ctx, chunks) = if quick { (64, 2) } else { (512, chunks) };
    let pressure = if quick {
        Pressure {
            requests: 4,
            prompt: 32,
            output: 8,
        }
    } else {
        Pressure {
            requests: 16,
            prompt: 256,
            output: 64,
        }
    };
    // A quarter of the workload's tokens in f32 (whole blocks per request, at least two
    // requests: the scheduler keeps a watermark of free blocks).
    let per_request = (pressure.prompt + pressure.output).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let tight = KvDtype::F32.bytes_per_token(&model.config)
        * (per_request * (pressure.requests / 4).max(2)) as u64;
    let mut rng = WorkloadRng::new(0x6b76_3035);
    let arrivals: Vec<Arrival> = (0..pressure.requests)
        .map(|_| Arrival {
            at: Duration::ZERO,
            request: workload::fixed_length(
                workload::window(&corpus, pressure.prompt, &mut rng),
                pressure.output,
            ),
        })
        .collect();
    let config = EngineConfig {
        max_num_seqs: pressure.requests,
        max_num_batched_tokens: 512.max(pressure.prompt),
        ..EngineConfig::default()
    };
    eprintln!(
        "kiln bench ch05 --only kv-cache: {}, {} requests × ({} + {}), KV memory {} bytes",
        args.model.display(),
        pressure.requests,
        pressure.prompt,
        pressure.output,
        tight
    );

    let mut rows = Vec::new();
    for dtype in KvDtype::ALL {
        eprintln!("== {dtype} KV");
        let capacity = |memory| -> anyhow::Result<usize> {
            let cache = CacheConfig {
                memory,
                block_size: BLOCK_SIZE,
                dtype,
            };
            Ok(ch07::cpu_executor(model, &cache, AttentionKind::Auto)?
                .kv_layout()
                .token_capacity())
        };
        let label = format!("{dtype} KV under pressure");
        let serve = measured(&label, reps, || match dtype {
            KvDtype::F32 => serve_with::<f32>(model, tight, config, &arrivals),
            KvDtype::Bf16 => serve_with::<bf16>(model, tight, config, &arrivals),
            KvDtype::Fp8E4M3 => serve_with::<F8E4M3>(model, tight, config, &arrivals),
            KvDtype::Int8 => serve_with::<KvInt8>(model, tight, config, &arrivals),
        })?;
        let ppl = perplexity_through_kv(model, &corpus, ctx, bos, Some(chunks), dtype)?;
        anyhow::ensure!(ppl.num_chunks == chunks, "Hamlet holds fewer chunks");
        eprintln!("   perplexity {:.4}", ppl.perplexity);
        rows.push(Row {
            dtype,
            bytes_per_token: dtype.bytes_per_token(&model.config),
            tokens_in_memory: capacity(MEMORY)?,
            tokens_under_pressure: capacity(tight)?,
            serve,
            perplexity: ppl.perplexity,
        });
    }

    let caption = part2_shared::caption(
        &format!(
            "{}, f32 weights, KV blocks of {BLOCK_SIZE}, attention `auto`",
            part2_shared::name(&args)
        ),
        facts,
        reps,
    );
    let (memory_md, memory_svg) = memory_figure(&rows, &caption);
    let (pressure_md, pressure_svg) =
        pressure_figure(&rows, &pressure, tight, ctx, chunks, &caption);
    write_figures(
        out,
        &[
            ("kv-memory", Some(&memory_md), &memory_svg),
            ("kv-pressure", Some(&pressure_md), &pressure_svg),
        ],
    )
}

/// Serves `arrivals` once with a pool of `K` of `memory` bytes (as many blocks as fit).
fn serve_with<K: KvElement>(
    model: &Llama,
    memory: u64,
    config: EngineConfig,
    arrivals: &[Arrival],
) -> anyhow::Result<serve::Run> {
    let pool = KvPool::<K>::with_budget(&model.config, BLOCK_SIZE, memory)?;
    serve::continuous(
        model,
        pool,
        config,
        AttentionKind::Auto,
        arrivals,
        &WallClock::start(),
    )
}

fn memory_figure(rows: &[Row], caption: &str) -> (String, String) {
    let f32_tokens = rows[0].tokens_in_memory as f64;
    let mut table = Table::new(["KV dtype", "bytes per token", "tokens in 512 MiB", "× f32"])
        .align(0, Align::Left);
    let mut bars = Vec::new();
    for r in rows {
        table.row([
            r.dtype.to_string(),
            r.bytes_per_token.to_string(),
            r.tokens_in_memory.to_string(),
            format!("{:.2}", r.tokens_in_memory as f64 / f32_tokens),
        ]);
        bars.push((r.dtype.to_string(), r.tokens_in_memory as f64));
    }
    let chart = BarChart::new("Tokens 512 MiB of KV cache holds")
        .x_label("tokens")
        .group("512 MiB", &bars);
    let markdown = format!(
        "{}\nTokens: the `token_capacity` of each executor's reported KV layout (whole blocks of \
         {BLOCK_SIZE}). An 8-bit position stores one byte per element and one f32 scale per KV \
         head, in K and in V, every layer.\n\n{caption}\n",
        table.to_markdown()
    );
    (markdown, chart.to_svg())
}

fn pressure_figure(
    rows: &[Row],
    pressure: &Pressure,
    memory: u64,
    ctx: usize,
    chunks: usize,
    caption: &str,
) -> (String, String) {
    let needed = pressure.requests * (pressure.prompt + pressure.output);
    let (f32_tput, f32_ppl) = (rows[0].serve.throughput, rows[0].perplexity);
    let mut table = Table::new([
        "KV dtype",
        "tokens the memory holds",
        "output tok/s",
        "× f32",
        "TTFT p50 (s)",
        "perplexity",
        "Δ perplexity",
    ])
    .align(0, Align::Left);
    let mut bars = Vec::new();
    for r in rows {
        table.row([
            r.dtype.to_string(),
            r.tokens_under_pressure.to_string(),
            format!("{:.1}", r.serve.throughput),
            format!("{:.2}", r.serve.throughput / f32_tput),
            format!("{:.2}", r.serve.ttft.p50),
            format!("{:.4}", r.perplexity),
            format!("{:+.4}", r.perplexity - f32_ppl),
        ]);
        bars.push((r.dtype.to_string(), r.serve.throughput));
    }
    let chart = BarChart::new("Engine throughput under KV memory pressure")
        .x_label("output tokens/s")
        .group(
            format!(
                "{} × ({} + {})",
                pressure.requests, pressure.prompt, pressure.output
            ),
            &bars,
        );
    let markdown = format!(
        "{}\n{} requests of {} prompt tokens (windows of Hamlet) each generating exactly {} \
         (greedy, EOS ignored), all submitted at time 0, need {needed} positions at once; the \
         KV memory is {memory} bytes ({:.1} MiB): the blocks of {} requests in f32. A sequence that \
         finds no free block is preempted and recomputed later. Output tok/s: output tokens over \
         the time from submission to the last token. Perplexity: Hamlet, {chunks} chunks of \
         {ctx} tokens (llama.cpp's scheme), each chunk one prefill through the executor whose \
         K/V are stored in the dtype before every position reads them.\n\n{caption}\n",
        table.to_markdown(),
        pressure.requests,
        pressure.prompt,
        pressure.output,
        memory as f64 / (1u64 << 20) as f64,
        rows[0].tokens_under_pressure
            / (pressure.prompt + pressure.output).div_ceil(BLOCK_SIZE)
            / BLOCK_SIZE,
    );
    (markdown, chart.to_svg())
}
