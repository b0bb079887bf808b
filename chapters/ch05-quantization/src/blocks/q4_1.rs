//! Q4_1: 32 weights share an f16 scale `d` and an f16 offset `m`; each weight is a 4-bit `q` in
//! 0..16, and `x = d · q + m`.
//!
//! ```text
//! bytes 0..2    d    f16 little-endian
//! bytes 2..4    m    f16 little-endian (the block's minimum)
//! bytes 4..20   qs   16 bytes: byte j holds element j (low nibble) and element j + 16 (high)
//! ```
//!
//! Round-to-nearest encoding, as llama.cpp's reference and gguf-py do it (bit for bit, tested):
//! `d = (max − min) / 15`, `id = 1 / d` (0 when `d = 0`), `q = min(15, trunc((x − min) · id + ½))`,
//! all in f32; `d` and `m = min` are then stored rounded to f16.

use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 20;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 32;

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let (d, m) = (f16_at(block, 0), f16_at(block, 2));
        let (lo, hi) = out.split_at_mut(16);
        for ((&b, lo), hi) in block[4..].iter().zip(lo).zip(hi) {
            *lo = d * f32::from(b & 0x0F) + m;
            *hi = d * f32::from(b >> 4) + m;
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
        let d = (max - min) / 15.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        put_f16(block, 0, d);
        put_f16(block, 2, min);
        let q = |v: f32| (((v - min) * id + 0.5).trunc() as u8).min(15);
        for j in 0..16 {
            block[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
}
