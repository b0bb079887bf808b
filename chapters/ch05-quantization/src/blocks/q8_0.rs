//! Q8_0: 32 weights share one f16 scale `d`; each weight is a signed byte `q`, and `x = d · q`.
//!
//! ```text
//! bytes 0..2   d   f16 little-endian
//! bytes 2..34  q   32 × i8
//! ```

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
        let d = half::f16::from_le_bytes([block[0], block[1]]).to_f32();
        for (o, &q) in out.iter_mut().zip(&block[2..]) {
            *o = d * f32::from(q as i8);
        }
    }
}
