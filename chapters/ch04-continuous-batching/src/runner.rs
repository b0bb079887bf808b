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

use ch01::Llama;
use ch01::model::silu;
use ch03::{BlockTable, KvPool};
use ndarray::{Array2, s};

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

/// Runs batches; keeps its buffers from step to step.
/// Invariant: every buffer has at least `rows` rows.
pub struct ModelRunner {
    rows: usize,
    x: Array2<f32>,    // [rows, hidden]
    h: Array2<f32>,    // [rows, hidden]
    q: Array2<f32>,    // [rows, q_dim]
    k: Array2<f32>,    // [rows, kv_dim]
    v: Array2<f32>,    // [rows, kv_dim]
    attn: Array2<f32>, // [rows, q_dim]
    gate: Array2<f32>, // [rows, intermediate]
    up: Array2<f32>,   // [rows, intermediate]
}

impl ModelRunner {
    pub fn new(model: &Llama) -> Self {
        let mut runner = ModelRunner {
            rows: 0,
            x: Array2::zeros((0, 0)),
            h: Array2::zeros((0, 0)),
            q: Array2::zeros((0, 0)),
            k: Array2::zeros((0, 0)),
            v: Array2::zeros((0, 0)),
            attn: Array2::zeros((0, 0)),
            gate: Array2::zeros((0, 0)),
            up: Array2::zeros((0, 0)),
        };
        runner.reserve(model, 1);
        runner
    }

    fn reserve(&mut self, model: &Llama, rows: usize) {
        if rows <= self.rows {
            return;
        }
        let c = &model.config;
        let (q_dim, kv_dim) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let buffer = |cols: usize| Array2::<f32>::zeros((rows, cols));
        *self = ModelRunner {
            rows,
            x: buffer(c.hidden_size),
            h: buffer(c.hidden_size),
            q: buffer(q_dim),
            k: buffer(kv_dim),
            v: buffer(kv_dim),
            attn: buffer(q_dim),
            gate: buffer(c.intermediate_size),
            up: buffer(c.intermediate_size),
        };
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
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        self.reserve(model, n);
        let rows = s![..n, ..];
        // Flatten: each row's token, position and slot.
        let mut row = 0;
        for seq in batch {
            for &id in seq.tokens {
                self.x
                    .row_mut(row)
                    .assign(&model.embed_tokens.row(id as usize));
                row += 1;
            }
        }
        for (i, layer) in model.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            layer
                .input_layernorm
                .forward_into(self.x.slice(rows), self.h.slice_mut(rows));
            attn.q_proj
                .forward_into(self.h.slice(rows), self.q.slice_mut(rows)); // [n, q_dim]
            attn.k_proj
                .forward_into(self.h.slice(rows), self.k.slice_mut(rows)); // [n, kv_dim]
            attn.v_proj
                .forward_into(self.h.slice(rows), self.v.slice_mut(rows)); // [n, kv_dim]
            let mut first = 0;
            for seq in batch {
                let len = seq.tokens.len();
                for t in 0..len {
                    let (r, pos) = (first + t, seq.start_pos + t);
                    let mut q_r = self.q.row_mut(r);
                    model
                        .rope
                        .rotate(q_r.as_slice_mut().expect("contiguous row"), pos);
                    let mut k_r = self.k.row_mut(r);
                    model
                        .rope
                        .rotate(k_r.as_slice_mut().expect("contiguous row"), pos);
                    pool.write(i, seq.table.slot(pos), self.k.row(r), self.v.row(r)); // slot mapping
                }
                let (q, out) = (
                    self.q.slice(s![first..first + len, ..]),
                    self.attn.slice_mut(s![first..first + len, ..]),
                );
                pool.attend(
                    i,
                    seq.table,
                    q.as_slice().expect("contiguous rows"),
                    seq.start_pos + len,
                    attn.shape(),
                    out.into_slice().expect("contiguous rows"),
                );
                first += len;
            }
            attn.o_proj
                .forward_into(self.attn.slice(rows), self.h.slice_mut(rows));
            self.x
                .slice_mut(rows)
                .zip_mut_with(&self.h.slice(rows), |x, o| *x += o);

            let mlp = &layer.mlp;
            layer
                .post_attention_layernorm
                .forward_into(self.x.slice(rows), self.h.slice_mut(rows));
            mlp.gate_proj
                .forward_into(self.h.slice(rows), self.gate.slice_mut(rows));
            mlp.up_proj
                .forward_into(self.h.slice(rows), self.up.slice_mut(rows));
            self.gate
                .slice_mut(rows)
                .zip_mut_with(&self.up.slice(rows), |g, u| *g = silu(*g) * u);
            mlp.down_proj
                .forward_into(self.gate.slice(rows), self.h.slice_mut(rows));
            self.x
                .slice_mut(rows)
                .zip_mut_with(&self.h.slice(rows), |x, o| *x += o);
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
        let picked = self.x.select(ndarray::Axis(0), &last_rows); // [S, hidden]
        let normed = model.norm.forward(picked.view());
        model.lm_head.forward(normed.view()) // [S, vocab]
    }
    // ANCHOR_END: execute
}
