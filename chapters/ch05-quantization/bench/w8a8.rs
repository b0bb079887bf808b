//! `kiln bench ch05 --only w8a8`: int8 weights and activations on SmolLM2-135M, naive and with
//! SmoothQuant's migration: perplexity on Hamlet (chunks of 512, part 1's scheme) and decode
//! and prefill tokens/s at b=1, beside f32, bf16 and int8 weights with f32 activations; and the
//! per-channel activation maxima of one layer's q/k/v input before and after smoothing.
//!
//! ```text
//! f32, bf16        chapter 2's FastLinear
//! RTN int8 W8A16   every projection int8 per output channel (round to nearest), f32 activations
//! W8A8 naive       the same weights, activations int8 per token, i32 sums (W8A8Quantizer)
//! SmoothQuant      the same loader on the smoothed checkpoint (α = 0.5), o_proj naive or
//!                  smoothed through v_proj (one factor per KV channel)
//! ```
//! The output head (tied to the embedding) stays f32 in every int8 row. Calibration: the
//! training plays (never Hamlet), `--samples` x `--seq-len` tokens, as GPTQ and AWQ use. With
//! `--quick` the default model, short sequences, two chunks of 64 and the committed sample text.

use ch01::{Llama, TensorParallel, Weights};
use ch05::smoothquant::{
    Int8Activations, LayerStats, SmoothConfig, SmoothedSource, W8A8Quantizer, calibrate, smooth,
};

use super::super::ch02::speed::{self, Speed};
use super::super::{RunFacts, bench_tokens, write_figures};
use super::part2_shared;
use crate::bench::bars::BarChart;
use crate::bench::svg::LinePlot;
use crate::bench::table::{Align, Table};
use crate::commands::{ModelArgs, quantize_hf};

/// The settings of one run.
pub struct Settings {
    pub quick: bool,
    pub reps: usize,
    pub prompt: usize,
    pub decode: usize,
    pub chunks: usize,
    pub samples: usize,
    pub seq_len: usize,
}

#[derive(Clone, Copy)]
enum Kind {
    F32,
    Bf16,
    W8A16,
    Naive,
    Smooth { o_proj: bool },
}

const VARIANTS: [(&str, &str, &str, Kind); 6] = [
    ("f32", "f32", "f32", Kind::F32),
    ("bf16", "bf16", "f32", Kind::Bf16),
    ("RTN int8", "int8 / channel", "f32", Kind::W8A16),
    ("W8A8 naive", "int8 / channel", "int8 / token", Kind::Naive),
    (
        "SmoothQuant α=0.5, o_proj naive",
        "int8 / channel",
        "int8 / token",
        Kind::Smooth { o_proj: false },
    ),
    (
        "SmoothQuant α=0.5",
        "int8 / channel",
        "int8 / token",
        Kind::Smooth { o_proj: true },
    ),
];

struct Row {
    label: &'static str,
    weights: &'static str,
    activations: &'static str,
    bytes: usize,
    speed: Speed,
    ppl: f64,
}

pub fn run(s: &Settings, out: &std::path::Path, facts: &RunFacts) -> anyhow::Result<()> {
    let args = part2_shared::model(s.quick)?;
    let ctx = if s.quick { 64 } else { 512 };
    let calibration_path = if s.quick {
        ch01::fixtures_dir().join("corpus/sample.txt")
    } else {
        quantize_hf::default_calibration()
    };
    let text = std::fs::read_to_string(&calibration_path).map_err(|e| {
        anyhow::anyhow!(
            "{}: {e} (run `python fixtures/scripts/corpus.py`)",
            calibration_path.display()
        )
    })?;
    let dense = args.load()?;
    let config = dense.model.config.clone();
    let samples = quantize_hf::calibration_samples(&dense.tokenizer, &text, s.samples, s.seq_len)?;
    eprintln!("== calibrating on {} x {} tokens", s.samples, s.seq_len);
    let stats = calibrate(&dense.model, &samples)?;
    let weights = Weights::open(&args.model)?;
    let (corpus, bos) = part2_shared::hamlet(&dense)?;
    let tokens = bench_tokens(
        s.prompt + s.decode,
        config.vocab_size,
        dense.tokenizer.bos_token_id(),
    );
    let smoothed = |o_proj| -> anyhow::Result<SmoothedSource<'_>> {
        let cfg = SmoothConfig { alpha: 0.5, o_proj };
        Ok(smooth(&weights, &config, &stats, &cfg)?)
    };
    let int8 = |activations| W8A8Quantizer { activations };

    let mut rows = Vec::new();
    let mut dense = Some(dense);
    for (label, w, a, kind) in VARIANTS {
        eprintln!("== {label}");
        let model: Llama = match kind {
            Kind::F32 => dense.take().expect("the f32 row is first").model,
            Kind::Bf16 => {
                ModelArgs {
                    dtype: "bf16".into(),
                    ..args.clone()
                }
                .load()?
                .model
            }
            Kind::W8A16 => Llama::load_with(&args.model, &int8(Int8Activations::None))?,
            Kind::Naive => Llama::load_with(&args.model, &int8(Int8Activations::PerToken))?,
            Kind::Smooth { o_proj } => Llama::from_source(
                config.clone(),
                &smoothed(o_proj)?,
                &int8(Int8Activations::PerToken),
                TensorParallel::whole(),
            )?,
        };
        let speed = speed::measure(&model, &tokens, s.prompt, s.decode, s.reps);
        let ppl = ch01::perplexity::perplexity(&model, &corpus, ctx, bos, Some(s.chunks))?;
        anyhow::ensure!(ppl.num_chunks == s.chunks, "Hamlet holds fewer chunks");
        eprintln!(
            "   decode {:.1} tok/s, prefill {:.1} tok/s, perplexity {:.4}",
            speed.decode_tok_s, speed.prefill_tok_s, ppl.perplexity
        );
        rows.push(Row {
            label,
            weights: w,
            activations: a,
            bytes: model.projection_bytes(),
            speed,
            ppl: ppl.perplexity,
        });
    }

    let factors = smoothed(true)?.factors;
    let layer = outlier_layer(&stats);
    let before = &stats[layer].attn_in.0;
    let after: Vec<f32> = before
        .iter()
        .zip(&factors[layer].attn)
        .map(|(x, s)| x / s)
        .collect();
    let name = part2_shared::name(&args);
    let markdown = table(&rows, s, ctx)
        + &outlier_summary(&stats, &factors, layer)
        + "\n"
        + &part2_shared::caption(&name, facts, s.reps)
        + "\n";
    let chart = chart(&rows, s.chunks, ctx);
    let plot = outlier_plot(&name, layer, before, &after);
    write_figures(
        out,
        &[
            ("w8a8", Some(&markdown), &chart),
            ("w8a8-outliers", None, &plot),
        ],
    )
}

/// SmolLM2 (or the model at `model_dir`) smoothed with α = 0.5 (o_proj through v_proj) on
/// `samples` x `seq_len` tokens of `calibration`, then loaded as W8A8 (the row of this name in
/// `kiln bench ch05 --part2`).
pub fn smoothquant_model(
    dense: &crate::commands::LoadedModel,
    model_dir: &std::path::Path,
    calibration: &std::path::Path,
    (samples, seq_len): (usize, usize),
) -> anyhow::Result<Llama> {
    let text = std::fs::read_to_string(calibration)
        .map_err(|e| anyhow::anyhow!("{}: {e}", calibration.display()))?;
    let samples = quantize_hf::calibration_samples(&dense.tokenizer, &text, samples, seq_len)?;
    let stats = calibrate(&dense.model, &samples)?;
    let weights = Weights::open(model_dir)?;
    let config = dense.model.config.clone();
    let cfg = SmoothConfig {
        alpha: 0.5,
        o_proj: true,
    };
    let smoothed = smooth(&weights, &config, &stats, &cfg)?;
    Ok(Llama::from_source(
        config,
        &smoothed,
        &W8A8Quantizer {
            activations: Int8Activations::PerToken,
        },
        TensorParallel::whole(),
    )?)
}

/// `(largest, median)` of per-channel maxima.
fn spread(m: &[f32]) -> (f32, f32) {
    let mut v = m.to_vec();
    v.sort_by(f32::total_cmp);
    (v.last().copied().unwrap_or(0.0), v[v.len() / 2])
}

/// The layer whose q/k/v input has the largest ratio of its largest channel to its median one.
fn outlier_layer(stats: &[LayerStats]) -> usize {
    let ratio = |st: &LayerStats| {
        let (hi, mid) = spread(&st.attn_in.0);
        hi / mid.max(f32::MIN_POSITIVE)
    };
    (0..stats.len())
        .max_by(|&a, &b| ratio(&stats[a]).total_cmp(&ratio(&stats[b])))
        .unwrap_or(0)
}

fn table(rows: &[Row], s: &Settings, ctx: usize) -> String {
    let mut t = Table::new([
        "variant",
        "weights",
        "activations",
        "projections + head MiB",
        "decode tok/s (b=1)",
        "prefill tok/s",
        "Hamlet PPL",
    ])
    .align(0, Align::Left)
    .align(1, Align::Left)
    .align(2, Align::Left);
    for r in rows {
        t.row([
            r.label.to_string(),
            r.weights.to_string(),
            r.activations.to_string(),
            format!("{:.1}", r.bytes as f64 / (1u64 << 20) as f64),
            format!("{:.1}", r.speed.decode_tok_s),
            format!("{:.1}", r.speed.prefill_tok_s),
            format!("{:.4}", r.ppl),
        ]);
    }
    format!(
        "{}\nDecode: {} tokens after a prompt of {}, one sequence; perplexity: Hamlet, {} chunks \
         of {ctx} tokens (llama.cpp's scheme). Every int8 row quantizes the projections on load \
         (round to nearest, one scale per output channel) and keeps the tied head f32; W8A8 \
         multiplies int8 codes and sums them in i32. SmoothQuant's factors come from {} samples \
         of {} tokens of the training plays.\n\n",
        t.to_markdown(),
        s.decode,
        s.prompt,
        s.chunks,
        s.samples,
        s.seq_len,
    )
}

/// One line on the plotted layer and the spread of every layer's q/k/v input, before and after.
fn outlier_summary(
    stats: &[LayerStats],
    factors: &[ch05::smoothquant::LayerFactors],
    layer: usize,
) -> String {
    let ratio = |m: &[f32]| {
        let (hi, mid) = spread(m);
        (hi, mid, hi / mid.max(f32::MIN_POSITIVE))
    };
    let after = |l: usize| -> Vec<f32> {
        stats[l]
            .attn_in
            .0
            .iter()
            .zip(&factors[l].attn)
            .map(|(x, s)| x / s)
            .collect()
    };
    let (hi, mid, r) = ratio(&stats[layer].attn_in.0);
    let (hi_s, mid_s, r_s) = ratio(&after(layer));
    let mean = |f: &dyn Fn(usize) -> f32| {
        (0..stats.len()).map(|l| f64::from(f(l))).sum::<f64>() / stats.len().max(1) as f64
    };
    let mean_before = mean(&|l| ratio(&stats[l].attn_in.0).2);
    let mean_after = mean(&|l| ratio(&after(l)).2);
    format!(
        "Activation outliers (q/k/v input, max |x| per channel over the calibration tokens): \
         layer {layer}, the most uneven, has a largest channel of {hi:.1} against a median of \
         {mid:.2} ({r:.0}x); smoothed, {hi_s:.2} against {mid_s:.2} ({r_s:.1}x). Over all {} \
         layers the largest-to-median ratio averages {mean_before:.0}x before and \
         {mean_after:.1}x after.\n",
        stats.len()
    )
}

fn chart(rows: &[Row], chunks: usize, ctx: usize) -> String {
    let mut chart = BarChart::new(format!(
        "Perplexity of Hamlet, {chunks} x {ctx} tokens, int8 weights and activations \
         (shorter is better)"
    ))
    .x_label("perplexity");
    for r in rows {
        chart = chart.group(r.label, &[("perplexity", r.ppl)]);
    }
    if let Some(first) = rows.first() {
        chart = chart.reference("f32", first.ppl);
    }
    chart.to_svg()
}

fn outlier_plot(name: &str, layer: usize, before: &[f32], after: &[f32]) -> String {
    let points = |m: &[f32]| -> Vec<(f64, f64)> {
        m.iter()
            .enumerate()
            .map(|(j, &v)| (j as f64, f64::from(v).max(1e-3)))
            .collect()
    };
    LinePlot::new(format!(
        "{name}, layer {layer}: max |x| per input channel of q/k/v"
    ))
    .x_label("input channel")
    .y_label("max |x| over calibration tokens")
    .log_y()
    .size(900, 460)
    .series("before smoothing", &points(before))
    .series("after smoothing (x / s, α = 0.5)", &points(after))
    .to_svg()
}
