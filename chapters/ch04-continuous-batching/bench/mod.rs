//! `kiln bench ch04`: what continuous batching buys, in wall-clock time with real arrivals.
//!
//! ```text
//! batching   one Poisson stream of requests with long-tailed lengths, served three ways:
//!            sequentially (max_num_seqs 1), by static batches (the baseline in
//!            static_batch), and by the continuous engine (max_num_seqs 32):
//!            output tokens/s, TTFT, TPOT, end-to-end latency (median, p99); then the same
//!            requests all at time 0, sequential and continuous (32 concurrent)
//! chunked    long prompts arriving among running decodes: the decodes' inter-token
//!            latency with chunked prefill on (a token budget of 128) and off
//! scaling    the same stream at max_num_seqs 1, 2, 4, … 32: throughput and p99 latency
//! ```
//! Writes `batching`, `chunked` and `scaling` (`.md` table + `.svg` plot; also
//! `scaling-latency.svg`) into `book/src/ch04/` (or `--out`). Every figure in a table comes
//! from this one run; the sweep's max_num_seqs 1 and 32 runs are the batching table's
//! sequential and continuous rows.

pub(crate) mod kv_dtype;
pub(crate) mod llama_cpp;
pub(crate) mod serve;
pub(crate) mod static_batch;
pub(crate) mod workload;

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use ch02::workload::{RequestLengths, WorkloadRng};
use ch03::{KvElement, KvPool};
use ch04::{CpuExecutor, EngineConfig};

use super::bars::BarChart;
use super::svg::LinePlot;
use super::table::{Align, Table};
use super::{Output, RunFacts, model_name, write_figures};
use crate::commands::ModelArgs;
use crate::commands::engine_args::AttentionArgs;
use serve::{Run, Summary, median_summary, summarize};
use static_batch::{Arrival, StaticBatcher, WallClock};
use workload::ScaledLengths;

/// The latency columns of the batching and scaling tables, in [`Summary`] order.
const LATENCY_COLUMNS: [&str; 6] = [
    "TTFT p50 (s)",
    "TTFT p99 (s)",
    "TPOT p50 (ms)",
    "TPOT p99 (ms)",
    "E2E p50 (s)",
    "E2E p99 (s)",
];

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// Requests in the batching and scaling workload [default: 32; 12 with --quick].
    #[arg(long, value_name = "N")]
    pub requests: Option<usize>,
    /// Poisson arrival rate, requests per second [default: 8; 400 with --quick].
    #[arg(long, value_name = "R")]
    pub rate: Option<f64>,
    /// Seed of the workload (lengths, arrival times, prompt windows).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Run only this part [default: all].
    #[arg(long, value_enum)]
    pub only: Option<Part>,
    #[command(flatten)]
    pub attention: AttentionArgs,
}

/// A part of the benchmark that runs alone.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// The KV cache's storage dtype: f32 against bf16 (`kv-dtype.md`, `kv-dtype.svg`).
    KvDtype,
    /// 32 sequences at once against llama.cpp's `llama-batched-bench` on the same weights
    /// (`llama-cpp.md`, `llama-cpp.svg`; also part of a full run).
    LlamaCpp,
}

/// Every size of the benchmark, full or --quick.
struct Plan {
    requests: usize,
    rate: f64,
    lengths: ScaledLengths,
    /// max_num_seqs of the scaling sweep: starts at 1 (sequential), ends at `continuous`.
    sweep: Vec<usize>,
    continuous: usize,
    static_batches: Vec<usize>,
    /// max_num_batched_tokens of the batching and scaling runs.
    budget: usize,
    /// Chunked prefill: `decodes` requests of `decode_prompt` + `decode_output` tokens at time
    /// 0, then long prompts (arrival in seconds, length) that generate `long_output` tokens.
    decodes: usize,
    decode_prompt: usize,
    decode_output: usize,
    long_prompts: Vec<(f64, usize)>,
    long_output: usize,
    chunk_budgets: Vec<usize>,
}

impl Plan {
    fn new(args: &Args, max_len: usize) -> anyhow::Result<Self> {
        let quick = args.output.quick;
        let plan = if quick {
            Plan {
                requests: args.requests.unwrap_or(12),
                rate: args.rate.unwrap_or(400.0),
                lengths: ScaledLengths {
                    scale: 1.0 / 16.0,
                    max_prompt: 32,
                    max_output: 16,
                },
                sweep: vec![1, 4, 16],
                continuous: 16,
                static_batches: vec![4],
                budget: 128,
                decodes: 4,
                decode_prompt: 16,
                decode_output: 24,
                long_prompts: vec![(0.02, 192), (0.05, 256)],
                long_output: 4,
                chunk_budgets: vec![32],
            }
        } else {
            Plan {
                requests: args.requests.unwrap_or(32),
                rate: args.rate.unwrap_or(8.0),
                lengths: ScaledLengths {
                    scale: 0.25,
                    max_prompt: 256,
                    max_output: 128,
                },
                sweep: vec![1, 2, 4, 8, 16, 32],
                continuous: 32,
                static_batches: vec![8, 32],
                budget: 512,
                decodes: 8,
                decode_prompt: 64,
                decode_output: 96,
                long_prompts: vec![(1.0, 1024), (3.0, 2048)],
                long_output: 8,
                chunk_budgets: vec![128],
            }
        };
        if plan.requests == 0 || !(plan.rate > 0.0 && plan.rate.is_finite()) {
            bail!("--requests must be at least 1 and --rate a positive number");
        }
        if args.block_size == 0 {
            bail!("--block-size must be at least 1");
        }
        let longest = plan.long_prompts.iter().map(|&(_, l)| l).max().unwrap_or(0);
        if plan.lengths.max_prompt + plan.lengths.max_output > max_len
            || longest + plan.long_output > max_len
        {
            bail!("the benchmark's lengths do not fit the model's context of {max_len} tokens");
        }
        Ok(plan)
    }
}

/// A pool that holds every request of `arrivals` at once (prompt + max_tokens each), plus the
/// engine's 1% watermark: the runs measure batching, never preemption. Its memory is backed
/// already ([`KvPool::populate`]).
pub(crate) fn pool_for<K: KvElement>(
    model: &ch01::Llama,
    block_size: usize,
    arrivals: &[Arrival],
) -> anyhow::Result<KvPool<K>> {
    let blocks: usize = arrivals
        .iter()
        .map(|a| (a.request.prompt.len() + a.request.max_tokens).div_ceil(block_size))
        .sum();
    let mut pool = KvPool::new(&model.config, block_size, blocks + blocks / 50 + 2)?;
    // Backed before the clock starts, as a server does at start-up and llama.cpp's context
    // creation does before its benchmark's timer (chapter 3's `KvPool::populate`).
    pool.populate();
    Ok(pool)
}

/// Runs `serve` `reps` times; the median of each figure.
pub(crate) fn measured(
    label: &str,
    reps: usize,
    mut serve: impl FnMut() -> anyhow::Result<Run>,
) -> anyhow::Result<Summary> {
    let mut runs = Vec::new();
    for _ in 0..reps {
        let start = Instant::now();
        let summary = summarize(&serve()?);
        eprintln!(
            "   {label}: {:.1} output tok/s, TTFT p99 {:.2} s, {:.1} s",
            summary.throughput,
            summary.ttft.p99,
            start.elapsed().as_secs_f64()
        );
        runs.push(summary);
    }
    Ok(median_summary(&runs))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let attention = args.attention.kind();
    let started = Instant::now();
    let facts = RunFacts::collect();
    let reps = args.output.reps(1)?;
    let out = args.output.dir("ch04");
    let loaded = args.model.load()?;
    let model = &loaded.model;
    let max_len = model.config.max_position_embeddings;
    let plan = Plan::new(&args, max_len)?;
    let name = model_name(&args.model.model);
    let bs = args.block_size;
    let threads = rayon::current_num_threads();
    eprintln!("kiln bench ch04: {name}, {threads} threads, {reps} rep(s)");

    let corpus_path = ch01::fixtures_dir().join("corpus/hamlet.txt");
    let text = std::fs::read_to_string(&corpus_path)
        .with_context(|| format!("reading {}", corpus_path.display()))?;
    let corpus = loaded.tokenizer.encode(&text, false)?;
    // Every figure says what ran, where, and with which command.
    let caption = format!(
        "_{name}, f32 weights, KV blocks of {bs}, {}, {}. Command: `{}`._",
        facts.machine(threads),
        super::runs(reps),
        facts.command
    );

    if args.only == Some(Part::KvDtype) {
        eprintln!("== KV cache dtype: f32 against bf16");
        let (kv_md, kv_svg) = kv_dtype::run(
            model,
            &corpus,
            args.output.quick,
            reps,
            bs,
            attention,
            &caption,
        )?;
        write_figures(&out, &[("kv-dtype", Some(&kv_md), &kv_svg)])?;
        eprintln!("in {:.0} s", started.elapsed().as_secs_f64());
        return Ok(());
    }

    let llama_cpp = || -> anyhow::Result<(String, String)> {
        eprintln!("== against llama.cpp: llama-batched-bench on the same work");
        let shape = llama_cpp::Shape::new(args.output.quick);
        llama_cpp::run(model, &name, &corpus, shape, reps, bs, attention, &caption)
    };
    if args.only == Some(Part::LlamaCpp) {
        let (md, svg) = llama_cpp()?;
        write_figures(&out, &[("llama-cpp", Some(&md), &svg)])?;
        eprintln!("in {:.0} s", started.elapsed().as_secs_f64());
        return Ok(());
    }

    let lengths = plan.lengths.sample(plan.requests, args.seed);
    let arrivals = workload::arrivals(&lengths, plan.rate, &corpus, args.seed);
    let engine_config = |max_num_seqs: usize| EngineConfig {
        max_num_seqs,
        max_num_batched_tokens: plan.budget,
        ..EngineConfig::default()
    };

    // Warm up: page in the weights, size the executor's buffers.
    serve::continuous(
        model,
        pool_for::<f32>(model, bs, &arrivals[..1])?,
        engine_config(1),
        attention,
        &arrivals[..1],
        &WallClock::start(),
    )?;

    eprintln!("== scaling: the engine at max_num_seqs {:?}", plan.sweep);
    let mut sweep = Vec::new();
    for &n in &plan.sweep {
        let summary = measured(&format!("max_num_seqs {n}"), reps, || {
            serve::continuous(
                model,
                pool_for::<f32>(model, bs, &arrivals)?,
                engine_config(n),
                attention,
                &arrivals,
                &WallClock::start(),
            )
        })?;
        sweep.push((n, summary));
    }
    let at = |n: usize| sweep.iter().find(|(m, _)| *m == n).expect("in the sweep").1;
    let (sequential, continuous) = (at(1), at(plan.continuous));

    // The same requests submitted together (`vllm bench serve --request-rate inf`): as many
    // run concurrently as max_num_seqs allows, until the queue drains.
    let at_once: Vec<Arrival> = arrivals
        .iter()
        .map(|a| Arrival {
            at: Duration::ZERO,
            request: a.request.clone(),
        })
        .collect();
    eprintln!("== at once: the same requests, all at time 0");
    let mut burst = Vec::new();
    for n in [1, plan.continuous] {
        burst.push(measured(
            &format!("at once, max_num_seqs {n}"),
            reps,
            || {
                serve::continuous(
                    model,
                    pool_for::<f32>(model, bs, &at_once)?,
                    engine_config(n),
                    attention,
                    &at_once,
                    &WallClock::start(),
                )
            },
        )?);
    }
    let (burst_sequential, burst_continuous) = (burst[0], burst[1]);

    eprintln!("== batching: static batches of {:?}", plan.static_batches);
    let mut statics = Vec::new();
    for &b in &plan.static_batches {
        let mut padding = (0, 0);
        let summary = measured(&format!("static batch {b}"), reps, || {
            let mut batcher = StaticBatcher::new(
                CpuExecutor::with_backend(
                    model,
                    pool_for::<f32>(model, bs, &arrivals)?,
                    attention.backend(),
                ),
                b,
            )?;
            let served = batcher.run(&arrivals, &WallClock::start())?;
            let stats = batcher.stats();
            padding = (stats.padded_rows, stats.useful_rows + stats.padded_rows);
            let rows = served.len() as u64 + stats.useful_rows + stats.padded_rows;
            Ok(Run {
                served,
                seqs_per_step: rows as f64 / stats.steps as f64,
            })
        })?;
        statics.push((b, summary, padding));
    }

    eprintln!("== chunked prefill: long prompts among running decodes");
    let chunk_arrivals = chunked_workload(&plan, &corpus, args.seed);
    let decode_ids = 0..plan.decodes;
    let longest = plan.long_prompts.iter().map(|&(_, l)| l).max().unwrap_or(0);
    let mut settings: Vec<(Option<usize>, EngineConfig)> = plan
        .chunk_budgets
        .iter()
        .map(|&b| {
            (
                Some(b),
                EngineConfig {
                    max_num_seqs: plan.continuous,
                    max_num_batched_tokens: b,
                    enable_chunked_prefill: true,
                    ..EngineConfig::default()
                },
            )
        })
        .collect();
    settings.push((
        None,
        EngineConfig {
            max_num_seqs: plan.continuous,
            max_num_batched_tokens: (longest + plan.decodes).next_power_of_two(),
            enable_chunked_prefill: false,
            ..EngineConfig::default()
        },
    ));
    let mut chunked = Vec::new();
    for (budget, config) in settings {
        let label = match budget {
            Some(b) => format!("chunked, budget {b}"),
            None => "whole prompts".to_string(),
        };
        let mut long_ttft = vec![Vec::new(); plan.long_prompts.len()];
        let decodes = measured(&label, reps, || {
            let run = serve::continuous(
                model,
                pool_for::<f32>(model, bs, &chunk_arrivals)?,
                config,
                attention,
                &chunk_arrivals,
                &WallClock::start(),
            )?;
            for (ttft, s) in long_ttft.iter_mut().zip(&run.served[plan.decodes..]) {
                ttft.push((s.token_times[0] - s.arrival).as_secs_f64());
            }
            Ok(Run {
                served: run.served[decode_ids.clone()].to_vec(),
                ..run
            })
        })?;
        let long_ttft: Vec<f64> = long_ttft
            .iter()
            .map(|t| serve::percentile(t, 50.0))
            .collect();
        chunked.push((label, config.max_num_batched_tokens, decodes, long_ttft));
    }

    // ─────────────────────────────── tables and plots ───────────────────────────────
    let secs = |x: f64| format!("{x:.2}");
    let millis = |x: f64| format!("{:.0}", 1e3 * x);
    let latency_cells = |s: &Summary| {
        [
            format!("{:.1}", s.seqs_per_step),
            secs(s.ttft.p50),
            secs(s.ttft.p99),
            millis(s.tpot.p50),
            millis(s.tpot.p99),
            secs(s.e2e.p50),
            secs(s.e2e.p99),
        ]
    };
    let best = sweep
        .iter()
        .map(|(_, s)| s.throughput)
        .chain(statics.iter().map(|(_, s, _)| s.throughput))
        .fold(0.0, f64::max);
    let requests = plan.requests;
    let workload_text = workload_text(&plan, &lengths, args.seed, corpus.len(), best);

    let mut batching = Table::new(
        ["engine", "output tok/s", "× sequential", "seqs per step"]
            .into_iter()
            .chain(LATENCY_COLUMNS),
    )
    .align(0, Align::Left);
    let mut row = |label: String, s: &Summary, baseline: &Summary| {
        let mut cells = vec![
            label,
            format!("{:.1}", s.throughput),
            format!("{:.2}", s.throughput / baseline.throughput),
        ];
        cells.extend(latency_cells(s));
        batching.row(cells);
    };
    row(
        "sequential (max_num_seqs 1)".into(),
        &sequential,
        &sequential,
    );
    for (b, s, _) in &statics {
        row(format!("static batching, batch {b}"), s, &sequential);
    }
    row(
        format!("continuous batching, max_num_seqs {}", plan.continuous),
        &continuous,
        &sequential,
    );
    row(
        format!("all {requests} at once: sequential"),
        &burst_sequential,
        &burst_sequential,
    );
    row(
        format!(
            "all {requests} at once: continuous, max_num_seqs {}",
            plan.continuous
        ),
        &burst_continuous,
        &burst_sequential,
    );
    let padding_text = statics
        .iter()
        .map(|(b, _, (padded, rows))| {
            format!(
                "batch {b}: {:.0}% of decode rows were padding",
                100.0 * *padded as f64 / (*rows).max(1) as f64
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let speedup = continuous.throughput / sequential.throughput;
    let burst_speedup = burst_continuous.throughput / burst_sequential.throughput;
    let batching_md = format!(
        "{}\n{workload_text}\n\nSequential is the engine with max_num_seqs 1: one request at a \
         time, first come first served. Static batching admits up to its batch size of the \
         requests that have arrived and nothing more until the batch's longest request is done \
         ({padding_text}). Throughput: output tokens over the time from the first arrival to \
         the last token. Seqs per step: the mean number of sequences in a forward pass (a static \
         batch's finished sequences included). TTFT: arrival to first token, queueing included. TPOT: per request, \
         the time between its first and last token over its tokens after the first. E2E: \
         arrival to last token. The last two rows serve the same {requests} requests submitted \
         together at time 0 (`vllm bench serve --request-rate inf`); their × column is against \
         the sequential engine on that same submission.\n\nWith all {requests} requests \
         submitted concurrently, continuous batching at max_num_seqs {} served \
         **{burst_speedup:.2}×** the sequential throughput (target at 32 concurrent requests: \
         at least 4×, {}). On the Poisson stream, where fewer run at once, it served \
         **{speedup:.2}×**.\n\n{caption}\n",
        batching.to_markdown(),
        plan.continuous,
        if burst_speedup >= 4.0 {
            "met"
        } else {
            "not met"
        },
    );
    let mut bars: Vec<(String, f64)> = vec![("sequential".into(), sequential.throughput)];
    bars.extend(
        statics
            .iter()
            .map(|(b, s, _)| (format!("static, batch {b}"), s.throughput)),
    );
    bars.push((
        format!("continuous, {} seqs", plan.continuous),
        continuous.throughput,
    ));
    let burst_bars = [
        ("sequential".to_string(), burst_sequential.throughput),
        (
            format!("continuous, {} seqs", plan.continuous),
            burst_continuous.throughput,
        ),
    ];
    let batching_chart = BarChart::new(format!("Serving {requests} requests, {name}"))
        .x_label("output tokens/s")
        .group("Poisson stream", &bars)
        .group(format!("all {requests} at once"), &burst_bars);
    let batching_svg = batching_chart.to_svg();

    let mut chunk_table = Table::new([
        "prefill",
        "token budget",
        "decode ITL p50 (ms)",
        "decode ITL p99 (ms)",
        "decode ITL max (ms)",
        "long prompts' TTFT (s)",
        "decodes done (s)",
    ])
    .align(0, Align::Left);
    for (label, budget, s, long) in &chunked {
        chunk_table.row([
            label.clone(),
            budget.to_string(),
            millis(s.itl.p50),
            millis(s.itl.p99),
            millis(s.itl.max),
            long.iter()
                .map(|&t| secs(t))
                .collect::<Vec<_>>()
                .join(" / "),
            secs(s.makespan),
        ]);
    }
    let long_text = plan
        .long_prompts
        .iter()
        .map(|&(t, l)| format!("{l} tokens at {t} s"))
        .collect::<Vec<_>>()
        .join(" and ");
    let chunked_md = format!(
        "{}\n{} requests of {} prompt tokens each decode {} tokens from time 0; long prompts of \
         {long_text} arrive among them (each generating {} tokens). Inter-token latency (ITL): \
         every gap between two consecutive tokens of the decoding requests. Whole prompts: the \
         token budget fits the longest prompt, which runs in one step. Chunked: a step holds at \
         most the budget's tokens, decodes first, then a chunk of the prompt. Prompts are \
         windows of Hamlet; max_num_seqs {}.\n\n{caption}\n",
        chunk_table.to_markdown(),
        plan.decodes,
        plan.decode_prompt,
        plan.decode_output,
        plan.long_output,
        plan.continuous,
    );
    let mut chunk_chart = BarChart::new(format!("ITL of running decodes, {name}")).x_label("ms");
    for (stat, pick) in [
        ("p50", (|s: &Summary| s.itl.p50) as fn(&Summary) -> f64),
        ("p99", |s: &Summary| s.itl.p99),
        ("max", |s: &Summary| s.itl.max),
    ] {
        let bars: Vec<(String, f64)> = chunked
            .iter()
            .map(|(label, _, s, _)| (label.clone(), 1e3 * pick(s)))
            .collect();
        chunk_chart = chunk_chart.group(format!("ITL {stat}"), &bars);
    }
    let chunked_svg = chunk_chart.to_svg();

    let mut scaling = Table::new(
        [
            "max_num_seqs",
            "output tok/s",
            "× max_num_seqs 1",
            "seqs per step",
        ]
        .into_iter()
        .chain(LATENCY_COLUMNS),
    );
    for (n, s) in &sweep {
        let mut cells = vec![
            n.to_string(),
            format!("{:.1}", s.throughput),
            format!("{:.2}", s.throughput / sequential.throughput),
        ];
        cells.extend(latency_cells(s));
        scaling.row(cells);
    }
    let scaling_md = format!(
        "{}\nThe batching table's workload, served by the engine with max_num_seqs from {} to \
         {} (token budget {}, chunked prefill on).\n\n{caption}\n",
        scaling.to_markdown(),
        plan.sweep[0],
        plan.continuous,
        plan.budget
    );
    let points = |f: fn(&Summary) -> f64| -> Vec<(f64, f64)> {
        sweep.iter().map(|(n, s)| (*n as f64, f(s))).collect()
    };
    let scaling_svg = LinePlot::new(format!("Throughput vs max_num_seqs, {name}"))
        .x_label("max_num_seqs")
        .y_label("output tokens/s")
        .log_x()
        .series("continuous batching", &points(|s| s.throughput))
        .to_svg();
    let scaling_latency_svg = LinePlot::new(format!("p99 latency vs max_num_seqs, {name}"))
        .x_label("max_num_seqs")
        .y_label("seconds")
        .log_x()
        .log_y()
        .series("TTFT p99", &points(|s| s.ttft.p99))
        .series("E2E p99", &points(|s| s.e2e.p99))
        .series("TPOT p99", &points(|s| s.tpot.p99))
        .to_svg();

    eprintln!("== KV cache dtype: f32 against bf16");
    let (kv_md, kv_svg) = kv_dtype::run(
        model,
        &corpus,
        args.output.quick,
        reps,
        bs,
        attention,
        &caption,
    )?;

    let (llama_md, llama_svg) = llama_cpp()?;

    write_figures(
        &out,
        &[
            ("llama-cpp", Some(&llama_md), &llama_svg),
            ("kv-dtype", Some(&kv_md), &kv_svg),
            ("batching", Some(&batching_md), &batching_svg),
            ("chunked", Some(&chunked_md), &chunked_svg),
            ("scaling", Some(&scaling_md), &scaling_svg),
            ("scaling-latency", None, &scaling_latency_svg),
        ],
    )?;
    eprintln!("in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The chunked-prefill workload: decodes from time 0, then the long prompts.
fn chunked_workload(plan: &Plan, corpus: &[u32], seed: u64) -> Vec<Arrival> {
    let mut rng = WorkloadRng::new(seed ^ 0xc4a2);
    let decodes: Vec<Arrival> = (0..plan.decodes)
        .map(|_| Arrival {
            at: Duration::ZERO,
            request: workload::fixed_length(
                workload::window(corpus, plan.decode_prompt, &mut rng),
                plan.decode_output,
            ),
        })
        .collect();
    let longs = plan.long_prompts.iter().map(|&(t, len)| Arrival {
        at: Duration::from_secs_f64(t),
        request: workload::fixed_length(workload::window(corpus, len, &mut rng), plan.long_output),
    });
    decodes.into_iter().chain(longs).collect()
}

/// The workload, in words, with its measured lengths.
/// `best`: the highest throughput measured on it.
fn workload_text(
    plan: &Plan,
    lengths: &[RequestLengths],
    seed: u64,
    corpus: usize,
    best: f64,
) -> String {
    let mean = |f: fn(&RequestLengths) -> usize| {
        lengths.iter().map(f).sum::<usize>() as f64 / lengths.len() as f64
    };
    let offered = plan.rate * mean(|r| r.output_len);
    let outputs: Vec<f64> = lengths.iter().map(|r| r.output_len as f64).collect();
    let l = &plan.lengths;
    format!(
        "Workload: {} requests arriving as a Poisson process at {} requests/s (seed {seed}), \
         an offered load of about {:.0} output tokens/s{}. \
         Lengths: chapter 2's ShareGPT-like log-normals with both medians scaled by {} (prompt \
         median {:.0}, σ {:.1}; output median {:.0}, σ {:.1}), clipped to at most {} prompt and {} \
         output tokens so that the run fits in minutes on a CPU; this sample: mean prompt {:.0}, \
         mean output {:.0}, median output {:.0}, longest output {:.0} tokens. Prompts are \
         windows of Hamlet ({corpus} tokens with this model's tokenizer); every request is \
         greedy and generates exactly its output length (ignore_eos). The KV pool holds the \
         whole workload at once, so nothing is preempted.",
        plan.requests,
        plan.rate,
        offered,
        if offered > best {
            " (more than any engine here serves, so each one's throughput is its capacity)"
        } else {
            ""
        },
        l.scale,
        l.prompt().median(),
        l.prompt().sigma(),
        l.output().median(),
        l.output().sigma(),
        l.max_prompt,
        l.max_output,
        mean(|r| r.prompt_len),
        mean(|r| r.output_len),
        serve::percentile(&outputs, 50.0),
        serve::percentile(&outputs, 100.0),
    )
}
