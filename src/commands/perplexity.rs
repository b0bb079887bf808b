//! `kiln perplexity`: score a text file the way llama.cpp's perplexity tool does.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use ch01::Llama;
use ch01::perplexity::{Perplexity, perplexity, perplexity_with};
use ch03::KvDtype;
use ch07::cuda::DeviceSpec;

use super::ModelArgs;
use super::prompt_step::{cache_for, prompt_logits};
use super::tensor_parallel::TensorParallelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub tensor_parallel: TensorParallelArgs,
    /// Text file to score (tokenized without added special tokens).
    #[arg(long, value_name = "FILE")]
    pub file: PathBuf,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Score through chapter 4's executor with a paged KV cache of this dtype (f32, bf16,
    /// fp8_e4m3 or int8): each chunk is one prefill that writes its K/V in that dtype and reads
    /// them back. Without it, chapter 1's forward scores the chunks (no cache); on a GPU
    /// (`--device cuda`, f32 or bf16) the default is f32.
    #[arg(long, value_name = "DTYPE", value_parser = ["f32", "bf16", "fp8", "fp8_e4m3", "int8"])]
    pub kv_cache_dtype: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // What is cheap to check comes before the model loads.
    let text = super::read_text_file(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    anyhow::ensure!(args.ctx >= 2, "--ctx must be at least 2 tokens");
    anyhow::ensure!(args.chunks != Some(0), "--chunks must be at least 1");
    if args.tensor_parallel.is_parallel()
        && let Some(dtype) = args.kv_cache_dtype.as_deref().filter(|d| *d != "f32")
    {
        anyhow::bail!(
            "tensor parallelism scores with an f32 KV cache: drop --kv-cache-dtype {dtype}"
        );
    }
    // Tensor-parallel ranks load their own shards: the host keeps no copy of the weights.
    let (host, model) = args.tensor_parallel.load_host(&args.model, false)?;
    let tokens = host.tokenizer.encode(&text, false)?;
    let bos = host
        .tokenizer
        .adds_bos()
        .then(|| host.tokenizer.bos_token_id())
        .flatten();
    // Before any cache is sized from it: a chunk never outgrows the model's context.
    let context = host.config.max_position_embeddings;
    anyhow::ensure!(
        args.ctx <= context,
        "--ctx {} is longer than the model's context of {context} positions",
        args.ctx
    );
    let start = Instant::now();
    let on_gpu = args.model.device != DeviceSpec::Cpu;
    let result = if let (Some(model), false) = (&model, args.tensor_parallel.is_parallel()) {
        match &args.kv_cache_dtype {
            None => perplexity(model, &tokens, args.ctx, bos, args.chunks)?,
            Some(dtype) => {
                let dtype: KvDtype = dtype.parse().map_err(anyhow::Error::msg)?;
                eprintln!("kiln: scoring through the engine's executor, {dtype} KV cache");
                perplexity_through_kv(model, &tokens, args.ctx, bos, args.chunks, dtype)?
            }
        }
    } else {
        // Each chunk is one prefill step on the ranks or the GPU, every row's logits wanted.
        let config = &host.config;
        let mut executor = if on_gpu {
            anyhow::ensure!(
                !args.tensor_parallel.is_parallel(),
                "--device {}: tensor parallelism runs on the CPU only so far",
                args.model.device
            );
            let dtype: KvDtype = args
                .kv_cache_dtype
                .as_deref()
                .unwrap_or("f32")
                .parse()
                .map_err(anyhow::Error::msg)?;
            let cache = cache_for(config, args.ctx, dtype);
            eprintln!("kiln: scoring on {}, {dtype} KV cache", args.model.device);
            args.model.gpu_executor(config, &cache)?
        } else {
            let cache = cache_for(config, args.ctx, KvDtype::F32);
            args.tensor_parallel.tensor_parallel_executor(
                &args.model,
                &cache,
                ch07::AttentionKind::Naive,
            )?
        };
        perplexity_with(&tokens, args.ctx, bos, args.chunks, |chunk| {
            prompt_logits(&mut *executor, chunk)
        })?
    };
    let running: Vec<String> = result
        .per_chunk
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[{}]{p:.4}", i + 1))
        .collect();
    // Written, not printed: a closed pipe is an error to report, not a panic.
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", running.join(","))?;
    writeln!(
        stdout,
        "Final estimate: PPL = {:.4} ({} chunks of {} tokens, {} tokens scored, {:.1} s)",
        result.perplexity,
        result.num_chunks,
        args.ctx,
        result.scored_tokens,
        start.elapsed().as_secs_f64()
    )?;
    Ok(())
}

// ANCHOR: perplexity_through_kv
/// [`perplexity`] through chapter 7's CPU executor (flash or naive attention, whichever `auto`
/// picks) with a paged KV cache of `dtype`: each chunk is one prefill step whose K/V are stored
/// in `dtype` before every position attends to them, so the score includes the cache's
/// rounding. The pool holds one chunk; each chunk overwrites the last.
pub fn perplexity_through_kv(
    model: &Llama,
    tokens: &[u32],
    ctx: usize,
    bos: Option<u32>,
    max_chunks: Option<usize>,
    dtype: KvDtype,
) -> anyhow::Result<Perplexity> {
    let cache = cache_for(&model.config, ctx, dtype);
    let mut executor = ch07::cpu_executor(model, &cache, ch07::AttentionKind::Auto)?;
    perplexity_with(tokens, ctx, bos, max_chunks, |chunk| {
        prompt_logits(&mut *executor, chunk)
    })
}
// ANCHOR_END: perplexity_through_kv
