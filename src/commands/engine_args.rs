//! The serving flags, named as vLLM names them: the paged KV cache (chapter 3) and the engine's
//! scheduler (chapter 4). `kiln generate --prompts-file` uses them; chapter 8's server will too.

use ch04::{EngineConfig, Preemption};

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
    pub fn pool(
        &self,
        config: &ch01::LlamaConfig,
        enable_prefix_caching: bool,
    ) -> anyhow::Result<ch03::PagedKv> {
        let kv = ch03::PagedKv::with_budget(
            config,
            self.block_size,
            self.kv_cache_memory,
            enable_prefix_caching,
        )?;
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

/// Chapter 4's scheduler. The defaults are [`EngineConfig::default`]'s.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// Most sequences in one engine step.
    #[arg(long, default_value_t = EngineConfig::default().max_num_seqs, value_name = "N")]
    pub max_num_seqs: usize,
    /// Most tokens in one engine step: prompt chunks plus one per decoding sequence.
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens, value_name = "N")]
    pub max_num_batched_tokens: usize,
    /// Run each prompt whole instead of in chunks that share steps with decodes (chunked
    /// prefill is on by default).
    #[arg(long = "no-enable-chunked-prefill", alias = "no-chunked-prefill", action = clap::ArgAction::SetFalse)]
    pub enable_chunked_prefill: bool,
    /// What a sequence preempted for lack of KV blocks does with its K/V: free it and recompute
    /// it later, or copy it to CPU memory and back.
    #[arg(long, alias = "preemption", value_enum, default_value_t = PreemptionMode::Recompute)]
    pub preemption_mode: PreemptionMode,
    /// Reuse the KV blocks of prompt prefixes already computed (chapter 3's prefix cache).
    #[arg(long)]
    pub enable_prefix_caching: bool,
}

/// `--preemption-mode`: [`Preemption`] on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreemptionMode {
    Recompute,
    Swap,
}

impl EngineArgs {
    pub fn config(&self) -> EngineConfig {
        EngineConfig {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            enable_chunked_prefill: self.enable_chunked_prefill,
            preemption: match self.preemption_mode {
                PreemptionMode::Recompute => Preemption::Recompute,
                PreemptionMode::Swap => Preemption::Swap,
            },
            ..EngineConfig::default()
        }
    }

    /// One line for the log: the scheduler's limits.
    pub fn describe(&self) -> String {
        format!(
            "max-num-seqs {} | max-num-batched-tokens {} | chunked prefill {} | preemption {} | \
             prefix caching {}",
            self.max_num_seqs,
            self.max_num_batched_tokens,
            on_off(self.enable_chunked_prefill),
            match self.preemption_mode {
                PreemptionMode::Recompute => "recompute",
                PreemptionMode::Swap => "swap",
            },
            on_off(self.enable_prefix_caching),
        )
    }
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}
