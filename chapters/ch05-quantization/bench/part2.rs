//! `kiln bench ch05 --part2`: every weight format of chapter 5 side by side in one run,
//! SmolLM2-135M-Instruct (or, with `--quick`, shakespeare-small), scored on Hamlet and timed at
//! batch 1: f32 and bf16; int8 weights (RTN per channel) with f32 activations, int8 per-token
//! activations (W8A8 naive) and SmoothQuant's; FP8 E4M3; part 1's Q4_0 on load and llama.cpp's
//! Q4_K_M file; and part 2's 4-bit quantizers, made by `kiln quantize --method ...` and loaded
//! back from the written directories.
//!
//! The GPTQ, AWQ and RTN rows keep the (tied) output head in Q8_0 (`--quantization q8_0` for
//! the dense weights of their directories); "Q4_0 (part 1)" is part 1's round-to-nearest Q4_0
//! on load with the head in Q4_0 too (what `--quantization q4_0` does to a tied head), and
//! "Q4_0 (part 1), Q8_0 head" keeps the head as the part 2 rows do, so that their decode speeds
//! compare at the same head. Decode is timed in rounds, every model once per round (the models
//! are all held in memory). A directory already written with the same options under
//! `fixtures/.cache/ch05-part2/` is reused (its quantization time is then not re-measured).
//! Writes `methods.md` and `methods.svg`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use ch01::WeightSource;
use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch05::GgmlType;
use ndarray::{Array1, Array2};

use ch05::fp8_linear::{ActivationScale, Fp8Quantizer};
use ch05::smoothquant::{Int8Activations, W8A8Quantizer};

use super::super::ch02::speed;
use super::super::{RunFacts, bench_tokens, write_figures};
use super::part2_shared;
use crate::bench::bars::BarChart;
use crate::bench::table::{Align, Table};
use crate::commands::ModelArgs;
use crate::commands::quantize_hf;

/// Part 1's Q4_0 of the projections and the output head in `head` (a tied head reaches
/// `load` as the projection `model.embed_tokens`, an untied one as `lm_head`).
struct Part1Q4 {
    projections: ch05::QuantLoader,
    head: ch05::QuantLoader,
}

impl LinearLoader for Part1Q4 {
    fn build(&self, w: Array2<f32>, b: Option<Array1<f32>>) -> ch01::Result<Box<dyn Linear>> {
        self.head.build(w, b)
    }
    fn load(&self, s: &dyn WeightSource, spec: &LinearSpec<'_>) -> ch01::Result<Box<dyn Linear>> {
        if matches!(spec.name, "model.embed_tokens" | "lm_head") {
            return self.head.load(s, spec);
        }
        self.projections.load(s, spec)
    }
}

/// A row's model: the dense one loaded once, or its own.
enum Held<'a> {
    Dense(&'a ch01::Llama),
    Own(Box<ch01::Llama>),
}

impl Held<'_> {
    fn model(&self) -> &ch01::Llama {
        match self {
            Held::Dense(m) => m,
            Held::Own(m) => m,
        }
    }
}

/// Where a row's model comes from.
enum Source {
    /// The checkpoint as it is, stored in this dtype (`f32`, `bf16`).
    Dense(&'static str),
    /// Part 1's Q4_0 on load, the output head in this type.
    Part1Q4_0(GgmlType),
    /// The GGUF file of this type that llama.cpp's `llama-quantize` made (part 1; not with
    /// `--quick`).
    LlamaCppGguf(&'static str),
    /// Int8 weights per output channel on load; activations f32 or int8 per token.
    Int8(Int8Activations),
    /// SmoothQuant (α = 0.5, o_proj through v_proj) on the calibration text, then W8A8.
    SmoothQuant,
    /// FP8 E4M3 weights per output channel on load, f32 activations.
    Fp8,
    /// `kiln quantize` with these options, loaded back from the directory it wrote.
    Quantize(&'static [&'static str]),
}

/// One row: a label and where its model comes from.
struct Variant {
    label: &'static str,
    source: Source,
}

const VARIANTS: &[Variant] = &[
    Variant {
        label: "F32",
        source: Source::Dense("f32"),
    },
    Variant {
        label: "BF16",
        source: Source::Dense("bf16"),
    },
    Variant {
        label: "RTN int8 (W8A16)",
        source: Source::Int8(Int8Activations::None),
    },
    Variant {
        label: "W8A8 naive",
        source: Source::Int8(Int8Activations::PerToken),
    },
    Variant {
        label: "SmoothQuant W8A8",
        source: Source::SmoothQuant,
    },
    Variant {
        label: "FP8 E4M3",
        source: Source::Fp8,
    },
    Variant {
        label: "Q4_K_M (part 1, llama.cpp's file)",
        source: Source::LlamaCppGguf("Q4_K_M"),
    },
    Variant {
        label: "Q4_0 (part 1)",
        source: Source::Part1Q4_0(GgmlType::Q4_0),
    },
    Variant {
        label: "Q4_0 (part 1), Q8_0 head",
        source: Source::Part1Q4_0(GgmlType::Q8_0),
    },
    Variant {
        label: "RTN g128",
        source: Source::Quantize(&["--method", "rtn"]),
    },
    Variant {
        label: "GPTQ g128",
        source: Source::Quantize(&["--method", "gptq"]),
    },
    Variant {
        label: "GPTQ g128 act-order",
        source: Source::Quantize(&["--method", "gptq", "--act-order"]),
    },
    Variant {
        label: "RTN g64 zp",
        source: Source::Quantize(&[
            "--method",
            "rtn",
            "--group-size",
            "64",
            "--asym",
            "--format",
            "awq",
        ]),
    },
    Variant {
        label: "AWQ g64",
        source: Source::Quantize(&["--method", "awq"]),
    },
    Variant {
        label: "RTN g32 zp",
        source: Source::Quantize(&[
            "--method",
            "rtn",
            "--group-size",
            "32",
            "--asym",
            "--format",
            "awq",
        ]),
    },
    Variant {
        label: "RTN g48",
        source: Source::Quantize(&["--method", "rtn", "--group-size", "48"]),
    },
];

struct Row {
    label: &'static str,
    command: String,
    /// Seconds `kiln quantize` took, and the build that measured them (a reused directory
    /// reports the time measured when it was written).
    quantize_s: Option<String>,
    projection_bytes: usize,
    kinds: String,
    ppl: f64,
    /// Decode tokens/s, the median of the timing rounds.
    decode_tok_s: f64,
}

/// The settings of one run.
pub struct Settings {
    pub quick: bool,
    pub reps: usize,
    pub prompt: usize,
    pub decode: usize,
    pub ctx: usize,
    pub chunks: usize,
    pub samples: usize,
    pub seq_len: usize,
    pub out: PathBuf,
    /// Only write (or reuse) the quantized directories; measure nothing.
    pub quantize_only: bool,
}

fn parse_options(
    options: &[&str],
    calibration: &Path,
    s: &Settings,
) -> anyhow::Result<quantize_hf::Args> {
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: quantize_hf::Args,
    }
    let samples = s.samples.to_string();
    let seq_len = s.seq_len.to_string();
    let mut argv = vec!["quantize"];
    argv.extend_from_slice(options);
    argv.extend(["--samples", &samples, "--seq-len", &seq_len]);
    let calibration = calibration.to_string_lossy().into_owned();
    argv.extend(["--calibration", &calibration]);
    Ok(<Wrapper as clap::Parser>::try_parse_from(argv)?.args)
}

pub fn run(s: &Settings) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let (model_dir, calibration) = if s.quick {
        (
            ch01::default_model_dir(),
            ch01::fixtures_dir().join("corpus/sample.txt"),
        )
    } else {
        (
            ch01::fixtures_dir().join(".cache/SmolLM2-135M-Instruct"),
            quantize_hf::default_calibration(),
        )
    };
    if !model_dir.exists() || !calibration.exists() {
        bail!(
            "{} or {} is missing (run `just fetch-smollm2` and `python fixtures/scripts/corpus.py`)",
            model_dir.display(),
            calibration.display()
        );
    }
    let cache = if s.quick {
        std::env::temp_dir().join(format!("kiln-ch05-part2-{}", std::process::id()))
    } else {
        ch01::fixtures_dir().join(".cache/ch05-part2")
    };
    let args = ModelArgs::cpu(model_dir.clone());
    let dense = args.load()?;
    let (corpus, bos) = part2_shared::hamlet(&dense)?;
    let tokens = bench_tokens(
        s.prompt + s.decode,
        dense.model.config.vocab_size,
        dense.tokenizer.bos_token_id(),
    );
    let int8 = |activations| W8A8Quantizer { activations };
    let mut rows = Vec::new();
    let mut models: Vec<Held> = Vec::new();
    for v in VARIANTS {
        let quantized = matches!(v.source, Source::Quantize(_));
        if s.quantize_only && !quantized {
            continue;
        }
        let gguf = |ty: &str| {
            ch01::fixtures_dir().join(format!(".cache/llama.cpp/SmolLM2-135M-Instruct-{ty}.gguf"))
        };
        if let Source::LlamaCppGguf(ty) = v.source
            && (s.quick || !gguf(ty).exists())
        {
            eprintln!(
                "== {}: left out ({})",
                v.label,
                if s.quick {
                    "no llama.cpp file of the --quick model".to_string()
                } else {
                    format!(
                        "{} is missing: run `just build-llama-cpp`",
                        gguf(ty).display()
                    )
                }
            );
            continue;
        }
        eprintln!("== {}", v.label);
        let mut quantize_s = None;
        let (held, command): (Held, String) = match v.source {
            Source::Dense("f32") => (Held::Dense(&dense.model), "—".into()),
            Source::Dense(dtype) => {
                let owned = ModelArgs {
                    dtype: dtype.into(),
                    ..args.clone()
                }
                .load()?
                .model;
                (Held::Own(Box::new(owned)), format!("--dtype {dtype}"))
            }
            Source::Part1Q4_0(head) => {
                let owned = args
                    .load_with(&Part1Q4 {
                        projections: ch05::QuantLoader::to(GgmlType::Q4_0)?,
                        head: ch05::QuantLoader::to(head)?,
                    })?
                    .model;
                let command = match head {
                    GgmlType::Q4_0 => "--quantization q4_0 (on load)".into(),
                    _ => format!("--quantization q4_0, the head {head} (on load)"),
                };
                (Held::Own(Box::new(owned)), command)
            }
            Source::LlamaCppGguf(ty) => {
                let owned = ModelArgs::cpu(gguf(ty)).load()?.model;
                (Held::Own(Box::new(owned)), format!("llama-quantize … {ty}"))
            }
            Source::Int8(activations) => {
                let owned = ch01::Llama::load_with(&model_dir, &int8(activations))?;
                (
                    Held::Own(Box::new(owned)),
                    format!("W8A8Quantizer {{ {activations:?} }} (on load)"),
                )
            }
            Source::SmoothQuant => {
                let owned = super::w8a8::smoothquant_model(
                    &dense,
                    &model_dir,
                    &calibration,
                    (s.samples, s.seq_len),
                )?;
                (
                    Held::Own(Box::new(owned)),
                    "SmoothQuant α=0.5, then W8A8 (on load)".into(),
                )
            }
            Source::Fp8 => {
                let owned = ch01::Llama::load_with(
                    &model_dir,
                    &Fp8Quantizer {
                        activations: ActivationScale::None,
                    },
                )?;
                (
                    Held::Own(Box::new(owned)),
                    "Fp8Quantizer, per channel (on load)".into(),
                )
            }
            Source::Quantize(options) => {
                let dir = cache.join(v.label.replace(' ', "-"));
                let command = format!("kiln quantize {}", options.join(" "));
                let stamp = dir.join("kiln-quantize-options.txt");
                let seconds = dir.join("kiln-quantize-seconds.txt");
                let wanted = format!(
                    "{command} --samples {} --seq-len {}\n",
                    s.samples, s.seq_len
                );
                if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
                    let args = parse_options(options, &calibration, s)?;
                    // Another run's checkpoint (other options, or cut short): replaced whole.
                    if dir.exists() {
                        std::fs::remove_dir_all(&dir)
                            .with_context(|| format!("removing {}", dir.display()))?;
                    }
                    let start = Instant::now();
                    quantize_hf::quantize_dir(&model_dir, &dir, &args)
                        .with_context(|| command.clone())?;
                    let build = if cfg!(debug_assertions) {
                        "dev"
                    } else {
                        "release"
                    };
                    let took = format!("{:.0} ({build})", start.elapsed().as_secs_f64());
                    std::fs::write(&seconds, &took)?;
                    std::fs::write(&stamp, &wanted)?;
                } else {
                    eprintln!("   reusing {}", dir.display());
                }
                quantize_s = std::fs::read_to_string(&seconds).ok();
                if s.quantize_only {
                    continue;
                }
                let args = ModelArgs {
                    quantization: Some("q8_0".into()),
                    ..ModelArgs::cpu(dir)
                };
                (Held::Own(Box::new(args.load()?.model)), command)
            }
        };
        let model = held.model();
        let ppl = ch01::perplexity::perplexity(model, &corpus, s.ctx, bos, Some(s.chunks))?;
        anyhow::ensure!(ppl.num_chunks == s.chunks, "Hamlet holds fewer chunks");
        let ppl = ppl.perplexity;
        eprintln!("   perplexity {ppl:.4}");
        rows.push(Row {
            label: v.label,
            command,
            quantize_s,
            projection_bytes: model.projection_bytes(),
            kinds: kinds(model),
            ppl,
            decode_tok_s: 0.0,
        });
        models.push(held);
    }
    if s.quantize_only {
        eprintln!("quantized directories are in {}", cache.display());
        return Ok(());
    }
    // ANCHOR: interleaved
    // Decode speed in rounds, every model once per round, so that a slow spell of the machine
    // falls on all of them alike; each row reports its median round.
    let mut rounds: Vec<Vec<f64>> = vec![Vec::new(); models.len()];
    for round in 0..s.reps.max(1) {
        eprintln!("== decode timing, round {} of {}", round + 1, s.reps.max(1));
        for (times, held) in rounds.iter_mut().zip(&models) {
            let speed = speed::measure(held.model(), &tokens, s.prompt, s.decode, 1);
            times.push(speed.decode_tok_s);
        }
    }
    for (row, mut times) in rows.iter_mut().zip(rounds) {
        times.sort_by(f64::total_cmp);
        row.decode_tok_s = times[times.len() / 2];
        eprintln!("   {}: decode {:.1} tokens/s", row.label, row.decode_tok_s);
    }
    // ANCHOR_END: interleaved
    let table = table(&rows, s, &facts, &model_dir);
    let plot = plot(&rows, s);
    write_figures(&s.out, &[("methods", Some(table.as_str()), plot.as_str())])
}

/// What the projections of layer 0 cost per weight (codes, scales and zero points together).
fn kinds(model: &ch01::Llama) -> String {
    let l = &model.layers[0];
    let bits = |layer: &dyn Linear| {
        layer.weight_bytes() as f64 * 8.0 / (layer.in_features() * layer.out_features()) as f64
    };
    format!(
        "{:.2} bits/weight (q_proj), {:.2} (down_proj)",
        bits(&*l.self_attn.q_proj),
        bits(&*l.mlp.down_proj)
    )
}

fn table(rows: &[Row], s: &Settings, facts: &RunFacts, model_dir: &Path) -> String {
    let mut t = Table::new([
        "variant",
        "made by",
        "quantize s (build)",
        "projections + head MiB",
        "layout in memory",
        "Hamlet PPL",
        "decode tok/s",
    ]);
    t = t
        .align(0, Align::Left)
        .align(1, Align::Left)
        .align(4, Align::Left);
    for r in rows {
        t.row([
            r.label.to_string(),
            format!("`{}`", r.command),
            r.quantize_s.clone().unwrap_or("—".into()),
            format!("{:.1}", r.projection_bytes as f64 / (1024.0 * 1024.0)),
            r.kinds.clone(),
            format!("{:.4}", r.ppl),
            format!("{:.1}", r.decode_tok_s),
        ]);
    }
    format!(
        "{}\n_{}: perplexity of Hamlet in {} chunks of {} tokens (the second half of each \
         scored), decode of {} tokens after a {}-token prompt at batch 1 ({}); calibration: {} \
         samples of {} tokens of the training plays. {}. Command: `{}`._\n",
        t.to_markdown(),
        crate::bench::model_name(model_dir),
        s.chunks,
        s.ctx,
        s.decode,
        s.prompt,
        if s.reps == 1 {
            "one run".to_string()
        } else {
            format!("median of {} rounds, every model once per round", s.reps)
        },
        s.samples,
        s.seq_len,
        facts.machine(rayon::current_num_threads()),
        facts.command
    )
}

fn plot(rows: &[Row], s: &Settings) -> String {
    let mut chart = BarChart::new(format!(
        "Perplexity of Hamlet, {} x {} tokens (shorter is better)",
        s.chunks, s.ctx
    ))
    .x_label("perplexity");
    for r in rows {
        chart = chart.group(r.label, &[("perplexity", r.ppl)]);
    }
    if let Some(f32_row) = rows.first() {
        chart = chart.reference("F32", f32_row.ppl);
    }
    chart.to_svg()
}
