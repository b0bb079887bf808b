//! The `Linear` seam: `y = x Wᵀ (+ b)`.
//!
//! Every projection of the model goes through this trait, so a later chapter can swap in
//! another storage (chapter 5's quantized weights) without touching the forward pass.

use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};

use crate::error::Result;
use crate::weights::Weights;

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

    /// Loads `{prefix}.weight` `[out, in]` and, when `bias`, `{prefix}.bias` `[out]`.
    pub fn load(
        weights: &Weights,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        let weight = weights.matrix(&format!("{prefix}.weight"), out_features, in_features)?;
        let bias = if bias {
            Some(weights.vector(&format!("{prefix}.bias"), out_features)?)
        } else {
            None
        };
        Ok(DenseLinear::new(weight, bias))
    }

    pub fn weight(&self) -> &Array2<f32> {
        &self.weight
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

/// Builds the projections of a model from a checkpoint: the hook a later chapter uses to load
/// another kind of [`Linear`] (a faster kernel, quantized weights) into the same forward pass.
pub trait LinearLoader {
    /// Makes a layer from dense f32 weights `[out_features, in_features]` and an optional bias.
    fn build(&self, weight: Array2<f32>, bias: Option<Array1<f32>>) -> Result<Box<dyn Linear>>;

    /// Loads `{prefix}.weight` (and `{prefix}.bias` when `bias`), checking their shapes, and
    /// builds the layer. A loader that reads another format overrides this.
    fn load(
        &self,
        weights: &Weights,
        prefix: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Box<dyn Linear>> {
        let dense = DenseLinear::load(weights, prefix, in_features, out_features, bias)?;
        self.build(dense.weight, dense.bias)
    }
}

/// Loads every projection as [`DenseLinear`].
pub struct DenseLoader;

impl LinearLoader for DenseLoader {
    fn build(&self, weight: Array2<f32>, bias: Option<Array1<f32>>) -> Result<Box<dyn Linear>> {
        Ok(Box::new(DenseLinear::new(weight, bias)))
    }
}
