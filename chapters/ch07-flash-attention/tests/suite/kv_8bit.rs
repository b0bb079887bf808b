//! Attention over chapter 5's 8-bit pools (FP8 E4M3 and int8 codes, one scale per position and
//! KV head), in both backends (chapter 4's batch attention, this chapter's flash attention) and
//! every instruction set:
//! - equals attention over an f32 pool holding the dequantized K/V (`code · scale`), to f32
//!   rounding: reading through the scales is the same arithmetic as dequantizing first;
//! - stays within a bound derived from the formats' rounding of attention over the original
//!   f32 K/V (see [`bound`]).

use crate::support;

use std::sync::atomic::{AtomicUsize, Ordering};

use ch01::attention::AttentionShape;
use ch01::testing::{assert_rel_close, seeded_runner};
use ch02::kernels::Isa;
use ch02::workload::WorkloadRng;
use ch03::{BlockManager, KvElement, KvPool};
use ch04::attention::{QueryRow, RowKernel, batch_attention, batch_attention_with};
use ch05::fp8::F8E4M3;
use ch05::kv_cache::{KvInt8, e4m3_error_bound};
use ch07_flash_attention::{LayerKv, Scratch, flash_attention_paged};
use ndarray::{Array1, Array2};
use proptest::prelude::*;
use support::{config, matrix, params, shape, values};

/// Relative L2 error allowed between two f32 computations of the same attention.
const F32_REL: f64 = 1e-5;

/// The largest error the 8-bit type `K` makes on element `x` of a head row whose largest
/// magnitude is `amax` (chapter 5's `kv_cache` module derives both).
fn element_bound<K: KvElement>(x: f32, amax: f32) -> f32 {
    match K::DTYPE {
        ch03::KvDtype::Int8 => KvInt8::error_bound(amax) * (1.0 + 1e-6),
        _ => e4m3_error_bound(x, amax),
    }
}

/// The bound on |o' − o| for query head `h` of one row, from per-element K/V errors:
/// each score moves by at most `Δ = ‖q_h‖₁ · max_i |Δk_ji| / √d`, so each softmax weight by a
/// factor within `e^{±2Δ}`, and `o' − o = Σ_j (p'_j − p_j) v_j + Σ_j p'_j (v'_j − v_j)` is at most
/// `(e^{2Δ} − 1) · max_j |v_j| + max_j |Δv_j|` in every coordinate.
fn bound<K: KvElement>(q_h: &[f32], k: &[&[f32]], v: &[&[f32]]) -> f32 {
    let d = q_h.len() as f32;
    let q1: f32 = q_h.iter().map(|x| x.abs()).sum();
    let worst = |rows: &[&[f32]]| {
        rows.iter()
            .map(|row| {
                let amax = row.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                row.iter()
                    .map(|&x| element_bound::<K>(x, amax))
                    .fold(0.0, f32::max)
            })
            .fold(0.0, f32::max)
    };
    let delta = q1 * worst(k) / d.sqrt();
    let v_max = v
        .iter()
        .flat_map(|row| row.iter())
        .fold(0.0f32, |m, x| m.max(x.abs()));
    (2.0 * delta).exp_m1() * v_max + worst(v)
}

/// Attention over an 8-bit pool of `K` against the dequantized and the original f32 pools.
///
/// `q_scale`: the queries' magnitude. The bound grows as `e^{2Δ}` with `Δ ∝ ‖q‖₁`, and once it
/// passes `2 · max|v|` it cannot fail (both outputs are weighted means of values that small);
/// so the queries are kept small enough for most bounds to say something, and the test asserts
/// that at least half of them did.
fn check_8bit<K: KvElement>(seed_base: u8, q_scale: f32) {
    let seq = (1usize..=120)
        .prop_flat_map(|len| (Just(len), prop_oneof![Just(1usize), 1usize..=len.min(40)]));
    let case = (
        shape(true),
        1usize..=17, // block size
        proptest::collection::vec(seq, 1..=3),
        params(),
        any::<u64>(),
    );
    let (checked, informative) = (AtomicUsize::new(0), AtomicUsize::new(0));
    seeded_runner(24, seed_base)
        .run(&case, |(shape, block_size, seqs, params, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let AttentionShape {
                num_heads,
                num_kv_heads,
                head_dim: d,
            } = shape;
            let (q_dim, kv_dim) = (num_heads * d, num_kv_heads * d);
            let num_blocks = 2 + seqs
                .iter()
                .map(|(l, _)| l.div_ceil(block_size))
                .sum::<usize>();
            let config = config(shape);
            let mut pool8 = KvPool::<K>::new(&config, block_size, num_blocks).unwrap();
            let mut original = KvPool::<f32>::new(&config, block_size, num_blocks).unwrap();
            let mut dequantized = KvPool::<f32>::new(&config, block_size, num_blocks).unwrap();
            let mut manager = BlockManager::new(num_blocks, block_size, false);
            let tables: Vec<_> = seqs
                .iter()
                .map(|&(len, _)| manager.allocate_prompt(&vec![0; len]).unwrap())
                .collect();
            // K/V rows whose heads differ in magnitude by up to 2⁶: each head gets its own scale.
            let mut kv = Vec::new();
            for (&(len, _), table) in seqs.iter().zip(&tables) {
                let head_gain = |rng: &mut WorkloadRng| -> Vec<f32> {
                    (0..num_kv_heads)
                        .map(|_| 2f32.powi((rng.uniform_open0() * 7.0) as i32 - 3))
                        .collect()
                };
                let (gain_k, gain_v) = (head_gain(&mut rng), head_gain(&mut rng));
                let mut k = matrix(&mut rng, len, kv_dim, 2.0);
                let mut v = matrix(&mut rng, len, kv_dim, 2.0);
                for (i, mut col) in k.columns_mut().into_iter().enumerate() {
                    col *= gain_k[i / d];
                }
                for (i, mut col) in v.columns_mut().into_iter().enumerate() {
                    col *= gain_v[i / d];
                }
                for pos in 0..len {
                    let slot = table.slot(pos);
                    pool8.write(0, slot, k.row(pos), v.row(pos));
                    original.write(0, slot, k.row(pos), v.row(pos));
                    let (codes_k, codes_v) = pool8.layer_kv(0);
                    let scales = pool8.layer_scales(0);
                    let deq = |codes: &[K], scale: &dyn Fn(usize) -> f32| -> Array1<f32> {
                        (0..kv_dim)
                            .map(|i| codes[slot * kv_dim + i].to_f32() * scale(i / d))
                            .collect()
                    };
                    let k_deq = deq(codes_k, &|h| scales.key(slot, h));
                    let v_deq = deq(codes_v, &|h| scales.value(slot, h));
                    dequantized.write(0, slot, k_deq.view(), v_deq.view());
                }
                kv.push((k, v));
            }
            let mut rows = Vec::new();
            let mut row_seq = Vec::new();
            for (s, (&(len, n), table)) in seqs.iter().zip(&tables).enumerate() {
                let blocks = table.blocks();
                rows.extend((len - n..len).map(|pos| QueryRow { blocks, pos }));
                row_seq.extend(std::iter::repeat_n(s, n));
            }
            let q = values(&mut rng, rows.len() * q_dim, q_scale);
            let mut expected_deq = vec![0.0; q.len()];
            batch_attention(
                Isa::Portable,
                &dequantized,
                0,
                &rows,
                &q,
                shape,
                &mut expected_deq,
            );
            let mut expected = vec![0.0; q.len()];
            batch_attention(Isa::Portable, &original, 0, &rows, &q, shape, &mut expected);

            let (codes_k, codes_v) = pool8.layer_kv(0);
            let layer = LayerKv {
                keys: codes_k,
                values: codes_v,
                scales: pool8.layer_scales(0),
                block_size,
                shape,
            };
            // Each of chapter 4's row kernels over the 8-bit pool; the AVX-512 rows fold the
            // scales into their weights as the AVX2 rows do, to the same bits.
            let per_kernel: Vec<Vec<f32>> = RowKernel::available()
                .into_iter()
                .map(|kernel| {
                    let mut out = vec![f32::NAN; q.len()];
                    batch_attention_with(kernel, &pool8, 0, &rows, &q, shape, &mut out);
                    let what = format!("{:?} {kernel:?} {shape:?} {seqs:?}", K::DTYPE);
                    assert_rel_close(&what, &out, &expected_deq, F32_REL);
                    out
                })
                .collect();
            if let [_, avx2, avx512] = &per_kernel[..] {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(avx512), bits(avx2));
            }
            let mut scratch = Scratch::new();
            for isa in Isa::available() {
                let what = format!(
                    "{:?} {isa:?} {shape:?} block {block_size} {seqs:?} {params:?}",
                    K::DTYPE
                );
                let mut naive = vec![f32::NAN; q.len()];
                batch_attention(isa, &pool8, 0, &rows, &q, shape, &mut naive);
                assert_rel_close(&format!("{what}, naive"), &naive, &expected_deq, F32_REL);
                let mut flash = vec![f32::NAN; q.len()];
                flash_attention_paged(isa, &layer, &rows, &q, &params, &mut scratch, &mut flash);
                assert_rel_close(&format!("{what}, flash"), &flash, &expected_deq, F32_REL);

                // Against the original K/V: within the derived bound, per row and head.
                for (r, row) in rows.iter().enumerate() {
                    let (k, v) = &kv[row_seq[r]];
                    for h in 0..num_heads {
                        let kv_head = h / (num_heads / num_kv_heads);
                        let cols = kv_head * d..(kv_head + 1) * d;
                        let head_rows = |m: &Array2<f32>| -> Vec<Vec<f32>> {
                            (0..=row.pos)
                                .map(|j| m.row(j).as_slice().unwrap()[cols.clone()].to_vec())
                                .collect()
                        };
                        let (k_h, v_h) = (head_rows(k), head_rows(v));
                        let k_refs: Vec<&[f32]> = k_h.iter().map(Vec::as_slice).collect();
                        let v_refs: Vec<&[f32]> = v_h.iter().map(Vec::as_slice).collect();
                        let q_h = &q[r * q_dim + h * d..][..d];
                        let allowed = bound::<K>(q_h, &k_refs, &v_refs);
                        let v_max = v_h.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
                        checked.fetch_add(1, Ordering::Relaxed);
                        if allowed < 2.0 * v_max {
                            informative.fetch_add(1, Ordering::Relaxed);
                        }
                        let at = r * q_dim + h * d;
                        for x in 0..d {
                            let (got, want) = (naive[at + x], expected[at + x]);
                            let slack = 1e-5 * (1.0 + want.abs());
                            prop_assert!(
                                (got - want).abs() <= allowed + slack,
                                "{what}: row {r} head {h} [{x}]: {got} vs {want}, bound {allowed}"
                            );
                        }
                    }
                }
            }
            Ok(())
        })
        .unwrap();
    let (checked, informative) = (checked.into_inner(), informative.into_inner());
    println!(
        "{:?}: {informative} of {checked} bounds below 2 · max|v|",
        K::DTYPE
    );
    assert!(2 * informative >= checked, "{informative} of {checked}");
}

#[test]
fn attention_over_an_int8_pool_is_attention_over_its_dequantized_values() {
    check_8bit::<KvInt8>(91, 2.0);
}

/// FP8 rounds each element by up to 1/16 of itself, where int8 rounds a head's largest by
/// 1/254 of it: smaller queries keep FP8's bound informative.
#[test]
fn attention_over_an_fp8_pool_is_attention_over_its_dequantized_values() {
    check_8bit::<F8E4M3>(92, 0.25);
}
