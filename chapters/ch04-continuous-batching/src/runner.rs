//! [`ModelRunner`]: one forward pass over every token the scheduler picked this step.
//!
//! ```text
//! seq A: prefill chunk  tokens a0 a1 a2   positions 0 1 2      ┐
//! seq B: decode         token  b7         position  7          ├─ flattened: x [4, hidden]
//! seq C: decode         token  c3         position  3          ┘
//! every projection:  [4, in] · Wᵀ   — the weights are read once for the whole batch
//! attention:         per sequence, its queries against its own blocks (block table)
//! logits:            only for rows that end a prompt or decode a token
//! ```
//! No padding: each token carries its own position and KV slot (the slot mapping).

use std::convert::Infallible;

use ch01::Llama;
use ch02::cached::{Workspace, decoder_layer};
use ch03::{BlockTable, KvPool};
use ndarray::{Array2, ArrayView2, ArrayViewMut2, Axis, s};

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
    tokens: Vec<u32>,      // [n] the step's tokens, flattened
    positions: Vec<usize>, // [n] each token's position in its sequence
}

impl ModelRunner {
    pub fn new(model: &Llama) -> Self {
        ModelRunner {
            workspace: Workspace::new(&model.config, 1),
            tokens: Vec::new(),
            positions: Vec::new(),
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
    ) -> Array2<f32> {
        // Flatten: each row's token and position.
        self.tokens.clear();
        self.positions.clear();
        for seq in batch {
            self.tokens.extend_from_slice(seq.tokens);
            self.positions
                .extend((0..seq.tokens.len()).map(|t| seq.start_pos + t));
        }
        let n = self.tokens.len();
        self.workspace.embed(model, &self.tokens);
        let positions = &self.positions;
        for (i, layer) in model.layers.iter().enumerate() {
            let shape = layer.self_attn.shape();
            // Each sequence writes its K/V through its slot mapping and attends to its blocks.
            let mut attend = |q: ArrayView2<f32>,
                              k: ArrayView2<f32>,
                              v: ArrayView2<f32>,
                              mut out: ArrayViewMut2<f32>|
             -> Result<(), Infallible> {
                let mut first = 0;
                for seq in batch {
                    let len = seq.tokens.len();
                    for t in 0..len {
                        let (r, pos) = (first + t, seq.start_pos + t);
                        pool.write(i, seq.table.slot(pos), k.row(r), v.row(r));
                    }
                    let q_seq = q.slice(s![first..first + len, ..]);
                    let out_seq = out.slice_mut(s![first..first + len, ..]);
                    pool.attend(
                        i,
                        seq.table,
                        q_seq.as_slice().expect("contiguous rows"),
                        seq.start_pos + len,
                        shape,
                        out_seq.into_slice().expect("contiguous rows"),
                    );
                    first += len;
                }
                Ok(())
            };
            let Ok(()) = decoder_layer(
                layer,
                &model.rope,
                &|r| positions[r],
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
        if last_rows.is_empty() {
            return Array2::zeros((0, model.config.vocab_size)); // only prompt chunks ran
        }
        let picked = self.workspace.residual().select(Axis(0), &last_rows); // [S, hidden]
        let normed = model.norm.forward(picked.view());
        model.lm_head.forward(normed.view()) // [S, vocab]
    }
    // ANCHOR_END: execute
}
