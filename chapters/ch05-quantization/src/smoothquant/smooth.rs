//! SmoothQuant's migration: divide each input channel `j` of a projection's activations by
//! `s_j` and multiply the weights' column `j` by `s_j`. `X W^T` is unchanged in exact
//! arithmetic; what changes is which side carries the outliers.
//!
//! ```text
//! s_j  = max|X_j|^α / max|W_j|^(1−α)        α = 0.5: both sides end with max √(max|X_j| max|W_j|)
//! X'   = X diag(1/s)                        folded into whatever produced X
//! W'   = W diag(s)                          then quantized per output channel as usual
//! ```
//! `max|X_j|` is over calibration tokens of the unquantized model, `max|W_j|` over the rows of
//! every projection that reads `X` (q, k and v share one `s`; gate and up share one). A zero
//! maximum leaves its channel alone (`s_j = 1`). A NaN or infinite one is an error
//! ([`SmoothError::Activation`], [`SmoothError::Weight`]): a factor chosen without it would be
//! silently wrong, and the W8A8 model built on it finite where the f32 model is not. `1/s` is
//! folded exactly:
//!
//! | input of      | produced by                          | `1/s` goes into                         |
//! |---------------|--------------------------------------|-----------------------------------------|
//! | q, k, v       | `input_layernorm`: `x / rms(x) · g`  | `g_j / s_j`                             |
//! | gate, up      | `post_attention_layernorm`           | `g_j / s_j`                             |
//! | down          | `silu(gate(m)) · up(m)`, linear in up | up's output row `j` (and bias) `/ s_j`  |
//! | o             | attention: softmax weights times V   | v's output row (and bias) `/ s`, one `s` per KV channel |
//!
//! o_proj is the one GQA complicates. Its input channel `(h, d)` (query head `h`, dimension `d`)
//! is a weighted sum of V's channel `(h / group, d)`, the KV head that `group` query heads share.
//! Dividing V's row by `s` divides *all* of them, so the factor cannot be chosen per query head:
//! here it is one `s` per KV channel, from the largest activation and weight over the group's
//! channels, and o's columns `(h, d)` for every `h` of the group are multiplied by it. With
//! [`SmoothConfig::o_proj`] off, o_proj is left as it is (naive W8A8).
//!
//! [`SmoothedSource`] is the result: chapter 1's `WeightSource` over the original weights with
//! the changed tensors replacing theirs, so any loader builds the smoothed model from it (dense,
//! to check that the migration is an identity; W8A8 to run it).

use std::collections::HashMap;
use std::path::Path;

use ch01::attention::causal_attention;
use ch01::model::silu;
use ch01::{Llama, LlamaConfig, RawTensor, TensorDtype, WeightSource};
use ndarray::{Array1, Array2, ArrayView2};

/// Why smoothing failed.
#[derive(Debug, thiserror::Error)]
pub enum SmoothError {
    #[error(transparent)]
    Model(#[from] ch01::Error),
    #[error("calibration needs at least one sample of at least one token")]
    NoCalibration,
    #[error("alpha {0} is not in [0, 1]")]
    Alpha(f64),
    #[error("the calibration has {got} layers, the model {want}")]
    Layers { got: usize, want: usize },
    #[error("layer {0}'s calibration maxima do not have the model's widths")]
    Widths(usize),
    /// A calibration maximum that is NaN or infinite: the unquantized model produced a NaN or
    /// ∞ on the calibration tokens (or the statistics were built so). No factor can be chosen
    /// from it.
    #[error(
        "layer {layer}: the calibration maximum of {input} channel {channel} is {value}: the model's activations hold a NaN or infinity"
    )]
    Activation {
        layer: usize,
        /// Which input: `attn_in`, `o_in`, `mlp_in` or `down_in` ([`LayerStats`]).
        input: &'static str,
        channel: usize,
        value: f32,
    },
    /// A NaN or infinite weight in a projection to be smoothed (and then quantized).
    #[error("`{name}`: weight {index} is {value}: a NaN or infinite weight cannot be smoothed")]
    Weight {
        name: String,
        /// Row-major, from the start of the tensor.
        index: usize,
        value: f32,
    },
}

/// `max |x_j|` per channel over every token seen: NaN once a NaN was seen in the channel (as
/// [`crate::kernels::act_amax`]; `f32::max` alone would skip it), ∞ once an ∞ was.
#[derive(Debug, Clone, PartialEq)]
pub struct ChannelMax(pub Vec<f32>);

impl ChannelMax {
    pub fn new(channels: usize) -> Self {
        ChannelMax(vec![0.0; channels])
    }

    /// Takes the tokens `x` `[T, channels]` into the maxima.
    pub fn add(&mut self, x: ArrayView2<f32>) {
        for row in x.rows() {
            for (m, &v) in self.0.iter_mut().zip(row) {
                // `m.max(NaN)` is `m`, and `NaN.max(v)` is `v`: a NaN must be kept by hand.
                *m = if m.is_nan() || v.is_nan() {
                    f32::NAN
                } else {
                    m.max(v.abs())
                };
            }
        }
    }

    /// The first channel whose maximum is NaN or infinite, and that maximum.
    pub fn first_non_finite(&self) -> Option<(usize, f32)> {
        self.0
            .iter()
            .copied()
            .enumerate()
            .find(|(_, m)| !m.is_finite())
    }
}

/// The activation maxima of one decoder layer's four inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStats {
    /// `input_layernorm`'s output, q/k/v's input `[hidden]`.
    pub attn_in: ChannelMax,
    /// The attention's output, o_proj's input `[heads · head_dim]`.
    pub o_in: ChannelMax,
    /// `post_attention_layernorm`'s output, gate/up's input `[hidden]`.
    pub mlp_in: ChannelMax,
    /// `silu(gate) · up`, down_proj's input `[intermediate]`.
    pub down_in: ChannelMax,
}

impl LayerStats {
    /// [`SmoothError::Activation`] for the first maximum of the four that is NaN or infinite.
    pub fn check_finite(&self, layer: usize) -> Result<(), SmoothError> {
        for (input, m) in [
            ("attn_in", &self.attn_in),
            ("o_in", &self.o_in),
            ("mlp_in", &self.mlp_in),
            ("down_in", &self.down_in),
        ] {
            if let Some((channel, value)) = m.first_non_finite() {
                return Err(SmoothError::Activation {
                    layer,
                    input,
                    channel,
                    value,
                });
            }
        }
        Ok(())
    }
}

// ANCHOR: calibrate
/// The activation maxima of every projection's input, from `model` (unquantized) run on the
/// calibration `samples`. One pass, as SmoothQuant collects them: every layer sees the
/// unquantized layers before it. A NaN or infinite activation is an error
/// ([`SmoothError::Activation`], naming the first layer and input where one appeared).
pub fn calibrate(model: &Llama, samples: &[Vec<u32>]) -> Result<Vec<LayerStats>, SmoothError> {
    if samples.iter().all(|s| s.is_empty()) {
        return Err(SmoothError::NoCalibration);
    }
    let c = &model.config;
    let mut stats: Vec<LayerStats> = (0..c.num_hidden_layers)
        .map(|_| LayerStats {
            attn_in: ChannelMax::new(c.hidden_size),
            o_in: ChannelMax::new(c.num_attention_heads * c.head_dim),
            mlp_in: ChannelMax::new(c.hidden_size),
            down_in: ChannelMax::new(c.intermediate_size),
        })
        .collect();
    for sample in samples.iter().filter(|s| !s.is_empty()) {
        model.check_tokens(sample)?;
        let mut x = model.embed(sample); // [T, hidden]
        for (layer, st) in model.layers.iter().zip(&mut stats) {
            let a = layer.input_layernorm.forward(x.view()); // [T, hidden]
            st.attn_in.add(a.view());
            let (q, k, v) = layer.self_attn.qkv(a.view(), &model.rope, 0);
            let o_in = causal_attention(q.view(), k.view(), v.view(), layer.self_attn.shape());
            st.o_in.add(o_in.view()); // [T, heads · head_dim]
            let h = &x + &layer.self_attn.output(o_in.view());
            let m = layer.post_attention_layernorm.forward(h.view());
            st.mlp_in.add(m.view());
            let mut d = layer.mlp.gate_proj.forward(m.view()); // [T, intermediate]
            let up = layer.mlp.up_proj.forward(m.view());
            d.zip_mut_with(&up, |g, u| *g = silu(*g) * u);
            st.down_in.add(d.view());
            x = h + layer.mlp.down_proj.forward(d.view());
        }
    }
    for (l, st) in stats.iter().enumerate() {
        st.check_finite(l)?;
    }
    Ok(stats)
}
// ANCHOR_END: calibrate

// ANCHOR: factors
/// `s_j = x_max[j]^α / w_max[j]^(1−α)`; 1 where either maximum is zero; NaN where either is
/// NaN or infinite, never a finite factor ([`smooth`] refuses such maxima first).
pub fn factors(x_max: &[f32], w_max: &[f32], alpha: f64) -> Vec<f32> {
    x_max
        .iter()
        .zip(w_max)
        .map(|(&x, &w)| {
            let (x, w) = (f64::from(x), f64::from(w));
            if !(x.is_finite() && w.is_finite()) {
                return f32::NAN;
            }
            if !(x > 0.0 && w > 0.0) {
                return 1.0;
            }
            let s = (x.powf(alpha) / w.powf(1.0 - alpha)) as f32;
            if s.is_finite() && s > 0.0 { s } else { 1.0 }
        })
        .collect()
}
// ANCHOR_END: factors

/// `max_o |w[o, j]|` per column `j` over every matrix of `ws` (all `[_, in]`): NaN for a column
/// holding a NaN, as [`ChannelMax`].
pub fn column_max(ws: &[&Array2<f32>]) -> Vec<f32> {
    let mut m = ChannelMax::new(ws.first().map_or(0, |w| w.ncols()));
    for w in ws {
        m.add(w.view());
    }
    m.0
}

/// [`SmoothError::Weight`] for the first NaN or infinite element of the matrix `name`.
fn check_weight(name: &str, w: &Array2<f32>) -> Result<(), SmoothError> {
    match w.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        Some((index, &value)) => Err(SmoothError::Weight {
            name: name.to_string(),
            index,
            value,
        }),
        None => Ok(()),
    }
}

/// `w` `[_, in]` with column `j` multiplied by `s[j]`.
fn scale_columns(w: &mut Array2<f32>, s: &[f32]) {
    for mut row in w.rows_mut() {
        for (v, &s) in row.iter_mut().zip(s) {
            *v *= s;
        }
    }
}

/// `w` `[out, _]` with row `o` divided by `s[o]`.
fn divide_rows(w: &mut Array2<f32>, s: &[f32]) {
    for (mut row, &s) in w.rows_mut().into_iter().zip(s) {
        row.mapv_inplace(|v| v / s);
    }
}

/// How to smooth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SmoothConfig {
    /// The migration strength: 0 leaves the activations as they are, 1 moves all of their
    /// range into the weights.
    pub alpha: f64,
    /// Also smooth o_proj, through v_proj's rows, one factor per KV channel (see the module doc).
    /// Off by default: on SmolLM2 it measured 0.10 perplexity worse than naive o_proj
    /// (`kiln bench ch05 --only w8a8`).
    pub o_proj: bool,
}

impl Default for SmoothConfig {
    fn default() -> Self {
        SmoothConfig {
            alpha: 0.5,
            o_proj: false,
        }
    }
}

/// The factors chosen for one layer (1 everywhere for o when it is not smoothed).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerFactors {
    pub attn: Vec<f32>,
    /// Per o_proj input channel `[heads · head_dim]` (equal across the query heads of a group).
    pub o: Vec<f32>,
    pub mlp: Vec<f32>,
    pub down: Vec<f32>,
}

/// Chapter 1's [`WeightSource`] over `base`, with the tensors smoothing changed replacing
/// theirs (f32). Everything else is read from `base` as stored.
pub struct SmoothedSource<'a> {
    base: &'a dyn WeightSource,
    changed: HashMap<String, (Vec<usize>, Vec<u8>)>,
    /// The factors of every layer, in order.
    pub factors: Vec<LayerFactors>,
}

impl SmoothedSource<'_> {
    fn put(&mut self, name: String, shape: Vec<usize>, values: &[f32]) {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.changed.insert(name, (shape, bytes));
    }

    fn put_matrix(&mut self, name: String, w: &Array2<f32>) {
        let w = w.as_standard_layout();
        let values = w.as_slice().expect("standard layout");
        self.put(name, w.shape().to_vec(), values);
    }

    /// Divides `{name}.bias` `[out]` by `s` when the checkpoint has one.
    fn divide_bias(&mut self, name: &str, s: &[f32]) -> ch01::Result<()> {
        let bias = format!("{name}.bias");
        if !self.base.contains(&bias) {
            return Ok(());
        }
        let b: Vec<f32> = self
            .base
            .vector(&bias, s.len())?
            .iter()
            .zip(s)
            .map(|(b, s)| b / s)
            .collect();
        self.put(bias, vec![s.len()], &b);
        Ok(())
    }
}

impl WeightSource for SmoothedSource<'_> {
    fn location(&self) -> &Path {
        self.base.location()
    }

    fn contains(&self, name: &str) -> bool {
        self.changed.contains_key(name) || self.base.contains(name)
    }

    fn tensor(&self, name: &str) -> ch01::Result<RawTensor<'_>> {
        match self.changed.get(name) {
            Some((shape, bytes)) => RawTensor::new(
                name,
                self.location(),
                TensorDtype::F32,
                shape.clone(),
                bytes.as_slice(),
            ),
            None => self.base.tensor(name),
        }
    }
}

// ANCHOR: smooth
/// Smooths every layer of the checkpoint `base` (configuration `config`) with the activation
/// maxima `stats`: the q/k/v, gate/up and down columns multiplied by their factors, the two
/// norms' gains and up's rows divided by them; v's rows and o's columns too when
/// `smooth.o_proj`. A NaN or infinite maximum in `stats` ([`SmoothError::Activation`]) or
/// weight in a projection ([`SmoothError::Weight`]) is an error.
pub fn smooth<'a>(
    base: &'a dyn WeightSource,
    config: &LlamaConfig,
    stats: &[LayerStats],
    smooth: &SmoothConfig,
) -> Result<SmoothedSource<'a>, SmoothError> {
    let alpha = smooth.alpha;
    if !(0.0..=1.0).contains(&alpha) {
        return Err(SmoothError::Alpha(alpha));
    }
    if stats.len() != config.num_hidden_layers {
        return Err(SmoothError::Layers {
            got: stats.len(),
            want: config.num_hidden_layers,
        });
    }
    let (hidden, inter, hd) = (
        config.hidden_size,
        config.intermediate_size,
        config.head_dim,
    );
    let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
    let (q_dim, kv_dim) = (heads * hd, kv_heads * hd);
    let group = heads / kv_heads.max(1);
    let mut out = SmoothedSource {
        base,
        changed: HashMap::new(),
        factors: Vec::with_capacity(stats.len()),
    };
    for (l, st) in stats.iter().enumerate() {
        let widths = [&st.attn_in, &st.o_in, &st.mlp_in, &st.down_in].map(|m| m.0.len());
        if widths != [hidden, q_dim, hidden, inter] || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(SmoothError::Widths(l));
        }
        st.check_finite(l)?;
        let p = format!("model.layers.{l}");
        let m = |name: &str, rows, cols| -> Result<Array2<f32>, SmoothError> {
            let full = format!("{p}.{name}.weight");
            let w = base.matrix(&full, rows, cols)?;
            check_weight(&full, &w)?;
            Ok(w)
        };
        let (mut q, mut k, mut v) = (
            m("self_attn.q_proj", q_dim, hidden)?,
            m("self_attn.k_proj", kv_dim, hidden)?,
            m("self_attn.v_proj", kv_dim, hidden)?,
        );
        let mut o = m("self_attn.o_proj", hidden, q_dim)?;
        let (mut gate, mut up) = (
            m("mlp.gate_proj", inter, hidden)?,
            m("mlp.up_proj", inter, hidden)?,
        );
        let mut down = m("mlp.down_proj", hidden, inter)?;

        // q, k, v: 1/s into input_layernorm's gain.
        let s_attn = factors(&st.attn_in.0, &column_max(&[&q, &k, &v]), alpha);
        for w in [&mut q, &mut k, &mut v] {
            scale_columns(w, &s_attn);
        }
        let norm1 = format!("{p}.input_layernorm.weight");
        let g = base.vector(&norm1, hidden)? / &Array1::from(s_attn.clone());
        out.put(norm1, vec![hidden], g.as_slice().expect("contiguous"));

        // o: one factor per KV channel (k, d), from the group's largest activation and weight;
        // 1/s into v's row (k, d), s into o's column (h, d) for every query head h of group k.
        let mut s_o = vec![1.0f32; q_dim];
        if smooth.o_proj {
            let w_max = column_max(&[&o]);
            let (mut x_kv, mut w_kv) = (vec![0.0f32; kv_dim], vec![0.0f32; kv_dim]);
            for (c, (&x, &w)) in st.o_in.0.iter().zip(&w_max).enumerate() {
                let kv = (c / hd) / group * hd + c % hd;
                x_kv[kv] = x_kv[kv].max(x);
                w_kv[kv] = w_kv[kv].max(w);
            }
            let s_kv = factors(&x_kv, &w_kv, alpha);
            for (c, s) in s_o.iter_mut().enumerate() {
                *s = s_kv[(c / hd) / group * hd + c % hd];
            }
            divide_rows(&mut v, &s_kv);
            scale_columns(&mut o, &s_o);
            out.divide_bias(&format!("{p}.self_attn.v_proj"), &s_kv)?;
        }

        // gate, up: 1/s into post_attention_layernorm's gain.
        let s_mlp = factors(&st.mlp_in.0, &column_max(&[&gate, &up]), alpha);
        scale_columns(&mut gate, &s_mlp);
        scale_columns(&mut up, &s_mlp);
        let norm2 = format!("{p}.post_attention_layernorm.weight");
        let g = base.vector(&norm2, hidden)? / &Array1::from(s_mlp.clone());
        out.put(norm2, vec![hidden], g.as_slice().expect("contiguous"));

        // down: silu(g) · (u / s) = (silu(g) · u) / s, so 1/s into up's output rows.
        let s_down = factors(&st.down_in.0, &column_max(&[&down]), alpha);
        scale_columns(&mut down, &s_down);
        divide_rows(&mut up, &s_down);
        out.divide_bias(&format!("{p}.mlp.up_proj"), &s_down)?;

        for (name, w) in [
            ("self_attn.q_proj", &q),
            ("self_attn.k_proj", &k),
            ("self_attn.v_proj", &v),
            ("self_attn.o_proj", &o),
            ("mlp.gate_proj", &gate),
            ("mlp.up_proj", &up),
            ("mlp.down_proj", &down),
        ] {
            out.put_matrix(format!("{p}.{name}.weight"), w);
        }
        out.factors.push(LayerFactors {
            attn: s_attn,
            o: s_o,
            mlp: s_mlp,
            down: s_down,
        });
    }
    Ok(out)
}
// ANCHOR_END: smooth
