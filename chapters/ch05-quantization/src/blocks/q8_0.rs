//! Q8_0: 32 weights share one f16 scale `d`; each weight is a signed byte `q`, and `x = d · q`.
//!
//! ```text
//! bytes 0..2   d   f16 little-endian
//! bytes 2..34  q   32 × i8
//! ```
//!
//! Round-to-nearest encoding, as llama.cpp's reference and gguf-py do it (bit for bit, tested):
//! `d = max|x| / 127` in f32, `id = 1 / d` (0 when `d = 0`), `q = round(x · id)` with halves
//! away from zero; `d` is then stored rounded to f16. The values are quantized with the f32 `d`,
//! so a block decodes to within `|d₁₆ − d|·127 + d/2` of its input.

use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 34;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 32;

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let d = f16_at(block, 0);
        for (o, &q) in out.iter_mut().zip(&block[2..]) {
            *o = d * f32::from(q as i8);
        }
    }
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        put_f16(block, 0, d);
        for (q, &x) in block[2..].iter_mut().zip(x) {
            // `round` is half away from zero, like llama.cpp's `roundf`; `as` saturates.
            *q = (x * id).round() as i8 as u8;
        }
    }
}
