//! The integer dot products in plain Rust: the reference for the AVX2 ones, and what runs on CPUs
//! without AVX2. Each returns exactly what its AVX2 twin returns (same integer sums, same f32
//! operations in the same order; the tests compare them for equality).

use super::{Act32, Act256, acc_d, acc_k};
use crate::blocks::f16_at;
use crate::blocks::q4_k::scale_min;
use crate::blocks::q5_0::q5;
use crate::blocks::q6_k::q6;

/// `Σ_l u[l] · q[l]` over 32 pairs.
#[inline]
fn dot32(u: impl Iterator<Item = i32>, q: &[i8]) -> i32 {
    u.zip(q).map(|(u, &q)| u * i32::from(q)).sum()
}

/// `Σ_l w(l) · q[l]` over one 32-element block: an exact i32.
#[inline]
fn block32(w: impl Fn(usize) -> i32, q: &[i8; 32]) -> i32 {
    dot32((0..32).map(w), q)
}

/// The nibble of element `l` (0..32) of a Q4_0/Q4_1 block: low nibbles, then high.
#[inline]
fn nibble(qs: &[u8], l: usize) -> i32 {
    i32::from(if l < 16 {
        qs[l] & 0x0F
    } else {
        qs[l - 16] >> 4
    })
}

/// One Q8_0 row (whole blocks) with one token's activation blocks.
pub fn dot_q8_0(row: &[u8], acts: &[Act32]) -> f32 {
    // ANCHOR: task_5_2
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(34).zip(acts) {
        let isum = block32(|l| i32::from(b[2 + l] as i8), &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, isum);
    }
    acc
    // ANCHOR_END: task_5_2
}

/// One Q4_0 row with one token's activation blocks: `Σ (q − 8)·x`.
pub fn dot_q4_0(row: &[u8], acts: &[Act32]) -> f32 {
    // ANCHOR: task_5_2
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(18).zip(acts) {
        let isum = block32(|l| nibble(&b[2..18], l) - 8, &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, isum);
    }
    acc
    // ANCHOR_END: task_5_2
}

/// One Q4_1 row with one token's activation blocks: `Σ (d·q + m)·x = d·Σ q·x + m·Σ x`, the
/// offsets in their own accumulator.
pub fn dot_q4_1(row: &[u8], acts: &[Act32]) -> f32 {
    // ANCHOR: task_5_2
    let (mut acc, mut acc_m) = (0.0f32, 0.0f32);
    for (b, a) in row.chunks_exact(20).zip(acts) {
        let isum = block32(|l| nibble(&b[4..20], l), &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, isum);
        acc_m = acc_d(acc_m, f16_at(b, 2), a.d, a.sum);
    }
    acc + acc_m
    // ANCHOR_END: task_5_2
}

/// One row of `G` Q4_0 blocks per scale ([`super::QuantMatrix::grouped`]): each run of 32
/// weights takes [`dot_q4_0`]'s steps with its group's `d`, so the row equals `dot_q4_0` on the
/// same blocks stored ungrouped, bit for bit.
pub fn dot_q4_0_grouped(row: &[u8], acts: &[Act32], g: usize) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(2 + 16 * g).zip(acts.chunks_exact(g)) {
        for (qs, a) in b[2..].chunks_exact(16).zip(a) {
            let isum = block32(|l| nibble(qs, l) - 8, &a.q);
            acc = acc_d(acc, f16_at(b, 0), a.d, isum);
        }
    }
    acc
}

/// One row of `G` Q4_1 blocks per scale and offset; equals [`dot_q4_1`] on the ungrouped blocks.
pub fn dot_q4_1_grouped(row: &[u8], acts: &[Act32], g: usize) -> f32 {
    let (mut acc, mut acc_m) = (0.0f32, 0.0f32);
    for (b, a) in row.chunks_exact(4 + 16 * g).zip(acts.chunks_exact(g)) {
        for (qs, a) in b[4..].chunks_exact(16).zip(a) {
            let isum = block32(|l| nibble(qs, l), &a.q);
            acc = acc_d(acc, f16_at(b, 0), a.d, isum);
            acc_m = acc_d(acc_m, f16_at(b, 2), a.d, a.sum);
        }
    }
    acc + acc_m
}

/// The little-endian u32 at `b[at..at + 4]` (a Q5 block's high bits).
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// One Q5_0 row with one token's activation blocks: `Σ (q − 16)·x`.
pub fn dot_q5_0(row: &[u8], acts: &[Act32]) -> f32 {
    let mut acc = 0.0f32;
    for (b, a) in row.chunks_exact(22).zip(acts) {
        let qh = u32_at(b, 2);
        let isum = block32(|l| i32::from(q5(qh, &b[6..22], l)) - 16, &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, isum);
    }
    acc
}

/// One Q5_1 row with one token's activation blocks: `d·Σ q·x + m·Σ x`, as Q4_1.
pub fn dot_q5_1(row: &[u8], acts: &[Act32]) -> f32 {
    let (mut acc, mut acc_m) = (0.0f32, 0.0f32);
    for (b, a) in row.chunks_exact(24).zip(acts) {
        let qh = u32_at(b, 4);
        let isum = block32(|l| i32::from(q5(qh, &b[8..24], l)), &a.q);
        acc = acc_d(acc, f16_at(b, 0), a.d, isum);
        acc_m = acc_d(acc_m, f16_at(b, 2), a.d, a.sum);
    }
    acc + acc_m
}

/// `Σ_j m[j] · (bsums[2j] + bsums[2j + 1])`: the mins' part of a Q4_K/Q5_K super-block.
#[inline(always)]
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
