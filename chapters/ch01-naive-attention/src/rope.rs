//! Rotary position embeddings (RoPE, Su et al. 2021), in the Hugging Face "rotate half" layout.
//!
//! A head vector `x` of even length `d` is split into halves `x[..d/2]` and `x[d/2..]`; pair
//! `(x[i], x[i + d/2])` is rotated by the angle `pos · inv_freq[i]`. Rotations keep the vector's
//! norm, and because `R(a)ᵀR(b) = R(b - a)`, the score `q·k` between a query at position `m` and a
//! key at position `n` depends only on `n - m`: that is the whole point.

use crate::config::{LlamaConfig, RopeScaling};

/// Precomputed inverse frequencies for one head dimension. Invariant: `inv_freq.len() == head_dim / 2`.
#[derive(Debug, Clone)]
pub struct Rope {
    inv_freq: Vec<f64>,
}

impl Rope {
    // ANCHOR: rope_new
    pub fn new(head_dim: usize, theta: f64, scaling: &RopeScaling) -> Self {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let inv_freq = match *scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_len = original_max_position_embeddings as f64;
                let low_freq_wavelen = old_len / low_freq_factor;
                let high_freq_wavelen = old_len / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_freq_wavelen {
                            f // high frequency: unchanged
                        } else if wavelen > low_freq_wavelen {
                            f / factor // low frequency: scaled like linear
                        } else {
                            // in between: interpolate smoothly
                            let smooth = (old_len / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        Rope { inv_freq }
    }
    // ANCHOR_END: rope_new

    pub fn from_config(config: &LlamaConfig) -> Self {
        Rope::new(config.head_dim, config.rope_theta, &config.rope_scaling)
    }

    /// `inv_freq[i]` for the pairs `i < head_dim / 2`, scaling applied (what a device uploads).
    pub fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    pub fn head_dim(&self) -> usize {
        self.inv_freq.len() * 2
    }

    /// Rotates every head of one token in place.
    /// `x`: [num_heads * head_dim] for the token at position `pos`.
    // ANCHOR: rope_rotate
    pub fn rotate(&self, x: &mut [f32], pos: usize) {
        // ANCHOR: task_1_3
        let head_dim = self.head_dim();
        let half = head_dim / 2;
        for (i, &freq) in self.inv_freq.iter().enumerate() {
            // Like transformers: the angle in f32, then cos/sin (the same for every head).
            let angle = (pos as f32) * (freq as f32);
            let (sin, cos) = angle.sin_cos();
            for head in x.chunks_exact_mut(head_dim) {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * cos - b * sin;
                head[i + half] = b * cos + a * sin;
            }
        }
        // ANCHOR_END: task_1_3
    }
    // ANCHOR_END: rope_rotate

    /// `(cos, sin)` of every pair's angle at `pos` into `out` [head_dim / 2], computed as
    /// [`rotate`](Self::rotate) computes them: a step can compute them once for all layers.
    pub fn cos_sin(&self, pos: usize, out: &mut [(f32, f32)]) {
        assert_eq!(out.len(), self.inv_freq.len(), "out is [head_dim / 2]");
        for (out, &freq) in out.iter_mut().zip(&self.inv_freq) {
            let (sin, cos) = ((pos as f32) * (freq as f32)).sin_cos();
            *out = (cos, sin);
        }
    }

    /// [`rotate`](Self::rotate) with the angles [`cos_sin`](Self::cos_sin) gave for the
    /// token's position: the same bits. `x`: [num_heads * head_dim], `cos_sin`: [head_dim / 2].
    pub fn rotate_with(&self, x: &mut [f32], cos_sin: &[(f32, f32)]) {
        let half = self.inv_freq.len();
        assert_eq!(cos_sin.len(), half, "cos_sin is [head_dim / 2]");
        for head in x.chunks_exact_mut(2 * half) {
            let (a, b) = head.split_at_mut(half);
            for ((a, b), &(cos, sin)) in a.iter_mut().zip(b).zip(cos_sin) {
                (*a, *b) = (*a * cos - *b * sin, *b * cos + *a * sin);
            }
        }
    }
}
