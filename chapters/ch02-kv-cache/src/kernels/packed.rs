//! The packed weight layout shared by the decode and prefill kernels.

use crate::weight_memory::{Elements, ZeroBits};

/// Output rows per panel: two 8-lane f32 vectors.
pub const NR: usize = 16;

/// Input features [`PackedWeight::refill_with`] asks for at a time: the 16 rows' parts of a
/// panel, 4 KiB of f32, stay in L1 while they are written out as panel rows.
pub const FILL_FEATURES: usize = 64;

/// A weight element: f32, or bf16 kept as its bits and widened to f32 where it is used.
pub trait WeightElement: ZeroBits {
    /// Whether a load widens it to f32 (bf16), work a prefill with many token tiles saves by
    /// widening each panel once (see [`matmul_part`](super::matmul_part)).
    const WIDENS_ON_LOAD: bool;

    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;

    /// Where output `j` (0..NR) of a panel row is stored within its 16 elements. The identity,
    /// unless a type's fastest vector load delivers the lanes in another order (bf16: see
    /// [`u16::slot`]).
    #[inline(always)]
    fn slot(j: usize) -> usize {
        j
    }

    /// Loads 16 consecutive elements as two 8-lane f32 vectors.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must support AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> (Avx2, Avx2);

    /// Loads 16 consecutive elements as one 16-lane f32 vector, lane `i` = element `i`.
    ///
    /// # Safety
    /// `p` must point to 16 readable elements; the CPU must support AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16_512(p: *const Self) -> Avx512;
}

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{__m256 as Avx2, __m512 as Avx512};

impl WeightElement for f32 {
    const WIDENS_ON_LOAD: bool = false;
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
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_512(p: *const f32) -> Avx512 {
        unsafe { super::avx512::load16_f32(p) }
    }
}

/// bf16 as its bits: the top 16 bits of an f32 (rounded to nearest even when stored).
impl WeightElement for u16 {
    const WIDENS_ON_LOAD: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    fn from_f32(v: f32) -> u16 {
        half::bf16::from_f32(v).to_bits()
    }
    /// The AVX2 load widens bf16 to f32 by interleaving zeros below each value, which works
    /// within 128-bit halves: it yields stored elements 0-3 and 8-11 as one vector, 4-7 and
    /// 12-15 as the other. So outputs 4-7 are stored at 8-11 and outputs 8-11 at 4-7.
    #[inline(always)]
    fn slot(j: usize) -> usize {
        match j / 4 {
            1 => j + 4,
            2 => j - 4,
            _ => j,
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const u16) -> (Avx2, Avx2) {
        unsafe { super::avx2::load16_bf16(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16_512(p: *const u16) -> Avx512 {
        unsafe { super::avx512::load16_bf16(p) }
    }
}

// ANCHOR: packed_weight
/// `W` [out, in] stored panel by panel: panel `p` holds output rows `p·NR .. p·NR + NR`, and
/// element `(o, k)` sits at `p·in·NR + k·NR + slot(o − p·NR)` ([`WeightElement::slot`]).
///
/// Invariants: `data.len() == num_panels · in · NR`, `num_panels = ceil(out / NR)`, and the rows
/// of the last panel past `out` are zero, so kernels may always compute whole panels.
pub struct PackedWeight<W> {
    data: Elements<W>,
    in_features: usize,
    out_features: usize,
}
// ANCHOR_END: packed_weight

impl<W: WeightElement> PackedWeight<W> {
    /// Packs row-major `w` [out, in], a model's weight: into weight memory (2 MiB pages where
    /// the system gives them, see [`crate::weight_memory`]).
    pub fn pack(w: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(w.len(), out_features * in_features, "w is [out, in]");
        let data = Elements::for_weights(out_features.div_ceil(NR) * in_features * NR);
        Self::fill_rows(data, out_features, in_features, |o| {
            &w[o * in_features..][..in_features]
        })
    }

    /// Packs row-major `w` [out, in] on the heap: a short-lived weight (one replaced while its
    /// model lives), whose space weight memory would keep until the whole model goes.
    pub fn pack_on_heap(w: &[f32], out_features: usize, in_features: usize) -> Self {
        assert_eq!(w.len(), out_features * in_features, "w is [out, in]");
        Self::pack_rows(out_features, in_features, |o| {
            &w[o * in_features..][..in_features]
        })
    }

    /// Packs `W` `[out, in]` whose output row `o` is `row(o)` `[in]`, wherever each row lies
    /// (a head's keys, one per stored position, inside rows of every KV head), on the heap: a
    /// short-lived weight.
    pub fn pack_rows<'w>(
        out_features: usize,
        in_features: usize,
        row: impl Fn(usize) -> &'w [f32],
    ) -> Self {
        let data = Elements::on_heap(out_features.div_ceil(NR) * in_features * NR);
        Self::fill_rows(data, out_features, in_features, row)
    }

    /// Packs `W` [out, in] on the heap from `fill(o, k, part)`, which writes elements
    /// `k..k + part.len()` of output row `o` as f32 into `part`: a weight stored some other way
    /// (chapter 5's FP8 and int8 codes), widened for one product. The panels are filled in
    /// parallel, each by one task.
    pub fn pack_with(
        out_features: usize,
        in_features: usize,
        fill: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) -> Self {
        let mut packed = PackedWeight {
            data: Elements::on_heap(0),
            in_features: 0,
            out_features: 0,
        };
        packed.refill_with(out_features, in_features, fill);
        packed
    }

    /// [`pack_with`](Self::pack_with) into this weight's own heap storage, kept from call to
    /// call (a weight widened for every product): nothing is allocated once it has grown to the
    /// largest shape. A panel is written [`FILL_FEATURES`] input features at a time: the 16 rows'
    /// parts, then the panel rows they make, whole cache lines in order.
    pub fn refill_with(
        &mut self,
        out_features: usize,
        in_features: usize,
        fill: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) {
        use rayon::prelude::*;
        const KB: usize = FILL_FEATURES;
        let len = out_features.div_ceil(NR) * in_features * NR;
        match &mut self.data {
            Elements::Heap(elements) => elements.resize(len, W::default()),
            weights => *weights = Elements::on_heap(len),
        }
        self.in_features = in_features;
        self.out_features = out_features;
        self.data
            .par_chunks_mut((in_features * NR).max(1))
            .enumerate()
            .for_each(|(p, panel)| {
                let mut parts = [0.0f32; NR * KB]; // [NR, KB]: each row's part
                let rows = NR.min(out_features - p * NR);
                for k in (0..in_features).step_by(KB) {
                    let width = KB.min(in_features - k);
                    for (j, part) in parts.chunks_exact_mut(KB).enumerate() {
                        match j < rows {
                            true => fill(p * NR + j, k, &mut part[..width]),
                            false => part.fill(0.0), // past `out`
                        }
                    }
                    let lines = panel[k * NR..(k + width) * NR].chunks_exact_mut(NR);
                    for (i, line) in lines.enumerate() {
                        for j in 0..NR {
                            line[W::slot(j)] = W::from_f32(parts[j * KB + i]);
                        }
                    }
                }
            });
    }

    /// Writes row `o` of `W` [out, in], `row(o)` [in], into zeroed `data` in the packed order.
    fn fill_rows<'w>(
        mut data: Elements<W>,
        out_features: usize,
        in_features: usize,
        row: impl Fn(usize) -> &'w [f32],
    ) -> Self {
        for o in 0..out_features {
            let row = row(o);
            assert_eq!(row.len(), in_features, "row {o} is [in]");
            let panel = &mut data[(o / NR) * in_features * NR..][..in_features * NR];
            for (k, &v) in row.iter().enumerate() {
                panel[k * NR + W::slot(o % NR)] = W::from_f32(v);
            }
        }
        PackedWeight {
            data,
            in_features,
            out_features,
        }
    }

    /// Packs `W` `[out, in]` given by its columns: `column(k)` `[out]` holds input `k`'s weight for
    /// every output (a head's values, one per stored position, as the weight whose outputs are
    /// the head's channels), on the heap. A panel row is a run of [`NR`] consecutive elements of
    /// a column.
    pub fn pack_columns<'w>(
        out_features: usize,
        in_features: usize,
        column: impl Fn(usize) -> &'w [f32],
    ) -> Self {
        let mut data = Elements::on_heap(out_features.div_ceil(NR) * in_features * NR);
        for k in 0..in_features {
            let column = column(k);
            assert_eq!(column.len(), out_features, "column {k} is [out]");
            for (p, outputs) in column.chunks(NR).enumerate() {
                let panel_row = &mut data[(p * in_features + k) * NR..][..NR];
                for (j, &v) in outputs.iter().enumerate() {
                    panel_row[W::slot(j)] = W::from_f32(v);
                }
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

    /// Whether the elements are in weight memory (see [`PackedWeight::pack`]).
    pub fn in_weight_memory(&self) -> bool {
        self.data.in_weight_memory()
    }
}
