//! Q5_K: llama.cpp's 5-bit K-quant: Q4_K's super-block (256 weights, 8 sub-blocks of 32 with
//! 6-bit scales and mins under f16 `d` and `dmin`) plus one high bit per weight, so `q` is in
//! 0..32 and `x = (d · sc[j]) · q − dmin · m[j]`.
//!
//! ```text
//! bytes 0..2      d       f16
//! bytes 2..4      dmin    f16
//! bytes 4..16     scales  12 bytes, packed as Q4_K's
//! bytes 16..48    qh      32 bytes: bit j of byte l is bit 4 of element l of sub-block j
//! bytes 48..176   qs      128 bytes: the low 4 bits, laid out as Q4_K's qs
//! ```
//!
//! **Encoding**: Q4_K's covering rule (see [`super::q4_k`]) with 31 steps instead of 15, so a
//! value decodes within `((hi_j − lo_j + dmin) / 31 + d) / 2` of itself.

use super::q4_k::{encode, pack_scale_min, scale_min};
use super::{f16_at, put_f16};

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 176;
/// Weights of one block.
pub const BLOCK_ELEMS: usize = 256;

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
        let (sc, m) = scale_min(&block[4..16]);
        let (qh, qs) = (&block[16..48], &block[48..]);
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let ds = d * f32::from(sc[j]);
            let dm = dmin * f32::from(m[j]);
            let (low, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
            for ((o, &b), &h) in out.iter_mut().zip(low).zip(qh) {
                let q = ((b >> shift) & 0x0F) | (((h >> j) & 1) << 4);
                *o = ds * f32::from(q) - dm;
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
        let e = encode(x, 31);
        put_f16(block, 0, e.d.to_f32());
        put_f16(block, 2, e.dmin.to_f32());
        block[4..16].copy_from_slice(&pack_scale_min(&e.sc, &e.m));
        let (qh, qs) = block[16..].split_at_mut(32);
        qh.fill(0);
        for (j, sub) in e.q.chunks_exact(32).enumerate() {
            for (h, &q) in qh.iter_mut().zip(sub) {
                *h |= ((q >> 4) & 1) << j;
            }
        }
        for i in 0..4 {
            for l in 0..32 {
                qs[32 * i + l] = (e.q[64 * i + l] & 0x0F) | ((e.q[64 * i + 32 + l] & 0x0F) << 4);
            }
        }
    }
}
