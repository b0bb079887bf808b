//! [`FastLinear`]: chapter 1's [`Linear`] seam implemented with this chapter's kernels, with the
//! weights stored once in their compute layout (`[out, in]` row-major, f32 or bf16).

use ch01::linear::{Linear, LinearLoader};
use half::bf16;
use ndarray::{Array1, Array2, ArrayView2};

use crate::kernels::{WeightElement, matmul, matvec};

/// How projection weights are stored. Activations and accumulation are always f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    #[default]
    F32,
    /// bfloat16: half the bytes read per decoded token; rounding to nearest even at load.
    Bf16,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(WeightDtype::F32),
            "bf16" => Ok(WeightDtype::Bf16),
            other => Err(format!("unknown dtype {other:?}: expected f32 or bf16")),
        }
    }
}

enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<u16>), // bf16 bits
}

/// A projection computed by [`matvec`] (one token) or [`matmul`] (several).
/// Invariant: the weight holds `out_features * in_features` elements, row-major.
pub struct FastLinear {
    weight: Storage,
    bias: Option<Array1<f32>>, // [out]
    in_features: usize,
    out_features: usize,
}

impl FastLinear {
    pub fn new(weight: Array2<f32>, bias: Option<Array1<f32>>, dtype: WeightDtype) -> Self {
        let (out_features, in_features) = weight.dim();
        let values = weight
            .as_standard_layout()
            .iter()
            .copied()
            .collect::<Vec<f32>>();
        let weight = match dtype {
            WeightDtype::F32 => Storage::F32(values),
            WeightDtype::Bf16 => Storage::Bf16(
                values
                    .into_iter()
                    .map(|v| bf16::from_f32(v).to_bits())
                    .collect(),
            ),
        };
        FastLinear {
            weight,
            bias,
            in_features,
            out_features,
        }
    }

    /// Bytes of weight storage: what one decode step reads for this layer.
    pub fn weight_bytes(&self) -> usize {
        match &self.weight {
            Storage::F32(w) => w.len() * 4,
            Storage::Bf16(w) => w.len() * 2,
        }
    }

    fn run<W: WeightElement>(&self, w: &[W], x: &[f32], y: &mut [f32], tokens: usize) {
        if tokens == 1 {
            matvec(w, x, y);
        } else {
            matmul(w, x, y, self.in_features, self.out_features);
        }
    }
}

impl Linear for FastLinear {
    fn in_features(&self) -> usize {
        self.in_features
    }

    fn out_features(&self) -> usize {
        self.out_features
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let tokens = x.nrows();
        let x = x.as_standard_layout(); // [T, in], contiguous (a no-op for the model's arrays)
        let x = x.as_slice().expect("standard layout is contiguous");
        let mut y = Array2::<f32>::zeros((tokens, self.out_features)); // [T, out]
        let y_slice = y.as_slice_mut().expect("fresh array is contiguous");
        match &self.weight {
            Storage::F32(w) => self.run(w, x, y_slice, tokens),
            Storage::Bf16(w) => self.run(w, x, y_slice, tokens),
        }
        if let Some(bias) = &self.bias {
            y += bias;
        }
        y
    }
}

/// Loads every projection (and a tied output head) as [`FastLinear`] with the given storage.
pub struct FastLoader {
    pub dtype: WeightDtype,
}

impl LinearLoader for FastLoader {
    fn build(
        &self,
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
    ) -> ch01::Result<Box<dyn Linear>> {
        Ok(Box::new(FastLinear::new(weight, bias, self.dtype)))
    }
}

/// Loads a model directory with fast projections.
pub fn load_fast(dir: &std::path::Path, dtype: WeightDtype) -> ch01::Result<ch01::Llama> {
    ch01::Llama::load_with(dir, &FastLoader { dtype })
}
