//! The integer dot products in plain Rust: the reference for the AVX2 ones, and what runs on CPUs
//! without AVX2. Each returns exactly what its AVX2 twin returns (same integer sums, same f32
//! operations in the same order; the tests compare them for equality).

use super::{Act32, Act256, acc_d, acc_dm, acc_k};
use crate::blocks::f16_at;
use crate::blocks::q4_k::scale_min;
use crate::blocks::q6_k::q6;

/// `Σ_l u[l] · q[l]` over 32 pairs.
#[inline]
fn dot32(u: impl Iterator<Item = i32>, q: &[i8]) -> i32 {
    u.zip(q).map(|(u, &q)| u * i32::from(q)).sum()
}

/// One Q8_0 row (whole blocks) with one token's activation blocks.
pub fn dot_q8_0(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(34).zip(acts) {
        let s = dot32(b[2..].iter().map(|&w| i32::from(w as i8)), &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, s);
    }
    acc
}

/// The 32 nibbles of a Q4_0/Q4_1 block in element order: low nibbles, then high.
#[inline]
fn nibbles(qs: &[u8]) -> impl Iterator<Item = i32> + '_ {
    let lo = qs.iter().map(|&b| i32::from(b & 0x0F));
    let hi = qs.iter().map(|&b| i32::from(b >> 4));
    lo.chain(hi)
}

/// One Q4_0 row with one token's activation blocks: `Σ (q − 8)·x = Σ q·x − 8·Σ x`.
pub fn dot_q4_0(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(18).zip(acts) {
        let s = dot32(nibbles(&b[2..18]), &a.q) - 8 * a.sum;
        acc = acc_d(acc, f16_at(b, 0), a.d, s);
    }
    acc
}

/// One Q4_1 row with one token's activation blocks: `Σ (d·q + m)·x = d·Σ q·x + m·Σ x`.
pub fn dot_q4_1(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(20).zip(acts) {
        let s = dot32(nibbles(&b[4..20]), &a.q);
        acc = acc_dm(acc, f16_at(b, 0), f16_at(b, 2), a.d, s, a.sum);
    }
    acc
}

/// `Σ_j m[j] · (bsums[2j] + bsums[2j + 1])`: the mins' part of a Q4_K/Q5_K super-block.
#[inline]
pub(super) fn mins_dot(m: &[u8; 8], bsums: &[i16; 16]) -> i32 {
    (0..8)
        .map(|j| i32::from(m[j]) * (i32::from(bsums[2 * j]) + i32::from(bsums[2 * j + 1])))
        .sum()
}

/// One Q4_K row with one token's Q8_K activation blocks.
pub fn dot_q4_k(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(144).zip(acts) {
        let (sc, m) = scale_min(&b[4..16]);
        let qs = &b[16..144];
        let mut isum = 0i32;
        for j in 0..8 {
            let (bytes, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
            let u = bytes.iter().map(|&b| i32::from((b >> shift) & 0x0F));
            isum += i32::from(sc[j]) * dot32(u, &a.q[32 * j..32 * j + 32]);
        }
        let imin = mins_dot(&m, &a.bsums);
        acc = acc_k(acc, f16_at(b, 0), f16_at(b, 2), a.d, isum, imin);
    }
    acc
}

/// One Q5_K row with one token's Q8_K activation blocks.
pub fn dot_q5_k(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(176).zip(acts) {
        let (sc, m) = scale_min(&b[4..16]);
        let (qh, qs) = (&b[16..48], &b[48..176]);
        let mut isum = 0i32;
        for j in 0..8 {
            let (bytes, shift) = (&qs[32 * (j / 2)..][..32], 4 * (j % 2));
            let u = bytes
                .iter()
                .zip(qh)
                .map(|(&b, &h)| i32::from(((b >> shift) & 0x0F) | (((h >> j) & 1) << 4)));
            isum += i32::from(sc[j]) * dot32(u, &a.q[32 * j..32 * j + 32]);
        }
        let imin = mins_dot(&m, &a.bsums);
        acc = acc_k(acc, f16_at(b, 0), f16_at(b, 2), a.d, isum, imin);
    }
    acc
}

/// One Q6_K row with one token's Q8_K activation blocks: per sub-block of 16,
/// `sc · Σ (q − 32)·x = sc · (Σ q·x − 32·bsum)`.
pub fn dot_q6_k(row: &[u8], acts: &[Act256]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(210).zip(acts) {
        let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
        let mut isum = 0i32;
        for (j, (&sc, &bsum)) in scales.iter().zip(&a.bsums).enumerate() {
            let s: i32 = (0..16)
                .map(|l| i32::from(q6(ql, qh, 16 * j + l)) * i32::from(a.q[16 * j + l]))
                .sum();
            isum += i32::from(sc as i8) * (s - 32 * i32::from(bsum));
        }
        acc = acc_d(acc, f16_at(b, 208), a.d, isum);
    }
    acc
}
