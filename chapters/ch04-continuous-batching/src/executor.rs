//! The [`Executor`] seam: what runs a step that the scheduler planned.
//!
//! ```text
//! Scheduler ──schedule()──▶ SchedulerOutput ──▶ Executor::execute() ──▶ logit rows ──▶ Scheduler::update()
//!   sequences, blocks,       plain data: tokens,    owns the weights and the KV        sampling, stop checks,
//!   policy; no K/V data      positions, tables,     memory; swaps, copies, forward      streamed outputs
//!                            copies, swaps
//! ```
//! The scheduler never touches K/V data and never sees where it lives: the CPU executor of this
//! chapter keeps it in a [`KvPool`](ch03::KvPool), the CUDA executor of chapter 7 in device
//! memory, the tensor-parallel executor of chapter 8 across ranks. Each reports its
//! [`KvLayout`], and the scheduler sizes its block pool from it.

use ch03::KvDtype;
use ndarray::ArrayView2;

use crate::scheduler::SchedulerOutput;

/// The shape of an executor's KV memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub num_layers: usize,
    /// KV heads this executor stores (a tensor-parallel rank stores its share).
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Positions per block.
    pub block_size: usize,
    /// Blocks the memory holds: the block ids the scheduler may hand out are `0..num_blocks`.
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvLayout {
    /// Bytes of one block: K and V, every layer, every position (with an 8-bit dtype's
    /// scales, one f32 per position and KV head).
    pub fn bytes_per_block(&self) -> u64 {
        2 * (self.num_layers * self.block_size) as u64
            * self.dtype.row_bytes(self.num_kv_heads, self.head_dim)
    }

    /// Positions the whole memory holds.
    pub fn token_capacity(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// What the scheduler must know of the model an executor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// The model's context: positions must be below this.
    pub max_model_len: usize,
}

impl ModelSpec {
    /// Checks that `tokens` can be run: non-empty, within the context, every id in the
    /// vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<(), ch01::Error> {
        ch01::model::check_tokens(tokens, self.vocab_size, self.max_model_len)
    }
}

/// Why an executor could not run a step (a device error, a lost rank): the engine fails the
/// requests in flight rather than trust its state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("executor: {0}")]
pub struct ExecutorError(pub String);

// ANCHOR: executor
/// Owns the weights and the KV memory; runs what the scheduler planned.
pub trait Executor {
    fn kv_layout(&self) -> KvLayout;

    fn model_spec(&self) -> ModelSpec;

    /// Runs one step: the block operations in list order (a block freed by one may be the
    /// target of a later one), then one forward over every scheduled token, writing each one's
    /// K/V to its slot. Drops what it kept for the `finished` requests.
    ///
    /// Returns the logit rows `[Σ logit_rows, vocab]`: for each scheduled sequence in order, the
    /// logits of its last `logit_rows` tokens.
    ///
    /// The scheduler guarantees: token ids below `vocab_size`; positions below `max_model_len`;
    /// every block id below `num_blocks`; each table covers its `start_pos + tokens.len()`
    /// positions, and positions `0..start_pos` hold K/V written by earlier steps (or swapped in).
    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError>;

    /// Runs one step as [`execute`](Self::execute) does, but returns only each logit row's
    /// [`argmax`](ch01::sampler::argmax) (`None` for a row whose every logit is −∞ or NaN):
    /// the engine asks for this when every token the step samples is greedy
    /// ([`Scheduler::samples_argmax_only`](crate::scheduler::Scheduler::samples_argmax_only)).
    /// An executor whose logits live on a device overrides it to copy back one id a row
    /// instead of a vocabulary of logits; this default takes each row's argmax on the host (on
    /// several threads when the rows are many).
    fn execute_argmax(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<Vec<Option<u32>>, ExecutorError> {
        let logits = self.execute(step)?;
        Ok(ch02::profile::timed(ch02::profile::Op::Sampling, || {
            argmax_rows(logits)
        }))
    }
}
// ANCHOR_END: executor

/// Each row's [`argmax`](ch01::sampler::argmax). rows: `[n, vocab]`.
pub fn argmax_rows(rows: ArrayView2<f32>) -> Vec<Option<u32>> {
    use rayon::prelude::*;
    let argmax = |row: ndarray::ArrayView1<f32>| {
        ch01::sampler::argmax(row.as_slice().expect("contiguous rows"))
    };
    match ch02::elementwise::items_per_task(rows.nrows(), rows.ncols()) {
        None => rows.rows().into_iter().map(argmax).collect(),
        Some(per_task) => {
            let rows: Vec<_> = rows.rows().into_iter().collect();
            rows.into_par_iter()
                .with_min_len(per_task)
                .map(argmax)
                .collect()
        }
    }
}
