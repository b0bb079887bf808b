//! Q8_K: llama.cpp's 8-bit super-block, used for **activations** in the K-quant dot products
//! (never for stored weights). 256 values share one f32 scale `d`; each is a signed byte `q`, and
//! `x = d · q`; the sums of each 16 consecutive `q` are kept, so a dot product with a format that
//! has per-sub-block offsets (Q4_K's mins, Q6_K's −32) needs no second pass over the values.
//!
//! ```text
//! bytes 0..4       d       f32 little-endian
//! bytes 4..260     qs      256 × i8
//! bytes 260..292   bsums   16 × i16 little-endian, bsums[g] = Σ qs[16g..16g+16]
//! ```
//!
//! **Encoding** (symmetric, the rule of Q8_0 with an f32 scale; llama.cpp instead maps the value
//! of largest magnitude to −128): `d = max|x| / 127` (never below f32's smallest normal; NaN
//! when a value is NaN, every `q` then 0), `id = 1 / d` (0 when `d = 0`),
//! `q = round(x · id)` (halves away from zero). So `|x − d·q| ≤ d·(½ + 2⁻¹⁵)`: `x · id` is within
//! three f32 roundings (of `d`, `id` and the product) of `x / d`, whose magnitude is at most 127,
//! and 127 · 3 · 2⁻²⁴ < 2⁻¹⁵.

/// Bytes of one block.
pub const BLOCK_BYTES: usize = 292;
/// Values of one block.
pub const BLOCK_ELEMS: usize = 256;

/// Encodes 256 values: returns `d` and fills `q` `[256]` and `bsums` `[16]`.
#[inline]
pub fn encode(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    // NaN for a block holding a NaN, so that the NaN reaches the outputs it touches.
    let d = crate::kernels::act_scale(crate::kernels::act_amax(x));
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (q, &x) in q.iter_mut().zip(x) {
        // (The clamp changes nothing but a scale too small to invert, whose `id` is ∞.)
        *q = (x * id).clamp(-127.0, 127.0).round() as i8;
    }
    for (s, q) in bsums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&q| i16::from(q)).sum();
    }
    d
}

/// `bytes`: whole blocks; `out`: `BLOCK_ELEMS` values per block (the caller checked the lengths).
pub fn dequantize(bytes: &[u8], out: &mut [f32]) {
    for (block, out) in bytes
        .chunks_exact(BLOCK_BYTES)
        .zip(out.chunks_exact_mut(BLOCK_ELEMS))
    {
        let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
        for (o, &q) in out.iter_mut().zip(&block[4..260]) {
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
        let (mut q, mut bsums) = ([0i8; 256], [0i16; 16]);
        let d = encode(x, &mut q, &mut bsums);
        block[..4].copy_from_slice(&d.to_le_bytes());
        for (b, q) in block[4..260].iter_mut().zip(q) {
            *b = q as u8;
        }
        for (b, s) in block[260..].chunks_exact_mut(2).zip(bsums) {
            b.copy_from_slice(&s.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block whose largest magnitude is near 1e-38 (where `max / 127` is too small to
    /// invert): the scale stops at f32's smallest normal, and every code keeps the bound
    /// `|x − d·q| ≤ d·(½ + 2⁻¹⁵)`.
    #[test]
    fn a_scale_too_small_to_invert_keeps_the_bound() {
        let mut x = [0.0f32; BLOCK_ELEMS];
        x[0] = -1e-38;
        x[1] = 5e-39;
        x[2] = 1.17e-38;
        let (mut q, mut bsums) = ([0i8; BLOCK_ELEMS], [0i16; 16]);
        let d = encode(&x, &mut q, &mut bsums);
        assert_eq!(d, f32::MIN_POSITIVE);
        for (&x, &q) in x.iter().zip(&q) {
            let err = (f64::from(x) - f64::from(d) * f64::from(q)).abs();
            assert!(err <= f64::from(d) * (0.5 + 2f64.powi(-15)), "{x:e} as {q}");
        }
        assert_eq!(&q[..3], &[-1, 0, 1]);
    }
}
