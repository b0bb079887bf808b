//! Q5_0: 32 weights share one f16 scale `d`; each weight is a 5-bit `q` in 0..32, and
//! `x = d · (q − 16)`.
//!
//! ```text
//! bytes 0..2    d    f16 little-endian
//! bytes 2..6    qh   u32 little-endian: bit l is the fifth (high) bit of element l
//! bytes 6..22   qs   16 bytes: byte j holds the low 4 bits of element j (low nibble) and of
//!                    element j + 16 (high nibble), as Q4_0 does
//! ```
//!
//! Round-to-nearest encoding, as llama.cpp's reference and gguf-py do it (bit for bit, tested):
//! the element of largest magnitude `max` (the first one on a tie, with its sign) sets
//! `d = max / −16`, so it encodes as `q = 0` exactly; with `id = 1 / d` (0 when `d = 0`) every
//! element is `q = min(31, trunc(x · id + 16.5))`.

use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 22;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 32;

/// The 5-bit `q` (0..32) of element `l` (0..32) of a Q5_0/Q5_1 block, from its `qh` (as a
/// little-endian u32) and its 16 bytes of nibbles `qs`.
#[inline(always)]
pub fn q5(qh: u32, qs: &[u8], l: usize) -> u8 {
    let low = if l < 16 {
        qs[l] & 0x0F
    } else {
        qs[l - 16] >> 4
    };
    low | ((((qh >> l) & 1) as u8) << 4)
}

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let d = f16_at(block, 0);
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        for (l, o) in out.iter_mut().enumerate() {
            *o = d * f32::from(q5(qh, &block[6..], l) as i8 - 16);
        }
    }
}

/// `values`: `BLOCK_ELEMS` per block; `out`: whole blocks (the caller checked the lengths).
pub fn quantize(values: &[f32], out: &mut [u8]) {
    for (x, block) in values
        .chunks_exact(BLOCK_ELEMS)
        .zip(out.chunks_exact_mut(BLOCK_BYTES))
    {
        // The first element of largest magnitude, with its sign.
        let max = x
            .iter()
            .fold(x[0], |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = max / -16.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        put_f16(block, 0, d);
        let q = |v: f32| ((v * id + 16.5).trunc() as u8).min(31);
        encode_q5(block, 2, x, q);
    }
}

/// Stores the 5-bit codes `q(x[l])` as `qh` (4 bytes at `at`) and the nibbles after it.
#[inline]
pub(crate) fn encode_q5(block: &mut [u8], at: usize, x: &[f32], q: impl Fn(f32) -> u8) {
    let mut qh = 0u32;
    for j in 0..16 {
        let (lo, hi) = (q(x[j]), q(x[j + 16]));
        qh |= u32::from(lo >> 4) << j | u32::from(hi >> 4) << (j + 16);
        block[at + 4 + j] = (lo & 0x0F) | (hi << 4);
    }
    block[at..at + 4].copy_from_slice(&qh.to_le_bytes());
}
