//! Small loops over f32 slices, written without branches or library calls so that the compiler
//! vectorises them (8 lanes wide inside an `avx2,fma` function): a dot product and `y += a·x`
//! (also eight rows at a time), a fast `exp`, a softmax, and the MLP's `silu(gate) · up`.
//!
//! `f32::exp` is a call into the C library per element, ~20 cycles; the step's softmaxes and
//! SiLUs make millions of them. [`exp`] is the textbook range reduction with a polynomial, a
//! handful of vector instructions per 8 elements, within 3 ulp of `f32::exp` over the range
//! attention and SiLU use (the tests check).

/// A number the loops read as f32: f32 itself, or a narrower storage type (a bf16 KV cache)
/// widened exactly as it is read.
pub trait ToF32: Copy {
    fn to_f32(self) -> f32;
}

impl ToF32 for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl ToF32 for half::bf16 {
    /// The top 16 bits of an f32: one shift, which the compiler vectorises (no NaN branch).
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

/// How many positions ahead of the group they compute the decode-attention loops ask for K/V
/// rows ([`prefetch_l2`]): four groups of [`KEYS`].
pub const PREFETCH_POSITIONS: usize = 4 * KEYS;

/// Bytes of a cache line (x86-64 and most CPUs).
pub const CACHE_LINE: usize = 64;

/// Asks the memory system to bring the cache lines of `data` into this core's L2 cache, one
/// request per [`CACHE_LINE`] bytes from its start (so all of them where `data` starts on a
/// line; a last line holding only its end is not asked for otherwise): a hint that changes no
/// result (and does nothing off x86-64).
///
/// Decode attention finds its K/V in memory, not in cache (the weights streamed since evict
/// them), and a group of eight K rows is lines at a stride of a whole row, a pattern the
/// hardware's prefetchers run ahead of poorly: asked for some groups ahead, the rows arrive
/// while the groups before them compute. Into L2 rather than L1: requests for L1 hold its few
/// miss buffers, and measured they gained nothing.
#[inline(always)]
pub fn prefetch_l2<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        let start = data.as_ptr() as *const i8;
        // A counted loop over the lines rather than `step_by`, whose set-up showed in the
        // profiles of attention, which asks for a few lines at a time.
        for line in 0..size_of_val(data).div_ceil(CACHE_LINE) {
            // SAFETY: `start + line · CACHE_LINE` is inside `data` (line < ⌈size / line size⌉);
            // a prefetch neither faults nor writes.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(start.add(line * CACHE_LINE)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// `Σ a[i] · b[i]` with 8 independent partial sums, which the compiler keeps in one vector;
/// `b` is widened to f32 as it is read.
#[inline(always)]
pub fn dot<B: ToF32>(a: &[f32], b: &[B]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (a8, b8) in a_chunks.zip(b_chunks) {
        for l in 0..LANES {
            acc[l] += a8[l] * b8[l].to_f32();
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y[i] += a · x[i]`, `x` widened to f32 as it is read.
#[inline(always)]
pub fn axpy<X: ToF32>(a: f32, x: &[X], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x.to_f32());
}

/// Keys [`dot8`] scores together, rows [`axpy8`] adds together.
pub const KEYS: usize = 8;

/// `s[p] = q · k[p]` for eight keys of `q.len()` elements each (widened to f32 as they are
/// read), with the arithmetic of [`dot`] for each key: eight accumulators of eight
/// lanes, one per key, so the eight dot products advance together instead of each waiting on
/// its own additions.
#[inline(always)]
pub fn dot8<K: ToF32>(q: &[f32], k: &[&[K]; KEYS]) -> [f32; KEYS] {
    const LANES: usize = 8;
    let (q8, q_tail) = q.as_chunks::<LANES>();
    let k8: [&[[K; LANES]]; KEYS] = std::array::from_fn(|p| k[p].as_chunks::<LANES>().0);
    let mut acc = [[0.0f32; LANES]; KEYS];
    for (c, q8) in q8.iter().enumerate() {
        for p in 0..KEYS {
            let k8 = &k8[p][c];
            for l in 0..LANES {
                acc[p][l] += q8[l] * k8[l].to_f32();
            }
        }
    }
    let mut s = [0.0; KEYS];
    for p in 0..KEYS {
        let tail = &k[p][q8.len() * LANES..];
        let tail: f32 = q_tail.iter().zip(tail).map(|(a, b)| a * b.to_f32()).sum();
        s[p] = acc[p].iter().sum::<f32>() + tail;
    }
    s
}

/// `o += Σ_p w[p] · v[p]`, for eight rows `v[p]` of `o.len()` elements, each element's additions
/// in [`axpy`]'s order, row after row: each 8-lane part of
/// `o` is loaded once, takes its eight products in a register, and is stored once.
#[inline(always)]
pub fn axpy8<V: ToF32>(w: &[f32; KEYS], v: &[&[V]; KEYS], o: &mut [f32]) {
    const LANES: usize = 8;
    let v8: [&[[V; LANES]]; KEYS] = std::array::from_fn(|p| v[p].as_chunks::<LANES>().0);
    let (o8, o_tail) = o.as_chunks_mut::<LANES>();
    for (c, o8) in o8.iter_mut().enumerate() {
        let mut acc = *o8;
        for p in 0..KEYS {
            let v8 = &v8[p][c];
            for l in 0..LANES {
                acc[l] += w[p] * v8[l].to_f32();
            }
        }
        *o8 = acc;
    }
    let body = o8.len() * LANES;
    for (i, o) in o_tail.iter_mut().enumerate() {
        for p in 0..KEYS {
            *o += w[p] * v[p][body + i].to_f32();
        }
    }
}

/// The largest element (−∞ for an empty slice), 8 running maxima at a time.
#[inline(always)]
pub fn max(x: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    acc.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

// ANCHOR: exp
/// e^x, within 3 ulp of `f32::exp` for x in [−87, 88]; inputs outside are clamped there (so
/// e^−∞ is about 1e−38, not 0, which no softmax or SiLU can tell apart). NaN stays NaN.
///
/// e^x = 2^n · e^r with n = round(x · log₂e) and r = x − n·ln2 in [−ln2/2, ln2/2]; e^r is its
/// Taylor series to r⁶ (the next term is below 2⁻²³), 2^n is built in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75; // ln 2 split in two so that n · LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to the nearest integer
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND; // 1.5 · 2^23 + n, exactly
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // n in [−126, 127] (so 2^n is normal) is also the low bits of `shifted`: integer steps on
    // its bits build 2^n, where `n as i32` would not vectorise (its saturation is per lane).
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    p * two_n
}
// ANCHOR_END: exp

/// `x[i] = e^(x[i] − shift)`; returns their sum (a softmax's numerator and denominator).
#[inline(always)]
pub fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    exp_scaled_shifted_sum(x, 1.0, shift)
}

/// `x[i] = e^(scale · x[i] − shift)`, the product rounded before the subtraction (exactly as
/// scaling `x` first, then [`exp_shifted_sum`]); returns their sum, added in the same order:
/// 8 running sums, each over every eighth element in turn, then the tail. Two groups of 8 per
/// iteration, so that two chains of [`exp`] are in flight at once.
#[inline(always)]
pub fn exp_scaled_shifted_sum(x: &mut [f32], scale: f32, shift: f32) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0.0f32; LANES];
    let mut pairs = x.chunks_exact_mut(2 * LANES);
    for c in &mut pairs {
        c.iter_mut().for_each(|v| *v = exp(*v * scale - shift));
        let (first, second) = c.split_at(LANES);
        for l in 0..LANES {
            acc[l] += first[l];
        }
        for l in 0..LANES {
            acc[l] += second[l];
        }
    }
    let mut chunks = pairs.into_remainder().chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = exp(c[l] * scale - shift);
            acc[l] += c[l];
        }
    }
    let mut tail = 0.0;
    for v in chunks.into_remainder() {
        *v = exp(*v * scale - shift);
        tail += *v;
    }
    acc.iter().sum::<f32>() + tail
}

/// `x = softmax(x)`: the row less its maximum through [`exp`], then times the reciprocal of
/// the sum (chapter 1's `softmax_in_place`, to a few ulp).
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let sum = exp_shifted_sum(x, max(x));
    normalize(x, sum);
}

/// `x = x / sum`, as a multiplication by the reciprocal.
#[inline(always)]
fn normalize(x: &mut [f32], sum: f32) {
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `x = softmax(scale · x)` for `scale > 0` (panics otherwise), the same bits as scaling `x` and
/// then [`softmax`], in one pass fewer: rounding keeps order, so the largest of the rounded
/// products `scale · x[i]` is the rounded product of `scale` and the largest `x[i]`, and the
/// products are formed inside the exponential's pass instead of written back first.
#[inline(always)]
pub fn scaled_softmax(x: &mut [f32], scale: f32) {
    assert!(
        scale > 0.0,
        "the scale is positive (else the largest product is not the largest x's)"
    );
    let sum = exp_scaled_shifted_sum(x, scale, max(x) * scale);
    normalize(x, sum);
}

/// [`scaled_softmax`] compiled for AVX-512F (16 lanes of [`exp`] at a time), or else for AVX2 +
/// FMA, when the CPU has them: the same bits, the lanes being independent and the sums kept in
/// the order the code names.
pub fn scaled_softmax_fastest(x: &mut [f32], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if super::Avx512::cached().is_some() {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn avx512(x: &mut [f32], scale: f32) {
            scaled_softmax(x, scale)
        }
        // SAFETY: an `Avx512` proof exists only once run-time detection found AVX-512F, AVX2
        // and FMA on this CPU; `avx512` is safe Rust otherwise.
        return unsafe { avx512(x, scale) };
    }
    #[cfg(target_arch = "x86_64")]
    if let super::Isa::Avx2Fma(_) = super::Isa::detect() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(x: &mut [f32], scale: f32) {
            scaled_softmax(x, scale)
        }
        // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA on
        // this CPU; `avx2` is safe Rust otherwise.
        return unsafe { avx2(x, scale) };
    }
    scaled_softmax(x, scale)
}

/// `gate[i] = silu(gate[i]) · up[i]`, the MLP's activation, with silu(x) = x / (1 + e^−x).
#[inline(always)]
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    gate.iter_mut()
        .zip(up)
        .for_each(|(g, u)| *g = *g / (1.0 + exp(-*g)) * u);
}

/// [`silu_mul`] compiled for AVX2 + FMA when the CPU has them.
pub fn silu_mul_fastest(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if let super::Isa::Avx2Fma(_) = super::Isa::detect() {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(gate: &mut [f32], up: &[f32]) {
            silu_mul(gate, up)
        }
        // SAFETY: an `Isa::Avx2Fma` exists only once run-time detection found AVX2 and FMA on
        // this CPU; `avx2` is safe Rust otherwise.
        return unsafe { avx2(gate, up) };
    }
    silu_mul(gate, up)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite positive f32.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_three_ulp_of_the_library() {
        let mut worst = (0, 0.0f32);
        let steps = 2_000_000;
        for i in 0..=steps {
            let x = -87.0 + 175.0 * i as f32 / steps as f32;
            let d = ulps(exp(x), x.exp());
            if d > worst.0 {
                worst = (d, x);
            }
        }
        assert!(worst.0 <= 3, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn exp_clamps_and_keeps_nan() {
        assert!(exp(f32::NEG_INFINITY) > 0.0 && exp(f32::NEG_INFINITY) < 1e-37);
        assert!(exp(f32::INFINITY).is_finite() && exp(f32::INFINITY) > 1e38);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
    }

    /// The fused pass against what it replaces, scaling the row first, and compiled for this
    /// CPU's widest vectors against plain: the same bits, on rows of every remainder modulo 16
    /// and with −∞, ties and signed zeros.
    #[test]
    fn scaled_softmax_equals_scaling_then_softmax_bit_for_bit() {
        for len in 1usize..70 {
            for scale in [0.125f32, 1.0 / 8f32.sqrt(), 3.7] {
                let x: Vec<f32> = (0..len)
                    .map(|i| match i % 9 {
                        0 => f32::NEG_INFINITY,
                        1 => -0.0,
                        2 => 0.0,
                        _ => ((i * 7919 % 23) as f32 - 11.0) * 1.37,
                    })
                    .collect();
                let mut fused = x.clone();
                scaled_softmax(&mut fused, scale);
                let mut fastest = x.clone();
                scaled_softmax_fastest(&mut fastest, scale);
                assert!(
                    fused
                        .iter()
                        .zip(&fastest)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "compiled for this CPU: len {len}, scale {scale}"
                );
                // Scaled and written back, the maximum, the exponentials, their sum in 8
                // running sums and a tail, then times the sum's reciprocal: one step at a time.
                let scaled: Vec<f32> = x.iter().map(|v| v * scale).collect();
                let m = scaled.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let e: Vec<f32> = scaled.iter().map(|v| exp(v - m)).collect();
                let whole = len / 8 * 8;
                let mut acc = [0.0f32; 8];
                e[..whole]
                    .iter()
                    .enumerate()
                    .for_each(|(i, v)| acc[i % 8] += v);
                let tail = e[whole..].iter().fold(0.0f32, |t, v| t + v);
                let inv = 1.0 / (acc.iter().sum::<f32>() + tail);
                let reference: Vec<f32> = e.iter().map(|v| v * inv).collect();
                assert!(
                    fused
                        .iter()
                        .zip(&reference)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "len {len}, scale {scale}"
                );
            }
        }
    }

    #[test]
    fn reductions_match_plain_loops() {
        for len in [0usize, 1, 7, 8, 9, 31, 64, 65] {
            let x: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let y: Vec<f32> = (0..len)
                .map(|i| ((i * 13 % 7) as f32 - 3.0) / 2.0)
                .collect();
            let plain_dot: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
            assert!((dot(&x, &y) - plain_dot).abs() <= 1e-5 * (1.0 + plain_dot.abs()));
            let plain_max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&x), plain_max);

            let mut e = x.clone();
            let sum = exp_shifted_sum(&mut e, 1.5);
            let plain: Vec<f32> = x.iter().map(|v| (v - 1.5).exp()).collect();
            for (a, b) in e.iter().zip(&plain) {
                assert!((a - b).abs() <= 1e-6 * b);
            }
            let plain_sum: f32 = plain.iter().sum();
            assert!((sum - plain_sum).abs() <= 1e-5 * plain_sum.max(1.0));

            let mut g = x.clone();
            silu_mul_fastest(&mut g, &y);
            for ((g, x), y) in g.iter().zip(&x).zip(&y) {
                let expected = x / (1.0 + (-x).exp()) * y;
                assert!((g - expected).abs() <= 1e-6 * (1.0 + expected.abs()));
            }

            let mut acc = y.clone();
            axpy(0.5, &x, &mut acc);
            for ((a, x), y) in acc.iter().zip(&x).zip(&y) {
                assert_eq!(*a, y + 0.5 * x);
            }
        }
    }
}
