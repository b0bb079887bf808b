//! The `Linear` seam: `y = x Wᵀ (+ b)`.
//!
//! Every projection of the model goes through this trait, so a later chapter can swap in
//! another storage (chapter 5's quantized weights) without touching the forward pass.

use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};

use crate::error::Result;
use crate::shard::ShardSpec;
use crate::source::WeightSource;

/// A linear layer. Invariant: `forward` maps `[T, in_features]` to `[T, out_features]`.
pub trait Linear: Send + Sync {
    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;
    /// Bytes of weight (and bias) storage: what one decode step reads from memory for this layer.
    fn weight_bytes(&self) -> usize;
    /// x: [T, in_features] → [T, out_features]
    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32>;

    /// Writes `forward(x)` into `y` [T, out_features]. A layer on a decode path overrides it to
    /// allocate nothing (chapter 2); this default allocates.
    fn forward_into(&self, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>) {
        y.assign(&self.forward(x));
    }
}

/// Dense f32 weights, stored as Hugging Face stores them: `weight` is `[out_features, in_features]`.
pub struct DenseLinear {
    weight: Array2<f32>,       // [out, in]
    bias: Option<Array1<f32>>, // [out]
}

impl DenseLinear {
    pub fn new(weight: Array2<f32>, bias: Option<Array1<f32>>) -> Self {
        if let Some(b) = &bias {
            assert_eq!(
                b.len(),
                weight.nrows(),
                "bias length must equal out_features"
            );
        }
        DenseLinear { weight, bias }
    }

    /// Loads this rank's part of `{spec.name}.weight` (full shape `[out, in]`) and, when
    /// `spec.bias` and the shard holds it, of `{spec.name}.bias` `[out]`, decoding only that part.
    pub fn load(source: &dyn WeightSource, spec: &LinearSpec<'_>) -> Result<Self> {
        let (rows, cols) = spec
            .shard
            .ranges(spec.name, spec.in_features, spec.out_features)?;
        let weight = source.matrix_block(
            &format!("{}.weight", spec.name),
            [spec.out_features, spec.in_features],
            rows.clone(),
            cols,
        )?; // [out / world, in] for a column shard, [out, in / world] for a row shard
        let bias = if spec.bias && spec.shard.holds_bias() {
            let full = source.vector(&format!("{}.bias", spec.name), spec.out_features)?;
            Some(full.slice(ndarray::s![rows]).to_owned()) // [rows]
        } else {
            None
        };
        Ok(DenseLinear::new(weight, bias))
    }

    pub fn weight(&self) -> &Array2<f32> {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Array1<f32>> {
        self.bias.as_ref()
    }
}

impl Linear for DenseLinear {
    fn in_features(&self) -> usize {
        self.weight.ncols()
    }

    fn out_features(&self) -> usize {
        self.weight.nrows()
    }

    fn weight_bytes(&self) -> usize {
        (self.weight.len() + self.bias.as_ref().map_or(0, |b| b.len())) * size_of::<f32>()
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = x.dot(&self.weight.t()); // [T, in] · [in, out] = [T, out]
        if let Some(bias) = &self.bias {
            y += bias;
        }
        y
    }
}

/// What a [`LinearLoader`] is asked to load: the tensor prefix, the full logical shape of the
/// layer (before sharding), whether it has a bias, and which part this rank holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearSpec<'a> {
    /// Tensor name prefix: the weight is `{name}.weight`, the bias `{name}.bias` (for a
    /// Hugging Face checkpoint; a quantized format reads its own tensors under the prefix).
    pub name: &'a str,
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
    pub shard: ShardSpec,
}

impl<'a> LinearSpec<'a> {
    /// The whole layer `{name}` mapping `in_features` → `out_features`.
    pub fn whole(name: &'a str, in_features: usize, out_features: usize, bias: bool) -> Self {
        LinearSpec {
            name,
            in_features,
            out_features,
            bias,
            shard: ShardSpec::whole(),
        }
    }

    /// The same layer, split as `shard` says.
    pub fn with_shard(self, shard: ShardSpec) -> Self {
        LinearSpec { shard, ..self }
    }
}

// ANCHOR: linear_loader
/// Builds the projections of a model from a [`WeightSource`]: the hook a later chapter uses to
/// load another kind of [`Linear`] (a faster kernel, quantized weights, one rank's shard) into
/// the same forward pass.
pub trait LinearLoader {
    /// Makes a layer from dense f32 weights `[out_features, in_features]` and an optional bias.
    fn build(&self, weight: Array2<f32>, bias: Option<Array1<f32>>) -> Result<Box<dyn Linear>>;

    /// Loads the part of `{spec.name}.weight` (and `.bias`) that `spec.shard` names, as dense f32
    /// with its shape checked, and builds the layer. The result maps the shard's local
    /// in-features to its local out-features. A loader that reads another format (GPTQ's
    /// `qweight`, GGUF blocks) overrides this and reads [`WeightSource::tensor`] itself.
    fn load(&self, source: &dyn WeightSource, spec: &LinearSpec<'_>) -> Result<Box<dyn Linear>> {
        let dense = DenseLinear::load(source, spec)?;
        self.build(dense.weight, dense.bias)
    }
}
// ANCHOR_END: linear_loader

/// Loads every projection as [`DenseLinear`].
pub struct DenseLoader;

impl LinearLoader for DenseLoader {
    fn build(&self, weight: Array2<f32>, bias: Option<Array1<f32>>) -> Result<Box<dyn Linear>> {
        Ok(Box::new(DenseLinear::new(weight, bias)))
    }
}
