//! `kiln bench ch05 --part2`: chapter 5 part 2's quantizers side by side, SmolLM2-135M-Instruct
//! (or, with `--quick`, shakespeare-small) quantized by `kiln quantize --method ...`, loaded
//! back from the written directories, scored on Hamlet and timed at batch 1.
//!
//! The GPTQ, AWQ and RTN rows keep the (tied) output head in Q8_0 (`--quantization q8_0` for
//! the dense weights of their directories); "Q4_0 (part 1)" is part 1's round-to-nearest Q4_0
//! on load, and SmolLM2's tied head reaches its loader as a projection, so that row's head is
//! Q4_0 too (its smaller "projections + head" column shows it). A directory already written with the same options under
//! `fixtures/.cache/ch05-part2/` is reused (its quantization time is then not re-measured).
//! Writes `methods.md` and `methods.svg`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use ch01::WeightSource;
use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch05::GgmlType;
use ndarray::{Array1, Array2};

use super::super::ch02::speed::{self, Speed};
use super::super::{RunFacts, bench_tokens, write_figures};
use crate::bench::bars::BarChart;
use crate::bench::table::{Align, Table};
use crate::commands::quantize_hf;
use crate::commands::{LoadedModel, ModelArgs};

/// Part 1's Q4_0 of the projections; a dense head built through `build` in Q8_0 (a tied head
/// that the model loads as a projection, SmolLM2's, gets Q4_0 like the projections).
struct Part1Q4 {
    projections: ch05::QuantLoader,
    head: ch05::QuantLoader,
}

impl LinearLoader for Part1Q4 {
    fn build(&self, w: Array2<f32>, b: Option<Array1<f32>>) -> ch01::Result<Box<dyn Linear>> {
        self.head.build(w, b)
    }
    fn load(&self, s: &dyn WeightSource, spec: &LinearSpec<'_>) -> ch01::Result<Box<dyn Linear>> {
        self.projections.load(s, spec)
    }
}

/// One row: a label, the `kiln quantize` options that make it (`None`: the model as it is).
struct Variant {
    label: &'static str,
    options: Option<&'static [&'static str]>,
    part1_q4_0: bool,
}

const VARIANTS: &[Variant] = &[
    Variant {
        label: "F32",
        options: None,
        part1_q4_0: false,
    },
    Variant {
        label: "Q4_0 (part 1)",
        options: None,
        part1_q4_0: true,
    },
    Variant {
        label: "RTN g128",
        options: Some(&["--method", "rtn"]),
        part1_q4_0: false,
    },
    Variant {
        label: "GPTQ g128",
        options: Some(&["--method", "gptq"]),
        part1_q4_0: false,
    },
    Variant {
        label: "GPTQ g128 act-order",
        options: Some(&["--method", "gptq", "--act-order"]),
        part1_q4_0: false,
    },
    Variant {
        label: "RTN g64 zp",
        options: Some(&[
            "--method",
            "rtn",
            "--group-size",
            "64",
            "--asym",
            "--format",
            "awq",
        ]),
        part1_q4_0: false,
    },
    Variant {
        label: "AWQ g64",
        options: Some(&["--method", "awq"]),
        part1_q4_0: false,
    },
    Variant {
        label: "RTN g32 zp",
        options: Some(&[
            "--method",
            "rtn",
            "--group-size",
            "32",
            "--asym",
            "--format",
            "awq",
        ]),
        part1_q4_0: false,
    },
    Variant {
        label: "RTN g48",
        options: Some(&["--method", "rtn", "--group-size", "48"]),
        part1_q4_0: false,
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
    speed: Speed,
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
    let hamlet = std::fs::read_to_string(ch01::fixtures_dir().join("corpus/hamlet.txt"))?;
    let q8 = ch05::QuantLoader::to(GgmlType::Q8_0)?;
    let mut rows = Vec::new();
    for v in VARIANTS {
        eprintln!("== {}", v.label);
        let mut quantize_s = None;
        let mut command = String::from("—");
        let loaded: LoadedModel = match v.options {
            None => {
                let args = ModelArgs::cpu(model_dir.clone());
                if v.part1_q4_0 {
                    command = "--quantization q4_0 (on load)".into();
                    args.load_with(&Part1Q4 {
                        projections: ch05::QuantLoader::to(GgmlType::Q4_0)?,
                        head: q8,
                    })?
                } else {
                    args.load()?
                }
            }
            Some(options) => {
                let dir = cache.join(v.label.replace(' ', "-"));
                command = format!("kiln quantize {}", options.join(" "));
                let stamp = dir.join("kiln-quantize-options.txt");
                let seconds = dir.join("kiln-quantize-seconds.txt");
                let wanted = format!(
                    "{command} --samples {} --seq-len {}\n",
                    s.samples, s.seq_len
                );
                if std::fs::read_to_string(&stamp).ok().as_deref() != Some(wanted.as_str()) {
                    let args = parse_options(options, &calibration, s)?;
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
                let args = ModelArgs {
                    quantization: Some("q8_0".into()),
                    ..ModelArgs::cpu(dir)
                };
                args.load()?
            }
        };
        if s.quantize_only {
            continue;
        }
        let model = &loaded.model;
        let tokens = bench_tokens(
            s.prompt + s.decode,
            model.config.vocab_size,
            loaded.tokenizer.bos_token_id(),
        );
        let speed = speed::measure(model, &tokens, s.prompt, s.decode, s.reps);
        let ppl = super::kiln_perplexity(&loaded, &hamlet, s.ctx, s.chunks)?;
        eprintln!(
            "   perplexity {ppl:.4}, decode {:.1} tokens/s",
            speed.decode_tok_s
        );
        rows.push(Row {
            label: v.label,
            command,
            quantize_s,
            projection_bytes: model.projection_bytes(),
            kinds: if v.options.is_some() {
                kinds(model)
            } else if v.part1_q4_0 {
                "Q4_0".into()
            } else {
                "f32".into()
            },
            ppl,
            speed,
        });
    }
    if s.quantize_only {
        eprintln!("quantized directories are in {}", cache.display());
        return Ok(());
    }
    let table = table(&rows, s, &facts, &model_dir);
    let plot = plot(&rows, s);
    write_figures(&s.out, &[("methods", Some(table.as_str()), plot.as_str())])
}

/// What the projections of layer 0 compute on (Q4_0 / Q4_1 blocks, or dense), by weight bytes.
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
            format!("{:.1}", r.speed.decode_tok_s),
        ]);
    }
    format!(
        "{}\n_{}: perplexity of Hamlet in {} chunks of {} tokens (the second half of each \
         scored), decode of {} tokens after a {}-token prompt at batch 1 ({}); calibration: {} \
         samples of {} tokens of the training plays. {} threads on {} ({} CPUs), {}. Command: `{}`._\n",
        t.to_markdown(),
        crate::bench::model_name(model_dir),
        s.chunks,
        s.ctx,
        s.decode,
        s.prompt,
        if s.reps == 1 {
            "one run".to_string()
        } else {
            format!("median of {}", s.reps)
        },
        s.samples,
        s.seq_len,
        rayon::current_num_threads(),
        facts.cpu.as_deref().unwrap_or("an unknown CPU"),
        facts.nproc,
        facts.date,
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
