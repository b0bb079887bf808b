//! Q4_K: llama.cpp's 4-bit K-quant. A super-block of 256 weights is 8 sub-blocks of 32; sub-block
//! `j` has a 6-bit scale `sc[j]` and a 6-bit min `m[j]`, themselves scaled by the super-block's
//! f16 `d` and `dmin`; each weight is a 4-bit `q` in 0..16, and
//! `x = (d · sc[j]) · q − dmin · m[j]`.
//!
//! ```text
//! bytes 0..2      d       f16
//! bytes 2..4      dmin    f16
//! bytes 4..16     scales  12 bytes: 8 × (6-bit sc, 6-bit m), packed as below
//! bytes 16..144   qs      128 bytes: bytes 32i..32i+32 hold sub-block 2i (low nibbles)
//!                         and sub-block 2i + 1 (high nibbles), element l in byte 32i + l
//!
//! scales byte   bits 7..6    bits 5..0          (j = 0..4)
//!   j           sc[j+4]₅₄    sc[j]
//!   4 + j       m[j+4]₅₄     m[j]
//!   8 + j       m[j+4]₃..₀ (high nibble) | sc[j+4]₃..₀ (low nibble)
//! ```
//!
//! **Encoding** (this crate's own, simpler than llama.cpp's iterative search for the best scale;
//! it does not reproduce llama.cpp's bytes). Every sub-block's grid is made to cover its values,
//! so that no value is clipped and each is at most half a step from a grid point:
//!
//! 1. sub-block `j` spans `[lo_j, hi_j]` with `lo_j = min(0, min x)` (the offset is subtracted, so
//!    it is never negative) and `hi_j = max x`; its offset is `mn_j = −lo_j`;
//! 2. `dmin` = the smallest f16 `≥ max_j mn_j / 63`; `m[j] = ⌈mn_j / dmin⌉`, so
//!    `dm_j = dmin · m[j] ∈ [mn_j, mn_j + dmin)`;
//! 3. the step needed is `r_j = (hi_j + dm_j) / 15`; `d` = the smallest f16 `≥ max_j r_j / 63`;
//!    `sc[j] = ⌈r_j / d⌉`, so `ds_j = d · sc[j] ∈ [r_j, r_j + d)`;
//! 4. `q = clamp(round((x + dm_j) / ds_j), 0, 15)`.
//!
//! Then the grid `−dm_j + ds_j · {0..15}` spans `[−dm_j, 15·ds_j − dm_j] ⊇ [lo_j, hi_j]`, and
//! every value decodes within `ds_j / 2 < (r_j + d) / 2 ≤ ((hi_j − lo_j + dmin) / 15 + d) / 2`
//! of itself, up to f32 rounding of the decode (a few units in the last place of
//! `|x| + dm_j`). The test `k_quants_stay_within_their_bound` checks that bound from the input.
//! `d` and `dmin` are f16: a super-block whose `max_j r_j / 63` or `max_j mn_j / 63` is beyond
//! 65504 (a sub-block range above about 6.2·10⁷, or a value below about −4.1·10⁶) would store
//! an infinite scale, and [`super::quantize`] refuses it ([`super::BlockError::Overflow`]).

use half::f16;

use super::{f16_at, f16_ceil, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 144;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 256;

/// The 8 scales and 8 mins of a Q4_K or Q5_K super-block, unpacked from its 12 bytes.
#[inline]
pub fn scale_min(scales: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = scales[j] & 0x3F;
        m[j] = scales[4 + j] & 0x3F;
        sc[4 + j] = (scales[8 + j] & 0x0F) | ((scales[j] >> 2) & 0x30);
        m[4 + j] = (scales[8 + j] >> 4) | ((scales[4 + j] >> 2) & 0x30);
    }
    (sc, m)
}

/// The inverse of [`scale_min`]: packs 8 scales and 8 mins (each below 64) into 12 bytes.
pub fn pack_scale_min(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..4 {
        out[j] = sc[j] | ((sc[4 + j] >> 4) << 6);
        out[4 + j] = m[j] | ((m[4 + j] >> 4) << 6);
        out[8 + j] = (sc[4 + j] & 0x0F) | ((m[4 + j] & 0x0F) << 4);
    }
    out
}

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = scale_min(&block[4..16]);
        let qs = &block[16..];
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let ds = d * f32::from(sc[j]);
            let dm = dmin * f32::from(m[j]);
            let (bytes, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
            for (o, &b) in out.iter_mut().zip(bytes) {
                *o = ds * f32::from((b >> shift) & 0x0F) - dm;
            }
        }
    }
}

/// A super-block's scales, mins and values on a grid of `levels + 1` steps (15 for Q4_K, 31 for
/// Q5_K), by the covering rule of the module doc.
pub struct Encoded {
    pub d: f16,
    pub dmin: f16,
    pub sc: [u8; 8],
    pub m: [u8; 8],
    /// `[256]`, each in `0..=levels`.
    pub q: [u8; 256],
}

/// Encodes 256 values (see the module doc; shared by Q4_K and Q5_K).
pub fn encode(x: &[f32], levels: u8) -> Encoded {
    let (mut lo, mut hi) = ([0f32; 8], [0f32; 8]);
    for (j, sub) in x.chunks_exact(32).enumerate() {
        lo[j] = sub.iter().copied().fold(0.0, f32::min);
        hi[j] = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    }
    let mn_max = lo.iter().fold(0.0f64, |a, &l| a.max(-l as f64));
    let dmin = f16_ceil(mn_max / 63.0);
    let mut m = [0u8; 8];
    let mut dm = [0f32; 8];
    for j in 0..8 {
        if dmin.to_f32() > 0.0 {
            m[j] = (-lo[j] as f64 / dmin.to_f64()).ceil().min(63.0) as u8;
        }
        dm[j] = dmin.to_f32() * f32::from(m[j]); // exactly as the decoder computes it
    }
    let r: [f64; 8] = std::array::from_fn(|j| (hi[j] as f64 + dm[j] as f64) / levels as f64);
    let r_max = r.iter().copied().fold(0.0, f64::max);
    let d = f16_ceil(r_max / 63.0);
    let mut sc = [0u8; 8];
    let mut q = [0u8; 256];
    for j in 0..8 {
        if d.to_f32() > 0.0 {
            sc[j] = (r[j] / d.to_f64()).ceil().clamp(0.0, 63.0) as u8;
        }
        let ds = (d.to_f32() * f32::from(sc[j])) as f64;
        if ds > 0.0 {
            for l in 0..32 {
                let v = ((x[32 * j + l] as f64 + dm[j] as f64) / ds).round();
                q[32 * j + l] = v.clamp(0.0, levels as f64) as u8;
            }
        }
    }
    Encoded { d, dmin, sc, m, q }
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let e = encode(x, 15);
        put_f16(block, 0, e.d.to_f32());
        put_f16(block, 2, e.dmin.to_f32());
        block[4..16].copy_from_slice(&pack_scale_min(&e.sc, &e.m));
        let qs = &mut block[16..];
        for i in 0..4 {
            for l in 0..32 {
                qs[32 * i + l] = e.q[64 * i + l] | (e.q[64 * i + 32 + l] << 4);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_and_mins_pack_and_unpack() {
        let sc = [0, 1, 17, 63, 32, 48, 15, 62];
        let m = [63, 0, 5, 33, 16, 1, 63, 47];
        assert_eq!(scale_min(&pack_scale_min(&sc, &m)), (sc, m));
    }
}
