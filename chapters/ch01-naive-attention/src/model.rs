//! The Llama forward pass, written to be read top to bottom.
//!
//! ```text
//! tokens [T] ─ embed_tokens ─▶ x [T, hidden]
//!   repeat num_hidden_layers times:
//!     x = x + o_proj(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))   n = rms_norm(x)
//!     x = x + down_proj(silu(gate_proj(n)) * up_proj(n))                      n = rms_norm(x)
//! x = rms_norm(x) ─ lm_head ─▶ logits [T, vocab]
//! ```
//!
//! Weight names mirror Hugging Face (`model.layers.3.self_attn.q_proj.weight`), so the loader
//! reads checkpoints exactly as `transformers` saves them.

use std::path::Path;

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, ArrayViewMut2, Axis};

use crate::attention::{AttentionShape, causal_attention};
use crate::config::LlamaConfig;
use crate::error::{Error, Result};
use crate::linear::{DenseLoader, Linear, LinearLoader, LinearSpec};
use crate::rope::Rope;
use crate::shard::{Split, TensorParallel};
use crate::source::WeightSource;
use crate::weights::Weights;

/// Root-mean-square normalisation: `x / sqrt(mean(x²) + eps) * weight`, row by row.
/// Invariant: `weight` is contiguous, so the row loops read it as a slice (which the compiler
/// vectorises; an ndarray iterator it does not).
pub struct RmsNorm {
    weight: Array1<f32>, // [hidden]
    eps: f32,
}

impl RmsNorm {
    pub fn new(weight: Array1<f32>, eps: f64) -> Self {
        RmsNorm {
            weight: weight.as_standard_layout().into_owned(),
            eps: eps as f32,
        }
    }

    /// x: [T, hidden] → [T, hidden]
    // ANCHOR: rms_norm
    pub fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        // ANCHOR: task_1_2
        let mut out = x.to_owned();
        for mut row in out.rows_mut() {
            let mean_square = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
            let inv_rms = 1.0 / (mean_square + self.eps).sqrt();
            row.zip_mut_with(&self.weight, |v, w| *v = *v * inv_rms * w);
        }
        out
        // ANCHOR_END: task_1_2
    }
    // ANCHOR_END: rms_norm

    /// `forward(x)` written into `out` [T, hidden], allocating nothing (chapter 2's decode path).
    pub fn forward_into(&self, x: ArrayView2<f32>, mut out: ArrayViewMut2<f32>) {
        for (x_row, mut out_row) in x.rows().into_iter().zip(out.rows_mut()) {
            let mean_square = sum_of_squares(&x_row) / x_row.len() as f32;
            self.scale_row(x_row.iter(), out_row.iter_mut(), mean_square);
        }
    }

    /// One row of [`forward_into`](Self::forward_into), bit for bit: `x`, `out`: `[hidden]`.
    /// Chapter 2 splits a step's rows across threads and runs this on each.
    pub fn forward_into_row(&self, x: &[f32], out: &mut [f32]) {
        let mean_square = sum_of_squares(&ArrayView1::from(x)) / x.len() as f32;
        self.scale_row(x.iter(), out.iter_mut(), mean_square);
    }

    /// One row of [`forward`](Self::forward), bit for bit (a single running sum of squares, not
    /// [`forward_into`](Self::forward_into)'s eight): `x`, `out`: `[hidden]`.
    pub fn forward_row(&self, x: &[f32], out: &mut [f32]) {
        let mean_square = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        self.scale_row(x.iter(), out.iter_mut(), mean_square);
    }

    /// `out[i] = x[i] · inv_rms · weight[i]`, the arithmetic every form above shares.
    #[inline(always)]
    fn scale_row<'a>(
        &self,
        x: impl Iterator<Item = &'a f32>,
        out: impl Iterator<Item = &'a mut f32>,
        mean_square: f32,
    ) {
        let inv_rms = 1.0 / (mean_square + self.eps).sqrt();
        let weight = self.weight.as_slice().expect("the weight is contiguous");
        for ((o, &v), &w) in out.zip(x).zip(weight) {
            *o = v * inv_rms * w;
        }
    }
}

/// `Σ v²` with 8 independent partial sums, which the compiler keeps in one vector register (a
/// single running sum would wait for each addition in turn).
fn sum_of_squares(row: &ArrayView1<f32>) -> f32 {
    let Some(values) = row.as_slice() else {
        return row.iter().map(|v| v * v).sum(); // a strided row: no vector loads anyway
    };
    let chunks = values.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    let mut acc = [0.0f32; 8];
    for chunk in chunks {
        for lane in 0..8 {
            acc[lane] += chunk[lane] * chunk[lane];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Multi-head self-attention with grouped key/value heads and RoPE.
/// The projections are public so that a later chapter can run them into its own buffers.
pub struct SelfAttention {
    pub q_proj: Box<dyn Linear>, // hidden → num_heads * head_dim
    pub k_proj: Box<dyn Linear>, // hidden → num_kv_heads * head_dim
    pub v_proj: Box<dyn Linear>, // hidden → num_kv_heads * head_dim
    pub o_proj: Box<dyn Linear>, // num_heads * head_dim → hidden
    shape: AttentionShape,
}

impl SelfAttention {
    pub fn shape(&self) -> AttentionShape {
        self.shape
    }

    /// Projects `x` [n, hidden], the tokens at positions `start_pos..start_pos + n`, to
    /// q [n, num_heads * head_dim], k and v [n, num_kv_heads * head_dim], with RoPE applied to q and k.
    /// Chapter 1 always starts at 0; a KV cache (chapter 2) starts after the cached positions.
    pub fn qkv(
        &self,
        x: ArrayView2<f32>,
        rope: &Rope,
        start_pos: usize,
    ) -> (Array2<f32>, Array2<f32>, Array2<f32>) {
        let mut q = self.q_proj.forward(x); // [n, num_heads * head_dim]
        let mut k = self.k_proj.forward(x); // [n, num_kv_heads * head_dim]
        let v = self.v_proj.forward(x); // [n, num_kv_heads * head_dim]
        for (i, (mut q_t, mut k_t)) in q.rows_mut().into_iter().zip(k.rows_mut()).enumerate() {
            rope.rotate(q_t.as_slice_mut().expect("contiguous row"), start_pos + i);
            rope.rotate(k_t.as_slice_mut().expect("contiguous row"), start_pos + i);
        }
        (q, k, v)
    }

    /// The output projection: attention output [n, num_heads * head_dim] → [n, hidden].
    pub fn output(&self, attn: ArrayView2<f32>) -> Array2<f32> {
        self.o_proj.forward(attn)
    }

    /// x: [T, hidden] for positions 0..T → [T, hidden]
    // ANCHOR: self_attention
    pub fn forward(&self, x: ArrayView2<f32>, rope: &Rope) -> Array2<f32> {
        let (q, k, v) = self.qkv(x, rope, 0); // RoPE'd q [T, q_dim]; k, v [T, kv_dim]
        let attn = causal_attention(q.view(), k.view(), v.view(), self.shape); // [T, num_heads * head_dim]
        self.output(attn.view()) // [T, hidden]
    }
    // ANCHOR_END: self_attention
}

/// The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
pub struct Mlp {
    pub gate_proj: Box<dyn Linear>, // hidden → intermediate
    pub up_proj: Box<dyn Linear>,   // hidden → intermediate
    pub down_proj: Box<dyn Linear>, // intermediate → hidden
}

impl Mlp {
    /// x: [T, hidden] → [T, hidden]
    // ANCHOR: mlp
    pub fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut gate = self.gate_proj.forward(x); // [T, intermediate]
        let up = self.up_proj.forward(x); // [T, intermediate]
        gate.zip_mut_with(&up, |g, u| *g = silu(*g) * u);
        self.down_proj.forward(gate.view())
    }
    // ANCHOR_END: mlp
}

// ANCHOR: silu
/// The SiLU (swish) activation `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
// ANCHOR_END: silu

/// One transformer block: pre-norm attention and pre-norm MLP, each with a residual.
/// Fields are public so that a later chapter can run the same layer with its own attention
/// (chapter 2 reads K/V from a cache) without copying the weights or the code.
pub struct DecoderLayer {
    pub input_layernorm: RmsNorm,
    pub self_attn: SelfAttention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: Mlp,
}

impl DecoderLayer {
    // ANCHOR: decoder_layer
    /// x: [T, hidden] → [T, hidden]
    pub fn forward(&self, x: &Array2<f32>, rope: &Rope) -> Array2<f32> {
        let h = x + &self
            .self_attn
            .forward(self.input_layernorm.forward(x.view()).view(), rope);
        &h + &self
            .mlp
            .forward(self.post_attention_layernorm.forward(h.view()).view())
    }
    // ANCHOR_END: decoder_layer
}

/// A Llama-family decoder (Llama, Mistral without sliding window, Qwen2).
///
/// `config` is the checkpoint's, for the whole model. When `shard.world > 1` the layers hold one
/// tensor-parallel rank's projections, so each layer's [`SelfAttention::shape`] has the local
/// head counts, and the partial outputs of o_proj and down_proj must be summed across ranks
/// (chapter 8) before this model's output means anything; the embedding table and lm_head hold
/// the rank's part of the vocabulary ([`TensorParallel::vocab_range`]).
pub struct Llama {
    pub config: LlamaConfig,
    pub embed_tokens: Array2<f32>, // [vocab / world, hidden]: the ids of shard.vocab_range
    pub layers: Vec<DecoderLayer>,
    pub norm: RmsNorm,
    pub lm_head: Box<dyn Linear>, // hidden → vocab / world
    pub rope: Rope,
    /// Which rank of how many this model's projections belong to.
    pub shard: TensorParallel,
}

impl Llama {
    /// Loads `config.json` and the safetensors weights of a Hugging Face model directory.
    pub fn load(dir: &Path) -> Result<Self> {
        Llama::load_with(dir, &DenseLoader)
    }

    /// Loads a model directory with `loader` choosing each projection's kind.
    pub fn load_with(dir: &Path, loader: &dyn LinearLoader) -> Result<Self> {
        Llama::load_shard(dir, loader, TensorParallel::whole())
    }

    /// Loads one tensor-parallel rank's part of a model directory (see [`Llama::from_source`]).
    pub fn load_shard(
        dir: &Path,
        loader: &dyn LinearLoader,
        shard: TensorParallel,
    ) -> Result<Self> {
        let config = LlamaConfig::from_dir(dir)?;
        let weights = Weights::open(dir)?;
        Llama::from_source(config, &weights, loader, shard)
    }

    /// Builds the whole model from already-opened safetensors weights.
    pub fn from_weights(
        config: LlamaConfig,
        weights: &Weights,
        loader: &dyn LinearLoader,
    ) -> Result<Self> {
        Llama::from_source(config, weights, loader, TensorParallel::whole())
    }

    /// Builds rank `shard.rank`'s part of the model from any [`WeightSource`], with `loader`
    /// choosing each projection's kind.
    ///
    /// q/k/v, gate and up are split by column (each rank gets whole heads and whole
    /// intermediate features), o_proj and down_proj by row; the embedding table by its rows and
    /// lm_head by its columns (the vocabulary); the norms stay whole (see [`TensorParallel`]).
    /// The query heads, intermediate size and vocabulary must divide by `shard.world`; the KV
    /// heads must divide by it or divide it (then they are replicated,
    /// [`TensorParallel::kv_spec`]). Each layer's attention shape is read from the projections
    /// the loader built, and checked.
    pub fn from_source(
        config: LlamaConfig,
        source: &dyn WeightSource,
        loader: &dyn LinearLoader,
        shard: TensorParallel,
    ) -> Result<Self> {
        let c = &config;
        let kv_spec = shard.check_model(c)?;
        let (hidden, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let norm = |name: &str| -> Result<RmsNorm> {
            Ok(RmsNorm::new(source.vector(name, hidden)?, c.rms_norm_eps))
        };
        // ANCHOR: load_projection
        // One projection: its full shape, whether it has a bias, and how it is split.
        let proj = |name: &str, in_f: usize, out_f: usize, bias: bool, split: Split| {
            let spec = LinearSpec::whole(name, in_f, out_f, bias).with_shard(shard.spec(split));
            loader.load(source, &spec)
        };
        // ANCHOR_END: load_projection
        // The rank's rows of the table only, decoded without the rest: [vocab / world, hidden].
        let embed_tokens = source.matrix_block(
            "model.embed_tokens.weight",
            [c.vocab_size, hidden],
            shard.vocab_range(c.vocab_size),
            0..hidden,
        )?;
        // k and v: split like q, or replicated when there are more ranks than KV heads.
        let kv_proj = |name: &str| {
            let spec = LinearSpec::whole(name, hidden, kv_dim, c.qkv_bias).with_shard(kv_spec);
            loader.load(source, &spec)
        };

        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = format!("{p}.self_attn");
            let mlp = format!("{p}.mlp");
            let q_proj = proj(
                &format!("{attn}.q_proj"),
                hidden,
                q_dim,
                c.qkv_bias,
                Split::Column,
            )?;
            let k_proj = kv_proj(&format!("{attn}.k_proj"))?;
            let v_proj = kv_proj(&format!("{attn}.v_proj"))?;
            let o_proj = proj(
                &format!("{attn}.o_proj"),
                q_dim,
                hidden,
                c.o_bias,
                Split::Row,
            )?;
            let shape = attention_shape(i, c, [&*q_proj, &*k_proj, &*v_proj, &*o_proj])?;
            let inter = c.intermediate_size;
            layers.push(DecoderLayer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"))?,
                self_attn: SelfAttention {
                    q_proj,
                    k_proj,
                    v_proj,
                    o_proj,
                    shape,
                },
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"))?,
                mlp: Mlp {
                    gate_proj: proj(
                        &format!("{mlp}.gate_proj"),
                        hidden,
                        inter,
                        c.mlp_bias,
                        Split::Column,
                    )?,
                    up_proj: proj(
                        &format!("{mlp}.up_proj"),
                        hidden,
                        inter,
                        c.mlp_bias,
                        Split::Column,
                    )?,
                    down_proj: proj(
                        &format!("{mlp}.down_proj"),
                        inter,
                        hidden,
                        c.mlp_bias,
                        Split::Row,
                    )?,
                },
            });
        }

        // ANCHOR: lm_head
        // Tied embeddings: the output head is the input embedding matrix [vocab, hidden], loaded
        // a second time as a projection, so the loader stores it in its own format (chapter 5
        // keeps a quantized embedding quantized for the head).
        let head = if c.tie_word_embeddings && !source.contains("lm_head.weight") {
            "model.embed_tokens"
        } else {
            "lm_head"
        };
        // Split by vocabulary: each rank computes the logits of its ids (whole on one rank).
        let lm_head = proj(head, hidden, c.vocab_size, false, Split::Column)?;
        // ANCHOR_END: lm_head

        Ok(Llama {
            rope: Rope::from_config(c),
            norm: norm("model.norm.weight")?,
            embed_tokens,
            layers,
            lm_head,
            config,
            shard,
        })
    }

    /// Checks that `tokens` can be run: non-empty, within the context, every id in the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        check_tokens(
            tokens,
            self.config.vocab_size,
            self.config.max_position_embeddings,
        )
    }

    /// Rows of the embedding table: tokens `[T]` → `[T, hidden]`. Ids must be checked first.
    /// On a tensor-parallel shard, the rows of the ids outside the rank's vocabulary are zero:
    /// the ranks' embeddings sum to the whole model's.
    pub fn embed(&self, tokens: &[u32]) -> Array2<f32> {
        if self.shard.world == 1 {
            let ids: Vec<usize> = tokens.iter().map(|&t| t as usize).collect();
            return self.embed_tokens.select(Axis(0), &ids);
        }
        let mut x = Array2::zeros((tokens.len(), self.config.hidden_size)); // [T, hidden]
        for (mut row, &id) in x.rows_mut().into_iter().zip(tokens) {
            if let Some(own) = self.embedding_row(id) {
                row.assign(&own);
            }
        }
        x
    }

    /// Token `id`'s embedding row when this rank holds it (always on one rank). `[hidden]`
    pub fn embedding_row(&self, id: u32) -> Option<ArrayView1<'_, f32>> {
        let vocab = self.shard.vocab_range(self.config.vocab_size);
        let id = id as usize;
        vocab
            .contains(&id)
            .then(|| self.embed_tokens.row(id - vocab.start))
    }

    /// The logits of every position: tokens `[T]` (positions 0..T) → `[T, vocab]`.
    /// Everything is recomputed from scratch on every call; nothing is cached.
    // ANCHOR: forward
    pub fn forward(&self, tokens: &[u32]) -> Result<Array2<f32>> {
        self.check_tokens(tokens)?;
        let mut x = self.embed(tokens); // [T, hidden]
        for layer in &self.layers {
            x = layer.forward(&x, &self.rope); // [T, hidden]
        }
        let x = self.norm.forward(x.view()); // [T, hidden]
        Ok(self.lm_head.forward(x.view())) // [T, vocab]
    }
    // ANCHOR_END: forward

    /// Bytes one decode step reads from the projections and the output head: every weight once.
    /// (The embedding table contributes one row per token, the norms a few vectors: ignored.)
    pub fn projection_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                let (a, m) = (&l.self_attn, &l.mlp);
                [
                    &a.q_proj,
                    &a.k_proj,
                    &a.v_proj,
                    &a.o_proj,
                    &m.gate_proj,
                    &m.up_proj,
                    &m.down_proj,
                ]
                .iter()
                .map(|p| p.weight_bytes())
                .sum::<usize>()
            })
            .sum();
        layers + self.lm_head.weight_bytes()
    }

    /// Logits of the last position only: what generation needs. `[vocab]`
    pub fn next_token_logits(&self, tokens: &[u32]) -> Result<Array1<f32>> {
        let logits = self.forward(tokens)?;
        Ok(logits.row(logits.nrows() - 1).to_owned())
    }
}

/// Layer `layer`'s attention shape, read from the projections the loader built (a shard has
/// its local heads): `num_heads = q_proj.out / head_dim`, `num_kv_heads = k_proj.out / head_dim`.
/// Checks that q, k, v and o agree with each other and with the hidden size, and that the query
/// heads form whole groups over the key/value heads.
fn attention_shape(
    layer: usize,
    c: &LlamaConfig,
    [q, k, v, o]: [&dyn Linear; 4],
) -> Result<AttentionShape> {
    let fail = |message: String| Err(Error::InconsistentLayer { layer, message });
    let d = c.head_dim;
    let hidden = c.hidden_size;
    if d == 0 || q.out_features() % d != 0 || k.out_features() % d != 0 {
        return fail(format!(
            "q_proj out_features {} and k_proj out_features {} must be multiples of head_dim {d}",
            q.out_features(),
            k.out_features()
        ));
    }
    let shape = AttentionShape {
        num_heads: q.out_features() / d,
        num_kv_heads: k.out_features() / d,
        head_dim: d,
    };
    if v.out_features() != k.out_features() {
        return fail(format!(
            "v_proj out_features {} differ from k_proj's {}",
            v.out_features(),
            k.out_features()
        ));
    }
    if o.in_features() != q.out_features() {
        return fail(format!(
            "o_proj in_features {} differ from q_proj out_features {}",
            o.in_features(),
            q.out_features()
        ));
    }
    if [
        q.in_features(),
        k.in_features(),
        v.in_features(),
        o.out_features(),
    ] != [hidden; 4]
    {
        return fail(format!(
            "q/k/v in_features and o_proj out_features must equal hidden_size {hidden}"
        ));
    }
    if shape.num_kv_heads == 0 || !shape.num_heads.is_multiple_of(shape.num_kv_heads) {
        return fail(format!(
            "{} query heads do not form whole groups over {} key/value heads",
            shape.num_heads, shape.num_kv_heads
        ));
    }
    Ok(shape)
}

/// Checks that `tokens` can be run by a model of `vocab_size` tokens and a context of `max_len`
/// positions: non-empty, within the context, every id in the vocabulary. Every engine that
/// accepts token ids (chapter 4's scheduler too) checks them with this one function.
pub fn check_tokens(tokens: &[u32], vocab_size: usize, max_len: usize) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    if tokens.len() > max_len {
        return Err(Error::ContextOverflow {
            len: tokens.len(),
            max_len,
        });
    }
    match tokens.iter().find(|&&id| id as usize >= vocab_size) {
        Some(&id) => Err(Error::TokenOutOfRange { id, vocab_size }),
        None => Ok(()),
    }
}
