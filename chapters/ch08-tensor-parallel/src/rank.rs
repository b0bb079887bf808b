//! [`Rank`]: one tensor-parallel rank: its shard of the model, a KV pool of its KV heads only,
//! and the step it runs, with the communication where Megatron-LM puts it.
//!
//! ```text
//! tokens ─ embedding rows of my vocabulary (others 0) ─ ALL-REDUCE ─▶ x [n, hidden]  (same on every rank)
//!   per layer:
//!     n = rms_norm(x)                                   whole, on every rank
//!     q, k, v = my heads' columns of q/k/v_proj (n)     no communication: heads are independent
//!     attention over my KV heads in my pool
//!     o = my rows of o_proj (attention)                 a partial sum of the whole o_proj
//!     x += ALL-REDUCE(o)
//!     n = rms_norm(x)
//!     g = silu(my columns of gate_proj (n)) · my columns of up_proj (n)
//!     x += ALL-REDUCE(my rows of down_proj (g))
//! logits of my vocabulary = my columns of lm_head (rms_norm(x)) ─ ALL-GATHER ─▶ [S, vocab]
//! ```
//! Two all-reduces of `[n, hidden]` per layer, one of the embeddings, one all-gather of the
//! logits: everything else is local.

use ch01::{Llama, LlamaConfig};
use ch02::Workspace;
use ch02::cached::decoder_layer_reduced;
use ch03::{KvElement, KvPool, PoolError};
use ch04::attention::AttentionBackend;
use ch04::{BatchAttention, SchedulerOutput, SwapSpace};
use ndarray::{ArrayView2, ArrayViewMut2, Axis};

use crate::comm::{CommError, Communicator};

/// One rank's model shard, KV memory and step buffers.
///
/// Invariant: every rank of a group holds the same layer count, block size and block count,
/// and its pool holds `local.num_key_value_heads` heads (the rank's share, or its replica).
pub struct Rank<K: KvElement = f32> {
    model: Llama,
    /// The sizes this rank's buffers and pool hold: its heads, KV heads and MLP features.
    local: LlamaConfig,
    pool: KvPool<K>,
    backend: Box<dyn AttentionBackend<K>>,
    swapped: SwapSpace<K>,
    workspace: Workspace,
    tokens: Vec<u32>,   // [n] the step's tokens, flattened
    part: Vec<f32>,     // [S, vocab / world] this rank's logits
    gathered: Vec<f32>, // [world, S, vocab / world] every rank's
    logits: Vec<f32>,   // [S, vocab]
}

/// The sizes one rank of `model` (a shard) works with: the whole model's, with its local
/// query heads, KV heads and intermediate features (read from layer 0's projections).
pub fn local_config(model: &Llama) -> LlamaConfig {
    let mut local = model.config.clone();
    if let Some(layer) = model.layers.first() {
        let shape = layer.self_attn.shape();
        local.num_attention_heads = shape.num_heads;
        local.num_key_value_heads = shape.num_kv_heads;
        local.intermediate_size = layer.mlp.up_proj.out_features();
    }
    local
}

impl<K: KvElement> Rank<K> {
    /// A rank over its shard `model`, with a pool of `num_blocks` blocks of `block_size`.
    pub fn new(model: Llama, block_size: usize, num_blocks: usize) -> Result<Self, PoolError> {
        let local = local_config(&model);
        let pool = KvPool::new(&local, block_size, num_blocks)?;
        Ok(Rank {
            workspace: Workspace::new(&local, 1),
            model,
            local,
            pool,
            backend: Box::new(BatchAttention::default()),
            swapped: SwapSpace::default(),
            tokens: Vec::new(),
            part: Vec::new(),
            gathered: Vec::new(),
            logits: Vec::new(),
        })
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn pool(&self) -> &KvPool<K> {
        &self.pool
    }

    /// The sizes this rank holds (see [`local_config`]).
    pub fn local(&self) -> &LlamaConfig {
        &self.local
    }

    // ANCHOR: rank_execute
    /// Runs this rank's shard of `step`: block operations on its pool, the forward with the
    /// all-reduces, and the all-gather of the logits. Every rank of the group must call it with
    /// the same step. Returns the logit rows `[Σ logit_rows, vocab]`, the same on every rank.
    pub fn execute(
        &mut self,
        step: &SchedulerOutput,
        comm: &mut dyn Communicator,
    ) -> Result<ArrayView2<'_, f32>, CommError> {
        self.swapped.apply_step(&mut self.pool, step);
        let model = &self.model;
        self.tokens.clear();
        for seq in &step.seqs {
            self.tokens.extend_from_slice(&seq.tokens);
        }
        let n = self.tokens.len();
        // Vocabulary-parallel embedding: my rows, zeros for the others' ids, then the sum.
        let mut x = self.workspace.residual_mut(&self.local, n); // [n, hidden]
        for (mut row, &id) in x.rows_mut().into_iter().zip(&self.tokens) {
            match model.embedding_row(id) {
                Some(own) => row.assign(&own),
                None => row.fill(0.0),
            }
        }
        comm.all_reduce_sum(x.as_slice_mut().expect("the first rows are contiguous"))?;

        let rows = step.query_rows(); // [n]
        for (i, layer) in model.layers.iter().enumerate() {
            let shape = layer.self_attn.shape(); // this rank's heads
            let (pool, backend) = (&mut self.pool, &mut self.backend);
            let mut attend = |q: ArrayView2<f32>,
                              k: ArrayView2<f32>,
                              v: ArrayView2<f32>,
                              out: ArrayViewMut2<f32>|
             -> Result<(), CommError> {
                backend.write_kv(pool, i, &rows, k, v);
                let (q, out) = (q.as_slice(), out.into_slice());
                let (q, out) = (q.expect("contiguous rows"), out.expect("contiguous rows"));
                backend.attend(pool, i, &rows, q, shape, out);
                Ok(())
            };
            // After o_proj and after down_proj: sum the ranks' partial outputs.
            let mut reduce = |mut partial: ArrayViewMut2<f32>| {
                comm.all_reduce_sum(partial.as_slice_mut().expect("contiguous rows"))
            };
            let ws = &mut self.workspace;
            decoder_layer_reduced(
                layer,
                &model.rope,
                &|r| rows[r].pos,
                n,
                ws,
                &mut attend,
                &mut reduce,
            )?;
        }

        // Vocabulary-parallel head: my columns of the logits, then everyone's.
        let picked = self
            .workspace
            .residual()
            .select(Axis(0), &step.logit_row_indices()); // [S, hidden]
        let normed = model.norm.forward(picked.view());
        let s = normed.nrows();
        if s == 0 {
            // No sequence wants logits this step (prompt chunks only): the same on every rank.
            return Ok(
                ArrayView2::from_shape((0, model.config.vocab_size), &[][..]).expect("[0, vocab]"),
            );
        }
        let (world, vocab) = (comm.world(), model.config.vocab_size);
        let local_vocab = model.lm_head.out_features(); // vocab / world
        resize(&mut self.part, s * local_vocab);
        let part = ArrayViewMut2::from_shape((s, local_vocab), &mut self.part[..])
            .expect("[S, vocab / world]");
        model.lm_head.forward_into(normed.view(), part);
        resize(&mut self.gathered, world * s * local_vocab);
        comm.all_gather(&self.part, &mut self.gathered)?; // [world, S, vocab / world]
        // Rank r's block of row t is columns r·vocab/world .. (r+1)·vocab/world of row t.
        resize(&mut self.logits, s * vocab);
        for (r, block) in self.gathered.chunks_exact(s * local_vocab).enumerate() {
            for (t, part_row) in block.chunks_exact(local_vocab).enumerate() {
                let start = t * vocab + r * local_vocab;
                self.logits[start..start + local_vocab].copy_from_slice(part_row);
            }
        }
        Ok(ArrayView2::from_shape((s, vocab), &self.logits[..]).expect("[S, vocab]"))
    }
    // ANCHOR_END: rank_execute
}

/// `buf` holds exactly `len` elements (the capacity is kept, so a step allocates only when
/// it is the largest so far).
fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.resize(len, 0.0);
}
