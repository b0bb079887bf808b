//! [`ModelRunner`]: one forward pass over every token the scheduler picked this step.
//!
//! ```text
//! seq A: prefill chunk  tokens a0 a1 a2   positions 0 1 2      ┐
//! seq B: decode         token  b7         position  7          ├─ flattened: x [4, hidden]
//! seq C: decode         token  c3         position  3          ┘
//! every projection:  [4, in] · Wᵀ   — the weights are read once for the whole batch
//! attention:         every row against its own sequence's blocks (block table), in one
//!                    parallel pass over the rows of the whole batch
//! logits:            only for rows that end a prompt or decode a token
//! ```
//! No padding: each token carries its own position and KV slot (the slot mapping).

use std::convert::Infallible;

use ch01::Llama;
use ch02::cached::{Workspace, decoder_layer};
use ch02::kernels::Isa;
use ch03::{BlockTable, KvPool};
use ndarray::{ArrayView2, ArrayViewMut2, Axis};

use crate::attention::{QueryRow, batch_attention};

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
pub struct ScheduledSeq<'a> {
    /// The tokens to run: a prompt chunk, or the one token decoded last step.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]`; positions `0..start_pos` already hold K/V.
    pub start_pos: usize,
    /// The sequence's blocks, reserved for `start_pos + tokens.len()` positions.
    pub table: &'a BlockTable,
    /// Whether this step needs the logits of the last token (false for a prompt chunk that
    /// does not finish the prompt).
    pub wants_logits: bool,
}

/// The step's batch, flattened in this order.
pub type ScheduledBatch<'a> = [ScheduledSeq<'a>];

/// Runs batches; keeps its buffers (chapter 2's [`Workspace`]) from step to step.
pub struct ModelRunner {
    workspace: Workspace,
    tokens: Vec<u32>, // [n] the step's tokens, flattened
    isa: Isa,
    logits: Vec<f32>, // [S, vocab] the last step's logits, S = sequences that wanted them
}

impl ModelRunner {
    pub fn new(model: &Llama) -> Self {
        ModelRunner {
            workspace: Workspace::new(&model.config, 1),
            tokens: Vec::new(),
            isa: Isa::detect(),
            logits: Vec::new(),
        }
    }

    /// Runs the batch, writing every new token's K/V into `pool`; returns the logits
    /// [number of sequences with `wants_logits`, vocab], in batch order.
    /// Token ids must be in the vocabulary and positions within the context (the engine checks).
    // ANCHOR: execute
    pub fn execute(
        &mut self,
        model: &Llama,
        pool: &mut KvPool,
        batch: &ScheduledBatch,
    ) -> ArrayView2<'_, f32> {
        // Flatten: each row's token, and its sequence's table and position.
        self.tokens.clear();
        for seq in batch {
            self.tokens.extend_from_slice(seq.tokens);
        }
        let n = self.tokens.len();
        self.workspace.embed(model, &self.tokens);
        let rows: Vec<QueryRow> = batch
            .iter()
            .flat_map(|seq| {
                (0..seq.tokens.len()).map(|t| QueryRow {
                    table: seq.table,
                    pos: seq.start_pos + t,
                })
            })
            .collect(); // [n]
        for (i, layer) in model.layers.iter().enumerate() {
            let shape = layer.self_attn.shape();
            // Every new token's K/V goes to its slot, then the whole batch attends at once.
            let mut attend = |q: ArrayView2<f32>,
                              k: ArrayView2<f32>,
                              v: ArrayView2<f32>,
                              out: ArrayViewMut2<f32>|
             -> Result<(), Infallible> {
                for (r, row) in rows.iter().enumerate() {
                    pool.write(i, row.table.slot(row.pos), k.row(r), v.row(r));
                }
                batch_attention(
                    self.isa,
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
        // The last row of every sequence that wants logits, normed, through the head at once.
        let mut last_rows = Vec::new();
        let mut end = 0;
        for seq in batch {
            end += seq.tokens.len();
            if seq.wants_logits {
                last_rows.push(end - 1);
            }
        }
        let picked = self.workspace.residual().select(Axis(0), &last_rows); // [S, hidden]
        let normed = model.norm.forward(picked.view());
        let vocab = model.config.vocab_size;
        // The logits buffer is kept: a fresh [S, vocab] every step is megabytes of new pages.
        let used = last_rows.len() * vocab;
        if self.logits.len() < used {
            self.logits.resize(used, 0.0);
        }
        let shape = (last_rows.len(), vocab);
        let logits =
            ArrayViewMut2::from_shape(shape, &mut self.logits[..used]).expect("[S, vocab]");
        model.lm_head.forward_into(normed.view(), logits);
        ArrayView2::from_shape(shape, &self.logits[..used]).expect("[S, vocab]")
    }
    // ANCHOR_END: execute
}
