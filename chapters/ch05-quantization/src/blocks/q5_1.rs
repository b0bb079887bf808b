//! Q5_1: 32 weights share an f16 scale `d` and an f16 offset `m`; each weight is a 5-bit `q` in
//! 0..32, and `x = d · q + m`.
//!
//! ```text
//! bytes 0..2    d    f16 little-endian
//! bytes 2..4    m    f16 little-endian (the block's minimum)
//! bytes 4..8    qh   u32 little-endian: bit l is the fifth (high) bit of element l
//! bytes 8..24   qs   16 bytes: low 4 bits, laid out as Q5_0's (see [`super::q5_0`])
//! ```
//!
//! Round-to-nearest encoding, as llama.cpp's reference and gguf-py do it (bit for bit, tested):
//! `d = (max − min) / 31`, `id = 1 / d` (0 when `d = 0`), `q = min(31, trunc((x − min) · id + ½))`,
//! all in f32; `d` and `m = min` are then stored rounded to f16.

use super::q5_0::{encode_q5, q5};
use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 24;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 32;

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let (d, m) = (f16_at(block, 0), f16_at(block, 2));
        let qh = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
        for (l, o) in out.iter_mut().enumerate() {
            *o = d * f32::from(q5(qh, &block[8..], l)) + m;
        }
    }
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let min = x.iter().copied().fold(f32::INFINITY, f32::min);
        let d = (max - min) / 31.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        put_f16(block, 0, d);
        put_f16(block, 2, min);
        let q = |v: f32| (((v - min) * id + 0.5).trunc() as u8).min(31);
        encode_q5(block, 4, x, q);
    }
}
