//! `kiln perplexity`: score a text file the way llama.cpp's perplexity tool does.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use ch01::Llama;
use ch01::perplexity::{Perplexity, perplexity, perplexity_with};
use ch03::KvDtype;
use ch04::{CacheConfig, ScheduledSeq, SchedulerOutput};
use ndarray::Array2;

use super::ModelArgs;
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
    /// them back. Without it, chapter 1's forward scores the chunks (no cache).
    #[arg(long, value_name = "DTYPE", value_parser = ["f32", "bf16", "fp8", "fp8_e4m3", "int8"])]
    pub kv_cache_dtype: Option<String>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = args.model.load()?;
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let tokens = loaded.tokenizer.encode(&text, false)?;
    let bos = loaded
        .tokenizer
        .adds_bos()
        .then(|| loaded.tokenizer.bos_token_id())
        .flatten();
    let start = Instant::now();
    let result = if args.tensor_parallel.is_parallel() {
        // Each chunk is one prefill step on the ranks, every row's logits wanted.
        let cache = ch04::CacheConfig {
            memory: 1 << 30,
            block_size: 16,
            dtype: ch03::KvDtype::F32,
        };
        let mut executor = args.tensor_parallel.tensor_parallel_executor(
            &args.model,
            &cache,
            ch07::AttentionKind::Naive,
        )?;
        let blocks = executor.kv_layout().num_blocks;
        anyhow::ensure!(
            blocks * 16 >= args.ctx,
            "--ctx {} exceeds the KV memory",
            args.ctx
        );
        let mut forward = |input: &[u32]| -> ch01::Result<ndarray::Array2<f32>> {
            let c = &loaded.model.config;
            ch01::model::check_tokens(input, c.vocab_size, c.max_position_embeddings)?;
            let step = ch04::SchedulerOutput {
                seqs: vec![ch04::ScheduledSeq {
                    id: 0,
                    tokens: input.to_vec(),
                    start_pos: 0,
                    block_table: (0..input.len().div_ceil(16) as u32).collect(),
                    logit_rows: input.len(),
                }],
                ..Default::default()
            };
            let logits = executor
                .execute(&step)
                .map_err(|e| ch01::Error::InvalidArgument(e.to_string()))?;
            Ok(logits.to_owned())
        };
        perplexity_with(&tokens, args.ctx, bos, args.chunks, &mut forward)?
    } else {
        match &args.kv_cache_dtype {
            None => perplexity(&loaded.model, &tokens, args.ctx, bos, args.chunks)?,
            Some(dtype) => {
                let dtype: KvDtype = dtype.parse().map_err(anyhow::Error::msg)?;
                eprintln!("kiln: scoring through the engine's executor, {dtype} KV cache");
                perplexity_through_kv(&loaded.model, &tokens, args.ctx, bos, args.chunks, dtype)?
            }
        }
    };
    let running: Vec<String> = result
        .per_chunk
        .iter()
        .enumerate()
        .map(|(i, p)| format!("[{}]{p:.4}", i + 1))
        .collect();
    println!("{}", running.join(","));
    println!(
        "Final estimate: PPL = {:.4} ({} chunks of {} tokens, {} tokens scored, {:.1} s)",
        result.perplexity,
        result.num_chunks,
        args.ctx,
        result.scored_tokens,
        start.elapsed().as_secs_f64()
    );
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
    const BLOCK_SIZE: usize = 16;
    let blocks = ctx.div_ceil(BLOCK_SIZE);
    let cache = CacheConfig {
        memory: dtype.bytes_per_token(&model.config) * (blocks * BLOCK_SIZE) as u64,
        block_size: BLOCK_SIZE,
        dtype,
    };
    let mut executor = ch07::cpu_executor(model, &cache, ch07::AttentionKind::Auto)?;
    let block_table: Vec<u32> = (0..blocks as u32).collect();
    perplexity_with(tokens, ctx, bos, max_chunks, |chunk| {
        let step = SchedulerOutput {
            seqs: vec![ScheduledSeq {
                id: 0,
                tokens: chunk.to_vec(),
                start_pos: 0,
                block_table: block_table.clone(),
                logit_rows: chunk.len(),
            }],
            ..SchedulerOutput::default()
        };
        let logits: Array2<f32> = executor.execute(&step)?.to_owned(); // [ctx, vocab]
        anyhow::Ok(logits)
    })
}
// ANCHOR_END: perplexity_through_kv
