//! `kiln perplexity`: score a text file the way llama.cpp's perplexity tool does.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use ch01::perplexity::perplexity;

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score (tokenized without added special tokens).
    #[arg(long, value_name = "FILE")]
    pub file: PathBuf,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
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
    let result = perplexity(&loaded.model, &tokens, args.ctx, bos, args.chunks)?;
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
