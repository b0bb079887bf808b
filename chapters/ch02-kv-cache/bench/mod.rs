//! `kiln bench ch02`: what the KV cache and the fast kernels buy, and what the cache costs.
//!
//! ```text
//! machine    read and copy bandwidth (1 GiB), GEMM GFLOP/s (ours; matrixmultiply on one thread)
//! speed      prefill and decode tokens/s, f32 and bf16, kiln beside transformers and llama.cpp
//! roofline   GFLOP/s of prefill at several lengths and of decode against the machine's limits
//! latency    the cost of the token at position T: recompute (chapter 1) vs cached (chapter 2)
//! waste      share of a contiguous, max-length KV reservation that ever holds a token
//! profile    one prefill step and one batch-32 decode step, op by op, row-wise ops serial vs threaded
//! gemm       GFLOP/s of every prefill micro-kernel on the model's projection shapes
//! ```
//! Writes `speed`, `roofline`, `latency` and `waste` (`.md` table + `.svg` plot) and `profile`
//! and `gemm` (`.md` only) into `book/src/ch02/` (or `--out`). Every ratio in the tables comes from this
//! one run.

mod gemm;
pub(crate) mod machine;
mod profile;
pub(crate) mod references;
mod report;
pub(crate) mod speed;
mod waste;

use anyhow::{Context, bail};
use ch02::{FastLoader, WeightDtype};

use super::{Output, RunFacts, bench_tokens, model_name, write_figures};
use crate::commands::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model (`--dtype` is ignored: f32 and bf16 storage are both measured).
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// Prompt tokens of the prefill measurement.
    #[arg(long, default_value_t = 128, value_name = "P")]
    pub prompt_tokens: usize,
    /// Tokens decoded after the prompt in the decode measurement.
    #[arg(long, default_value_t = 64, value_name = "D")]
    pub decode_tokens: usize,
    /// Skip transformers and llama.cpp.
    #[arg(long)]
    pub no_references: bool,
    /// Context lengths of the latency comparison [default: 16,64,256,1024 within the context].
    #[arg(long, value_delimiter = ',', value_name = "T,..")]
    pub lengths: Vec<usize>,
    /// Run only these parts [default: all].
    #[arg(long, value_delimiter = ',', value_name = "PART,..")]
    pub only: Vec<Part>,
}

/// The parts of the benchmark, each one table and one plot.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Speed,
    Roofline,
    Latency,
    Waste,
    Profile,
    Gemm,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let reps = args.output.reps(3)?;
    let (prompt, decode) = if args.output.quick {
        (16, 8)
    } else {
        (args.prompt_tokens, args.decode_tokens)
    };
    if prompt == 0 || decode == 0 {
        bail!("--prompt-tokens and --decode-tokens must be at least 1");
    }
    let out = args.output.dir("ch02");

    let dense = args.model.load_with(&ch01::linear::DenseLoader)?;
    let fast_f32 = args.model.load_with(&FastLoader {
        dtype: WeightDtype::F32,
    })?;
    let fast_bf16 = args.model.load_with(&FastLoader {
        dtype: WeightDtype::Bf16,
    })?;
    let config = &fast_f32.model.config;
    let max_len = config.max_position_embeddings;
    let mut lengths = match (&args.lengths[..], args.output.quick) {
        ([], true) => vec![8, 16],
        ([], false) => vec![16, 64, 256, 1024],
        (given, _) => given.to_vec(),
    };
    lengths.retain(|&t| t >= 1 && t + 2 <= max_len);
    lengths.sort_unstable();
    lengths.dedup();
    if lengths.is_empty() || prompt + decode > max_len {
        bail!("the benchmark lengths do not fit the model's context of {max_len} tokens");
    }
    let longest = prompt
        .max(decode)
        .max(lengths[lengths.len() - 1])
        .max(profile::PREFILL_TOKENS)
        + decode
        + 2;
    let tokens = bench_tokens(
        longest.min(max_len),
        config.vocab_size,
        fast_f32.tokenizer.bos_token_id(),
    );
    let model_name = model_name(&args.model.model);
    let threads = rayon::current_num_threads();
    eprintln!("kiln bench ch02: {model_name}, {threads} threads, {reps} reps");

    let wants = |part: Part| args.only.is_empty() || args.only.contains(&part);
    let mut report = report::Report {
        facts: &facts,
        model_name: &model_name,
        config,
        threads,
        reps,
        prompt,
        decode,
        f32_bytes: fast_f32.model.projection_bytes(),
        bf16_bytes: fast_bf16.model.projection_bytes(),
        measured: None,
        latency: None,
        waste: None,
    };
    if wants(Part::Speed) || wants(Part::Roofline) {
        let probe = || {
            eprintln!("== machine: bandwidth and GEMM");
            let machine = machine::Machine::measure(reps, args.output.quick);
            eprintln!(
                "   read {:.1} GB/s, copy {:.1} GB/s, GEMM kiln {:.1} GFLOP/s, matrixmultiply (1 thread) {:.1}",
                machine.read_gb_s,
                machine.copy_gb_s,
                machine.kiln_gemm_gflop_s,
                machine.reference_gemm_gflop_s
            );
            machine
        };
        let before = probe();
        // Taken around every decode measurement, kiln's and the references'.
        let around = machine::ReadProbe::new(if args.output.quick {
            machine::AROUND_BYTES / 16
        } else {
            machine::AROUND_BYTES
        });

        eprintln!("== speed: kiln prefill {prompt} + decode {decode}");
        let speed_of =
            |model| speed::measure_around(model, &tokens, prompt, decode, reps, Some(&around));
        let kiln_f32 = speed_of(&fast_f32.model);
        let kiln_bf16 = speed_of(&fast_bf16.model);
        eprintln!("   f32 {kiln_f32:?}\n   bf16 {kiln_bf16:?}");
        // The machine again, after kiln's runs; each figure the best of both probes.
        let machine = before.best_with(probe());

        let mut references = Vec::new();
        let mut missing = Vec::new();
        if wants(Part::Speed) && !(args.output.quick || args.no_references) {
            let setup = references::Setup {
                model_dir: &args.model.model,
                threads,
                prompt,
                decode,
                reps,
                probe: Some(&around),
            };
            for (name, result) in [
                ("transformers", references::transformers(&setup)),
                ("llama.cpp", references::llama_cpp(&setup)),
            ] {
                match result {
                    Ok(found) => references.extend(found),
                    Err(error) => {
                        eprintln!("   {name}: not measured: {error:#}");
                        missing.push(format!("{name}: not measured ({error:#})"));
                    }
                }
            }
        }

        eprintln!("== roofline: prefill at several lengths");
        let prefill_seconds = [8, 32, 128, 512]
            .into_iter()
            .filter(|&t| t <= tokens.len() && (!args.output.quick || t <= 32))
            .map(|t| (t, speed::prefill_seconds(&fast_f32.model, &tokens, t, reps)))
            .collect();
        report.measured = Some(report::Measured {
            parts: [Part::Speed, Part::Roofline]
                .into_iter()
                .filter(|&p| wants(p))
                .collect(),
            machine,
            kiln_f32,
            kiln_bf16,
            references,
            missing,
            prefill_seconds,
            around_bytes: around.bytes(),
        });
    }
    if wants(Part::Latency) {
        eprintln!("== latency: recompute vs cached at T = {lengths:?}");
        report.latency = Some(speed::latency(
            &dense.model,
            &fast_f32.model,
            &tokens,
            &lengths,
            reps,
        ));
    }
    if wants(Part::Waste) {
        eprintln!("== waste: contiguous reservations");
        report.waste = Some(waste::measure(config)?);
    }

    if wants(Part::Profile) {
        let reps = args.output.reps(9)?;
        eprintln!(
            "== profile: prefill {} tokens and decode batch {}, {reps} reps",
            profile::PREFILL_TOKENS,
            profile::DECODE_BATCH
        );
        let measured = profile::measure(&fast_f32.model, &tokens, reps)?;
        let markdown = measured.markdown(&facts, &model_name, threads, reps);
        std::fs::create_dir_all(&out)?;
        let path = out.join(format!("{}.md", profile::STEM));
        std::fs::write(&path, &markdown).with_context(|| format!("writing {}", path.display()))?;
        println!("{markdown}");
    }

    if wants(Part::Gemm) {
        let reps = args.output.reps(7)?;
        eprintln!("== gemm: every prefill micro-kernel, {reps} rounds");
        let measured = gemm::measure(config, reps);
        let markdown = measured.markdown(&facts, &model_name, threads, reps);
        std::fs::create_dir_all(&out)?;
        let path = out.join(format!("{}.md", gemm::STEM));
        std::fs::write(&path, &markdown).with_context(|| format!("writing {}", path.display()))?;
        println!("{markdown}");
    }

    let files = report.files();
    let figures: Vec<_> = files
        .iter()
        .map(|(stem, markdown, svg)| (*stem, Some(markdown.as_str()), svg.as_str()))
        .collect();
    write_figures(&out, &figures)?;
    Ok(())
}
