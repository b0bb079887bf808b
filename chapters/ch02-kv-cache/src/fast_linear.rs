//! [`FastLinear`]: chapter 1's [`Linear`] seam implemented with this chapter's kernels, with the
//! weights stored once in their compute layout ([`PackedWeight`], f32 or bf16).

use ch01::linear::{Linear, LinearLoader};
use ndarray::{Array1, Array2, ArrayView2, ArrayViewMut2};

use crate::kernels::{Isa, PackedWeight, WeightElement, linear};

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
    F32(PackedWeight<f32>),
    Bf16(PackedWeight<u16>), // bf16 bits
}

/// A projection computed by [`crate::kernels::matvec`] (one token) or
/// [`crate::kernels::matmul`] (several), on the fastest [`Isa`] of this CPU.
pub struct FastLinear {
    weight: Storage,
    bias: Option<Array1<f32>>, // [out]
    isa: Isa,
}

impl FastLinear {
    /// `weight`: `[out, in]`; `bias`: `[out]`. The packed weights go to weight memory
    /// ([`crate::weight_memory`]): a model's projection, kept as long as the model.
    pub fn new(weight: Array2<f32>, bias: Option<Array1<f32>>, dtype: WeightDtype) -> Self {
        Self::packed(weight, bias, dtype, true)
    }

    /// [`FastLinear::new`] with the packed weights on the heap: a short-lived projection (one
    /// replaced while its model lives, as quantization's calibration does), whose space weight
    /// memory would keep until the whole model goes.
    pub fn on_heap(weight: Array2<f32>, bias: Option<Array1<f32>>, dtype: WeightDtype) -> Self {
        Self::packed(weight, bias, dtype, false)
    }

    fn packed(
        weight: Array2<f32>,
        bias: Option<Array1<f32>>,
        dtype: WeightDtype,
        in_weight_memory: bool,
    ) -> Self {
        fn pack<W: WeightElement>(
            w: &[f32],
            out: usize,
            inp: usize,
            kept: bool,
        ) -> PackedWeight<W> {
            match kept {
                true => PackedWeight::pack(w, out, inp),
                false => PackedWeight::pack_on_heap(w, out, inp),
            }
        }
        let (out_features, in_features) = weight.dim();
        let weight = weight.as_standard_layout();
        let w = weight.as_slice().expect("standard layout is contiguous");
        let (out, inp, kept) = (out_features, in_features, in_weight_memory);
        let weight = match dtype {
            WeightDtype::F32 => Storage::F32(pack(w, out, inp, kept)),
            WeightDtype::Bf16 => Storage::Bf16(pack(w, out, inp, kept)),
        };
        FastLinear {
            weight,
            bias,
            isa: Isa::detect(),
        }
    }

    /// The same layer computed by another implementation (tests compare them).
    pub fn with_isa(mut self, isa: Isa) -> Self {
        self.isa = isa;
        self
    }

    fn dims(&self) -> (usize, usize) {
        match &self.weight {
            Storage::F32(w) => (w.in_features(), w.out_features()),
            Storage::Bf16(w) => (w.in_features(), w.out_features()),
        }
    }

    /// x: [T, in] → y: [T, out], both contiguous row-major.
    fn run(&self, x: &[f32], y: &mut [f32], tokens: usize) {
        fn go<W: WeightElement>(isa: Isa, w: &PackedWeight<W>, x: &[f32], y: &mut [f32], t: usize) {
            linear(isa, w, x, y, t)
        }
        match &self.weight {
            Storage::F32(w) => go(self.isa, w, x, y, tokens),
            Storage::Bf16(w) => go(self.isa, w, x, y, tokens),
        }
        if let Some(bias) = &self.bias {
            let bias = bias.as_slice().expect("a fresh bias is contiguous");
            for y_t in y.chunks_exact_mut(bias.len()) {
                y_t.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
            }
        }
    }
}

impl Linear for FastLinear {
    fn in_features(&self) -> usize {
        self.dims().0
    }

    fn out_features(&self) -> usize {
        self.dims().1
    }

    /// Packed weights (padding included) plus the f32 bias.
    fn weight_bytes(&self) -> usize {
        let weight = match &self.weight {
            Storage::F32(w) => w.bytes(),
            Storage::Bf16(w) => w.bytes(),
        };
        weight + self.bias.as_ref().map_or(0, |b| b.len() * size_of::<f32>())
    }

    fn forward(&self, x: ArrayView2<f32>) -> Array2<f32> {
        let mut y = Array2::<f32>::zeros((x.nrows(), self.out_features())); // [T, out]
        self.forward_into(x, y.view_mut());
        y
    }

    /// Allocates nothing when `x` and `y` are contiguous row-major (the decode path's buffers).
    fn forward_into(&self, x: ArrayView2<f32>, mut y: ArrayViewMut2<f32>) {
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
