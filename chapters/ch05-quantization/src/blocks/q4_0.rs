//! Q4_0: 32 weights share one f16 scale `d`; each weight is a 4-bit `q` in 0..16, and
//! `x = d · (q − 8)`.
//!
//! ```text
//! bytes 0..2    d    f16 little-endian
//! bytes 2..18   qs   16 bytes: byte j holds element j (low nibble) and element j + 16 (high)
//! ```
//!
//! Round-to-nearest encoding, as llama.cpp's reference and gguf-py do it (bit for bit, tested):
//! the element of largest magnitude `max` (the first one on a tie, with its sign) sets
//! `d = max / −8`, so it encodes as `q = 0` exactly; with `id = 1 / d` (0 when `d = 0`) every
//! element is `q = min(15, trunc(x · id + 8.5))`. The scale's sign carries the extreme
//! value's, so one side of the block gets 8 steps and the other 7.

use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 18;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 32;

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    // ANCHOR: task_5_1
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let d = f16_at(block, 0);
        let (lo, hi) = out.split_at_mut(16);
        for ((&b, lo), hi) in block[2..].iter().zip(lo).zip(hi) {
            *lo = d * f32::from((b & 0x0F) as i8 - 8);
            *hi = d * f32::from((b >> 4) as i8 - 8);
        }
    }
    // ANCHOR_END: task_5_1
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    // ANCHOR: task_5_1
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        // The first element of largest magnitude, with its sign.
        let max = x
            .iter()
            .fold(x[0], |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -8.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        put_f16(block, 0, d);
        let q = |v: f32| ((v * id + 8.5).trunc() as u8).min(15);
        for j in 0..16 {
            block[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
    // ANCHOR_END: task_5_1
}
