//! The packed weight layout shared by the decode and prefill kernels.

/// Output rows per panel: two 8-lane f32 vectors.
pub const NR: usize = 16;

/// A weight element: f32, or bf16 kept as its bits and widened to f32 where it is used.
pub trait WeightElement: Copy + Default + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    /// Loads 16 consecutive elements as two 8-lane f32 vectors.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> (Avx2, Avx2);
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256 as Avx2;

impl WeightElement for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> f32 {
        v
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> (Avx2, Avx2) {
        unsafe { super::avx2::load16_f32(p) }
    }
}

/// bf16 as its bits: the top 16 bits of an f32 (rounded to nearest even when stored).
impl WeightElement for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    fn from_f32(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> (Avx2, Avx2) {
        unsafe { super::avx2::load16_bf16(p) }
    }
}

// ANCHOR: packed_weight
/// `W` [out, in] stored panel by panel: panel `p` holds output rows `p·NR .. p·NR + NR`, and
/// element `(o, k)` sits at `p·in·NR + k·NR + (o − p·NR)`.
///
/// Invariants: `data.len() == num_panels · in · NR`, `num_panels = ceil(out / NR)`, and the rows
/// of the last panel past `out` are zero, so kernels may always compute whole panels.
pub struct PackedWeight<W> {
    data: Vec<W>,
    in_features: usize,
    out_features: usize,
}
// ANCHOR_END: packed_weight

impl<W: WeightElement> PackedWeight<W> {
    /// Packs row-major `w` [out, in].
    pub fn pack(w: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(w.len(), out_features * in_features, "w is [out, in]");
        let panels = out_features.div_ceil(NR);
        let mut data = vec![W::default(); panels * in_features * NR];
        for (o, row) in w.chunks_exact(in_features.max(1)).enumerate() {
            let panel = &mut data[(o / NR) * in_features * NR..][..in_features * NR];
            for (k, &v) in row.iter().enumerate() {
                panel[k * NR + o % NR] = W::from_f32(v);
            }
        }
        PackedWeight {
            data,
            in_features,
            out_features,
        }
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn num_panels(&self) -> usize {
        self.out_features.div_ceil(NR)
    }

    /// Panel `p`: [in][NR].
    pub fn panel(&self, p: usize) -> &[W] {
        &self.data[p * self.in_features * NR..][..self.in_features * NR]
    }

    /// Bytes of storage, padding included: what one decode step reads.
    pub fn bytes(&self) -> usize {
        self.data.len() * size_of::<W>()
    }
}
