//! Integer kernels for `y = x Wᵀ` with `W` `[out, in]` stored as rows of blocks ([`QuantMatrix`]).
//!
//! Like llama.cpp, the kernels never decode a weight to f32. They quantize the **activation** row
//! to 8-bit blocks first, once per call, and take integer dot products block by block:
//!
//! - the 32-element formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) pair with [`Act32`]: Q8_0's rule with
//!   an f32 scale `d_x` and the sum of the block's values, so Q4_1's and Q5_1's offset `m` costs
//!   one multiply per block instead of one per weight;
//! - the K-quants (Q4_K, Q5_K, Q6_K) pair with [`Act256`], Q8_K: one f32 scale per 256 values and
//!   the sums of each 16 (for Q4_K's and Q5_K's mins and Q6_K's −32).
//!
//! Per weight block the kernel forms an exact i32 (`Σ q_w · q_x`, the sub-block scales applied in
//! integers for the K-quants), then adds `(d_w · d_x) · i` (and the offset's term) to one f32
//! accumulator per output, block after block in row order. [`Isa::Avx2Fma`] forms the integers
//! with `maddubs`/`madd` (see `avx2.rs`, `tiles.rs`), or, for the 32-element formats on a CPU
//! with AVX-512 VNNI, with one `vpdpbusd` (see `vnni.rs`), [`Isa::Portable`] with plain Rust;
//! the f32 steps are the same operations in the same order, so **they are all equal bit for
//! bit** (tested with `==`). Threads (rayon) split the output rows.
//!
//! # Interleaved rows (the 32-element formats on AVX2)
//!
//! A block's work is small (one load, an unpack, one integer dot product, three f32 steps), so
//! what surrounds it decides the speed. Kept row after row, a vector holds 32 weights of one
//! row: the integer products of a block end in 8 lanes of one output, and the f32 steps (scale
//! product, conversion, multiply, add) are paid once per row and block. [`QuantMatrix`] stores
//! these formats instead in **groups of 8 rows, interleaved** ([`interleave`]): a vector holds 4
//! consecutive weights of each of 8 rows, it multiplies 4 activation bytes broadcast to every
//! lane, and 8 such products make the block's exact integer sum for 8 rows at once, one row per
//! lane. The f32 steps then run once per 8 rows, and no lane is ever summed across:
//!
//! ```text
//! for b in blocks:                               W: groups of 8 rows   X: [T tokens, blocks]
//!     w[k] = 4 weights of 8 rows, k < 8          unpacked once, used by T tokens
//!     for t < T:
//!         i = Σ_k w[k] · bcast(X[t, b].q[4k..4k+4])        [8 rows × i32], exact
//!         acc[t] += (d_w[8 rows] · d_x[t]) · i             [8 rows × f32]
//! ```
//!
//! A tile takes `G` groups × `T` tokens (`tiles.rs`): decode 2 × 1 on AVX2 and 4 × 1 with
//! AVX-512 VNNI (whose 32 registers hold more), prefill 1 × 2 and 2 × 4. Each group of a tile
//! asks for the block the next tile will read (a prefetch, into L2 for one token:
//! [`PrefetchInto`]): a group
//! is a short stream of `8 · row_bytes`, too short for the hardware's prefetcher to reach speed
//! on its own. The tiles change which outputs are computed together, never the operations of
//! one output, so [`matmul`] equals [`matvec`] bit for bit. Q4_K and Q6_K are interleaved too
//! (`ktiles.rs`): per super-block of 8 rows, each sub-block's exact integer sums, multiplied by
//! the 8 rows' sub-block scales in integers, then the f32 steps once; tiles of one group × 1
//! token (decode) or × 4 (2 on AVX2) tokens, prefetching [`K_PREFETCH_BYTES`] ahead. Q5_K keeps
//! the file's rows, one row at a time and, in [`matmul`], four tokens per unpacked super-block.
//! W8A8's int8 weights times int8 activations use the same interleaving with a whole row's sum
//! in integers ([`int8`]).
//!
//! # The error bound against dequantize-then-dense
//!
//! Let `w̃` be the weights as [`crate::blocks::dequantize`] decodes them and `x` the f32 input.
//! The reference is `Σ_l w̃_l x_l` in f64. The kernel computes instead, in exact arithmetic,
//! `Σ_l w_l x̂_l`, where `w` is the exact real value of the block (`d·q + m`, not rounded to f32)
//! and `x̂ = d_x · q_x` is the quantized activation, then rounds. Three terms separate them:
//!
//! 1. **activation rounding**: `|x − x̂| ≤ d_x·(½ + 2⁻¹⁵)` per element (see [`crate::blocks::q8_k`]),
//!    so `|Σ w (x − x̂)| ≤ Σ_blocks d_x·(½ + 2⁻¹⁵)·Σ_{l∈block} |w_l|`;
//! 2. **decode rounding** of the reference's weights: `w̃` is `w` after at most three f32
//!    roundings of terms no larger than `|w̃| + |offset|` (`offset` = Q4_1's `m`, a K-quant's
//!    `dmin·m`, else 0), so `|Σ (w − w̃) x| ≤ 3u · Σ (|w̃| + |offset|)·|x|`, `u = 2⁻²⁴`;
//! 3. **the kernel's f32 arithmetic**: per block `(d_w·d_x)`, the i32→f32 conversion, the product
//!    and (with an offset) a second product and a sum: at most 5 roundings of the block's
//!    term `t_b`; then `n_b` sequential additions into the accumulator, each rounding the
//!    running sum, which is at most `Σ |t_b|`. So at most `(n_b + 5)·u·Σ_b |t_b|`, with
//!    `|t_b| ≤ Σ_{l∈b} (|w̃_l| + |offset|)·(|x_l| + d_x) · (1 + 4u)`. A K-quant's term is the
//!    difference of two products of three roundings each (its i32 sums pass 2²⁴, so their
//!    conversion rounds too), `(d·d_x)·isum` and `(dmin·d_x)·imin`, each as large as the
//!    block's magnitude sum: `4u·(|A| + |B|) ≤ 8u·Σ (|w̃| + |offset|)·(|x| + d_x)`, three
//!    roundings more than the 32-element formats' 5.
//!
//! `bound = Σ_b d_x,b·(½ + 2⁻¹⁵)·Σ_{l∈b} |w̃_l| + (n_b + 13)·u·Σ_l (|w̃_l| + |offset_l|)·(|x_l| + d_x,l)`
//! (the first factor uses `|w̃|`; `n_b + 13` covers the K-quants' `n_b + 8 + 3` roundings, of
//! the sum, their terms and the decode, with slack for `|w| − |w̃|`; the 32-element formats
//! need `n_b + 9`). `tests/kernels.rs` computes it
//! per output and asserts it. Term 1 dominates: about `d_x/2 ≈ max|x| / 254` per unit of
//! `Σ|w|`.
//!
//! # Costs
//! (Per call.)
//! One pass over `x` to quantize it (`T·in` values, into a [`Scratch`] that grows once), then
//! `out · in` weight bytes read once per call whatever `T` is, `T · out · in` integer products.
//! Nothing allocates once the scratch has grown to the largest call, except that [`matmul`]'s
//! transposition buffer is freed after a call of more than [`KEEP_OUTPUTS`] outputs (prefill).

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod int8;
pub mod interleave;
#[cfg(target_arch = "x86_64")]
mod ktiles;
pub mod portable;
#[cfg(test)]
mod test_util;
#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
mod vnni;

use std::borrow::Cow;

use rayon::prelude::*;

pub use ch02::kernels::Isa;

use crate::blocks::{self, BlockError, q8_k};
use crate::format::GgmlType;
use ch02::kernels::{EVEN_SPLIT_PANELS, NR, even_split};
use ch02::weight_memory::Elements;

/// 32 activations quantized as Q8_0 is (`x ≈ d·q`, `|q| ≤ 127`) but with an f32 scale, and the sum
/// of `q` for the weight formats' offsets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Act32 {
    pub q: [i8; 32],
    pub d: f32,
    /// `Σ q`.
    pub sum: i32,
}

/// The scale of 8-bit activation codes for a block whose largest magnitude is `amax`:
/// `amax / 127`, never below f32's smallest normal number (below it `1 / d` would be infinite
/// and every code ±127), 0 for a block of zeros, NaN for a block holding a NaN ([`act_amax`]).
pub fn act_scale(amax: f32) -> f32 {
    if amax > 0.0 {
        crate::kv_cache::scale_for(amax, 127.0)
    } else if amax.is_nan() {
        f32::NAN
    } else {
        0.0
    }
}

/// The largest magnitude of an activation block, NaN if the block holds a NaN. (`f32::max`
/// alone skips a NaN: the block would quantize as if the element were 0, and the output would
/// be a finite number where a dense product gives NaN. With a NaN scale every output the block
/// reaches is NaN; an infinite element gives an infinite scale, and NaN outputs too.)
#[inline]
pub fn act_amax(x: &[f32]) -> f32 {
    let (m, nan) = x.iter().fold((0.0f32, false), |(m, nan), v| {
        (m.max(v.abs()), nan | v.is_nan())
    });
    if nan { f32::NAN } else { m }
}

impl Act32 {
    const ZERO: Act32 = Act32 {
        q: [0; 32],
        d: 0.0,
        sum: 0,
    };

    /// Quantizes 32 values: `d = max|x| / 127` ([`act_scale`]), `q = round(x / d)` (halves
    /// away from zero). A block holding a NaN gets `d` NaN and every `q` 0 ([`act_amax`]).
    pub fn quantize(x: &[f32]) -> Act32 {
        let d = act_scale(act_amax(x));
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        let mut q = [0i8; 32];
        for (q, &x) in q.iter_mut().zip(x) {
            // (The clamp changes nothing but a scale too small to invert, whose `id` is ∞.)
            *q = round_half_away((x * id).clamp(-127.0, 127.0)) as i8;
        }
        let sum = q.iter().map(|&q| i32::from(q)).sum();
        Act32 { q, d, sum }
    }
}

/// `v.round()` (halves away from zero) for `|v| < 2³¹`, saturating beyond like `as`, NaN to 0,
/// in operations that inline and vectorise (`f32::round` is a library call on baseline x86-64).
/// `v − trunc(v)` is exact (both have the same sign and `trunc(v)` has no more bits than `v`),
/// so comparing it with ±½ decides the rounding exactly.
#[inline(always)]
pub fn round_half_away(v: f32) -> i32 {
    let t = v as i32; // truncation toward zero
    let frac = v - t as f32;
    t + i32::from(frac >= 0.5) - i32::from(frac <= -0.5)
}

/// 256 activations as Q8_K ([`crate::blocks::q8_k`]): `x ≈ d·q`, `|q| ≤ 127`, and the sums of
/// each 16 `q`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Act256 {
    pub q: [i8; 256],
    pub bsums: [i16; 16],
    pub d: f32,
}

impl Act256 {
    const ZERO: Act256 = Act256 {
        q: [0; 256],
        bsums: [0; 16],
        d: 0.0,
    };

    /// Quantizes 256 values by Q8_K's rule.
    pub fn quantize(x: &[f32]) -> Act256 {
        let mut a = Act256::ZERO;
        a.d = q8_k::encode(x, &mut a.q, &mut a.bsums);
        a
    }
}

// The f32 steps after a block's integer sum, shared by every instruction set so that they
// round identically. Rust does not fuse `a * b + c`, so each operation rounds once.

/// `acc + (d_w · d_x) · s`.
#[inline(always)]
fn acc_d(acc: f32, d: f32, dx: f32, s: i32) -> f32 {
    acc + (d * dx) * s as f32
}

/// `acc + ((d · d_x) · isum − (dmin · d_x) · imin)`: a K-quant super-block.
#[inline(always)]
fn acc_k(acc: f32, d: f32, dmin: f32, dx: f32, isum: i32, imin: i32) -> f32 {
    acc + ((d * dx) * isum as f32 - (dmin * dx) * imin as f32)
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    #[test]
    fn round_half_away_equals_f32_round() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut values = vec![
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            126.5,
            -127.5,
            0.49999997,
            -0.49999997,
        ];
        values.extend((0..=200_000).map(|i| i as f32 / 782.0 - 128.0));
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            values.push(f32::from_bits(state as u32) % 128.0);
        }
        for v in values.into_iter().filter(|v| v.is_finite()) {
            assert_eq!(round_half_away(v), v.round() as i32, "{v:e}");
        }
        assert_eq!(round_half_away(f32::NAN), 0);
    }
}

/// The types the kernels multiply, 32-element formats first.
pub const KERNEL_FORMATS: [GgmlType; 8] = {
    use GgmlType::*;
    [Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4K, Q5K, Q6K]
};

/// Whether the kernels multiply weights of type `ty` (one of [`KERNEL_FORMATS`]).
pub const fn has_kernel(ty: GgmlType) -> bool {
    let mut i = 0;
    while i < KERNEL_FORMATS.len() {
        if KERNEL_FORMATS[i] as u32 == ty as u32 {
            return true;
        }
        i += 1;
    }
    false
}

/// A weight the kernels cannot take.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    #[error(
        "no integer kernel multiplies {0} weights (kernels: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)"
    )]
    NoKernel(GgmlType),
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error("{ty} has no kernel for {group} blocks per scale (Q4_0 and Q4_1 take 1, 2, 4 or 8)")]
    Group { ty: GgmlType, group: usize },
    #[error("bias has {bias} elements, expected out_features = {out}")]
    Bias { bias: usize, out: usize },
}

/// A weight `[rows, cols]` (`[out_features, in_features]`) of one block type, each row
/// `cols / block_elems` blocks. The 32-element formats, Q4_K and Q6_K are stored in groups of 8
/// interleaved rows ([`interleave`]), the bytes in the order the kernels read them (the last
/// group filled up with zero rows); Q5_K row after row as the file stores it.
/// [`QuantMatrix::bytes`] gives the file's layout back.
///
/// A **grouped** matrix ([`QuantMatrix::grouped`], Q4_0 and Q4_1 only) stores `group`
/// consecutive blocks of a row that share their scale (and offset) once: the f16 `d` (and `m`),
/// then the `group` blocks' 16 nibble bytes each. It computes exactly what the same blocks
/// stored one by one compute, with `16 · (group − 1)` fewer bits of scales per `32 · group`
/// weights: a GPTQ or AWQ group's one scale, stored once.
///
/// Invariant (checked by the constructors): `ty` has a kernel, `group` is 1, or one of
/// [`GROUPS`] for Q4_0 and Q4_1, `cols` is a whole number of `group` blocks, and
/// `stored.len()` is `rows · row_bytes`, or, interleaved, `rows.div_ceil(8)` groups of
/// [`interleave::block_bytes`] per stored block of a row.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    ty: GgmlType,
    /// Blocks of 32 per stored scale.
    group: usize,
    rows: usize,
    cols: usize,
    /// Bytes of one row in the file's layout.
    row_bytes: usize,
    /// In weight memory (2 MiB pages where the system gives them), as chapter 2's weights.
    stored: Elements<u8>,
}

/// The blocks per scale a grouped [`QuantMatrix`] may share (besides 1, every format's).
pub const GROUPS: [usize; 3] = [2, 4, 8];

/// Bytes of a Q4_0 or Q4_1 block before its 16 nibble bytes: `d` (and `m`), its header.
pub fn header_bytes(ty: GgmlType) -> usize {
    ty.block_bytes() - 16
}

/// Bytes of one stored scale group of `ty` (`group` blocks): one header, `group` bodies.
pub fn group_bytes(ty: GgmlType, group: usize) -> usize {
    header_bytes(ty) + 16 * group
}

impl QuantMatrix {
    /// Takes `bytes` as `rows` rows of `cols` elements of `ty`.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        if !has_kernel(ty) {
            return Err(KernelError::NoKernel(ty));
        }
        let length = BlockError::Length {
            ty,
            bytes: bytes.len(),
            elems: rows.saturating_mul(cols),
        };
        let row_bytes = ty.row_bytes(cols).ok_or(length.clone())?;
        if rows.checked_mul(row_bytes) != Some(bytes.len()) {
            return Err(length.into());
        }
        Ok(QuantMatrix::store(ty, 1, rows, cols, row_bytes, bytes))
    }

    /// The matrix of `bytes`, checked, in the file's layout: interleaved if
    /// [`interleave::interleaved`] says so for `ty`.
    fn store(
        ty: GgmlType,
        group: usize,
        rows: usize,
        cols: usize,
        row_bytes: usize,
        bytes: Vec<u8>,
    ) -> QuantMatrix {
        let layout = if interleave::interleaved(ty) {
            interleave::pack(ty, group, rows, row_bytes, &bytes)
        } else {
            bytes
        };
        let mut stored = Elements::for_weights(layout.len());
        stored.copy_from_slice(&layout);
        QuantMatrix {
            ty,
            group,
            rows,
            cols,
            row_bytes,
            stored,
        }
    }

    /// Takes `bytes` as `rows` rows of `cols` elements of Q4_0 or Q4_1 blocks, `group`
    /// consecutive blocks sharing one stored scale (see the type's doc); `group` 1 is
    /// [`QuantMatrix::new`].
    pub fn grouped(
        ty: GgmlType,
        group: usize,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<Self, KernelError> {
        if group == 1 {
            return QuantMatrix::new(ty, rows, cols, bytes);
        }
        if !matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1) || !GROUPS.contains(&group) {
            return Err(KernelError::Group { ty, group });
        }
        let length = BlockError::Length {
            ty,
            bytes: bytes.len(),
            elems: rows.saturating_mul(cols),
        };
        if !cols.is_multiple_of(32 * group) {
            return Err(length.into());
        }
        let row_bytes = cols / (32 * group) * group_bytes(ty, group);
        if rows.checked_mul(row_bytes) != Some(bytes.len()) {
            return Err(length.into());
        }
        Ok(QuantMatrix::store(ty, group, rows, cols, row_bytes, bytes))
    }

    /// Blocks of 32 per stored scale: 1 but for a [`QuantMatrix::grouped`] matrix.
    pub fn group(&self) -> usize {
        self.group
    }

    /// The blocks one by one, each with its group's header (what `ty`'s own layout stores).
    fn ungrouped(&self) -> Cow<'_, [u8]> {
        let bytes = self.bytes();
        if self.group == 1 {
            return bytes;
        }
        let header = header_bytes(self.ty);
        let mut out = Vec::with_capacity(self.rows * self.cols / 32 * self.ty.block_bytes());
        for g in bytes.chunks_exact(group_bytes(self.ty, self.group)) {
            for body in g[header..].chunks_exact(16) {
                out.extend_from_slice(&g[..header]);
                out.extend_from_slice(body);
            }
        }
        out.into()
    }

    /// Encodes a dense row-major `weight` `[rows, cols]` as `ty` (see [`blocks::quantize`]: a
    /// NaN or ∞ weight, or a block whose f16 scale would overflow, is an error, its element
    /// counted row-major from the start of `weight`).
    pub fn quantize(
        ty: GgmlType,
        weight: &[f32],
        rows: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        if !has_kernel(ty) {
            return Err(KernelError::NoKernel(ty));
        }
        let length = BlockError::Length {
            ty,
            bytes: 0,
            elems: weight.len(),
        };
        let row_bytes = ty.row_bytes(cols).ok_or(length.clone())?;
        if rows.checked_mul(cols) != Some(weight.len()) {
            return Err(length.into());
        }
        let mut bytes = vec![0u8; rows * row_bytes];
        if row_bytes > 0 {
            bytes
                .par_chunks_mut(row_bytes)
                .zip(weight.par_chunks(cols))
                .enumerate()
                .try_for_each(|(r, (out, w))| {
                    blocks::quantize(ty, w, out).map_err(|e| e.offset(r * cols))
                })?;
        }
        QuantMatrix::new(ty, rows, cols, bytes)
    }

    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The blocks row after row in the file's layout (grouped when [`QuantMatrix::group`] > 1):
    /// borrowed for the K-quants, put back in row order for the interleaved formats.
    pub fn bytes(&self) -> Cow<'_, [u8]> {
        if !interleave::interleaved(self.ty) {
            return self.stored[..].into();
        }
        let mut out = vec![0u8; self.rows * self.row_bytes];
        for (r, row) in out.chunks_exact_mut(self.row_bytes.max(1)).enumerate() {
            self.unpack_row(r, row);
        }
        out.into()
    }

    /// Row `r`'s blocks in the file's layout.
    pub fn row(&self, r: usize) -> Cow<'_, [u8]> {
        if !interleave::interleaved(self.ty) {
            return self.stored[r * self.row_bytes..(r + 1) * self.row_bytes].into();
        }
        let mut out = vec![0u8; self.row_bytes];
        self.unpack_row(r, &mut out);
        out.into()
    }

    /// Row `r` of an interleaved matrix into `out[..row_bytes]`, in the file's layout.
    fn unpack_row(&self, r: usize, out: &mut [u8]) {
        interleave::unpack_row(self.ty, self.group, self.row_bytes, &self.stored, r, out);
    }

    /// Bytes of one group of 8 interleaved rows.
    #[cfg(target_arch = "x86_64")]
    fn group_bytes(&self) -> usize {
        let blocks = self.cols / self.ty.block_elems() / self.group;
        blocks * interleave::block_bytes(self.ty, self.group)
    }

    /// Bytes the matrix holds in memory (with an interleaved matrix's zero rows).
    pub fn stored_bytes(&self) -> usize {
        self.stored.len()
    }

    /// The weights decoded to f32, `[rows, cols]` row-major (what "dequantize, then dense" uses).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        blocks::dequantize(self.ty, &self.ungrouped(), &mut out)
            .expect("lengths checked at construction");
        out
    }
}

/// Reusable buffers of the kernels: the quantized activations and, for several tokens, the
/// outputs before they are transposed into `y`. They grow to the largest call and stay.
#[derive(Debug, Default)]
pub struct Scratch {
    act32: Vec<Act32>,   // [T, in / 32]
    act256: Vec<Act256>, // [T, in / 256]
    yt: Vec<f32>,        // [out, T]
}

/// One call's quantized activations, `[T, blocks]`.
#[derive(Clone, Copy)]
enum Acts<'a> {
    B32(&'a [Act32]),
    B256(&'a [Act256]),
}

impl<'a> Acts<'a> {
    /// Token `t`'s blocks (`n` per token).
    fn token(self, t: usize, n: usize) -> Acts<'a> {
        match self {
            Acts::B32(a) => Acts::B32(&a[t * n..(t + 1) * n]),
            Acts::B256(a) => Acts::B256(&a[t * n..(t + 1) * n]),
        }
    }
}

/// Quantizes `x` [tokens, cols] into the activation blocks `ty` pairs with; returns them.
fn quantize_acts<'s>(
    path: Path,
    ty: GgmlType,
    x: &[f32],
    tokens: usize,
    act32: &'s mut Vec<Act32>,
    act256: &'s mut Vec<Act256>,
) -> Acts<'s> {
    fn fill<'b, A: Copy + Send>(
        buf: &'b mut Vec<A>,
        zero: A,
        x: &[f32],
        tokens: usize,
        elems: usize,
        encode: impl Fn(&[f32]) -> A + Sync,
    ) -> &'b [A] {
        let n = x.len() / elems;
        if buf.len() < n {
            buf.resize(n, zero);
        }
        let buf = &mut buf[..n];
        if tokens > 1 {
            buf.par_iter_mut()
                .zip(x.par_chunks_exact(elems))
                .for_each(|(a, x)| *a = encode(x));
        } else {
            buf.iter_mut()
                .zip(x.chunks_exact(elems))
                .for_each(|(a, x)| *a = encode(x));
        }
        buf
    }
    if ty.block_elems() == 32 {
        #[cfg(target_arch = "x86_64")]
        if let Some(cpu) = path.avx2() {
            let encode = |x: &[f32]| avx2::quantize_act32(cpu, x);
            return Acts::B32(fill(act32, Act32::ZERO, x, tokens, 32, encode));
        }
        let _ = path;
        Acts::B32(fill(act32, Act32::ZERO, x, tokens, 32, Act32::quantize))
    } else {
        Acts::B256(fill(act256, Act256::ZERO, x, tokens, 256, Act256::quantize))
    }
}

/// Which cache the decode tiles' prefetches fill ([`set_prefetch`]); a prompt's tiles fill L1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefetchInto {
    /// L1 (`prefetcht0`), as the tiles first did. The next tile is 10 to 51 KiB of SmolLM2's
    /// weights (4 groups with VNNI), as much as an L1 of 32 KiB holds or more: likely why
    /// asking for it there did not pay.
    L1,
    /// L2 (`prefetcht1`), the default: one token through SmolLM2's projections on one thread
    /// read Q8_0 weights at 23 GB/s instead of 17, Q4_0 at 34 instead of 17
    /// (`examples/quant_prefetch_distance.rs`), and whole decodes on one thread ran 35% and
    /// 104% faster (AMD EPYC, 2026-12-05).
    L2,
}

/// How far ahead the K-quant decode tiles (Q4_K, Q6_K) prefetch, in bytes of the matrix (rounded down
/// to whole super-blocks): 16 KiB, 13 of Q4_K, 9 of Q6_K. A tile reads one group of 8 rows, a
/// single stream, and one thread keeps enough of it in flight only far ahead: counted as two
/// super-blocks (2.3 KiB of Q4_K, 3.3 KiB of Q6_K), SmolLM2 quantized to Q4_K on load (only its
/// down_proj is Q4_K) read at 26.5 GB/s on one thread, at 16 KiB at 32.5; llama.cpp's Q4_K_M
/// file at 23.9 and 26.1 (`examples/quant_prefetch_distance.rs`, AMD EPYC, both into L2).
pub const K_PREFETCH_BYTES: usize = 16384;

/// `true` while [`set_prefetch`] asks for L1.
static PREFETCH_L1: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// [`K_PREFETCH_BYTES`], unless [`set_prefetch`] changed it.
static K_PREFETCH_DISTANCE: std::sync::atomic::AtomicUsize =
    std::sync::atomic::AtomicUsize::new(K_PREFETCH_BYTES);

/// Makes the tiles prefetch `into` that cache and the K-quant tiles `k_bytes` ahead (at most
/// 1 MiB), for the whole process; the results are the same bits either way. For measuring them
/// (`examples/quant_prefetch_distance.rs`); the defaults are [`PrefetchInto::L2`] and
/// [`K_PREFETCH_BYTES`].
pub fn set_prefetch(into: PrefetchInto, k_bytes: usize) {
    use std::sync::atomic::Ordering::Relaxed;
    PREFETCH_L1.store(into == PrefetchInto::L1, Relaxed);
    K_PREFETCH_DISTANCE.store(k_bytes.min(1 << 20), Relaxed);
}

/// Whether a tile of `tokens` tokens prefetches into L1: a tile of several tokens always does
/// (it reads each block for each of them; L2 was not measured to pay there), a tile of one
/// token (a decode's, or a prompt's last tokens) as [`set_prefetch`] says. Read once per call.
#[cfg(target_arch = "x86_64")]
fn prefetch_into_l1(tokens: usize) -> bool {
    tokens > 1 || PREFETCH_L1.load(std::sync::atomic::Ordering::Relaxed)
}

/// The decode K-quant tiles' distance, [`K_PREFETCH_BYTES`] unless [`set_prefetch`] changed it.
#[cfg(target_arch = "x86_64")]
fn k_prefetch_distance() -> usize {
    K_PREFETCH_DISTANCE.load(std::sync::atomic::Ordering::Relaxed)
}

/// Which kernels a call runs: the portable ones, the AVX2 ones with their proof (AVX2, FMA and
/// F16C; a CPU with AVX2 but without F16C runs the portable kernels), or, on a CPU that also has
/// AVX-512 VNNI, the tiles on `vpdpbusd` (Q5_K's rows stay on AVX2).
#[derive(Clone, Copy)]
enum Path {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(avx2::Avx2F16c),
    #[cfg(target_arch = "x86_64")]
    Vnni(vnni::Avx512Vnni),
}

impl Path {
    fn of(isa: Isa) -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(cpu) = vnni::Avx512Vnni::detect(isa) {
                return Path::Vnni(cpu);
            }
            if let Some(cpu) = avx2::Avx2F16c::detect(isa) {
                return Path::Avx2(cpu);
            }
        }
        let _ = isa;
        Path::Portable
    }

    /// The AVX2 proof, for the kernels that have no VNNI form.
    #[cfg(target_arch = "x86_64")]
    fn avx2(self) -> Option<avx2::Avx2F16c> {
        match self {
            Path::Portable => None,
            Path::Avx2(cpu) => Some(cpu),
            Path::Vnni(cpu) => Some(cpu.avx2_f16c()),
        }
    }
}

/// One row's dot product with one token's activation blocks (`group` blocks per scale).
#[inline]
fn dot(path: Path, ty: GgmlType, group: usize, row: &[u8], acts: Acts<'_>) -> f32 {
    use GgmlType::*;
    match (path, acts) {
        (_, Acts::B32(a)) if group > 1 => match ty {
            Q4_0 => portable::dot_q4_0_grouped(row, a, group),
            Q4_1 => portable::dot_q4_1_grouped(row, a, group),
            _ => unreachable!("{ty} is never grouped"),
        },
        (_, Acts::B32(a)) => match ty {
            Q8_0 => portable::dot_q8_0(row, a),
            Q4_0 => portable::dot_q4_0(row, a),
            Q4_1 => portable::dot_q4_1(row, a),
            Q5_0 => portable::dot_q5_0(row, a),
            Q5_1 => portable::dot_q5_1(row, a),
            _ => unreachable!("{ty} has no 32-element kernel"),
        },
        (_, Acts::B256(a)) => {
            #[cfg(target_arch = "x86_64")]
            if let Some(cpu) = path.avx2() {
                return dot_k_avx2(cpu.avx2_fma(), ty, row, [a])[0];
            }
            match ty {
                Q4K => portable::dot_q4_k(row, a),
                Q5K => portable::dot_q5_k(row, a),
                Q6K => portable::dot_q6_k(row, a),
                _ => unreachable!("{ty} has no 256-element kernel"),
            }
        }
    }
}

/// One K-quant row with `T` tokens on AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
fn dot_k_avx2<const T: usize>(
    cpu: ch02::kernels::Avx2Fma,
    ty: GgmlType,
    row: &[u8],
    acts: [&[Act256]; T],
) -> [f32; T] {
    use GgmlType::*;
    match ty {
        Q5K => avx2::dot_q5_k(cpu, row, acts),
        _ => unreachable!("{ty} has no row-by-row AVX2 kernel (Q4_K and Q6_K are interleaved)"),
    }
}

/// A task's outputs: `rows` output rows × `tokens`, stored by groups of 8 rows,
/// `[groups][tokens][8]`, so that a tile's 8 rows of one token are one contiguous store (for one
/// token, plain row order). [`matmul`] turns them into `y` [tokens, out] a run of 8 at a time.
///
/// Invariant (checked by [`Outs::new`]): `buf` holds every slot of a row below `rows`.
pub struct Outs<'a> {
    buf: &'a mut [f32],
    rows: usize,
    tokens: usize,
}

impl<'a> Outs<'a> {
    /// Outputs of `rows` rows × `tokens` in `buf`. Panics unless `buf` holds them (a whole
    /// last group, but for one token, where it ends at `rows`).
    pub fn new(buf: &'a mut [f32], rows: usize, tokens: usize) -> Outs<'a> {
        let last = if rows == 0 || tokens == 0 {
            0
        } else {
            Self::at(rows - 1, tokens - 1, tokens) + 1
        };
        assert!(
            buf.len() >= last,
            "the outputs of {rows} rows × {tokens} tokens"
        );
        Outs { buf, rows, tokens }
    }

    /// Where row `r`, token `t` is stored.
    #[inline(always)]
    fn at(r: usize, t: usize, tokens: usize) -> usize {
        use interleave::ROWS;
        (r / ROWS * tokens + t) * ROWS + r % ROWS
    }

    /// Rows of these outputs.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Sets row `r`, token `t`.
    #[inline]
    pub fn set(&mut self, r: usize, t: usize, v: f32) {
        assert!(r < self.rows && t < self.tokens, "row {r}, token {t}");
        self.buf[Self::at(r, t, self.tokens)] = v;
    }

    /// Sets the rows of group `g` (rows `8g..8g + 8`) that exist, for token `t`.
    #[inline]
    pub fn set8(&mut self, g: usize, t: usize, v: &[f32; interleave::ROWS]) {
        let (at, n) = self.group_at(g, t);
        self.buf[at..at + n].copy_from_slice(&v[..n]);
    }

    /// The rows of group `g` that exist, for token `t` (up to 8 contiguous outputs).
    pub fn group(&self, g: usize, t: usize) -> &[f32] {
        let (at, n) = self.group_at(g, t);
        &self.buf[at..at + n]
    }

    /// Where group `g`'s outputs for token `t` start, and how many rows of it exist.
    #[inline]
    fn group_at(&self, g: usize, t: usize) -> (usize, usize) {
        use interleave::ROWS;
        assert!(t < self.tokens, "token {t}");
        let n = self.rows.saturating_sub(ROWS * g).min(ROWS);
        (Self::at(ROWS * g, t, self.tokens), n)
    }

    /// Row `r`, token `t`.
    pub fn get(&self, r: usize, t: usize) -> f32 {
        assert!(r < self.rows && t < self.tokens, "row {r}, token {t}");
        self.buf[Self::at(r, t, self.tokens)]
    }
}

/// Whole groups of interleaved rows of `w` (`packed`) times every token of `a` into `outs`, in
/// the register tiles of `cpu` ([`tiles::Tiles`]).
#[cfg(target_arch = "x86_64")]
fn rows32_tiles<C: tiles::Tiles>(
    cpu: C,
    w: &QuantMatrix,
    packed: &[u8],
    a: &[Act32],
    tokens: usize,
    outs: &mut Outs<'_>,
) {
    use GgmlType::*;
    match (w.ty, w.group) {
        (Q8_0, 1) => cpu.rows::<tiles::Q8_0>(packed, a, tokens, outs),
        (Q4_0, 1) => cpu.rows::<tiles::Q4_0>(packed, a, tokens, outs),
        (Q4_1, 1) => cpu.rows::<tiles::Q4_1>(packed, a, tokens, outs),
        (Q5_0, 1) => cpu.rows::<tiles::Q5_0>(packed, a, tokens, outs),
        (Q5_1, 1) => cpu.rows::<tiles::Q5_1>(packed, a, tokens, outs),
        (Q4_0, 2) => cpu.rows::<tiles::Q4_0G<2>>(packed, a, tokens, outs),
        (Q4_0, 4) => cpu.rows::<tiles::Q4_0G<4>>(packed, a, tokens, outs),
        (Q4_0, 8) => cpu.rows::<tiles::Q4_0G<8>>(packed, a, tokens, outs),
        (Q4_1, 2) => cpu.rows::<tiles::Q4_1G<2>>(packed, a, tokens, outs),
        (Q4_1, 4) => cpu.rows::<tiles::Q4_1G<4>>(packed, a, tokens, outs),
        (Q4_1, 8) => cpu.rows::<tiles::Q4_1G<8>>(packed, a, tokens, outs),
        (ty, group) => unreachable!("{ty} has no 32-element kernel for groups of {group}"),
    }
}

/// Rows `r0..r0 + outs.rows()` of `w` times every token of `acts` (`per_token` blocks each)
/// into `outs`; `r0` is a multiple of 8 (a whole interleaved group).
fn rows_times_tokens(
    path: Path,
    w: &QuantMatrix,
    r0: usize,
    acts: Acts<'_>,
    tokens: usize,
    per_token: usize,
    outs: &mut Outs<'_>,
) {
    let n = outs.rows();
    #[cfg(target_arch = "x86_64")]
    if interleave::interleaved(w.ty) {
        use tiles::Tiles;
        // Whole groups of 8 interleaved rows (the last one may hold zero rows past `rows`).
        let (g0, g1) = (r0 / interleave::ROWS, (r0 + n).div_ceil(interleave::ROWS));
        let packed = &w.stored[g0 * w.group_bytes()..g1 * w.group_bytes()];
        match (path, acts) {
            (Path::Avx2(cpu), Acts::B32(a)) => {
                return rows32_tiles(cpu, w, packed, a, tokens, outs);
            }
            (Path::Vnni(cpu), Acts::B32(a)) => {
                return rows32_tiles(cpu, w, packed, a, tokens, outs);
            }
            (Path::Avx2(cpu), Acts::B256(a)) => return cpu.rows_k(w.ty, packed, a, tokens, outs),
            (Path::Vnni(cpu), Acts::B256(a)) => return cpu.rows_k(w.ty, packed, a, tokens, outs),
            (Path::Portable, _) => {}
        }
    }
    // The K-quants on AVX2, several tokens: each row's super-blocks unpacked once per
    // `KQ_TOKENS` tokens.
    #[cfg(target_arch = "x86_64")]
    if let (Some(cpu), Acts::B256(a), true) = (path.avx2(), acts, tokens > 1) {
        const KQ_TOKENS: usize = 4;
        for i in 0..n {
            let row = &w.stored[(r0 + i) * w.row_bytes..(r0 + i + 1) * w.row_bytes];
            let token = |t: usize| &a[t * per_token..(t + 1) * per_token];
            let mut t = 0;
            while t + KQ_TOKENS <= tokens {
                let acts = std::array::from_fn(|j| token(t + j));
                let y = dot_k_avx2::<KQ_TOKENS>(cpu.avx2_fma(), w.ty, row, acts);
                y.iter()
                    .enumerate()
                    .for_each(|(j, &y)| outs.set(i, t + j, y));
                t += KQ_TOKENS;
            }
            for t in t..tokens {
                outs.set(i, t, dot_k_avx2(cpu.avx2_fma(), w.ty, row, [token(t)])[0]);
            }
        }
        return;
    }
    // The portable kernels read a row in the file's layout: an interleaved one is put back in
    // this thread's row buffer (grown once, so decode allocates nothing here either).
    crate::scratch::with_local(&ROW, |buf: &mut Vec<u8>| {
        for i in 0..n {
            let row: &[u8] = if interleave::interleaved(w.ty) {
                if buf.len() < w.row_bytes {
                    buf.resize(w.row_bytes, 0);
                }
                w.unpack_row(r0 + i, buf);
                &buf[..w.row_bytes]
            } else {
                &w.stored[(r0 + i) * w.row_bytes..(r0 + i + 1) * w.row_bytes]
            };
            for t in 0..tokens {
                let y = dot(path, w.ty, w.group, row, acts.token(t, per_token));
                outs.set(i, t, y);
            }
        }
    })
}

thread_local! {
    /// Each thread's buffer for one row in the file's layout (the portable kernels').
    static ROW: crate::scratch::Spares<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Output rows one task computes: enough to amortise the task, few enough to balance the cores;
/// a multiple of 32, so that tasks split into whole interleaved groups and register tiles.
fn rows_per_task(rows: usize) -> usize {
    rows.div_ceil(4 * rayon::current_num_threads())
        .clamp(1, 64)
        .next_multiple_of(32)
}

/// Output rows one task of [`matvec`] computes (at least 32). A matrix of at most chapter 2's
/// `EVEN_SPLIT_PANELS` panels of rows (2048: every projection of a SmolLM2 layer) is split
/// evenly, one contiguous run per thread, as chapter 2's decode product splits it (a short
/// stream cut into several tasks per thread reads slower in the machine's fast moments);
/// larger ones, and any with `ch02::kernels::set_even_split(false)`, as [`rows_per_task`] says.
fn matvec_rows_per_task(rows: usize) -> usize {
    if rows <= EVEN_SPLIT_PANELS * NR && even_split() {
        rows.div_ceil(rayon::current_num_threads())
            .next_multiple_of(32)
            .max(32)
    } else {
        rows_per_task(rows)
    }
}

// ANCHOR: matvec
/// One token: `y[o] = Σ_k W[o, k] · x[k]`, output rows split across threads.
/// `x`: `[in]`, `y`: `[out]`. Panics on other lengths (a caller's mistake: shapes were checked
/// when `w` was made).
pub fn matvec(isa: Isa, w: &QuantMatrix, x: &[f32], y: &mut [f32], scratch: &mut Scratch) {
    assert_eq!(x.len(), w.cols, "x is [in]");
    assert_eq!(y.len(), w.rows, "y is [out]");
    let (path, per_token) = (Path::of(isa), w.cols / w.ty.block_elems());
    let acts = quantize_acts(path, w.ty, x, 1, &mut scratch.act32, &mut scratch.act256); // [in / block]
    let per_task = matvec_rows_per_task(w.rows);
    y.par_chunks_mut(per_task)
        .enumerate()
        .for_each(|(task, y)| {
            let rows = y.len(); // for one token, `Outs` is plain row order
            rows_times_tokens(
                path,
                w,
                task * per_task,
                acts,
                1,
                per_token,
                &mut Outs::new(y, rows, 1),
            )
        });
}
// ANCHOR_END: matvec

// ANCHOR: matmul
/// Several tokens: `y[t, o] = Σ_k x[t, k] · W[o, k]`, i.e. `y = x Wᵀ`. `x`: [tokens, in],
/// `y`: [tokens, out], both row-major. Each task takes a run of output rows and, row by row,
/// computes every token's output from that row while it is in L1: each weight byte is read
/// from memory once per call. Every output equals [`matvec`]'s for its token, bit for bit.
pub fn matmul(
    isa: Isa,
    w: &QuantMatrix,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
    scratch: &mut Scratch,
) {
    assert_eq!(x.len(), tokens * w.cols, "x is [tokens, in]");
    assert_eq!(y.len(), tokens * w.rows, "y is [tokens, out]");
    if tokens == 0 || w.rows == 0 {
        return;
    }
    let Scratch { act32, act256, yt } = scratch;
    let path = Path::of(isa);
    let acts = quantize_acts(path, w.ty, x, tokens, act32, act256); // [tokens, in / block]
    let per_token = w.cols / w.ty.block_elems();
    let slots = w.rows.next_multiple_of(interleave::ROWS) * tokens;
    if yt.len() < slots {
        yt.resize(slots, 0.0);
    }
    let yt = &mut yt[..slots]; // [out / 8, tokens, 8]
    let per_task = rows_per_task(w.rows); // a multiple of 8: tasks take whole groups
    yt.par_chunks_mut(per_task * tokens)
        .enumerate()
        .for_each(|(task, yt)| {
            let (r0, rows) = (task * per_task, per_task.min(w.rows - task * per_task));
            let mut outs = Outs::new(yt, rows, tokens);
            rows_times_tokens(path, w, r0, acts, tokens, per_token, &mut outs)
        });
    // [out / 8, tokens, 8] → [tokens, out], 8 outputs a copy.
    let outs = Outs::new(yt, w.rows, tokens);
    for (t, y_t) in y.chunks_exact_mut(w.rows).enumerate() {
        for (g, y) in y_t.chunks_mut(interleave::ROWS).enumerate() {
            y.copy_from_slice(outs.group(g, t));
        }
    }
    // A prefill-sized buffer is not kept: it would hold as much memory as its `y` forever.
    if scratch.yt.len() > KEEP_OUTPUTS {
        scratch.yt = Vec::new();
    }
}

/// The most outputs (f32) a [`Scratch`] keeps between [`matmul`] calls: 4 MiB, enough for a
/// batched decode step over a large vocabulary; larger prefill buffers are freed after use.
pub const KEEP_OUTPUTS: usize = 1 << 20;
// ANCHOR_END: matmul

/// `y = x Wᵀ` for any number of tokens: [`matvec`] for one, [`matmul`] for more.
pub fn linear(
    isa: Isa,
    w: &QuantMatrix,
    x: &[f32],
    y: &mut [f32],
    tokens: usize,
    scratch: &mut Scratch,
) {
    if tokens == 1 {
        matvec(isa, w, x, y, scratch);
    } else {
        matmul(isa, w, x, y, tokens, scratch);
    }
}
