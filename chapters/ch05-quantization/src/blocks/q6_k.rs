//! Q6_K: llama.cpp's 6-bit K-quant. A super-block of 256 weights is 16 sub-blocks of 16; sub-block
//! `j` has a signed 8-bit scale `sc[j]` under the super-block's f16 `d`; each weight is a 6-bit
//! `q` in 0..64 (4 low bits and 2 high bits stored apart), and `x = (d · sc[j]) · (q − 32)`.
//!
//! ```text
//! bytes 0..128     ql      low 4 bits: element h·128 + r (half h = 0, 1; r = 0..128) is
//!                          nibble r / 64 (low, then high) of byte h·64 + r mod 64
//! bytes 128..192   qh      high 2 bits: element h·128 + r is bits 2·(r / 32)..+2 of
//!                          byte h·32 + r mod 32
//! bytes 192..208   scales  16 × i8, sub-block j = element / 16
//! bytes 208..210   d       f16
//! ```
//!
//! **Encoding** (this crate's own, not llama.cpp's search; symmetric, so it uses `q − 32` in
//! −31..=31 and leaves −32 unused): sub-block `j` needs the step `r_j = max|x| / 31`; `d` = the
//! smallest f16 `≥ max_j r_j / 127`; `sc[j] = ⌈r_j / d⌉`, so `ds_j = d · sc[j] ∈ [r_j, r_j + d)`;
//! `q − 32 = clamp(round(x / ds_j), −32, 31)`. The grid `ds_j · {−31..31}` covers the sub-block,
//! so a value decodes within `ds_j / 2 < (max|x|_j / 31 + d) / 2` of itself, up to f32 rounding.
//! `d` is an f16: from `max|x|` about 2.6·10⁸ on it would be infinite, and [`super::quantize`]
//! refuses the block ([`super::BlockError::Overflow`]).

use super::{f16_at, f16_ceil, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 210;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 256;

/// The 6-bit value (0..64) of element `e` of a block whose low bits are `ql` and high bits `qh`.
#[inline]
pub fn q6(ql: &[u8], qh: &[u8], e: usize) -> u8 {
    let (h, r) = (e / 128, e % 128);
    let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
    let hi = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 0x03;
    lo | (hi << 4)
}

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
        let d = f16_at(block, 208);
        for (j, out) in out.chunks_exact_mut(16).enumerate() {
            let ds = d * f32::from(scales[j] as i8);
            for (l, o) in out.iter_mut().enumerate() {
                let q = q6(ql, qh, 16 * j + l) as i8 - 32;
                *o = ds * f32::from(q);
            }
        }
    }
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let r: [f64; 16] = std::array::from_fn(|j| {
            x[16 * j..16 * j + 16]
                .iter()
                .fold(0.0f64, |m, v| m.max(v.abs() as f64))
                / 31.0
        });
        let d = f16_ceil(r.iter().copied().fold(0.0, f64::max) / 127.0);
        block.fill(0);
        for j in 0..16 {
            let sc = if d.to_f32() > 0.0 {
                (r[j] / d.to_f64()).ceil().clamp(0.0, 127.0) as i8
            } else {
                0
            };
            block[192 + j] = sc as u8;
            let ds = (d.to_f32() * f32::from(sc)) as f64;
            for l in 0..16 {
                let e = 16 * j + l;
                let v = if ds > 0.0 {
                    (x[e] as f64 / ds).round().clamp(-32.0, 31.0)
                } else {
                    0.0
                };
                let u = (v as i32 + 32) as u8; // 0..64
                let (h, r) = (e / 128, e % 128);
                block[h * 64 + r % 64] |= (u & 0x0F) << (4 * (r / 64));
                block[128 + h * 32 + r % 32] |= (u >> 4) << (2 * (r / 32));
            }
        }
        put_f16(block, 208, d.to_f32());
    }
}
