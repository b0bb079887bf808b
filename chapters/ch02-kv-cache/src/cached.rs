//! The forward pass over new tokens only, reading earlier positions from a [`KvStore`].
//!
//! ```text
//! prefill:  tokens [T] at positions 0..T        → K/V of 0..T stored,   logits [T, vocab]
//! decode:   token  [1] at position  len         → K/V of len stored,     logits [1, vocab]
//! ```
//! The weights and layers are chapter 1's (`ch01::Llama`); only attention changes: the new
//! queries attend to everything the store holds. Every intermediate lives in a [`Workspace`]
//! that is reused from step to step, so a decode step allocates nothing.

use ch01::generate::{GenerateOptions, Generation, generate_with};
use ch01::model::DecoderLayer;
use ch01::rope::Rope;
use ch01::{Llama, LlamaConfig, Tokenizer};
use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut2, s};

use crate::elementwise::{add_rows, gather_rows, rms_norm_rows, rope_rows, silu_mul_rows};
use crate::kv_store::{KvError, KvStore};
use crate::profile::{Op, span, timed};
use crate::{Error, Result};

/// The buffers of one forward step over up to `rows` tokens.
/// Invariant: every `[rows, _]` buffer has the same `rows`; a step over `n <= rows` tokens uses
/// the first `n` rows of each.
pub struct Workspace {
    rows: usize,
    x: Array2<f32>,               // [rows, hidden]        the residual stream
    h: Array2<f32>,               // [rows, hidden]        normed input, then a block's output
    q: Array2<f32>,               // [rows, num_heads * head_dim]
    k: Array2<f32>,               // [rows, num_kv_heads * head_dim]
    v: Array2<f32>,               // [rows, num_kv_heads * head_dim]
    attn: Array2<f32>,            // [rows, num_heads * head_dim]
    gate: Array2<f32>,            // [rows, intermediate]
    up: Array2<f32>,              // [rows, intermediate]
    logits: Array2<f32>,          // [1, vocab]                the last position's logits
    positions: Vec<usize>,        // [n]                     each row's position, for RoPE
    rope_angles: Vec<(f32, f32)>, // [n, head_dim / 2]  (cos, sin) at each row's position
}

impl Workspace {
    pub fn new(config: &LlamaConfig, rows: usize) -> Self {
        let c = config;
        let (q_dim, kv_dim) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let buffer = |cols: usize| Array2::<f32>::zeros((rows, cols));
        Workspace {
            rows,
            x: buffer(c.hidden_size),
            h: buffer(c.hidden_size),
            q: buffer(q_dim),
            k: buffer(kv_dim),
            v: buffer(kv_dim),
            attn: buffer(q_dim),
            gate: buffer(c.intermediate_size),
            up: buffer(c.intermediate_size),
            logits: Array2::zeros((1, c.vocab_size)),
            positions: Vec::with_capacity(rows),
            rope_angles: Vec::with_capacity(rows * c.head_dim / 2),
        }
    }

    /// Grows the buffers to hold `rows` tokens (prefill allocates here; decode never does).
    pub fn reserve(&mut self, config: &LlamaConfig, rows: usize) {
        if rows > self.rows {
            *self = Workspace::new(config, rows);
        }
    }

    /// Puts the embeddings of `tokens` (checked ids) in the residual stream's first rows.
    pub fn embed(&mut self, model: &Llama, tokens: &[u32]) {
        let _span = span(Op::Embed);
        self.reserve(&model.config, tokens.len());
        let x = used_mut(&mut self.x, tokens.len()); // [n, hidden]
        gather_rows(model.embed_tokens.view(), tokens, x);
    }

    /// Sets the positions of the `n` rows and RoPE's angles for them, unless they are those of
    /// the layer before: every layer of a step rotates the same positions, so the sines and
    /// cosines are computed once per step.
    fn set_positions(&mut self, rope: &Rope, n: usize, position: &dyn Fn(usize) -> usize) {
        if self.positions.iter().copied().eq((0..n).map(position)) {
            return;
        }
        self.positions.clear();
        self.positions.extend((0..n).map(position)); // within capacity after the first step
        let half = rope.head_dim() / 2; // > 0: the config checks head_dim is even, non-zero
        self.rope_angles.resize(n * half, (0.0, 0.0));
        let rows = self.rope_angles.chunks_exact_mut(half);
        for (&pos, angles) in self.positions.iter().zip(rows) {
            rope.cos_sin(pos, angles);
        }
    }

    /// The residual stream: row `t` is token `t`'s hidden state. [rows, hidden]
    pub fn residual(&self) -> ArrayView2<'_, f32> {
        self.x.view()
    }

    /// The residual stream's first `n` rows, to be written (chapter 8 writes a rank's part of
    /// the embeddings there, then sums the parts); grows the buffers first. [n, hidden]
    pub fn residual_mut(&mut self, config: &LlamaConfig, n: usize) -> ArrayViewMut2<'_, f32> {
        self.reserve(config, n);
        self.x.slice_mut(s![..n, ..])
    }
}

/// The first `n` rows of a workspace buffer as one slice. [n, cols]
/// Invariant: workspace buffers are fresh, row-major arrays, so their rows are contiguous.
fn used(buffer: &Array2<f32>, n: usize) -> &[f32] {
    &buffer.as_slice().expect("a fresh array is contiguous")[..n * buffer.ncols()]
}

/// [`used`], to be written. [n, cols]
fn used_mut(buffer: &mut Array2<f32>, n: usize) -> &mut [f32] {
    let len = n * buffer.ncols();
    &mut buffer.as_slice_mut().expect("a fresh array is contiguous")[..len]
}

/// Runs `tokens`, the positions `store.len()..store.len() + n`, through the model, storing their
/// K/V. Leaves the final hidden states (after the last norm) in `ws.h[..n]`.
// ANCHOR: forward_cached
pub fn forward_hidden_cached(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
    ws: &mut Workspace,
) -> Result<()> {
    model.check_tokens(tokens)?;
    let (n, start) = (tokens.len(), store.len());
    let context_len = start + n;
    if context_len > model.config.max_position_embeddings {
        return Err(ch01::Error::ContextOverflow {
            len: context_len,
            max_len: model.config.max_position_embeddings,
        }
        .into());
    }
    ws.embed(model, tokens);
    for (i, layer) in model.layers.iter().enumerate() {
        let shape = layer.self_attn.shape();
        let mut attend = |q: ArrayView2<f32>,
                          k: ArrayView2<f32>,
                          v: ArrayView2<f32>,
                          out: ArrayViewMut2<f32>|
         -> Result<()> {
            store.write(i, start, k, v)?;
            store.attend(i, q, context_len, shape, out);
            Ok(())
        };
        decoder_layer(layer, &model.rope, &|t| start + t, n, ws, &mut attend)?;
    }
    store.commit(context_len);
    let _span = span(Op::FinalNorm);
    let hidden = ws.x.ncols();
    rms_norm_rows(&model.norm, used(&ws.x, n), used_mut(&mut ws.h, n), hidden); // [n, hidden]
    Ok(())
}
// ANCHOR_END: forward_cached

/// Attention for one layer: given the new tokens' q [n, q_dim], k and v [n, kv_dim] (RoPE
/// applied), stores k and v and writes the attention output into `out` [n, q_dim].
pub type Attend<'a, E> = dyn FnMut(ArrayView2<f32>, ArrayView2<f32>, ArrayView2<f32>, ArrayViewMut2<f32>) -> Result<(), E>
    + 'a;

/// What happens to a block's output `[n, hidden]` before it joins the residual stream: nothing
/// on one device; on a tensor-parallel rank (chapter 8) an all-reduce that sums the ranks'
/// partial outputs of o_proj and down_proj.
pub type Reduce<'a, E> = dyn FnMut(ArrayViewMut2<f32>) -> Result<(), E> + 'a;

/// Tokens of a step from which [`decoder_layer_reduced`] runs q's product on its own rather than
/// beside k's and v's (a choice between the measured 16, where the two orders tie, and 32).
pub const Q_ALONE_FROM: usize = 24;

/// One decoder layer over the `n` tokens in the residual stream `ws.x[..n]`, in place: chapter
/// 1's layer with the attention supplied by the caller (one sequence's [`KvStore`] here, a
/// batch of sequences over paged blocks in chapter 4). Token `t` is at position `position(t)`.
pub fn decoder_layer<E>(
    layer: &DecoderLayer,
    rope: &Rope,
    position: &dyn Fn(usize) -> usize,
    n: usize,
    ws: &mut Workspace,
    attend: &mut Attend<'_, E>,
) -> Result<(), E> {
    decoder_layer_reduced(layer, rope, position, n, ws, attend, &mut |_| Ok(()))
}

/// [`decoder_layer`] with `reduce` applied to the attention block's and the MLP's outputs
/// before each residual addition (chapter 8's all-reduces).
///
/// The ops between the products (norms, RoPE, residual additions, SiLU) are
/// [`elementwise`](crate::elementwise)'s: split across threads by rows when the step is big
/// enough, with the same results either way. Products that read the same input (q, k and v;
/// gate and up) run as one parallel region (`rayon::join` of the three, each splitting its own
/// rows): a thread that finishes its part of one takes tasks of the next instead of waiting at
/// a join between them, which for a decode step of a few microseconds per product is much of
/// the step. From [`Q_ALONE_FROM`] tokens on, q runs first and k and v (joined) after it:
/// measured on SmolLM2's shapes (`examples/product_order`), the three joined took 7-14% longer
/// at 124 and 32 tokens, the same at 16, and less at 1 to 8 (gate and up joined stayed 0.5-8%
/// faster at every size). Each op runs in a [`profile`](crate::profile) span.
// ANCHOR: decoder_layer
pub fn decoder_layer_reduced<E>(
    layer: &DecoderLayer,
    rope: &Rope,
    position: &dyn Fn(usize) -> usize,
    n: usize,
    ws: &mut Workspace,
    attend: &mut Attend<'_, E>,
    reduce: &mut Reduce<'_, E>,
) -> Result<(), E> {
    let rows = s![..n, ..];
    let (attn, mlp) = (&layer.self_attn, &layer.mlp);
    let (hidden, q_dim, kv_dim) = (ws.x.ncols(), ws.q.ncols(), ws.k.ncols());
    let inter = ws.up.ncols();
    ws.set_positions(rope, n, position); // [n], and their angles [n, head_dim / 2]
    timed(Op::RmsNorm, || {
        let norm = &layer.input_layernorm;
        rms_norm_rows(norm, used(&ws.x, n), used_mut(&mut ws.h, n), hidden)
    });
    // q, k and v read the same input: one parallel region for the three (see the doc above).
    timed(Op::QkvProj, || {
        let h = ws.h.slice(rows);
        let (q, k, v) = (
            ws.q.slice_mut(rows),
            ws.k.slice_mut(rows),
            ws.v.slice_mut(rows),
        );
        let kv = || {
            rayon::join(
                || attn.k_proj.forward_into(h, k), // [n, kv_dim]
                || attn.v_proj.forward_into(h, v), // [n, kv_dim]
            )
        };
        if n < Q_ALONE_FROM {
            rayon::join(|| attn.q_proj.forward_into(h, q), kv); // [n, q_dim]
        } else {
            attn.q_proj.forward_into(h, q); // [n, q_dim]
            kv();
        }
    });
    timed(Op::Rope, || {
        rope_rows(rope, used_mut(&mut ws.q, n), q_dim, &ws.rope_angles);
        rope_rows(rope, used_mut(&mut ws.k, n), kv_dim, &ws.rope_angles);
    });
    timed(Op::Attention, || {
        attend(
            ws.q.slice(rows),
            ws.k.slice(rows),
            ws.v.slice(rows),
            ws.attn.slice_mut(rows),
        )
    })?;
    timed(Op::OProj, || {
        attn.o_proj
            .forward_into(ws.attn.slice(rows), ws.h.slice_mut(rows)) // [n, hidden]
    });
    reduce(ws.h.slice_mut(rows))?;
    timed(Op::Residual, || {
        add_rows(used_mut(&mut ws.x, n), used(&ws.h, n), hidden) // x += attention
    });

    timed(Op::RmsNorm, || {
        let norm = &layer.post_attention_layernorm;
        rms_norm_rows(norm, used(&ws.x, n), used_mut(&mut ws.h, n), hidden)
    });
    timed(Op::GateUpProj, || {
        let h = ws.h.slice(rows);
        let (gate, up) = (ws.gate.slice_mut(rows), ws.up.slice_mut(rows));
        rayon::join(
            || mlp.gate_proj.forward_into(h, gate), // [n, inter]
            || mlp.up_proj.forward_into(h, up),     // [n, inter]
        );
    });
    timed(Op::SiluMul, || {
        silu_mul_rows(used_mut(&mut ws.gate, n), used(&ws.up, n), inter) // gate = silu(gate) · up
    });
    timed(Op::DownProj, || {
        mlp.down_proj
            .forward_into(ws.gate.slice(rows), ws.h.slice_mut(rows)) // [n, hidden]
    });
    reduce(ws.h.slice_mut(rows))?;
    timed(Op::Residual, || {
        add_rows(used_mut(&mut ws.x, n), used(&ws.h, n), hidden) // x += MLP
    });
    Ok(())
}
// ANCHOR_END: decoder_layer

/// Logits of every new position: [n, vocab]. Allocates its own workspace and result.
pub fn forward_cached(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
) -> Result<Array2<f32>> {
    let mut ws = Workspace::new(&model.config, tokens.len());
    forward_hidden_cached(model, tokens, store, &mut ws)?;
    Ok(model.lm_head.forward(ws.h.slice(s![..tokens.len(), ..])))
}

/// Logits of the last new position only (what generation needs), in `ws`: `[vocab]`.
pub fn next_token_logits_cached<'w>(
    model: &Llama,
    tokens: &[u32],
    store: &mut dyn KvStore,
    ws: &'w mut Workspace,
) -> Result<ArrayView1<'w, f32>> {
    forward_hidden_cached(model, tokens, store, ws)?;
    let n = tokens.len();
    let last = ws.h.slice(s![n - 1..n, ..]); // [1, hidden]
    let _span = span(Op::LmHead);
    model.lm_head.forward_into(last, ws.logits.view_mut());
    Ok(ws.logits.row(0))
}

/// One sequence being generated: the model, its cache and its step buffers.
pub struct CachedSession<'m, S: KvStore> {
    model: &'m Llama,
    store: S,
    workspace: Workspace,
}

impl<'m, S: KvStore> CachedSession<'m, S> {
    pub fn new(model: &'m Llama, store: S) -> Self {
        CachedSession {
            model,
            store,
            workspace: Workspace::new(&model.config, 1),
        }
    }

    /// The K/V stored so far.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Runs the prompt in one pass; returns the logits of its last position. `[vocab]`
    pub fn prefill(&mut self, prompt: &[u32]) -> Result<ArrayView1<'_, f32>> {
        next_token_logits_cached(self.model, prompt, &mut self.store, &mut self.workspace)
    }

    /// Runs one new token against the cache; returns the logits of the next position, `[vocab]`.
    /// Allocates nothing once the session has decoded a token (see the tests).
    pub fn decode(&mut self, token: u32) -> Result<ArrayView1<'_, f32>> {
        next_token_logits_cached(self.model, &[token], &mut self.store, &mut self.workspace)
    }
}

/// Chapter 1's generation loop with a KV cache: the first call prefills the prompt, every later
/// call decodes the one token appended since.
// ANCHOR: generate_cached
pub fn generate_cached(
    model: &Llama,
    tokenizer: &Tokenizer,
    prompt_tokens: &[u32],
    store: &mut dyn KvStore,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    model.check_tokens(prompt_tokens)?;
    if !store.is_empty() {
        return Err(KvError::NotAppending {
            start_pos: 0,
            len: store.len(),
        }
        .into());
    }
    let mut ws = Workspace::new(&model.config, prompt_tokens.len());
    let mut next_token_logits = |tokens: &[u32]| -> Result<Array1<f32>> {
        let new_tokens = &tokens[store.len()..]; // the whole prompt first, then one token
        Ok(next_token_logits_cached(model, new_tokens, store, &mut ws)?.to_owned())
    };
    let max_len = model.config.max_position_embeddings;
    generate_with::<Error>(
        tokenizer,
        prompt_tokens,
        max_len,
        options,
        &mut next_token_logits,
        on_text,
    )
}
// ANCHOR_END: generate_cached
