//! Chapter 4's [`AttentionBackend`] seam, implemented by flash attention: the CPU executor runs
//! unchanged with either backend, and `--attention-backend naive|flash|auto` picks one.
//!
//! ```text
//! CpuExecutor::with_backend(model, pool, Box::new(FlashAttention::new()))
//!     write_kv   the trait's default: each new row's K/V into its slot
//!     attend     flash_attention_paged over the pool's layer, scratch kept in the backend
//! ```

use ch01::Llama;
use ch01::attention::AttentionShape;
use ch02::kernels::Isa;
use ch03::{KvDtype, KvElement, KvPool, PoolError};
use ch04::attention::{AttentionBackend, BatchAttention, QueryRow};
use ch04::{CacheConfig, CpuExecutor, Executor};

use crate::attention::{FlashParams, Scratch, decode_rows, flash_attention_paged};
use crate::tile::LayerKv;

// ANCHOR: backend
/// Flash attention inside chapter 4's CPU executor, for a pool of any [`KvElement`] (f32,
/// bf16, or chapter 5's 8-bit codes with scales). Owns its scratch, so a decode step allocates nothing once the buffers have grown.
pub struct FlashAttention {
    pub isa: Isa,
    pub params: FlashParams,
    scratch: Scratch,
}

impl<K: KvElement> AttentionBackend<K> for FlashAttention {
    fn attend(
        &mut self,
        pool: &KvPool<K>,
        layer: usize,
        rows: &[QueryRow],
        q: &[f32],
        shape: AttentionShape,
        out: &mut [f32],
    ) {
        let (keys, values) = pool.layer_kv(layer);
        let kv = LayerKv {
            keys,
            values,
            scales: pool.layer_scales(layer),
            block_size: pool.block_size(),
            shape,
        };
        flash_attention_paged(self.isa, &kv, rows, q, &self.params, &mut self.scratch, out);
    }
}
// ANCHOR_END: backend

impl FlashAttention {
    /// The fastest instruction set, the default tiles and automatic split-K.
    pub fn new() -> FlashAttention {
        FlashAttention::with_params(Isa::detect(), FlashParams::default())
    }

    pub fn with_params(isa: Isa, params: FlashParams) -> FlashAttention {
        FlashAttention {
            isa,
            params,
            scratch: Scratch::new(),
        }
    }

    /// Bytes of scratch it holds now.
    pub fn scratch_bytes(&self) -> usize {
        self.scratch.bytes()
    }
}

impl Default for FlashAttention {
    fn default() -> Self {
        FlashAttention::new()
    }
}

/// Which attention a CPU executor runs: `--attention-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionKind {
    /// Chapter 4's [`BatchAttention`]: one task per query row, every score of the row at once.
    Naive,
    /// This chapter's [`FlashAttention`].
    Flash,
    /// [`AutoAttention`]: per step, whichever the benchmark measured faster at its lengths.
    #[default]
    Auto,
}

impl AttentionKind {
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Naive => "naive",
            AttentionKind::Flash => "flash",
            AttentionKind::Auto => "auto",
        }
    }

    /// A fresh backend of this kind for a pool of `K`.
    pub fn backend<'a, K: KvElement>(self) -> Box<dyn AttentionBackend<K> + 'a> {
        match self {
            AttentionKind::Naive => Box::new(BatchAttention::default()),
            AttentionKind::Flash => Box::new(FlashAttention::new()),
            AttentionKind::Auto => Box::new(AutoAttention::default()),
        }
    }
}

impl std::fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AttentionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "naive" => Ok(AttentionKind::Naive),
            "flash" => Ok(AttentionKind::Flash),
            "auto" => Ok(AttentionKind::Auto),
            other => Err(format!(
                "unknown attention backend {other:?}: expected naive, flash or auto"
            )),
        }
    }
}

// ANCHOR: auto
/// The rule of `--attention-backend auto`, from what `kiln bench ch07` measured:
/// - a step with a prompt chunk runs flash attention if its longest sequence has at least
///   [`AutoAttention::FLASH_FROM`] positions, chapter 4's kernel below (first run of 2026-12-03:
///   flash 1.24× at 128 positions, 1.56× to 2.24× from 256 to 16k; after chapter 4's kernel took
///   eight positions at a time, 1.07× at 128, 1.39× to 2.64× from 256 to 16k; after it gained
///   its AVX2 and AVX-512 loops, and flash its AVX-512 compilation, three runs of 2026-12-07:
///   0.72×, 0.87× and 0.89× at 128, 1.09×, 0.86× and 0.98× at 256, 0.96×, 1.09× and 1.03× at
///   512, 1.09× to 3.50× from 1k to 16k. Chapter 4's kernel led at 128 and the two tied at 256
///   and 512; the rule starts flash at 512 rather than 256, where one run had flash 14% behind.
///   Below 128 nothing was measured);
/// - a step of decode rows only (one row per sequence) runs flash attention only if its split-K
///   would cut the longest row into more than one partition
///   ([`Partitions::count`](crate::Partitions::count): few rows, long context), chapter 4's
///   kernel otherwise: one decode row through chapter 4's kernel took
///   0.021 ms at 256 positions against 0.034 for one flash partition and was ahead of one
///   partition to 16k, while split-K won from 1k (0.059 against 0.084 ms; `kiln bench ch07`,
///   2026-12-03); with its K/V prefetched, 0.027 against 0.035 at 256 and ahead at every length
///   to 32k, split-K winning from 1k (0.061 against 0.101 ms; first run of 2026-12-04; the
///   second run had it behind at 4k only, 0.550 against 0.487, and split-K behind from 8k).
#[derive(Default)]
pub struct AutoAttention {
    naive: BatchAttention,
    flash: FlashAttention,
}

impl AutoAttention {
    /// Context length (positions) from which flash attention is about as fast as chapter 4's
    /// kernel in prefill, or faster (the two tie within the runs' spread at 512).
    pub const FLASH_FROM: usize = 512;

    /// Whether a step of `rows` runs flash attention.
    pub fn runs_flash(&self, rows: &[QueryRow]) -> bool {
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(0);
        if decode_rows(rows) == rows.len() {
            self.flash.params.partitions.count(longest, rows.len()) > 1
        } else {
            longest >= Self::FLASH_FROM
        }
    }
}
// ANCHOR_END: auto

impl<K: KvElement> AttentionBackend<K> for AutoAttention {
    fn attend(
        &mut self,
        pool: &KvPool<K>,
        layer: usize,
        rows: &[QueryRow],
        q: &[f32],
        shape: AttentionShape,
        out: &mut [f32],
    ) {
        if self.runs_flash(rows) {
            self.flash.attend(pool, layer, rows, q, shape, out);
        } else {
            self.naive.attend(pool, layer, rows, q, shape, out);
        }
    }
}

/// Chapter 4's [`ch04::cpu_executor()`] with the attention backend chosen: a CPU executor with a
/// pool of `cache.dtype` elements, as many blocks as `cache.memory` holds. Every dtype: f32 and
/// bf16 (chapter 3), FP8 E4M3 and int8 with scales (chapter 5's element types).
pub fn cpu_executor<'m>(
    model: &'m Llama,
    cache: &CacheConfig,
    attention: AttentionKind,
) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
    executor_with(model, cache, attention, false)
}

/// [`cpu_executor`] with its pool's memory backed at once ([`KvPool::populate`]): a server's,
/// made at start-up, whose steps then never stop on the first write of a block (and whose pool,
/// if the memory is not there, fails now rather than under load).
pub fn populated_cpu_executor<'m>(
    model: &'m Llama,
    cache: &CacheConfig,
    attention: AttentionKind,
) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
    executor_with(model, cache, attention, true)
}

fn executor_with<'m>(
    model: &'m Llama,
    cache: &CacheConfig,
    attention: AttentionKind,
    populate: bool,
) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
    fn boxed<'m, K: KvElement>(
        model: &'m Llama,
        cache: &CacheConfig,
        attention: AttentionKind,
        populate: bool,
    ) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
        let mut pool = KvPool::<K>::with_budget(&model.config, cache.block_size, cache.memory)?;
        if populate {
            pool.populate();
        }
        Ok(Box::new(CpuExecutor::with_backend(
            model,
            pool,
            attention.backend::<K>(),
        )))
    }
    match cache.dtype {
        KvDtype::F32 => boxed::<f32>(model, cache, attention, populate),
        KvDtype::Bf16 => boxed::<half::bf16>(model, cache, attention, populate),
        KvDtype::Fp8E4M3 => boxed::<ch05::fp8::F8E4M3>(model, cache, attention, populate),
        KvDtype::Int8 => boxed::<ch05::kv_cache::KvInt8>(model, cache, attention, populate),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ch03::BlockId;

    fn rows<'a>(sequences: &'a [Vec<BlockId>], positions: &[(usize, usize)]) -> Vec<QueryRow<'a>> {
        // (sequence, pos) per row
        positions
            .iter()
            .map(|&(s, pos)| QueryRow {
                blocks: &sequences[s],
                pos,
            })
            .collect()
    }

    #[test]
    fn auto_sends_decode_steps_to_split_k_only_where_it_partitions() {
        let auto = AutoAttention::default();
        let tables: Vec<Vec<BlockId>> = (0..32).map(|s| vec![s as BlockId; 256]).collect();
        // 32 decodes at 200 positions: one partition each, chapter 4's kernel.
        let batch: Vec<_> = (0..32).map(|s| (s, 199)).collect();
        assert!(!auto.runs_flash(&rows(&tables, &batch)));
        // One decode at 4000 positions: split-K cuts it.
        assert!(auto.runs_flash(&rows(&tables, &[(0, 3999)])));
        // One short decode: nothing to cut.
        assert!(!auto.runs_flash(&rows(&tables, &[(0, 99)])));
        // A prompt chunk of 600 positions (with a decode beside it): flash.
        let mut chunk: Vec<_> = (0..600).map(|p| (1, p)).collect();
        chunk.push((2, 50));
        assert!(auto.runs_flash(&rows(&tables, &chunk)));
        // Prompt chunks shorter than FLASH_FROM: chapter 4's kernel.
        for len in [20, 130, AutoAttention::FLASH_FROM - 1] {
            let short: Vec<_> = (0..len).map(|p| (1, p)).collect();
            assert!(!auto.runs_flash(&rows(&tables, &short)), "{len} positions");
        }
        let exact: Vec<_> = (0..AutoAttention::FLASH_FROM).map(|p| (1, p)).collect();
        assert!(auto.runs_flash(&rows(&tables, &exact)));
    }
}
