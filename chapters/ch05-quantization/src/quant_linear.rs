//! [`QuantLinear`]: chapter 1's [`Linear`] seam on this chapter's integer kernels, and
//! [`QuantLoader`], the [`LinearLoader`] that builds it from GGUF blocks or by quantizing dense
//! weights on load.
//!
//! Choices (what a loader does with each kind of tensor):
//!
//! | `{name}.weight` is                      | result                                                  |
//! |-----------------------------------------|---------------------------------------------------------|
//! | blocks with a kernel (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) | [`QuantLinear`] on the stored bytes, whatever `target` says (never re-quantized: that would add a second rounding) |
//! | blocks without a kernel that [`crate::blocks`] decodes (Q8_K) | decoded to f32, then as a dense tensor |
//! | other blocks (Q2_K, Q3_K, IQ4_NL, ...)  | an error naming the tensor and its type                 |
//! | dense F32 / F16 / BF16                  | `target: None`: chapter 2's [`FastLinear`] (f32); `target: Some(t)`: quantized to `t` on load |
//!
//! A K-quant target needs `in_features` to be a multiple of 256; when it is not (SmolLM2's 576),
//! [`QuantLoader::to`] falls back for that layer as llama.cpp's quantizer does (Q4_K → Q5_0,
//! Q5_K → Q5_1, Q6_K → Q8_0); the
//! layer's own [`QuantLinear::ty`] says what it holds. With no fallback, or when even the
//! fallback's block does not divide `in_features`, loading fails with an error.
//!
//! Shards (chapter 8): a whole layer or a column split (a range of output rows) takes whole rows
//! of blocks; a row split (a range of input columns) must cut every row at block boundaries, so
//! `in_features / world` must be a multiple of the block length, else loading fails saying so.

use std::cell::RefCell;

use ch01::linear::{Linear, LinearLoader, LinearSpec};
use ch01::{TensorDtype, WeightSource};
use ch02::{FastLinear, WeightDtype};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2, s};

use crate::blocks;
use crate::format::GgmlType;
use crate::kernels::{Isa, KernelError, QuantMatrix, Scratch, has_kernel, linear};

thread_local! {
    /// Each calling thread's kernel scratch, grown once to its largest call.
    static SCRATCH: crate::scratch::Spares<Scratch> = const { RefCell::new(Vec::new()) };
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    crate::scratch::with_local(&SCRATCH, f)
}

/// A projection with block-quantized weights, computed by [`crate::kernels::linear`] on the
/// fastest [`Isa`] of this CPU.
pub struct QuantLinear {
    weight: QuantMatrix,       // [out, in] in blocks
    bias: Option<Array1<f32>>, // [out]
    isa: Isa,
}

impl QuantLinear {
    /// `weight` `[out, in]`; `bias` `[out]`.
    pub fn new(weight: QuantMatrix, bias: Option<Array1<f32>>) -> Result<Self, KernelError> {
        if let Some(b) = &bias
            && b.len() != weight.rows()
        {
            return Err(KernelError::Bias {
                bias: b.len(),
                out: weight.rows(),
            });
        }
        Ok(QuantLinear {
            weight,
            bias,
            isa: Isa::detect(),
        })
    }

    /// Quantizes a dense `weight` [out, in] to `ty`.
    pub fn quantize(
        ty: GgmlType,
        weight: &Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> Result<Self, KernelError> {
        let (rows, cols) = weight.dim();
        let weight = weight.as_standard_layout();
        let w = weight.as_slice().expect("standard layout is contiguous");
        QuantLinear::new(QuantMatrix::quantize(ty, w, rows, cols)?, bias)
    }

    /// The same layer computed by another implementation (tests compare them).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.isa = isa;
        self
    }

    /// The block type of the weights.
    pub fn ty(&self) -> GgmlType {
        self.weight.ty()
    }

    pub fn weight(&self) -> &QuantMatrix {
        &self.weight
    }

    /// x: [T, in] → y: [T, out], both contiguous row-major.
    fn run(&self, x: &[f32], y: &mut [f32], tokens: usize) {
        with_scratch(|scratch| linear(self.isa, &self.weight, x, y, tokens, scratch));
        if let Some(bias) = &self.bias {
            let bias = bias.as_slice().expect("a fresh bias is contiguous");
            for y_t in y.chunks_exact_mut(bias.len().max(1)) {
                y_t.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
    }
}

impl Linear for QuantLinear {
    fn in_features(&self) -> usize {
        self.weight.cols()
    }

    fn out_features(&self) -> usize {
        self.weight.rows()
    }

    /// The stored blocks plus the f32 bias.
    fn weight_bytes(&self) -> usize {
        self.weight.bytes().len() + self.bias.as_ref().map_or(0, |b| b.len() * size_of::<f32>())
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = Array2::<f32>::zeros((x.nrows(), self.out_features())); // [T, out]
        self.forward_into(x, y.view_mut());
        y
    }

    /// Allocates nothing when `x` and `y` are contiguous row-major and this thread's scratch
    /// has already grown to the call's size (every decode step after the first).
    fn forward_into(&self, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>) {
        assert_eq!(x.ncols(), self.in_features(), "x is [T, in]");
        assert_eq!(y.dim(), (x.nrows(), self.out_features()), "y is [T, out]");
        let tokens = x.nrows();
        let x = x.as_standard_layout(); // borrows when already contiguous
        let x = x.as_slice().expect("standard layout is contiguous");
        match y.as_slice_mut() {
            Some(y) => self.run(x, y, tokens),
            None => {
                let mut tmp = vec![0.0f32; tokens * self.out_features()];
                self.run(x, &mut tmp, tokens);
                y.iter_mut().zip(tmp).for_each(|(y, v)| *y = v);
            }
        }
    }
}

/// Loads projections as [`QuantLinear`] (see the module doc for what it does with each tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QuantLoader {
    /// The type dense weights are quantized to on load (`--quantization`); `None` keeps them
    /// dense. Stored blocks are never re-quantized.
    pub target: Option<GgmlType>,
    /// The type used instead of `target` for a layer whose `in_features` is not a whole number
    /// of `target` blocks.
    pub fallback: Option<GgmlType>,
    /// How a dense weight that is not quantized is stored (chapter 2's f32 or bf16).
    pub dense: WeightDtype,
}

impl QuantLoader {
    /// Stored blocks on the kernels, dense weights dense (a GGUF file as it is).
    pub const fn native() -> Self {
        QuantLoader {
            target: None,
            fallback: None,
            dense: WeightDtype::F32,
        }
    }

    /// The same loader, keeping dense weights that are not quantized in `dense` storage.
    pub const fn dense(self, dense: WeightDtype) -> Self {
        QuantLoader { dense, ..self }
    }

    /// Dense weights quantized to `target` on load; a K-quant target falls back as llama.cpp's
    /// quantizer does (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0) for layers whose `in_features` is
    /// not a multiple of 256. `target` must have a kernel.
    pub fn to(target: GgmlType) -> Result<Self, KernelError> {
        if !has_kernel(target) {
            return Err(KernelError::NoKernel(target));
        }
        let fallback = crate::gguf::convert::k_quant_fallback(target);
        Ok(QuantLoader {
            target: Some(target),
            fallback,
            dense: WeightDtype::F32,
        })
    }

    /// The type a dense layer of `in_features` is quantized to (`Ok(None)`: stays dense).
    pub fn choose(&self, in_features: usize) -> Result<Option<GgmlType>, String> {
        let Some(target) = self.target else {
            return Ok(None);
        };
        let fits = |t: GgmlType| t.row_bytes(in_features).is_some();
        if fits(target) {
            return Ok(Some(target));
        }
        match self.fallback {
            Some(f) if fits(f) => Ok(Some(f)),
            Some(f) => Err(format!(
                "cannot quantize a layer of in_features = {in_features} to {target} (blocks of \
                 {}) nor to its fallback {f} (blocks of {})",
                target.block_elems(),
                f.block_elems()
            )),
            None => Err(format!(
                "cannot quantize a layer of in_features = {in_features} to {target}: not a \
                 multiple of its block of {}",
                target.block_elems()
            )),
        }
    }

    /// `what` names the weight in an error: a quoted tensor name ([`shard_label`] for a part
    /// of one) or "a dense layer".
    fn build_named(
        &self,
        what: &str,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let ty = self
            .choose(weight.ncols())
            .map_err(|e| ch01::Error::InvalidArgument(format!("{what}: {e}")))?;
        Ok(match ty {
            Some(ty) => Box::new(
                QuantLinear::quantize(ty, &weight, bias)
                    .map_err(|e| ch01::Error::InvalidArgument(format!("{what}: {e}")))?,
            ),
            None => Box::new(FastLinear::new(weight, bias, self.dense)),
        })
    }
}

/// How an error names the weight `name` of `spec` when this rank holds `rows` × `cols` of it:
/// the name (quoted) alone for the whole tensor, else with the part, so that an element index counted
/// within the part (a quantizer's error) is not read as one of the whole tensor.
pub(crate) fn shard_label(
    name: &str,
    spec: &LinearSpec<'_>,
    (rows, cols): (&std::ops::Range<usize>, &std::ops::Range<usize>),
) -> String {
    if rows.len() == spec.out_features && cols.len() == spec.in_features {
        format!("`{name}`")
    } else {
        format!(
            "`{name}`, rows {}..{} and columns {}..{} of it (this rank's part, in which elements \
             are counted)",
            rows.start, rows.end, cols.start, cols.end
        )
    }
}

impl LinearLoader for QuantLoader {
    /// Dense f32 weights (a tied output head, a test's layer): quantized to the target, or
    /// chapter 2's [`FastLinear`] when there is none.
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        self.build_named("a dense layer", weight, bias)
    }

    fn load(
        &self,
        source: &dyn WeightSource,
        spec: &LinearSpec<'_>,
    ) -> ch01::Result<Box<dyn Linear>> {
        let name = format!("{}.weight", spec.name);
        let shape = [spec.out_features, spec.in_features];
        let (rows, cols) = spec
            .shard
            .ranges(spec.name, spec.in_features, spec.out_features)?;
        let bias = shard_bias(source, spec, rows.clone())?;
        let raw = source.tensor(&name)?;
        if !matches!(raw.dtype(), TensorDtype::Blocks { .. }) {
            // Dense: decode this rank's block, then quantize it or keep it dense.
            drop(raw);
            let label = shard_label(&name, spec, (&rows, &cols));
            let weight = source.matrix_block(&name, shape, rows, cols)?; // [rows, cols]
            return self.build_named(&label, weight, bias);
        }
        let tensor_error = |message: String| ch01::Error::Tensor {
            name: name.clone(),
            location: source.location().to_path_buf(),
            message,
        };
        let ty = GgmlType::from_tensor_dtype(raw.dtype())
            .ok_or_else(|| tensor_error(format!("unknown block format: {}", raw.dtype())))?;
        if raw.shape() != shape {
            return Err(ch01::Error::ShapeMismatch {
                name,
                expected: shape.to_vec(),
                actual: raw.shape().to_vec(),
            });
        }
        let be = ty.block_elems();
        if cols.start % be != 0 || cols.end % be != 0 {
            return Err(tensor_error(format!(
                "a row split must cut {ty} rows at block boundaries: columns {cols:?} of \
                 {} cut a block of {be} (in_features / world must be a multiple of {be})",
                spec.in_features
            )));
        }
        // This rank's part of every row it holds: rows `rows`, blocks `cols / be`.
        let row_bytes = ty
            .row_bytes(spec.in_features)
            .expect("checked by the source");
        let (first, last) = (
            cols.start / be * ty.block_bytes(),
            cols.end / be * ty.block_bytes(),
        );
        let mut bytes = Vec::with_capacity(rows.len() * (last - first));
        for r in rows.clone() {
            bytes.extend_from_slice(&raw.bytes()[r * row_bytes + first..r * row_bytes + last]);
        }
        if has_kernel(ty) {
            let weight = QuantMatrix::new(ty, rows.len(), cols.len(), bytes)
                .map_err(|e| tensor_error(e.to_string()))?;
            let layer = QuantLinear::new(weight, bias).map_err(|e| tensor_error(e.to_string()))?;
            return Ok(Box::new(layer));
        }
        if !blocks::can_dequantize(ty) {
            return Err(tensor_error(format!(
                "kiln cannot multiply or decode {ty} weights"
            )));
        }
        let mut values = vec![0.0f32; rows.len() * cols.len()];
        blocks::dequantize(ty, &bytes, &mut values).map_err(|e| tensor_error(e.to_string()))?;
        let weight = Array2::from_shape_vec((rows.len(), cols.len()), values)
            .map_err(|e| tensor_error(e.to_string()))?;
        self.build_named(&format!("`{name}`"), weight, bias)
    }
}

/// The bias entries of `rows` when the layer has a bias and this shard holds it (chapter 8's
/// row split leaves it to one rank).
pub(crate) fn shard_bias(
    source: &dyn WeightSource,
    spec: &LinearSpec<'_>,
    rows: std::ops::Range<usize>,
) -> ch01::Result<Option<Array1<f32>>> {
    if !(spec.bias && spec.shard.holds_bias()) {
        return Ok(None);
    }
    let full = source.vector(&format!("{}.bias", spec.name), spec.out_features)?;
    Ok(Some(full.slice(s![rows]).to_owned())) // [rows]
}
