//! [`W8A8Linear`]: int8 weights with one scale per output channel, times int8 activations with
//! one scale per token, multiplied in integers.
//!
//! ```text
//! weights      q_w[o, i] = round(w[o, i] / s_w[o])   s_w[o] = max_i |w[o, i]| / 127   (once)
//! activations  q_x[t, i] = round(x[t, i] / s_x[t])   s_x[t] = max_i |x[t, i]| / 127   (per call)
//! product      acc[t, o] = Σ_i q_x[t, i] · q_w[o, i]                                  exact, in i32
//!              y[t, o]   = s_x[t] · s_w[o] · acc[t, o] + bias[o]                      f32
//! ```
//! Both grids are symmetric (codes in `-127..=127`, zero is code 0), so the sum needs no zero
//! point corrections. The products are at most `127² = 16129`, so an i32 holds the sum exactly
//! for up to [`MAX_IN_FEATURES`] inputs; a wider layer is refused. Everything up to the
//! rescaling is exact: the layer's only errors are the two roundings to the grids, and the
//! f32 rounding of the final product. With [`Int8Activations::None`] the activations stay f32
//! (W8A16: what "RTN int8" means in the benchmark's table): the dot products widen the codes as
//! they read them, and a prefill runs on chapter 2's GEMM with the codes widened a chunk of rows
//! at a time. The integer products never pass through f32 (whose sums would not be exact): on
//! a CPU with AVX2, W8A8 keeps its codes in interleaved groups of 8 rows and forms the sums in
//! register tiles of rows × tokens ([`crate::kernels::int8`]); elsewhere, one dot product per
//! output and token. Both give the same i32 sums, so the same outputs bit for bit.

use ch01::linear::{DenseLinear, Linear, LinearLoader, LinearSpec};
use ch02::kernels::Isa;
use ch02::{FastLoader, WeightDtype};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};
use rayon::prelude::*;
use std::borrow::Cow;
use std::cell::RefCell;

use crate::codes_dot::dot_int8;
use crate::kernels::int8::{Int8Cpu, Int8Rows, int8_products};
use crate::kernels::interleave::ROWS as GROUP_ROWS;
use crate::kernels::round_half_away;
use crate::widened::{GEMM_FROM_TOKENS, scaled_codes_matmul};

/// The largest code of the symmetric int8 grid.
pub const QMAX: f32 = 127.0;

/// The widest layer whose i32 sums cannot overflow: `⌊(2³¹ − 1) / 127²⌋`.
pub const MAX_IN_FEATURES: usize = (i32::MAX as usize) / (127 * 127);

/// What the activations go through before the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Activations {
    /// Quantized to int8 per token, `max |x_t| / 127`, on the fly (W8A8).
    PerToken,
    /// Kept f32: int8 weights only (W8A16).
    None,
}

/// Why int8 weights could not be made into a layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum W8A8Error {
    #[error("{codes} weight codes are not [{out}, {in_features}]")]
    Codes {
        codes: usize,
        out: usize,
        in_features: usize,
    },
    #[error("{scales} weight scales for {out} output channels")]
    Scales { scales: usize, out: usize },
    #[error("a bias of {len} for {out} outputs")]
    Bias { len: usize, out: usize },
    #[error("scale {0} is not a positive finite number")]
    BadScale(f32),
    #[error("weight code -128 at {0}: the grid is symmetric, -127..=127")]
    Code(usize),
    #[error("{0} input features: an i32 sum holds at most {MAX_IN_FEATURES}")]
    TooWide(usize),
    #[error("weight value {0} is not finite")]
    NotFinite(f32),
}

/// A projection with int8 weights, per-channel scales, and int8 (or f32) activations.
///
/// Invariant: `codes` holds `out · in` codes, every one in `-127..=127`, `scale.len() == out`,
/// every scale positive and finite, `in ≤ MAX_IN_FEATURES`, `bias` is `[out]` when present.
pub struct W8A8Linear {
    codes: Codes,              // [out, in]
    scale: Vec<f32>,           // [out]
    bias: Option<Array1<f32>>, // [out]
    activations: Int8Activations,
    in_features: usize,
    isa: Isa, // the dot products' and the GEMM's instruction set
}

/// The weight codes, laid out for the products the layer runs.
enum Codes {
    /// Row-major `[out, in]`: one dot product per output and token (f32 activations, or a CPU
    /// without AVX2).
    Rows(Vec<i8>),
    /// Interleaved groups of 8 rows: int8 activations on the int8 tiles of `cpu`.
    Tiled(Int8Rows, Int8Cpu),
}

impl Codes {
    /// `codes` `[out, in]` (in `-127..=127`) as the products for `activations` on `isa` read
    /// them.
    fn arrange(
        codes: Vec<i8>,
        out: usize,
        n: usize,
        activations: Int8Activations,
        isa: Isa,
    ) -> Codes {
        // A layer without inputs has nothing to tile: its outputs are its bias.
        let cpu =
            Int8Cpu::detect(isa).filter(|_| activations == Int8Activations::PerToken && n > 0);
        match cpu {
            Some(cpu) => {
                let rows = Int8Rows::pack(&codes, out, n)
                    .expect("W8A8Linear::new checked the shape and the codes");
                Codes::Tiled(rows, cpu)
            }
            None => Codes::Rows(codes),
        }
    }

    /// The codes `[out, in]`, row-major.
    fn rows(&self) -> Cow<'_, [i8]> {
        match self {
            Codes::Rows(codes) => Cow::Borrowed(codes),
            Codes::Tiled(rows, _) => Cow::Owned(rows.unpack()),
        }
    }

    /// Bytes held.
    fn bytes(&self) -> usize {
        match self {
            Codes::Rows(codes) => codes.len(),
            Codes::Tiled(rows, _) => rows.bytes(),
        }
    }
}

/// The symmetric int8 grid of `values`: its scale `max |v| / 127` (1 for all zeros; never
/// below f32's smallest normal, whose inverse is the largest finite one); NaN when a value is
/// NaN or infinite (a maximum by `f32::max` alone would skip a NaN and give a finite grid).
pub fn grid_scale(values: &[f32]) -> f32 {
    crate::kv_cache::int8_scale(values)
}

/// `round(v / scale)`, halves away from zero, clamped to `-127..=127` (NaN to 0): clamped
/// first, then rounded in operations that vectorise, where `f32::round` is a library call per
/// element on baseline x86-64. Clamping first changes nothing: ±127.5 and beyond round to ±128,
/// which the clamp after would have made ±127.
fn code(v: f32, inv_scale: f32) -> i8 {
    round_half_away((v * inv_scale).clamp(-QMAX, QMAX)) as i8
}

// ANCHOR: quantize_token
/// One token's activations `x` `[in]` as int8 codes in `out` `[in]`; returns their scale, NaN
/// when an activation is NaN or infinite (int8 has no NaN: the scale carries it, and the
/// token's outputs are NaN, as in f32, never finite).
pub fn quantize_token(x: &[f32], out: &mut [i8]) -> f32 {
    let scale = crate::kv_cache::int8_scale(x);
    let inv = 1.0 / scale;
    for (q, &v) in out.iter_mut().zip(x) {
        *q = code(v, inv);
    }
    scale
}
// ANCHOR_END: quantize_token

// ANCHOR: dot_i8
/// `Σ_i a[i] · b[i]` of int8 codes, exact in i32 (for `len ≤ MAX_IN_FEATURES`). Written as
/// 32-wide chunks of i16 products summed into i32 lanes, which the compiler turns into
/// multiply-add instructions (`pmaddwd`); no `unsafe`, no intrinsics. The layer runs it where
/// it has no int8 tiles (a CPU without AVX2, or [`Isa::Portable`]); the tiles' sums are the
/// same, exactly.
pub fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    const LANES: usize = 32;
    let mut acc = [0i32; LANES];
    let (a_main, a_tail) = a.split_at(a.len() - a.len() % LANES);
    let (b_main, b_tail) = b.split_at(a_main.len().min(b.len()));
    for (ca, cb) in a_main.chunks_exact(LANES).zip(b_main.chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += i32::from(i16::from(ca[k]) * i16::from(cb[k]));
        }
    }
    let tail: i32 = a_tail
        .iter()
        .zip(b_tail)
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum();
    acc.iter().sum::<i32>() + tail
}
// ANCHOR_END: dot_i8

impl W8A8Linear {
    /// `codes` `[out, in]` in `-127..=127`; `scale` `[out]`; `bias` `[out]`.
    pub fn new(
        codes: Vec<i8>,
        out_features: usize,
        in_features: usize,
        scale: Vec<f32>,
        bias: Option<Array1<f32>>,
        activations: Int8Activations,
    ) -> Result<Self, W8A8Error> {
        if in_features > MAX_IN_FEATURES {
            return Err(W8A8Error::TooWide(in_features));
        }
        if Some(codes.len()) != out_features.checked_mul(in_features) {
            return Err(W8A8Error::Codes {
                codes: codes.len(),
                out: out_features,
                in_features,
            });
        }
        if scale.len() != out_features {
            return Err(W8A8Error::Scales {
                scales: scale.len(),
                out: out_features,
            });
        }
        if let Some(&bad) = scale.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(W8A8Error::BadScale(bad));
        }
        if let Some(at) = codes.iter().position(|&c| c == i8::MIN) {
            return Err(W8A8Error::Code(at));
        }
        if let Some(b) = &bias
            && b.len() != out_features
        {
            return Err(W8A8Error::Bias {
                len: b.len(),
                out: out_features,
            });
        }
        let isa = Isa::detect();
        Ok(W8A8Linear {
            codes: Codes::arrange(codes, out_features, in_features, activations, isa),
            scale,
            bias,
            activations,
            in_features,
            isa,
        })
    }

    /// The same layer computed with `isa` (the tests compare every one).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        let (out, n) = (self.scale.len(), self.in_features);
        let codes = match self.codes {
            Codes::Rows(codes) => codes,
            Codes::Tiled(rows, _) => rows.unpack(),
        };
        self.codes = Codes::arrange(codes, out, n, self.activations, isa);
        self.isa = isa;
        self
    }

    /// Whether the products run on the int8 tiles (int8 activations on a CPU with AVX2).
    pub fn tiled(&self) -> bool {
        matches!(self.codes, Codes::Tiled(..))
    }

    /// Round-to-nearest of dense `weight` [out, in] to int8, one scale per output channel.
    pub fn quantize(
        weight: ArrayView2<f32>,
        bias: Option<Array1<f32>>,
        activations: Int8Activations,
    ) -> Result<Self, W8A8Error> {
        let (out, n) = weight.dim();
        if let Some(&bad) = weight.iter().find(|v| !v.is_finite()) {
            return Err(W8A8Error::NotFinite(bad));
        }
        let mut codes = Vec::with_capacity(out * n);
        let mut scales = Vec::with_capacity(out);
        for row in weight.rows() {
            let row = row.to_vec();
            let scale = grid_scale(&row);
            let inv = 1.0 / scale;
            codes.extend(row.iter().map(|&v| code(v, inv)));
            scales.push(scale);
        }
        W8A8Linear::new(codes, out, n, scales, bias, activations)
    }

    // ANCHOR: w8a8_tiled
    /// `y_t` `[out, T]` `= s_w[o] · s_x[t] · Σ_i q_x[t, i] · q_w[o, i]` on the int8 tiles of
    /// `cpu`: [`TASK_ROWS`] outputs per task, [`TOKEN_STEP`] tokens at a time, so that the
    /// sums of one step fit on the stack. `q_x` is `[T, w.stride()]`, `s_x` `[T]`.
    fn tiled_into(&self, w: &Int8Rows, cpu: Int8Cpu, q_x: &[i8], s_x: &[f32], y_t: &mut [f32]) {
        let (t, stride) = (s_x.len(), w.stride());
        y_t.par_chunks_mut(TASK_ROWS * t)
            .enumerate()
            .for_each(|(c, y_c)| {
                let g0 = c * TASK_ROWS / GROUP_ROWS;
                let groups = g0..g0 + (y_c.len() / t).div_ceil(GROUP_ROWS);
                let mut sums = [0i32; TASK_ROWS * TOKEN_STEP]; // [rows, tokens of the step]
                for t0 in (0..t).step_by(TOKEN_STEP) {
                    let tn = TOKEN_STEP.min(t - t0);
                    let sums = &mut sums[..groups.len() * GROUP_ROWS * tn];
                    int8_products(
                        cpu,
                        w,
                        groups.clone(),
                        &q_x[t0 * stride..(t0 + tn) * stride],
                        sums,
                    );
                    for (j, y_o) in y_c.chunks_exact_mut(t).enumerate() {
                        let s_w = self.scale[c * TASK_ROWS + j];
                        for i in 0..tn {
                            y_o[t0 + i] = s_w * s_x[t0 + i] * sums[j * tn + i] as f32;
                        }
                    }
                }
            });
    }
    // ANCHOR_END: w8a8_tiled

    /// The weight codes `[out, in]`, row-major.
    pub fn codes(&self) -> Cow<'_, [i8]> {
        self.codes.rows()
    }

    /// The per-output-channel scales `[out]`.
    pub fn scales(&self) -> &[f32] {
        &self.scale
    }

    /// The weights the layer computes with, `s_w[o] · q_w[o, i]` `[out, in]`.
    pub fn dequantized(&self) -> Array2<f32> {
        let (n, codes) = (self.in_features, self.codes());
        Array2::from_shape_fn((self.scale.len(), n), |(o, i)| {
            self.scale[o] * f32::from(codes[o * n + i])
        })
    }
}

impl Linear for W8A8Linear {
    fn in_features(&self) -> usize {
        self.in_features
    }

    fn out_features(&self) -> usize {
        self.scale.len()
    }

    fn weight_bytes(&self) -> usize {
        self.codes.bytes() + 4 * self.scale.len() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = Array2::zeros((x.nrows(), self.out_features()));
        self.forward_into(x, y.view_mut());
        y
    }

    // ANCHOR: w8a8_forward
    fn forward_into(&self, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>) {
        let (t, n, out) = (x.nrows(), self.in_features, self.out_features());
        assert_eq!(x.ncols(), n, "x is [T, in_features]");
        assert_eq!(y.dim(), (t, out), "y is [T, out_features]");
        if t == 0 {
            return;
        }
        let int8 = self.activations == Int8Activations::PerToken;
        // Codes per token as the products read them (the tiles' rows end on a multiple of 4).
        let stride = match &self.codes {
            Codes::Tiled(w, _) => w.stride(),
            Codes::Rows(_) => n,
        };
        with_scratch(|scratch| {
            let W8A8Scratch { q_x, s_x, x_f, y_t } = scratch;
            // The activations, once per call: int8 codes and a scale per token, or f32 as
            // they are. The buffers grow once to the largest call.
            q_x.resize(if int8 { t * stride } else { 0 }, 0); // [T, stride]
            s_x.clear();
            s_x.resize(t, 1.0); // [T]
            x_f.resize(if int8 { 0 } else { t * n }, 0.0); // [T, in]
            for (r, x_t) in x.rows().into_iter().enumerate() {
                if int8 {
                    let (q, pad) = q_x[r * stride..(r + 1) * stride].split_at_mut(n);
                    pad.fill(0);
                    s_x[r] = match x_t.as_slice() {
                        Some(row) => quantize_token(row, q),
                        None => quantize_token(&x_t.to_vec(), q),
                    };
                } else {
                    for (d, v) in x_f[r * n..(r + 1) * n].iter_mut().zip(x_t) {
                        *d = *v;
                    }
                }
            }
            let bias = |o: usize| self.bias.as_ref().map_or(0.0, |b| b[o]);
            let isa = self.isa;
            let codes = match &self.codes {
                Codes::Rows(codes) => codes,
                Codes::Tiled(w, cpu) => {
                    // Int8 activations on the tiles: exact i32 sums, then the two scales.
                    y_t.resize(out * t, 0.0); // [out, T]
                    self.tiled_into(w, *cpu, q_x, s_x, y_t);
                    for o in 0..out {
                        for r in 0..t {
                            y[[r, o]] = y_t[o * t + r] + bias(o);
                        }
                    }
                    return;
                }
            };
            if !int8 && t >= GEMM_FROM_TOKENS {
                // Many tokens with f32 activations (W8A16, a prefill): y[t, o] = s_w[o] ·
                // (x[t] · q_w[o]) + bias[o] on chapter 2's GEMM, the codes widened a chunk of
                // rows at a time.
                return scaled_codes_matmul(
                    isa,
                    x_f,
                    y,
                    codes,
                    f32::from,
                    &self.scale,
                    self.bias.as_ref(),
                );
            }
            // yᵀ[o, t] = s_w[o] · s_x[t] · (q_x[t] · q_w[o]), 16 output channels per task.
            y_t.resize(out * t, 0.0); // [out, T]
            const ROWS: usize = 16;
            let (q_x, s_x, x_f) = (&*q_x, &*s_x, &*x_f);
            y_t.par_chunks_mut(ROWS * t)
                .enumerate()
                .for_each(|(c, y_c)| {
                    for (j, y_o) in y_c.chunks_exact_mut(t).enumerate() {
                        let o = c * ROWS + j;
                        let w_o = &codes[o * n..(o + 1) * n];
                        for (r, y_ot) in y_o.iter_mut().enumerate() {
                            *y_ot = if int8 {
                                let acc = dot_i8(&q_x[r * n..(r + 1) * n], w_o);
                                self.scale[o] * s_x[r] * acc as f32
                            } else {
                                self.scale[o] * dot_int8(isa, &x_f[r * n..(r + 1) * n], w_o)
                            };
                        }
                    }
                });
            for o in 0..out {
                for r in 0..t {
                    y[[r, o]] = y_t[o * t + r] + bias(o);
                }
            }
        });
    }
    // ANCHOR_END: w8a8_forward
}

/// Output rows per task of the tiled products: 4 groups of 8 (a decode tile's on AVX-512 VNNI).
const TASK_ROWS: usize = 4 * GROUP_ROWS;

/// Tokens per step of a tiled task; its sums, `TASK_ROWS · TOKEN_STEP` i32, live on the stack.
const TOKEN_STEP: usize = 32;

/// One thread's buffers for [`W8A8Linear::forward_into`]: nothing is allocated per token
/// once they have grown to the largest call.
#[derive(Default)]
struct W8A8Scratch {
    q_x: Vec<i8>,  // [T, stride] activation codes
    s_x: Vec<f32>, // [T] activation scales
    x_f: Vec<f32>, // [T, in] activations as they are (int8 weights, f32 activations)
    y_t: Vec<f32>, // [out, T] the outputs, transposed
}

thread_local! {
    static SCRATCH: crate::scratch::Spares<W8A8Scratch> = const { RefCell::new(Vec::new()) };
}

fn with_scratch<R>(f: impl FnOnce(&mut W8A8Scratch) -> R) -> R {
    crate::scratch::with_local(&SCRATCH, f)
}

/// Whether a projection is the output head (its own `lm_head`, or the tied embedding loaded a
/// second time as a projection).
pub fn is_head(name: &str) -> bool {
    name == "lm_head" || name == "model.embed_tokens"
}

/// What the head becomes: chapter 2's f32 `FastLinear`.
const DENSE: FastLoader = FastLoader {
    dtype: WeightDtype::F32,
};

/// Quantizes every projection of a dense checkpoint to int8 as it loads (round to nearest, one
/// scale per output channel), the activations as `activations` says. The output head (tied to
/// the embedding in SmolLM2) stays dense f32, as SmoothQuant leaves it: it is read once per
/// token like the others, but its 49,152 logits are what perplexity is scored on.
pub struct W8A8Quantizer {
    pub activations: Int8Activations,
}

impl LinearLoader for W8A8Quantizer {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let layer = W8A8Linear::quantize(weight.view(), bias, self.activations)
            .map_err(|e| ch01::Error::InvalidArgument(e.to_string()))?;
        Ok(Box::new(layer))
    }

    fn load(
        &self,
        source: &dyn ch01::WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01::Result<Box<dyn Linear>> {
        if is_head(spec.name) {
            return DENSE.load(source, spec);
        }
        let dense = DenseLinear::load(source, spec)?;
        let bias = dense.bias().cloned();
        let weight = dense.weight().view();
        let layer = W8A8Linear::quantize(weight, bias, self.activations)
            .map_err(|e| ch01::Error::InvalidArgument(format!("`{}`: {e}", spec.name)))?;
        Ok(Box::new(layer))
    }
}
