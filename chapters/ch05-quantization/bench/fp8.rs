//! `kiln bench ch05 --only fp8`: FP8 E4M3 weights against f32 on SmolLM2-135M: decode and
//! prefill tokens/s at b=1 and perplexity on Hamlet (chunks of 512, part 1's scheme).
//!
//! ```text
//! f32        chapter 2's FastLinear, f32 weights
//! FP8 E4M3   every projection (the tied head too) quantized on load with per-channel scales
//!            (Fp8Quantizer); activations f32, or rounded through E4M3 with a per-token scale
//! ```
//! With `--quick` the default model, short sequences and two chunks of 64.

use super::super::ch02::speed;
use super::super::{RunFacts, bench_tokens, write_figures};
use ch05::fp8_linear::{ActivationScale, Fp8Quantizer};

use super::part2_shared;
use crate::bench::bars::BarChart;
use crate::bench::table::{Align, Table};

pub fn run(
    quick: bool,
    reps: usize,
    (prompt, decode, chunks): (usize, usize, usize),
    out: &std::path::Path,
    facts: &RunFacts,
) -> anyhow::Result<()> {
    let args = part2_shared::model(quick)?;
    let ctx = if quick { 64 } else { 512 };
    let mut rows = Vec::new();
    let variants = [
        ("f32", None),
        (
            "FP8 E4M3 weights, f32 activations",
            Some(ActivationScale::None),
        ),
        (
            "FP8 E4M3 weights and activations (per token)",
            Some(ActivationScale::Dynamic),
        ),
    ];
    for (label, fp8) in variants {
        eprintln!("== {label}");
        let loaded = match fp8 {
            Some(activations) => args.load_with(&Fp8Quantizer { activations })?,
            None => args.load()?,
        };
        let model = &loaded.model;
        let tokens = bench_tokens(
            prompt + decode,
            model.config.vocab_size,
            loaded.tokenizer.bos_token_id(),
        );
        let speed = speed::measure(model, &tokens, prompt, decode, reps);
        let (corpus, bos) = part2_shared::hamlet(&loaded)?;
        let ppl = ch01::perplexity::perplexity(model, &corpus, ctx, bos, Some(chunks))?;
        anyhow::ensure!(ppl.num_chunks == chunks, "Hamlet holds fewer chunks");
        eprintln!(
            "   decode {:.1} tok/s, prefill {:.1} tok/s, perplexity {:.4}",
            speed.decode_tok_s, speed.prefill_tok_s, ppl.perplexity
        );
        rows.push((label, model.projection_bytes(), speed, ppl.perplexity));
    }
    let mut table = Table::new([
        "weights",
        "projection MiB",
        "decode tok/s (b=1)",
        "prefill tok/s",
        "perplexity",
    ])
    .align(0, Align::Left);
    let mut chart = BarChart::new("Decode speed at b=1, f32 and FP8 weights").x_label("tokens/s");
    let mut bars = Vec::new();
    for (label, bytes, speed, ppl) in &rows {
        table.row([
            label.to_string(),
            format!("{:.1}", *bytes as f64 / (1u64 << 20) as f64),
            format!("{:.1}", speed.decode_tok_s),
            format!("{:.1}", speed.prefill_tok_s),
            format!("{ppl:.4}"),
        ]);
        bars.push((label.to_string(), speed.decode_tok_s));
    }
    chart = chart.group("decode", &bars);
    let markdown = format!(
        "{}\nDecode: {decode} tokens after a prompt of {prompt}, one sequence; perplexity: \
         Hamlet, {chunks} chunks of {ctx} tokens (llama.cpp's scheme). FP8 weights are \
         quantized on load from the f32 ones, one scale per output channel, the tied head too; \
         the products are f32 (no FP8 arithmetic on a CPU), so FP8 saves bytes read, not \
         operations.\n\n{}\n",
        table.to_markdown(),
        part2_shared::caption(&part2_shared::name(&args), facts, reps),
    );
    write_figures(out, &[("fp8", Some(&markdown), &chart.to_svg())])
}
