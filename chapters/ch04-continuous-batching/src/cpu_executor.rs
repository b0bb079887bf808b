//! [`CpuExecutor`]: the [`Executor`] of this chapter. The weights are chapter 1's model (with
//! chapter 2's kernels), the KV memory chapter 3's pool, and one forward runs every token the
//! scheduler picked.
//!
//! ```text
//! seq A: prefill chunk  tokens a0 a1 a2   positions 0 1 2      ┐
//! seq B: decode         token  b7         position  7          ├─ flattened: x [4, hidden]
//! seq C: decode         token  c3         position  3          ┘
//! every projection:  [4, in] · Wᵀ   — the weights are read once for the whole batch
//! attention:         the backend writes each row's K/V to its slot, then every row attends
//!                    to its own sequence's blocks, in one parallel pass over the batch
//! logits:            only for the rows the scheduler asked for
//! ```
//! No padding: each token carries its own position and KV slot (the slot mapping).

use std::collections::HashMap;
use std::convert::Infallible;

use ch01::Llama;
use ch02::awake::awake;
use ch02::cached::{Workspace, decoder_layer};
use ch02::elementwise::rms_norm_picked_rows;
use ch02::profile::{Op, timed};
use ch03::{BlockData, KvDtype, KvElement, KvPool, PoolError};
use ndarray::{ArrayView2, ArrayViewMut2};

use crate::attention::{AttentionBackend, BatchAttention};
use crate::executor::{Executor, ExecutorError, KvLayout, ModelSpec};
use crate::request::RequestId;
use crate::scheduler::{BlockOp, SchedulerOutput};

/// The KV memory of an executor, as vLLM's `--kv-cache-memory`, `--block-size` and
/// `--kv-cache-dtype` size it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheConfig {
    /// Bytes of K/V memory: as many whole blocks as fit.
    pub memory: u64,
    /// Positions per block.
    pub block_size: usize,
    pub dtype: KvDtype,
}

/// Runs steps on the CPU: chapter 1's model, a pool of `K` elements, and an attention backend.
///
/// Invariant: the pool was made for this model (its KV heads and head size) and holds its
/// first `n` layers: the executor runs those `n` layers, then the final norm and the head.
/// Normally `n` is every layer; fewer make the target's own draft model (chapter 6's
/// self-speculation by layer skipping).
pub struct CpuExecutor<'m, K: KvElement = f32> {
    model: &'m Llama,
    pool: KvPool<K>,
    backend: Box<dyn AttentionBackend<K> + 'm>,
    swapped: SwapSpace<K>,
    workspace: Workspace,
    tokens: Vec<u32>, // [n] the step's tokens, flattened
    normed: Vec<f32>, // [rows, hidden] the rows that want logits, after the final norm
    logits: Vec<f32>, // [rows, vocab] the last step's logit rows
}

impl<'m, K: KvElement> CpuExecutor<'m, K> {
    /// An executor over `pool` with this chapter's attention ([`BatchAttention`]).
    pub fn new(model: &'m Llama, pool: KvPool<K>) -> Self {
        Self::with_backend(model, pool, Box::new(BatchAttention::default()))
    }

    /// An executor with another attention backend (chapter 7's flash attention).
    pub fn with_backend(
        model: &'m Llama,
        pool: KvPool<K>,
        backend: Box<dyn AttentionBackend<K> + 'm>,
    ) -> Self {
        assert!(
            (1..=model.layers.len()).contains(&pool.num_layers()),
            "a pool of {} layers for a model of {}",
            pool.num_layers(),
            model.layers.len()
        );
        CpuExecutor {
            model,
            pool,
            backend,
            swapped: SwapSpace::default(),
            workspace: Workspace::new(&model.config, 1),
            tokens: Vec::new(),
            normed: Vec::new(),
            logits: Vec::new(),
        }
    }

    pub fn pool(&self) -> &KvPool<K> {
        &self.pool
    }

    // ANCHOR: execute
    /// The logits of the rows `step` asks for: [rows, vocab].
    fn run_step(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.swapped.apply_step(&mut self.pool, step);
        let model = self.model;
        // Flatten: each row's token, and its sequence's table and position.
        self.tokens.clear();
        for seq in &step.seqs {
            self.tokens.extend_from_slice(&seq.tokens);
        }
        let n = self.tokens.len();
        self.workspace.embed(model, &self.tokens);
        let rows = step.query_rows(); // [n]
        let layers = model.layers.iter().take(self.pool.num_layers());
        for (i, layer) in layers.enumerate() {
            let shape = layer.self_attn.shape();
            let (pool, backend) = (&mut self.pool, &mut self.backend);
            // Every new token's K/V goes to its slot, then the whole batch attends at once.
            let mut attend = |q: ArrayView2<f32>,
                              k: ArrayView2<f32>,
                              v: ArrayView2<f32>,
                              out: ArrayViewMut2<f32>|
             -> Result<(), Infallible> {
                backend.write_kv(pool, i, &rows, k, v);
                backend.attend(
                    pool,
                    i,
                    &rows,
                    q.as_slice().expect("contiguous rows"),
                    shape,
                    out.into_slice().expect("contiguous rows"),
                );
                Ok(())
            };
            let Ok(()) = decoder_layer(
                layer,
                &model.rope,
                &|r| rows[r].pos,
                n,
                &mut self.workspace,
                &mut attend,
            );
        }
        // The rows that want logits (the last `logit_rows` of each sequence), normed, through
        // the head at once.
        let picked_rows = step.logit_row_indices();
        let hidden = model.config.hidden_size;
        self.normed.resize(picked_rows.len() * hidden, 0.0);
        let residual = self.workspace.residual(); // [rows, hidden]
        let residual = residual.as_slice().expect("a fresh array is contiguous");
        let normed = &mut self.normed[..];
        timed(Op::FinalNorm, || {
            rms_norm_picked_rows(&model.norm, residual, &picked_rows, normed, hidden) // [S, hidden]
        });
        let normed = ArrayView2::from_shape((picked_rows.len(), hidden), &self.normed[..])
            .expect("[S, hidden]");
        let vocab = model.config.vocab_size;
        // The logits buffer is kept: a fresh [S, vocab] every step is megabytes of new pages.
        let used = picked_rows.len() * vocab;
        if self.logits.len() < used {
            self.logits.resize(used, 0.0);
        }
        let shape = (picked_rows.len(), vocab);
        let logits =
            ArrayViewMut2::from_shape(shape, &mut self.logits[..used]).expect("[S, vocab]");
        timed(Op::LmHead, || model.lm_head.forward_into(normed, logits));
        Ok(ArrayView2::from_shape(shape, &self.logits[..used]).expect("[S, vocab]"))
    }
    // ANCHOR_END: execute
}

/// The CPU memory that swapped-out K/V wait in, and the step's block operations on a pool
/// (every executor that keeps K/V in a [`KvPool`] applies them the same way: chapter 8's
/// ranks each on their own pool).
pub struct SwapSpace<K: KvElement> {
    /// What swapping out kept: per request, one copy of each block (see `KvPool::read_block`).
    swapped: HashMap<RequestId, Vec<BlockData<K>>>,
}

impl<K: KvElement> Default for SwapSpace<K> {
    fn default() -> Self {
        SwapSpace {
            swapped: HashMap::new(),
        }
    }
}

impl<K: KvElement> SwapSpace<K> {
    /// The block operations and the finished requests of `step`, in list order.
    pub fn apply_step(&mut self, pool: &mut KvPool<K>, step: &SchedulerOutput) {
        for op in &step.block_ops {
            self.apply(pool, op);
        }
        for id in &step.finished {
            self.swapped.remove(id);
        }
    }

    fn apply(&mut self, pool: &mut KvPool<K>, op: &BlockOp) {
        match op {
            BlockOp::Copy(copy) => pool.copy_block(*copy),
            BlockOp::SwapOut { id, blocks } => {
                let data = blocks.iter().map(|&b| pool.read_block(b)).collect();
                self.swapped.insert(*id, data);
            }
            BlockOp::SwapIn { id, blocks } => {
                let data = self.swapped.remove(id).unwrap_or_default();
                for (block, data) in blocks.iter().zip(&data) {
                    if let Some(block) = block {
                        pool.write_block(*block, data);
                    }
                }
            }
        }
    }
}

/// A CPU executor with a pool of `cache.dtype` elements, as many blocks as `cache.memory` holds.
/// This chapter builds f32 and bf16 pools; the 8-bit element types are chapter 5's (chapter 7's
/// `cpu_executor` builds every dtype).
pub fn cpu_executor<'m>(
    model: &'m Llama,
    cache: &CacheConfig,
) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
    fn boxed<'m, K: KvElement>(
        model: &'m Llama,
        cache: &CacheConfig,
    ) -> Result<Box<dyn Executor + Send + 'm>, PoolError> {
        let pool = KvPool::<K>::with_budget(&model.config, cache.block_size, cache.memory)?;
        Ok(Box::new(CpuExecutor::new(model, pool)))
    }
    match cache.dtype {
        KvDtype::F32 => boxed::<f32>(model, cache),
        KvDtype::Bf16 => boxed::<half::bf16>(model, cache),
        dtype @ (KvDtype::Fp8E4M3 | KvDtype::Int8) => Err(PoolError::DtypeElsewhere { dtype }),
    }
}

impl<K: KvElement> Executor for CpuExecutor<'_, K> {
    fn kv_layout(&self) -> KvLayout {
        let c = &self.model.config;
        KvLayout {
            num_layers: self.pool.num_layers(),
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            block_size: self.pool.block_size(),
            num_blocks: self.pool.num_blocks(),
            dtype: K::DTYPE,
        }
    }

    fn model_spec(&self) -> ModelSpec {
        ModelSpec {
            vocab_size: self.model.config.vocab_size,
            max_model_len: self.model.config.max_position_embeddings,
        }
    }

    /// One step: `CpuExecutor::run_step` with the pool's other threads spinning for its
    /// parallel regions instead of sleeping between them (chapter 2's [`awake`]).
    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        awake(move || self.run_step(step))
    }
}
