//! The serving flags, named as vLLM names them: the paged KV cache (chapter 3), the engine's
//! scheduler (chapter 4) and its attention backend (chapter 7). `kiln generate --prompts-file`
//! and `kiln serve` use them.

use anyhow::{Context, bail};
use ch03::KvDtype;
use ch04::{CacheConfig, EngineConfig, Preemption};
use ch07::AttentionKind;
use ch07::cuda::DeviceSpec;

/// The names `--kv-cache-dtype` accepts.
pub const KV_CACHE_DTYPES: [&str; 6] = ["auto", "f32", "bf16", "fp8", "fp8_e4m3", "int8"];

/// Chapter 3's paged KV cache, sized as vLLM's `--kv-cache-memory`, `--block-size` and
/// `--kv-cache-dtype`.
#[derive(clap::Args, Debug)]
pub struct KvArgs {
    /// Memory for the paged KV cache, e.g. 512MiB, 2GiB, 1.5GB or a number of bytes. (On a
    /// GPU, --gpu-memory-utilization sizes it instead: not both.)
    #[arg(long, default_value = "512MiB", value_parser = super::parse_bytes,
          conflicts_with = "gpu_memory_utilization")]
    pub kv_cache_memory: u64,
    /// Positions per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Storage of the cached keys and values: auto (the --dtype of the weights on the engine;
    /// f32 for one --prompt, which runs on chapter 3's f32 cache), f32, bf16 (twice the tokens
    /// in the same memory), or chapter 5's 8-bit codes with one f32 scale per position and KV
    /// head, fp8_e4m3 (alias fp8) or int8 (3.76× the tokens of f32 at head_dim 64). Attention
    /// computes in f32 whatever the storage.
    #[arg(long, default_value = "auto", value_parser = KV_CACHE_DTYPES)]
    pub kv_cache_dtype: String,
}

/// The largest `--block-size` (vLLM offers 8 to 256 tokens a block).
const MAX_BLOCK_SIZE: usize = 4096;

impl KvArgs {
    /// The KV memory, logged as a server logs it: bytes, blocks, and how many tokens they hold.
    /// `weights`: the `--dtype` of the weights, which `auto` follows.
    pub fn cache(&self, config: &ch01::LlamaConfig, weights: &str) -> anyhow::Result<CacheConfig> {
        let dtype: KvDtype = match self.kv_cache_dtype.as_str() {
            "auto" => weights,
            other => other,
        }
        .parse()
        .map_err(anyhow::Error::msg)?;
        if !(1..=MAX_BLOCK_SIZE).contains(&self.block_size) {
            bail!("--block-size must be from 1 to {MAX_BLOCK_SIZE}");
        }
        let token_bytes = dtype.bytes_per_token(config);
        let block_bytes = token_bytes
            .checked_mul(self.block_size as u64)
            .filter(|&b| b > 0)
            .with_context(|| format!("KV blocks of {} tokens: too large", self.block_size))?;
        let blocks = self.kv_cache_memory / block_bytes;
        eprintln!(
            "kiln: KV cache {:.1} MiB of {dtype} = {blocks} blocks of {} tokens = {} tokens ({token_bytes} bytes per token)",
            self.kv_cache_memory as f64 / (1u64 << 20) as f64,
            self.block_size,
            blocks.saturating_mul(self.block_size as u64),
        );
        Ok(CacheConfig {
            memory: self.kv_cache_memory,
            block_size: self.block_size,
            dtype,
        })
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

/// Chapter 7's choice of attention inside the CPU executor.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct AttentionArgs {
    /// Attention in the engine's executor: naive (chapter 4's batch attention), flash (chapter
    /// 7's tiled flash attention and split-K decode), or auto: for a step with a prompt chunk,
    /// flash if its longest sequence has at least 128 positions (where `kiln bench ch07`
    /// measured flash ahead in prefill), naive below; for a step of decodes only, flash where
    /// split-K cuts the longest row into partitions (few rows, long contexts), naive otherwise.
    #[arg(long, value_enum, default_value_t = AttentionBackend::Auto)]
    pub attention_backend: AttentionBackend,
}

/// `--attention-backend`: [`AttentionKind`] on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionBackend {
    Naive,
    Flash,
    Auto,
}

impl AttentionArgs {
    pub fn kind(&self) -> AttentionKind {
        match self.attention_backend {
            AttentionBackend::Naive => AttentionKind::Naive,
            AttentionBackend::Flash => AttentionKind::Flash,
            AttentionBackend::Auto => AttentionKind::Auto,
        }
    }

    /// [`Self::kind`], refused on a GPU unless left at `auto`: `--attention-backend` picks the
    /// CPU executor's attention, and the GPU's kernels are chosen otherwise.
    pub fn kind_on(&self, device: DeviceSpec) -> anyhow::Result<AttentionKind> {
        if device != DeviceSpec::Cpu && self.attention_backend != AttentionBackend::Auto {
            anyhow::bail!(
                "--attention-backend picks the CPU executor's attention; on --device {device} the \
                 GPU's kernels run (KILN_DECODE_KERNEL and KILN_PREFILL_KERNEL choose among them)"
            );
        }
        Ok(self.kind())
    }
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
            enable_prefix_caching: self.enable_prefix_caching,
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
