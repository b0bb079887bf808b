//! FP8 weights as chapter 1's [`Linear`]: E4M3 codes with a per-tensor or per-channel scale, as
//! Hugging Face FP8 checkpoints (`quant_method: "fp8"`) store them, and [`Fp8Loader`], which
//! reads them.
//!
//! ```text
//! checkpoint   {name}.weight        F8_E4M3 [out, in]     codes
//!              {name}.weight_scale  F32 [] / [1] / [out] / [out, 1]: per tensor or per output channel
//!              {name}.input_scale   F32 [] / [1]          activation_scheme "static" only
//! forward      x' = round_e4m3(x / s_x) · s_x            the activations as an FP8 GPU sees them
//!              y[t, o] = scale[o] · Σ_i x'[t, i] · w[o, i] + bias[o]
//! ```
//! The activations are rounded through E4M3 exactly as a W8A8 FP8 kernel would feed them to its
//! tensor cores: with the checkpoint's `input_scale` (`activation_scheme: "static"`), or with a
//! scale per token, `max |x_t| / 448`, computed on the fly (`"dynamic"`). The products and their
//! sum are f32 (a GPU accumulates FP8 products in f32 too). One token's dot products widen the
//! weight codes as they read them, 8 lanes at a time in the AVX2 build; a prefill runs on
//! chapter 2's GEMM, the codes widened to f32 a chunk of rows at a time. Block-wise scales
//! (`weight_block_size`) are refused with an error, not read wrongly.

use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch01::{TensorDtype, WeightSource};
use ch02::kernels::Isa;
use ch02::kernels::vector::{ToF32, dot};
use ch02::{FastLoader, WeightDtype};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};
use rayon::prelude::*;

use crate::codes_dot::dot_e4m3;
use crate::fp8::F8E4M3;
use crate::kv_cache::{amax, scale_for};
use crate::quant_linear::shard_bias;
use crate::widened::{GEMM_FROM_TOKENS, scaled_codes_matmul};

/// How a layer's activations are rounded to E4M3 before the products.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ActivationScale {
    /// One scale for every token, from the checkpoint (`input_scale`).
    Static(f32),
    /// Each token's own: `max |x_t| / 448`.
    Dynamic,
    /// Not rounded: FP8 weights with f32 activations (W8A16, what a CPU or an FP8-weight-only
    /// GPU kernel computes).
    None,
}

/// A projection with FP8 E4M3 weights.
///
/// Invariant: `codes.len() == out · in`, `scale.len() == out` (a per-tensor scale repeated),
/// `bias` is `[out]` when present.
pub struct Fp8Linear {
    codes: Vec<F8E4M3>,        // [out, in]
    scale: Vec<f32>,           // [out]
    bias: Option<Array1<f32>>, // [out]
    activations: ActivationScale,
    in_features: usize,
    isa: Isa,
    nan_free: bool, // no code is a NaN: decode may take `codes_dot`'s AVX2 loop
}

/// Why FP8 weights could not be made into a layer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Fp8Error {
    #[error("{codes} weight codes are not [{out}, {in_features}]")]
    Codes {
        codes: usize,
        out: usize,
        in_features: usize,
    },
    #[error("{scales} weight scales: expected 1 (per tensor) or {out} (per output channel)")]
    Scales { scales: usize, out: usize },
    #[error("a bias of {len} for {out} outputs")]
    Bias { len: usize, out: usize },
    /// A weight scale that is not positive and finite.
    #[error("weight scale {0} is not a positive finite number")]
    BadWeightScale(f32),
    /// A static input scale that is NaN, infinite, or below `f32::MIN_POSITIVE` (its inverse
    /// must be finite).
    #[error("input scale {0} is not a positive finite normal number (its inverse must be finite)")]
    BadInputScale(f32),
    /// A NaN or infinite weight given to [`Fp8Linear::quantize_per_channel`]: its row's scale
    /// would be NaN-blind or infinite (an ∞ makes every other weight of the row 0). `index`
    /// counts row-major from the start of the matrix.
    #[error("weight {index} is {value}: a NaN or infinite weight cannot be quantized")]
    NotFinite { index: usize, value: f32 },
}

impl Fp8Linear {
    /// `codes` `[out, in]`; `scale` of 1 (per tensor) or `out` (per channel) values;
    /// `bias` `[out]`.
    pub fn new(
        codes: Vec<F8E4M3>,
        out_features: usize,
        in_features: usize,
        scale: &[f32],
        bias: Option<Array1<f32>>,
        activations: ActivationScale,
    ) -> Result<Self, Fp8Error> {
        if Some(codes.len()) != out_features.checked_mul(in_features) {
            return Err(Fp8Error::Codes {
                codes: codes.len(),
                out: out_features,
                in_features,
            });
        }
        let scale = match scale.len() {
            1 => vec![scale[0]; out_features],
            n if n == out_features => scale.to_vec(),
            n => {
                return Err(Fp8Error::Scales {
                    scales: n,
                    out: out_features,
                });
            }
        };
        let input = match activations {
            ActivationScale::Static(s) => Some(s),
            ActivationScale::Dynamic | ActivationScale::None => None,
        };
        // The input scale is inverted for every row: a subnormal one has an infinite inverse
        // (1 / 1e-39 overflows), so it must be at least f32's smallest normal number.
        if let Some(&bad) = scale.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(Fp8Error::BadWeightScale(bad));
        }
        if let Some(bad) = input.filter(|s| !(s.is_finite() && *s >= f32::MIN_POSITIVE)) {
            return Err(Fp8Error::BadInputScale(bad));
        }
        if let Some(b) = &bias
            && b.len() != out_features
        {
            return Err(Fp8Error::Bias {
                len: b.len(),
                out: out_features,
            });
        }
        let nan_free = codes.iter().all(|c| c.to_bits() & 0x7F != 0x7F);
        Ok(Fp8Linear {
            codes,
            scale,
            bias,
            activations,
            in_features,
            isa: Isa::detect(),
            nan_free,
        })
    }

    /// The same layer computed with `isa` (the tests compare every one).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.isa = isa;
        self
    }

    /// Quantizes dense `weight` [out, in] to E4M3 with one scale per output channel
    /// (`max |row| / 448`, saturating): how kiln writes an FP8 checkpoint. A NaN or infinite
    /// weight is refused ([`Fp8Error::NotFinite`]).
    pub fn quantize_per_channel(
        weight: ArrayView2<f32>,
    ) -> Result<(Vec<F8E4M3>, Vec<f32>), Fp8Error> {
        if let Some((index, &value)) = weight.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Fp8Error::NotFinite { index, value });
        }
        let mut codes = Vec::with_capacity(weight.len());
        let mut scales = Vec::with_capacity(weight.nrows());
        for row in weight.rows() {
            let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let scale = crate::kv_cache::scale_for(amax, F8E4M3::MAX);
            codes.extend(row.iter().map(|&x| F8E4M3::from_f32(x / scale)));
            scales.push(scale);
        }
        Ok((codes, scales))
    }

    /// The activation row `x` [in] as the products see it: rounded through E4M3.
    fn round_activations(&self, x: &[f32], out: &mut [f32]) {
        let scale = match self.activations {
            ActivationScale::None => return out.copy_from_slice(x),
            ActivationScale::Static(s) => s,
            ActivationScale::Dynamic => scale_for(amax(x), F8E4M3::MAX),
        };
        let inv = 1.0 / scale;
        for (o, &v) in out.iter_mut().zip(x) {
            *o = F8E4M3::from_f32(v * inv).to_f32() * scale;
        }
    }
}

/// `Σ_i x[i] · w[i]`, `w` widened to f32 as it is read (E4M3 codes, or f32 already), compiled
/// for AVX2 + FMA when `isa` has them.
fn dot_codes<W: ToF32>(isa: Isa, x: &[f32], w: &[W]) -> f32 {
    match isa {
        Isa::Portable => dot(x, w),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2Fma(_) => {
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<W: ToF32>(x: &[f32], w: &[W]) -> f32 {
                dot(x, w)
            }
            // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA
            // on this CPU; `avx2` is safe Rust otherwise.
            unsafe { avx2(x, w) }
        }
    }
}

/// One thread's buffers for [`Fp8Linear::forward_into`], grown once to the largest call.
#[derive(Default)]
struct Fp8Scratch {
    rounded: Vec<f32>, // [T, in] the activations, rounded to E4M3
    y_t: Vec<f32>,     // [out, T] the outputs, transposed (the dot products')
}

thread_local! {
    static SCRATCH: crate::scratch::Spares<Fp8Scratch> = const { std::cell::RefCell::new(Vec::new()) };
}

fn with_scratch<R>(f: impl FnOnce(&mut Fp8Scratch) -> R) -> R {
    crate::scratch::with_local(&SCRATCH, f)
}

impl Linear for Fp8Linear {
    fn in_features(&self) -> usize {
        self.in_features
    }

    fn out_features(&self) -> usize {
        self.scale.len()
    }

    fn weight_bytes(&self) -> usize {
        self.codes.len() + 4 * self.scale.len() + self.bias.as_ref().map_or(0, |b| 4 * b.len())
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = Array2::zeros((x.nrows(), self.out_features()));
        self.forward_into(x, y.view_mut());
        y
    }

    // ANCHOR: fp8_forward
    fn forward_into(&self, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>) {
        let (t, n, out) = (x.nrows(), self.in_features, self.out_features());
        assert_eq!(x.ncols(), n, "x is [T, in_features]");
        assert_eq!(y.dim(), (t, out), "y is [T, out_features]");
        with_scratch(|Fp8Scratch { rounded, y_t }| {
            rounded.resize(t * n, 0.0); // [T, in] the activations, rounded to E4M3
            for (x_t, r_t) in x.rows().into_iter().zip(rounded.chunks_exact_mut(n.max(1))) {
                match x_t.as_slice() {
                    Some(row) => self.round_activations(row, r_t),
                    None => self.round_activations(&x_t.to_vec(), r_t),
                }
            }
            let rounded = &*rounded;
            let bias = |o: usize| self.bias.as_ref().map_or(0.0, |b| b[o]);
            if t >= GEMM_FROM_TOKENS {
                // Many tokens (a prefill): y[t, o] = scale[o] · (x'_t · w_o) + bias[o] on
                // chapter 2's GEMM, the codes widened to f32 a chunk of rows at a time.
                return scaled_codes_matmul(
                    self.isa,
                    rounded,
                    y,
                    &self.codes,
                    F8E4M3::to_f32,
                    &self.scale,
                    self.bias.as_ref(),
                );
            }
            // yᵀ[o, t] = scale[o] · (x'_t · w_o), 16 outputs per task. One token (decode) widens
            // the codes inside the dot product; a few widen each row once and reuse it.
            y_t.resize(out * t, 0.0); // [out, T]
            const ROWS: usize = 16;
            let nan_free = self.nan_free;
            y_t.par_chunks_mut(ROWS * t.max(1))
                .enumerate()
                .for_each_init(
                    || vec![0.0f32; if t > 1 { n } else { 0 }],
                    |w_f32, (c, y_c)| {
                        for (j, y_o) in y_c.chunks_exact_mut(t.max(1)).enumerate() {
                            let o = c * ROWS + j;
                            let w_o = &self.codes[o * n..(o + 1) * n];
                            if t == 1 {
                                let dot = if nan_free { dot_e4m3 } else { dot_codes };
                                y_o[0] = self.scale[o] * dot(self.isa, rounded, w_o);
                                continue;
                            }
                            w_f32.iter_mut().zip(w_o).for_each(|(w, c)| *w = c.to_f32());
                            for (y_ot, r_t) in y_o.iter_mut().zip(rounded.chunks_exact(n)) {
                                *y_ot = self.scale[o] * dot_codes(self.isa, r_t, w_f32);
                            }
                        }
                    },
                );
            for ((o, r), v) in (0..out)
                .flat_map(|o| (0..t).map(move |r| (o, r)))
                .zip(y_t.iter())
            {
                y[[r, o]] = v + bias(o);
            }
        });
    }
    // ANCHOR_END: fp8_forward
}

/// Loads Hugging Face FP8 checkpoints: a projection whose weight is F8_E4M3 becomes an
/// [`Fp8Linear`]; any other (the layers a checkpoint keeps in bf16, `modules_to_not_convert`)
/// becomes chapter 2's dense `FastLinear`.
pub struct Fp8Loader {
    /// `activation_scheme: "static"` reads each layer's `input_scale`; `"dynamic"` scales per
    /// token.
    pub static_activations: bool,
}

/// What a projection that is not FP8 becomes: chapter 2's f32 `FastLinear`.
const DENSE: FastLoader = FastLoader {
    dtype: WeightDtype::F32,
};

impl LinearLoader for Fp8Loader {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        DENSE.build(weight, bias)
    }

    fn load(
        &self,
        source: &dyn WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let name = format!("{}.weight", spec.name);
        let raw = source.tensor(&name)?;
        if raw.dtype() != TensorDtype::F8E4M3 {
            drop(raw);
            return DENSE.load(source, spec);
        }
        let tensor_error = |name: &str, message: String| ch01::Error::Tensor {
            name: name.to_string(),
            location: source.location().to_path_buf(),
            message,
        };
        let shape = [spec.out_features, spec.in_features];
        if raw.shape() != shape {
            return Err(ch01::Error::ShapeMismatch {
                name,
                expected: shape.to_vec(),
                actual: raw.shape().to_vec(),
            });
        }
        let (rows, cols) = spec
            .shard
            .ranges(spec.name, spec.in_features, spec.out_features)?;
        let codes: Vec<F8E4M3> = rows
            .clone()
            .flat_map(|r| &raw.bytes()[r * spec.in_features..][cols.clone()])
            .map(|&b| F8E4M3::from_bits(b))
            .collect(); // [rows, cols]
        let scale_name = format!("{}.weight_scale", spec.name);
        let scale = source.tensor(&scale_name)?.to_f32(&scale_name)?;
        let scale = match scale.len() {
            1 => scale,
            n if n == spec.out_features => scale[rows.clone()].to_vec(),
            n => {
                return Err(tensor_error(
                    &scale_name,
                    format!("{n} scales for {} output channels", spec.out_features),
                ));
            }
        };
        let activations = if self.static_activations {
            let input_name = format!("{}.input_scale", spec.name);
            let input = source.tensor(&input_name)?.to_f32(&input_name)?;
            match input[..] {
                [s] => ActivationScale::Static(s),
                _ => {
                    let message = format!("{} values: expected one", input.len());
                    return Err(tensor_error(&input_name, message));
                }
            }
        } else {
            ActivationScale::Dynamic
        };
        let bias = shard_bias(source, spec, rows.clone())?;
        let layer = Fp8Linear::new(codes, rows.len(), cols.len(), &scale, bias, activations)
            .map_err(|e| tensor_error(&name, e.to_string()))?;
        Ok(Box::new(layer))
    }
}

/// A checkpoint's `quantization_config` when it is Hugging Face FP8 (`quant_method: "fp8"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Config {
    /// `activation_scheme: "static"` (an `input_scale` per layer) rather than `"dynamic"`.
    pub static_activations: bool,
}

/// Reads `quantization_config` from a model directory's `config.json`: `Ok(None)` when there is
/// none or it is another method, an error for an FP8 variant this loader does not read.
pub fn fp8_config(dir: &std::path::Path) -> ch01::Result<Option<Fp8Config>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|error| ch01::Error::Io {
        path: path.clone(),
        error,
    })?;
    let bad = |message: String| ch01::Error::Config {
        path: path.clone(),
        message,
    };
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(config) = json.get("quantization_config") else {
        return Ok(None);
    };
    if config.get("quant_method").and_then(|m| m.as_str()) != Some("fp8") {
        return Ok(None);
    }
    if config
        .get("weight_block_size")
        .is_some_and(|b| !b.is_null())
    {
        return Err(bad(
            "FP8 with block-wise scales (weight_block_size) is not supported: per-tensor and \
             per-channel scales are"
                .into(),
        ));
    }
    let static_activations = match config.get("activation_scheme").and_then(|s| s.as_str()) {
        Some("static") => true,
        Some("dynamic") | None => false,
        Some(other) => return Err(bad(format!("unknown FP8 activation_scheme {other:?}"))),
    };
    Ok(Some(Fp8Config { static_activations }))
}

/// Quantizes every projection of a dense checkpoint to E4M3 as it loads, with per-channel
/// scales and the activations rounded as `activations` says (how `kiln bench ch05` measures FP8
/// on SmolLM2, which ships no FP8 checkpoint; there is no calibration, so `Static` has no
/// meaningful scale here). The tied output head is quantized too.
pub struct Fp8Quantizer {
    pub activations: ActivationScale,
}

impl Fp8Quantizer {
    /// `what` names the weight in an error: a quoted tensor name (`shard_label` for a part
    /// of one) or "a dense layer".
    fn build_named(
        &self,
        what: &str,
        weight: ArrayView2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let (out, n) = weight.dim();
        let layer = Fp8Linear::quantize_per_channel(weight)
            .and_then(|(codes, scales)| {
                Fp8Linear::new(codes, out, n, &scales, bias, self.activations)
            })
            .map_err(|e| ch01::Error::InvalidArgument(format!("{what}: {e}")))?;
        Ok(Box::new(layer))
    }
}

impl LinearLoader for Fp8Quantizer {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        self.build_named("a dense layer", weight.view(), bias)
    }

    /// As [`LinearLoader::load`]'s default, with the tensor named in an error.
    fn load(
        &self,
        source: &dyn ch01::WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let dense = ch01::linear::DenseLinear::load(source, spec)?;
        let bias = dense.bias().cloned();
        let name = format!("{}.weight", spec.name);
        let (rows, cols) = spec
            .shard
            .ranges(spec.name, spec.in_features, spec.out_features)?;
        let label = crate::quant_linear::shard_label(&name, spec, (&rows, &cols));
        self.build_named(&label, dense.weight().view(), bias)
    }
}
