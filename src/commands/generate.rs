//! `kiln generate`: stream a completion to stdout, timings to stderr (as llama.cpp prints them).

use std::io::Write;

use ch01::{FinishReason, GenerateOptions, SamplingParams};

use super::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt, tokenized with the tokenizer's own special-token rules.
    #[arg(long)]
    pub prompt: String,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// 1.0 disables.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// 0.0 disables.
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// 1.0 disables.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Random seed; a fresh one (printed) when omitted.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating after the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Chapter 1's loop: recompute the whole sequence for every token instead of using the KV cache.
    #[arg(long, conflicts_with = "contiguous")]
    pub recompute: bool,
    /// Chapter 2's cache: one contiguous buffer reserved for the model's whole context, instead
    /// of chapter 3's paged blocks.
    #[arg(long)]
    pub contiguous: bool,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// Chapter 3's paged KV cache, sized as vLLM's `--kv-cache-memory` and `--block-size`.
#[derive(clap::Args, Debug)]
pub struct KvArgs {
    /// Memory for the paged KV cache, e.g. 512MiB, 2GiB, 1.5GB or a number of bytes.
    #[arg(long, default_value = "512MiB", value_parser = super::parse_bytes)]
    pub kv_cache_memory: u64,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
}

impl KvArgs {
    /// The pool, logged as a server logs it: bytes, blocks, and how many tokens they hold.
    pub fn pool(&self, config: &ch01::LlamaConfig) -> anyhow::Result<ch03::PagedKv> {
        let kv = ch03::PagedKv::with_budget(config, self.block_size, self.kv_cache_memory, false)?;
        eprintln!(
            "kiln: KV cache {:.1} MiB = {} blocks of {} tokens = {} tokens ({} bytes per token)",
            self.kv_cache_memory as f64 / (1u64 << 20) as f64,
            kv.pool.num_blocks(),
            self.block_size,
            kv.pool.token_capacity(),
            ch03::KvPool::bytes_per_block(config, 1),
        );
        Ok(kv)
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let loaded = args.model.load()?;
    let seed = args.seed.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        nanos.as_nanos() as u64
    });
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            frequency_penalty: args.frequency_penalty,
            presence_penalty: args.presence_penalty,
            seed,
        },
        stop: args.stop,
        ignore_eos: args.ignore_eos,
        eos_token_ids: loaded.eos_token_ids.clone(),
    };
    options.sampling.validate()?;
    let prompt_tokens = loaded.tokenizer.encode(&args.prompt, true)?;
    eprintln!(
        "kiln: {} | prompt {} tokens | seed {seed}",
        args.model.model.display(),
        prompt_tokens.len()
    );

    // Chapter 3's paged pool, checked before anything is printed.
    let mut paged = None;
    if !(args.recompute || args.contiguous) {
        let config = &loaded.model.config;
        let kv = args.kv.pool(config)?;
        let needed = (prompt_tokens.len() + args.max_tokens).min(config.max_position_embeddings);
        if needed > kv.pool.token_capacity() {
            anyhow::bail!(
                "the KV cache holds {} tokens, but the prompt ({}) plus --max-tokens ({}) needs {needed}: \
                 raise --kv-cache-memory",
                kv.pool.token_capacity(),
                prompt_tokens.len(),
                args.max_tokens
            );
        }
        paged = Some(kv);
    }

    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{}", args.prompt)?;
    stdout.flush()?;
    let mut write_error = None;
    let mut on_text = |text: &str| {
        if let Err(e) = write!(stdout, "{text}").and_then(|()| stdout.flush()) {
            write_error.get_or_insert(e);
        }
    };
    let (model, tokenizer) = (&loaded.model, &loaded.tokenizer);
    let generation = if args.recompute {
        ch01::generate(model, tokenizer, &prompt_tokens, &options, &mut on_text)?
    } else if args.contiguous {
        let mut cache = ch02::ContiguousKvCache::for_max_len(&model.config);
        ch02::generate_cached(
            model,
            tokenizer,
            &prompt_tokens,
            &mut cache,
            &options,
            &mut on_text,
        )?
    } else {
        let kv = paged
            .as_mut()
            .expect("made above unless --recompute or --contiguous");
        ch03::generate_paged(model, tokenizer, &prompt_tokens, kv, &options, &mut on_text)?
    };
    writeln!(stdout)?;
    if let Some(e) = write_error {
        return Err(e.into());
    }

    let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let prompt_secs = generation.prompt_time.as_secs_f64();
    let gen_secs = generation.generation_time.as_secs_f64();
    eprintln!(
        "prompt eval: {} tokens in {:.1} ms ({:.1} tokens/s)",
        prompt_tokens.len(),
        prompt_secs * 1e3,
        rate(prompt_tokens.len(), prompt_secs)
    );
    eprintln!(
        "generation:  {} tokens in {:.1} ms ({:.1} tokens/s) | finish: {}",
        generation.output_tokens.len(),
        (prompt_secs + gen_secs) * 1e3,
        rate(generation.decode_steps, gen_secs),
        match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    );
    Ok(())
}
