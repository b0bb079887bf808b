//! `kiln bench ch06`: what speculative decoding buys, and when.
//!
//! ```text
//! acceptance  shakespeare-small as the target, three drafters (n-gram lookup, shakespeare-tiny,
//!             the target's first half of layers), temperature 0 and 0.8: acceptance rate α
//!             (from k = 1, where accepted / drafted is α itself) and at k = 4
//! tokens      mean tokens per target step for k = 1..8, against (1 − α^(k+1)) / (1 − α)
//! speedup     batch 1, decode only: SmolLM2 (--model) with n-gram lookup on prompts that ask
//!             it to repeat a quoted passage; the Shakespeare pair with every drafter;
//!             outputs compared with the target alone, token for token
//! batch       output tokens/s with and without speculation at batch 1, 4, 16, 32
//! ```
//! Writes `acceptance.md`, `tokens-per-step.svg` (+ `.md`), `speedup.md` (+ `.svg`) and
//! `batch.md` (+ `.svg`) into `book/src/ch06/` (or `--out`).

mod workload;

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ch01::Llama;
use ch03::KvPool;
use ch04::{Completion, Counters, CpuExecutor, Engine, EngineConfig, Request, Speculator};
use ch06::{
    ModelDrafter, NgramDrafter, SpecConfig, SpeculativeDecoding, draft_executor,
    layer_skip_executor,
};

use super::bars::BarChart;
use super::svg::LinePlot;
use super::table::{Align, Table};
use super::{Output, RunFacts, model_name, write_figures};
use crate::commands::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model of the n-gram speed-up and batch runs (SmolLM2-135M-Instruct in the book).
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
}

/// The drafters measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Ngram,
    Draft,
    LayerSkip,
}

impl Method {
    const ALL: [Method; 3] = [Method::Ngram, Method::Draft, Method::LayerSkip];

    fn name(self) -> &'static str {
        match self {
            Method::Ngram => "n-gram lookup (n = 1..4)",
            Method::Draft => "draft model shakespeare-tiny",
            Method::LayerSkip => "layer skip (first 3 of 6 layers)",
        }
    }
}

/// A speculator of `method` over `target` (and `draft` for the draft model), k drafts.
fn speculator<'m>(
    method: Method,
    target: &'m Llama,
    draft: &'m Llama,
    k: usize,
    block_size: usize,
) -> anyhow::Result<Box<dyn Speculator + 'm>> {
    let config = SpecConfig {
        num_speculative_tokens: k,
        disable_by_batch_size: None,
    };
    let vocab = target.config.vocab_size;
    let memory = 64 << 20;
    Ok(match method {
        Method::Ngram => Box::new(SpeculativeDecoding::new(NgramDrafter::new(1, 4)?, config)),
        Method::Draft => Box::new(SpeculativeDecoding::new(
            ModelDrafter::new(draft_executor(draft, block_size, memory)?, vocab)?,
            config,
        )),
        Method::LayerSkip => Box::new(SpeculativeDecoding::new(
            ModelDrafter::new(
                layer_skip_executor(target, target.layers.len() / 2, block_size, memory)?,
                vocab,
            )?,
            config,
        )),
    })
}

/// What one engine run produced.
struct Measured {
    completions: Vec<Completion>,
    counters: Counters,
    /// From the start to the last token.
    wall: Duration,
    /// From the first request's first token to the last token (batch 1: decode only).
    decode: Duration,
}

impl Measured {
    fn output_tokens(&self) -> usize {
        self.completions.iter().map(|c| c.tokens.len()).sum()
    }

    /// Tokens per second after the first token of the first request (decode speed at batch 1).
    fn decode_rate(&self) -> f64 {
        let tokens = self.output_tokens().saturating_sub(self.completions.len());
        tokens as f64 / self.decode.as_secs_f64()
    }

    fn throughput(&self) -> f64 {
        self.output_tokens() as f64 / self.wall.as_secs_f64()
    }

    /// Mean tokens a verification step yields (accepted drafts + 1).
    fn tokens_per_step(&self) -> f64 {
        let c = &self.counters;
        (c.spec_decode_num_accepted_tokens + c.spec_decode_num_drafts) as f64
            / c.spec_decode_num_drafts as f64
    }

    fn acceptance(&self) -> f64 {
        let c = &self.counters;
        c.spec_decode_num_accepted_tokens as f64 / c.spec_decode_num_draft_tokens as f64
    }
}

/// Runs `requests` together through an engine over `model` (max_num_seqs = their number),
/// with `speculator` if given.
fn run_engine<'m>(
    model: &'m Llama,
    speculator: Option<Box<dyn Speculator + 'm>>,
    requests: &[Request],
    block_size: usize,
) -> anyhow::Result<Measured> {
    let blocks: usize = requests
        .iter()
        .map(|r| (r.prompt.len() + r.max_tokens).div_ceil(block_size) + 1)
        .sum();
    let pool = KvPool::<f32>::new(&model.config, block_size, blocks + blocks / 50 + 2)?;
    let config = EngineConfig {
        max_num_seqs: requests.len(),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(CpuExecutor::new(model, pool), config)?;
    if let Some(speculator) = speculator {
        engine = engine.with_speculator(speculator);
    }
    let start = Instant::now();
    let ids = requests
        .iter()
        .map(|r| engine.add_request(r.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut first_token = None;
    while engine.has_unfinished() {
        let outputs = engine.step_or_stall()?;
        if first_token.is_none() && outputs.iter().any(|o| !o.new_tokens.is_empty()) {
            first_token = Some(Instant::now());
        }
    }
    let end = Instant::now();
    let completions = ids
        .into_iter()
        .map(|id| engine.take(id).context("a finished request"))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Measured {
        completions,
        counters: engine.scheduler().counters(),
        wall: end - start,
        decode: end - first_token.unwrap_or(start),
    })
}

/// The median by `key` of `reps` runs.
fn median_of(
    reps: usize,
    key: impl Fn(&Measured) -> f64,
    mut run: impl FnMut() -> anyhow::Result<Measured>,
) -> anyhow::Result<Measured> {
    let mut runs = (0..reps)
        .map(|_| run())
        .collect::<anyhow::Result<Vec<_>>>()?;
    runs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    Ok(runs.swap_remove(runs.len() / 2))
}

/// Decode tokens, seconds and drafts summed over several measured runs (a workload as one).
#[derive(Debug, Default, Clone, Copy)]
struct DecodeTotal {
    tokens: usize,
    seconds: f64,
    drafts: u64,
    accepted: u64,
}

impl DecodeTotal {
    fn add(&mut self, run: &Measured) {
        self.tokens += run.output_tokens().saturating_sub(run.completions.len());
        self.seconds += run.decode.as_secs_f64();
        self.drafts += run.counters.spec_decode_num_draft_tokens;
        self.accepted += run.counters.spec_decode_num_accepted_tokens;
    }

    /// Decode tokens/s of the whole workload.
    fn rate(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }

    /// Accepted draft tokens over proposed ones, over the whole workload.
    fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafts.max(1) as f64
    }
}

/// Whether every completion of `a` equals `b`'s, token for token.
fn same_tokens(a: &Measured, b: &Measured) -> bool {
    a.completions
        .iter()
        .zip(&b.completions)
        .all(|(x, y)| x.tokens == y.tokens)
}

fn yes_no(same: bool) -> &'static str {
    if same { "yes" } else { "NO" }
}

/// Every size of the benchmark, full or `--quick`.
struct Plan {
    /// Acceptance workload: prompts of `prompt_len` corpus tokens, `output` tokens each.
    prompts: usize,
    prompt_len: usize,
    output: usize,
    ks: Vec<usize>,
    /// Batch-1 speed-up: grounded prompts on --model, `grounded_output` tokens each.
    grounded: usize,
    grounded_output: usize,
    batches: Vec<usize>,
    batch_output: usize,
}

impl Plan {
    fn new(quick: bool) -> Self {
        if quick {
            Plan {
                prompts: 2,
                prompt_len: 16,
                output: 16,
                ks: vec![1, 2, 4],
                grounded: 1,
                grounded_output: 24,
                batches: vec![1, 4],
                batch_output: 16,
            }
        } else {
            Plan {
                prompts: 8,
                prompt_len: 48,
                output: 96,
                ks: (1..=8).collect(),
                grounded: 4,
                grounded_output: 160,
                batches: vec![1, 4, 16, 32],
                batch_output: 64,
            }
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let facts = RunFacts::collect();
    let quick = args.output.quick;
    let reps = args.output.reps(3)?;
    let out = args.output.dir("ch06");
    let plan = Plan::new(quick);
    let bs = args.block_size;
    ensure!(bs >= 1, "--block-size must be at least 1");
    let threads = rayon::current_num_threads();

    let fixtures = ch01::fixtures_dir();
    let target_args = ModelArgs::cpu(fixtures.join("shakespeare-small"));
    let draft_args = ModelArgs::cpu(fixtures.join("shakespeare-tiny"));
    let target = target_args.load()?;
    let draft = draft_args.load()?;
    let big = args.model.load()?;
    let big_name = model_name(&args.model.model);
    eprintln!(
        "kiln bench ch06: shakespeare-small + shakespeare-tiny, {big_name}, {threads} threads"
    );
    let caption_with = |runs: &str| {
        format!(
            "_f32 weights, KV blocks of {bs}, {}, {runs}. Command: `{}`._",
            facts.machine(threads),
            facts.command
        )
    };
    let caption = format!(
        "_f32 weights, KV blocks of {bs}, {}, {}. Command: `{}`._",
        facts.machine(threads),
        crate::bench::runs(reps),
        facts.command
    );

    let corpus_path = fixtures.join("corpus/hamlet.txt");
    let text = std::fs::read_to_string(&corpus_path)
        .with_context(|| format!("reading {}", corpus_path.display()))?;
    let shakespeare = workload::corpus_prompts(
        &target.tokenizer.encode(&text, false)?,
        target.tokenizer.bos_token_id(),
        plan.prompts,
        plan.prompt_len,
    );
    let (model, tiny) = (&target.model, &draft.model);

    // Warm up: page in the weights, size the buffers.
    let warm = workload::requests(&shakespeare[..1], 4, 0.0, &[]);
    run_engine(
        model,
        Some(speculator(Method::Draft, model, tiny, 2, bs)?),
        &warm,
        bs,
    )?;

    // ---- acceptance and tokens per step ---------------------------------------------------
    eprintln!("== acceptance: k = {:?}, temperature 0 and 0.8", plan.ks);
    let mut acceptance = Table::new([
        "drafter",
        "temperature",
        "α (k = 1)",
        "acceptance at k = 4",
        "tokens per step at k = 4",
    ])
    .align(0, Align::Left);
    let mut tokens_table = Table::new(
        std::iter::once("drafter, temperature".to_string())
            .chain(plan.ks.iter().map(|k| format!("k = {k}"))),
    )
    .align(0, Align::Left);
    let mut plot = LinePlot::new(
        "Mean tokens per target step: measured (solid) and (1 − α^(k+1)) / (1 − α) (dashed)",
    )
    .x_label("draft tokens per step, k")
    .y_label("tokens per target step");
    let mut alphas: Vec<(Method, [f64; 2])> =
        Method::ALL.iter().map(|&m| (m, [f64::NAN; 2])).collect();
    for (t, temperature) in [0.0f32, 0.8].into_iter().enumerate() {
        let requests = workload::requests(&shakespeare, plan.output, temperature, &[]);
        for method in Method::ALL {
            let mut per_k = Vec::new();
            for &k in &plan.ks {
                let m = run_engine(
                    model,
                    Some(speculator(method, model, tiny, k, bs)?),
                    &requests,
                    bs,
                )?;
                per_k.push((k, m));
            }
            let at = |k: usize| per_k.iter().find(|(j, _)| *j == k).map(|(_, m)| m);
            let alpha = at(1).map_or(f64::NAN, Measured::acceptance);
            if let Some(entry) = alphas.iter_mut().find(|(m, _)| *m == method) {
                entry.1[t] = alpha;
            }
            let at4 = at(4);
            eprintln!("   {} at T = {temperature}: α = {alpha:.3}", method.name());
            acceptance.row([
                method.name().to_string(),
                format!("{temperature}"),
                format!("{alpha:.3}"),
                at4.map_or("–".into(), |m| format!("{:.3}", m.acceptance())),
                at4.map_or("–".into(), |m| format!("{:.2}", m.tokens_per_step())),
            ]);
            let label = format!("{}, T = {temperature}", method.name());
            tokens_table.row(
                std::iter::once(label.clone()).chain(
                    per_k
                        .iter()
                        .map(|(_, m)| format!("{:.2}", m.tokens_per_step())),
                ),
            );
            if temperature == 0.0 {
                let measured: Vec<(f64, f64)> = per_k
                    .iter()
                    .map(|(k, m)| (*k as f64, m.tokens_per_step()))
                    .collect();
                let formula: Vec<(f64, f64)> = plan
                    .ks
                    .iter()
                    .map(|&k| (k as f64, expected_tokens(alpha, k)))
                    .collect();
                plot = plot
                    .series(method.name(), &measured)
                    .reference(format!("formula, α = {alpha:.2}"), &formula);
            }
        }
    }
    let mut formula_row = vec!["(1 − α^(k+1)) / (1 − α), α = 0.5".to_string()];
    formula_row.extend(
        plan.ks
            .iter()
            .map(|&k| format!("{:.2}", expected_tokens(0.5, k))),
    );
    tokens_table.row(formula_row);
    let mut alpha_chart =
        BarChart::new("Acceptance rate α of each drafter, target shakespeare-small (k = 1)")
            .x_label("α: accepted / drafted");
    for (method, [greedy, sampled]) in &alphas {
        alpha_chart = alpha_chart.group(
            method.name(),
            &[("temperature 0", *greedy), ("temperature 0.8", *sampled)],
        );
    }
    let acceptance_md = format!(
        "{}\n_The target shakespeare-small; {} prompts of {} tokens from Hamlet, {} tokens each, \
         all at once. α: accepted / drafted at k = 1. Tokens per step: (accepted + \
         verifications) / verifications._ {caption}\n",
        acceptance.to_markdown(),
        plan.prompts,
        plan.prompt_len,
        plan.output
    );
    let tokens_md = format!(
        "{}\n_Mean tokens per verification step, same runs as the acceptance table. The last \
         row is the formula at α = 0.5 for scale._ {caption}\n",
        tokens_table.to_markdown()
    );

    // ---- batch-1 speed-up ------------------------------------------------------------------
    eprintln!("== speed-up at batch 1 (decode only)");
    let mut speedup = Table::new([
        "target",
        "drafter",
        "k",
        "target alone (tok/s)",
        "speculative (tok/s)",
        "speed-up",
        "acceptance",
        "same tokens",
    ])
    .align(0, Align::Left)
    .align(1, Align::Left);
    let mut bars = Vec::new();
    // SmolLM2 (or --model) with n-gram lookup on grounded prompts.
    let grounded = workload::grounded_prompts(&big.tokenizer, &text, plan.grounded)?;
    let ks = [2, 4, 8];
    // The whole workload: decode tokens and seconds summed over the passages, alone and per k.
    let mut workload_alone = DecodeTotal::default();
    let mut workload_spec = [DecodeTotal::default(); 3];
    let mut workload_same = true;
    for (i, prompt) in grounded.iter().enumerate() {
        let request = workload::requests(
            std::slice::from_ref(prompt),
            plan.grounded_output,
            0.0,
            &big.eos_token_ids,
        );
        let alone = median_of(reps, Measured::decode_rate, || {
            run_engine(&big.model, None, &request, bs)
        })?;
        workload_alone.add(&alone);
        for (j, k) in ks.into_iter().enumerate() {
            let spec = median_of(reps, Measured::decode_rate, || {
                let drafter = NgramDrafter::new(1, 4)?;
                let config = SpecConfig {
                    num_speculative_tokens: k,
                    disable_by_batch_size: None,
                };
                run_engine(
                    &big.model,
                    Some(Box::new(SpeculativeDecoding::new(drafter, config))),
                    &request,
                    bs,
                )
            })?;
            workload_spec[j].add(&spec);
            workload_same &= same_tokens(&alone, &spec);
            let ratio = spec.decode_rate() / alone.decode_rate();
            eprintln!("   {big_name} prompt {i}, n-gram k = {k}: {ratio:.2}x");
            speedup.row([
                format!("{big_name}, passage {i}"),
                "n-gram lookup (n = 1..4)".into(),
                k.to_string(),
                format!("{:.1}", alone.decode_rate()),
                format!("{:.1}", spec.decode_rate()),
                format!("{ratio:.2}x"),
                format!("{:.3}", spec.acceptance()),
                yes_no(same_tokens(&alone, &spec)).into(),
            ]);
            if k == 4 {
                bars.push((format!("{big_name} passage {i}, n-gram k = 4"), ratio));
            }
        }
    }
    // The workload as one: every passage's decode tokens over every passage's decode time.
    for (k, spec) in ks.into_iter().zip(&workload_spec) {
        let ratio = spec.rate() / workload_alone.rate();
        eprintln!("   {big_name}, all passages, n-gram k = {k}: {ratio:.2}x");
        speedup.row([
            format!("{big_name}, all {} passages", grounded.len()),
            "n-gram lookup (n = 1..4)".into(),
            k.to_string(),
            format!("{:.1}", workload_alone.rate()),
            format!("{:.1}", spec.rate()),
            format!("{ratio:.2}x"),
            format!("{:.3}", spec.acceptance()),
            yes_no(workload_same).into(),
        ]);
        if k == 4 {
            bars.push((format!("{big_name} all passages, n-gram k = 4"), ratio));
        }
    }
    // The Shakespeare pair, every drafter.
    let one = workload::requests(&shakespeare[..1], plan.output, 0.0, &[]);
    let alone = median_of(reps, Measured::decode_rate, || {
        run_engine(model, None, &one, bs)
    })?;
    for method in Method::ALL {
        let k = 4;
        let spec = median_of(reps, Measured::decode_rate, || {
            run_engine(
                model,
                Some(speculator(method, model, tiny, k, bs)?),
                &one,
                bs,
            )
        })?;
        let ratio = spec.decode_rate() / alone.decode_rate();
        eprintln!("   shakespeare-small, {}: {ratio:.2}x", method.name());
        speedup.row([
            "shakespeare-small".to_string(),
            method.name().into(),
            k.to_string(),
            format!("{:.1}", alone.decode_rate()),
            format!("{:.1}", spec.decode_rate()),
            format!("{ratio:.2}x"),
            format!("{:.3}", spec.acceptance()),
            yes_no(same_tokens(&alone, &spec)).into(),
        ]);
        bars.push((format!("shakespeare-small, {}", method.name()), ratio));
    }
    let speedup_md = format!(
        "{}\n_Greedy, one request at a time; decode tokens/s from the first token to the last. \
         {big_name}: {} prompts asking it to repeat a quoted Hamlet passage, its answer begun with \
         the passage's first speech, up to {} tokens (it stops at its end-of-sequence token). shakespeare-small: one Hamlet prompt, {} tokens. \
         \"same tokens\": the speculative output equals the target alone's._ {caption}\n",
        speedup.to_markdown(),
        plan.grounded,
        plan.grounded_output,
        plan.output
    );
    let mut chart = BarChart::new("Batch-1 decode speed-up of speculative decoding (greedy)")
        .x_label("speed-up over the target alone (×)")
        .reference("no speed-up", 1.0);
    for (name, ratio) in &bars {
        chart = chart.group(name.clone(), &[("speed-up", *ratio)]);
    }

    // ---- batch size ------------------------------------------------------------------------
    eprintln!("== speed-up against batch size {:?}", plan.batches);
    let mut batch = Table::new([
        "target, drafter",
        "batch",
        "target alone (tok/s)",
        "speculative (tok/s)",
        "speed-up",
        "acceptance",
        "same tokens",
    ])
    .align(0, Align::Left);
    let mut batch_plot =
        LinePlot::new("Speed-up of speculative decoding against batch size (greedy, k = 4)")
            .log_x()
            .x_label("requests decoding together")
            .y_label("output tokens/s, speculative / target alone");
    /// One series of the batch sweep.
    struct Case<'a> {
        name: String,
        model: &'a Llama,
        method: Method,
        prompts: &'a [Vec<u32>],
        eos: &'a [u32],
    }
    let cases = [
        Case {
            name: "shakespeare-small, draft model".into(),
            model,
            method: Method::Draft,
            prompts: &shakespeare,
            eos: &[],
        },
        Case {
            name: format!("{big_name}, n-gram lookup"),
            model: &big.model,
            method: Method::Ngram,
            prompts: &grounded,
            eos: &big.eos_token_ids,
        },
    ];
    for case in &cases {
        let (label, target_model, method) = (&case.name, case.model, case.method);
        let mut points = Vec::new();
        for &b in &plan.batches {
            let chosen: Vec<Vec<u32>> = case.prompts.iter().cycle().take(b).cloned().collect();
            let requests = workload::requests(&chosen, plan.batch_output, 0.0, case.eos);
            // One run each: the sweep is the long part of the benchmark.
            let alone = median_of(1, Measured::throughput, || {
                run_engine(target_model, None, &requests, bs)
            })?;
            let spec = median_of(1, Measured::throughput, || {
                run_engine(
                    target_model,
                    Some(speculator(method, target_model, tiny, 4, bs)?),
                    &requests,
                    bs,
                )
            })?;
            let ratio = spec.throughput() / alone.throughput();
            eprintln!("   {label}, batch {b}: {ratio:.2}x");
            batch.row([
                label.clone(),
                b.to_string(),
                format!("{:.1}", alone.throughput()),
                format!("{:.1}", spec.throughput()),
                format!("{ratio:.2}x"),
                format!("{:.3}", spec.acceptance()),
                yes_no(same_tokens(&alone, &spec)).into(),
            ]);
            points.push((b as f64, ratio));
        }
        batch_plot = batch_plot.series(label.clone(), &points);
    }
    let flat: Vec<(f64, f64)> = plan.batches.iter().map(|&b| (b as f64, 1.0)).collect();
    batch_plot = batch_plot.reference("no speed-up", &flat);
    let batch_md = format!(
        "{}\n_Greedy, k = 4, the requests submitted together; output tokens/s over the whole run \
         (prefill included). shakespeare-small: Hamlet prompts, {} tokens each; {big_name}: the \
         repeat-the-passage prompts, up to {} tokens (end-of-sequence stops)._ {}\n",
        batch.to_markdown(),
        plan.batch_output,
        plan.batch_output,
        caption_with("one run per cell")
    );

    write_figures(
        &out,
        &[
            ("acceptance", Some(&acceptance_md), &alpha_chart.to_svg()),
            ("tokens-per-step", Some(&tokens_md), &plot.to_svg()),
            ("speedup", Some(&speedup_md), &chart.to_svg()),
            ("batch", Some(&batch_md), &batch_plot.to_svg()),
        ],
    )?;
    eprintln!("in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

// ANCHOR: expected_tokens
/// Expected tokens per target step with k drafts each accepted with probability α
/// (independently): 1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α).
fn expected_tokens(alpha: f64, k: usize) -> f64 {
    if (1.0 - alpha).abs() < 1e-12 {
        return (k + 1) as f64;
    }
    (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
}
// ANCHOR_END: expected_tokens

#[cfg(test)]
mod tests {
    use super::expected_tokens;

    #[test]
    fn the_formula_is_the_geometric_sum() {
        assert_eq!(expected_tokens(0.0, 5), 1.0);
        assert_eq!(expected_tokens(1.0, 3), 4.0);
        let direct: f64 = (0..=4).map(|i| 0.6f64.powi(i)).sum();
        assert!((expected_tokens(0.6, 4) - direct).abs() < 1e-12);
    }
}
