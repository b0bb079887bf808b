//! Flash attention equals chapter 1's naive attention: dense and paged, prefill chunks and
//! split-K decodes, on random shapes (lengths that are not multiples of any tile, head dims
//! 24, 64 and 128 beside small odd ones, GQA groups 1 to 4), random tile sizes and partition
//! counts, random block tables, f32 and bf16 pools, in every instruction set this CPU runs (and,
//! with AVX-512, the prefill tasks' AVX2 and AVX-512 compilations equal bit for bit).

mod support;

use ch01::attention::{AttentionShape, causal_attention};
use ch01::testing::{assert_rel_close, seeded_runner};
use ch02::kernels::{Avx512, Isa};
use ch02::workload::WorkloadRng;
use ch03::{BlockManager, KvPool, KvScales};
use ch04::attention::QueryRow;
use ch07_flash_attention::{
    FlashParams, LayerKv, Partitions, Scratch, TileSizes, flash_attention_paged,
    flash_attention_with, naive_attention, set_prefill_avx512,
};
use half::bf16;
use ndarray::{Array2, ArrayView2};
use proptest::prelude::*;
use support::{config, matrix, params, shape, values};

/// Relative L2 error allowed against the oracle in f32 (as chapter 4's kernels are held to).
const F32_REL: f64 = 1e-5;

#[test]
fn dense_flash_equals_naive_attention() {
    // (shape, T_k, T_q ≤ T_k: a chunk that starts at T_k − T_q > 0 unless T_q = T_k, params)
    let case = (shape(false), 1usize..=300, params(), any::<u64>()).prop_flat_map(
        |(shape, t_k, params, seed)| (Just(shape), Just(t_k), 1..=t_k, Just(params), Just(seed)),
    );
    seeded_runner(48, 71)
        .run(&case, |(shape, t_k, t_q, params, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let (q_dim, kv_dim) = (
                shape.num_heads * shape.head_dim,
                shape.num_kv_heads * shape.head_dim,
            );
            let q = matrix(&mut rng, t_q, q_dim, 2.0);
            let k = matrix(&mut rng, t_k, kv_dim, 2.0);
            let v = matrix(&mut rng, t_k, kv_dim, 2.0);
            let expected = naive_attention(q.view(), k.view(), v.view(), shape).unwrap();
            for isa in Isa::available() {
                let out = flash_attention_with(isa, &params, q.view(), k.view(), v.view(), shape)
                    .unwrap();
                assert_rel_close(
                    &format!("{isa:?} {shape:?} T_k {t_k} T_q {t_q} {params:?}"),
                    out.as_slice().unwrap(),
                    expected.as_slice().unwrap(),
                    F32_REL,
                );
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn paged_flash_equals_naive_attention_per_sequence() {
    // Per sequence: (context length, query rows at its end); 1 row is a split-K decode.
    let seq = (1usize..=200)
        .prop_flat_map(|len| (Just(len), prop_oneof![Just(1usize), 1usize..=len.min(70)]));
    let case = (
        shape(true),
        1usize..=17, // block size
        proptest::collection::vec(seq, 1..=4),
        proptest::collection::vec(1usize..60, 0..4), // earlier sequences, freed: scattered blocks
        params(),
        any::<u64>(),
    );
    seeded_runner(40, 72)
        .run(&case, |(shape, block_size, seqs, earlier, params, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let (q_dim, kv_dim) = (
                shape.num_heads * shape.head_dim,
                shape.num_kv_heads * shape.head_dim,
            );
            let num_blocks = 4 + earlier
                .iter()
                .chain(seqs.iter().map(|(l, _)| l))
                .map(|l| l.div_ceil(block_size))
                .sum::<usize>();
            let config = config(shape);
            let mut pool = KvPool::<f32>::new(&config, block_size, num_blocks).unwrap();
            let mut pool_bf16 = KvPool::<bf16>::new(&config, block_size, num_blocks).unwrap();
            let mut manager = BlockManager::new(num_blocks, block_size, false);
            let held: Vec<_> = earlier
                .iter()
                .map(|&len| manager.allocate_prompt(&vec![0; len]).unwrap())
                .collect();
            let tables: Vec<_> = seqs
                .iter()
                .map(|&(len, _)| manager.allocate_prompt(&vec![0; len]).unwrap())
                .collect();
            held.into_iter().for_each(|t| manager.free(t));

            let mut kv = Vec::new();
            for (&(len, _), table) in seqs.iter().zip(&tables) {
                let k = matrix(&mut rng, len, kv_dim, 2.0);
                let v = matrix(&mut rng, len, kv_dim, 2.0);
                for pos in 0..len {
                    pool.write(0, table.slot(pos), k.row(pos), v.row(pos));
                    pool_bf16.write(0, table.slot(pos), k.row(pos), v.row(pos));
                }
                kv.push((k, v));
            }
            let mut rows = Vec::new();
            for (&(len, n), table) in seqs.iter().zip(&tables) {
                let blocks = table.blocks();
                rows.extend((len - n..len).map(|pos| QueryRow { blocks, pos }));
            }
            let q = values(&mut rng, rows.len() * q_dim, 2.0);
            let round = |a: &Array2<f32>| a.mapv(|x| bf16::from_f32(x).to_f32());
            let (mut expected, mut expected_bf16) = (Vec::new(), Vec::new());
            let mut first = 0;
            for (&(_, n), (k, v)) in seqs.iter().zip(&kv) {
                let q_seq =
                    ArrayView2::from_shape((n, q_dim), &q[first * q_dim..][..n * q_dim]).unwrap();
                expected.extend(causal_attention(q_seq, k.view(), v.view(), shape));
                expected_bf16.extend(causal_attention(
                    q_seq,
                    round(k).view(),
                    round(v).view(),
                    shape,
                ));
                first += n;
            }
            let mut scratch = Scratch::new();
            for isa in Isa::available() {
                let what = format!("{isa:?} {shape:?} block {block_size} {seqs:?} {params:?}");
                let mut out = vec![f32::NAN; rows.len() * q_dim];
                let (keys, values) = pool.layer_kv(0);
                let layer = LayerKv {
                    keys,
                    values,
                    scales: KvScales::NONE,
                    block_size,
                    shape,
                };
                flash_attention_paged(isa, &layer, &rows, &q, &params, &mut scratch, &mut out);
                assert_rel_close(&what, &out, &expected, F32_REL);
                same_bits_in_avx2(isa, &what, &layer, &rows, &q, &params, &mut scratch, &out);
                // The same scratch again, on the bf16 pool: buffers kept from a step are reused.
                out.fill(f32::NAN);
                let (keys, values) = pool_bf16.layer_kv(0);
                let layer = LayerKv {
                    keys,
                    values,
                    scales: KvScales::NONE,
                    block_size,
                    shape,
                };
                flash_attention_paged(isa, &layer, &rows, &q, &params, &mut scratch, &mut out);
                assert_rel_close(&format!("{what}, bf16"), &out, &expected_bf16, F32_REL);
                let what = format!("{what}, bf16");
                same_bits_in_avx2(isa, &what, &layer, &rows, &q, &params, &mut scratch, &out);
            }
            Ok(())
        })
        .unwrap();
}

/// On a CPU with AVX-512 and `isa` = AVX2: the prefill tasks' AVX2 compilation gives `out`'s
/// bits, which their AVX-512 compilation gave. (The switch is back on when this returns or
/// panics; a test running meanwhile gets one compilation or the other, the same bits.)
#[allow(clippy::too_many_arguments)]
fn same_bits_in_avx2<K: ch03::KvElement>(
    isa: Isa,
    what: &str,
    layer: &LayerKv<K>,
    rows: &[QueryRow],
    q: &[f32],
    params: &FlashParams,
    scratch: &mut Scratch,
    out: &[f32],
) {
    if !matches!(isa, Isa::Avx2Fma(_)) || Avx512::cached().is_none() {
        return;
    }
    struct BackOn;
    impl Drop for BackOn {
        fn drop(&mut self) {
            set_prefill_avx512(true);
        }
    }
    let _back_on = BackOn;
    set_prefill_avx512(false);
    let mut avx2 = vec![f32::NAN; out.len()];
    flash_attention_paged(isa, layer, rows, q, params, scratch, &mut avx2);
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&avx2), bits(out), "{what}: AVX2 against AVX-512");
}

#[test]
fn split_k_decode_equals_naive_with_any_partition_count() {
    let case = (
        shape(false),
        1usize..=700,
        1usize..=64,
        1usize..=16,
        any::<u64>(),
    );
    seeded_runner(48, 73)
        .run(&case, |(shape, len, parts, block_size, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let (q_dim, kv_dim) = (
                shape.num_heads * shape.head_dim,
                shape.num_kv_heads * shape.head_dim,
            );
            let k = matrix(&mut rng, len, kv_dim, 2.0);
            let v = matrix(&mut rng, len, kv_dim, 2.0);
            let q = matrix(&mut rng, 1, q_dim, 2.0);
            let expected = causal_attention(q.view(), k.view(), v.view(), shape);
            // A block table in reverse order: position p in block (n − 1 − p / block_size).
            let num_blocks = len.div_ceil(block_size);
            let blocks: Vec<u32> = (0..num_blocks as u32).rev().collect();
            let (mut keys, mut vals) = (
                vec![0.0; num_blocks * block_size * kv_dim],
                vec![0.0; num_blocks * block_size * kv_dim],
            );
            for pos in 0..len {
                let slot = blocks[pos / block_size] as usize * block_size + pos % block_size;
                keys[slot * kv_dim..][..kv_dim].copy_from_slice(k.row(pos).as_slice().unwrap());
                vals[slot * kv_dim..][..kv_dim].copy_from_slice(v.row(pos).as_slice().unwrap());
            }
            let layer = LayerKv {
                keys: &keys,
                values: &vals,
                scales: KvScales::NONE,
                block_size,
                shape,
            };
            let rows = [QueryRow {
                blocks: &blocks,
                pos: len - 1,
            }];
            let params = FlashParams {
                partitions: Partitions::fixed(parts).unwrap(),
                ..FlashParams::default()
            };
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; q_dim];
                flash_attention_paged(
                    isa,
                    &layer,
                    &rows,
                    q.as_slice().unwrap(),
                    &params,
                    &mut Scratch::new(),
                    &mut out,
                );
                assert_rel_close(
                    &format!("{isa:?} {shape:?} len {len} parts {parts}"),
                    &out,
                    expected.as_slice().unwrap(),
                    F32_REL,
                );
            }
            Ok(())
        })
        .unwrap();
}

/// Scores of magnitude 10⁴: e^(10⁴) overflows f32 (so does the sum of a softmax taken without
/// subtracting a maximum), yet the running maximum keeps every exponent ≤ 0. Checked against
/// an f64 softmax, which is exact enough here.
#[test]
fn stable_where_a_softmax_without_the_running_max_would_overflow() {
    assert!(10_000f32.exp().is_infinite());
    let shape = AttentionShape {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 24,
    };
    let (t, d) = (150, shape.head_dim);
    let mut rng = WorkloadRng::new(5);
    // Elements in ±100: scores q · k / √24 of a few thousand, the largest beyond 10⁴.
    let q = matrix(&mut rng, t, shape.num_heads * d, 100.0);
    let k = matrix(&mut rng, t, d, 100.0);
    let v = matrix(&mut rng, t, d, 1.0);
    let mut largest = 0.0f32;
    let mut expected = vec![0.0f32; t * shape.num_heads * d];
    for i in 0..t {
        for h in 0..shape.num_heads {
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    (0..d)
                        .map(|x| q[[i, h * d + x]] as f64 * k[[j, x]] as f64)
                        .sum::<f64>()
                        / (d as f64).sqrt()
                })
                .collect();
            largest = largest.max(s.iter().fold(0.0f64, |m, x| m.max(x.abs())) as f32);
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for x in 0..d {
                let o: f64 = w
                    .iter()
                    .enumerate()
                    .map(|(j, w)| w * v[[j, x]] as f64)
                    .sum();
                expected[i * shape.num_heads * d + h * d + x] = (o / sum) as f32;
            }
        }
    }
    assert!(largest > 1e4, "the test's scores reach only {largest}");
    for parts in [1, 3] {
        let params = FlashParams {
            tiles: TileSizes::new(7, 13).unwrap(),
            partitions: Partitions::fixed(parts).unwrap(),
        };
        for isa in Isa::available() {
            let out =
                flash_attention_with(isa, &params, q.view(), k.view(), v.view(), shape).unwrap();
            assert!(out.iter().all(|x| x.is_finite()));
            // An f32 score of 10⁴ is only known to about 10⁻³ absolute, which moves each
            // weight by about 10⁻³ of itself: 10⁻³ relative, not 10⁻⁵.
            assert_rel_close(
                &format!("{isa:?}"),
                out.as_slice().unwrap(),
                &expected,
                1e-3,
            );
            // Decode rows (split-K) over the same keys.
            let last = q.slice(ndarray::s![t - 1..t, ..]);
            let out = flash_attention_with(isa, &params, last, k.view(), v.view(), shape).unwrap();
            let row = &expected[(t - 1) * shape.num_heads * d..];
            assert!(out.iter().all(|x| x.is_finite()));
            assert_rel_close(
                &format!("{isa:?} decode"),
                out.as_slice().unwrap(),
                row,
                1e-3,
            );
        }
    }
}

#[test]
fn bad_shapes_and_parameters_are_errors() {
    let shape = AttentionShape {
        num_heads: 3,
        num_kv_heads: 2,
        head_dim: 4,
    };
    let a = Array2::<f32>::zeros((2, 12));
    let kv = Array2::<f32>::zeros((2, 8));
    assert!(naive_attention(a.view(), kv.view(), kv.view(), shape).is_err());
    let shape = AttentionShape {
        num_kv_heads: 1,
        ..shape
    };
    let k = Array2::<f32>::zeros((1, 4));
    let err = ch07_flash_attention::flash_attention(a.view(), k.view(), k.view(), shape);
    assert!(matches!(
        err,
        Err(ch07_flash_attention::ShapeError::MoreQueriesThanKeys { t_q: 2, t_k: 1 })
    ));
    assert!(TileSizes::new(0, 4).is_err() && Partitions::fixed(0).is_err());
}

/// Tile sizes and partition counts far beyond a step's rows and context change nothing (a query
/// tile past the rows, a K/V tile past the context, partitions past the keys are padding and
/// empty pieces), and must not size the scratch: it once grew with them, not with the step.
#[test]
fn oversized_tiles_and_partitions_use_only_what_the_step_needs() {
    let shape = AttentionShape {
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 8,
    };
    let (q_dim, kv_dim, block_size) = (16, 8, 8);
    let mut rng = WorkloadRng::new(9);
    // Sequence A in block 1: a chunk at positions 4..=6 of 7; sequence B in block 0: a decode
    // at position 4.
    let (keys, vals) = (
        values(&mut rng, 2 * block_size * kv_dim, 2.0),
        values(&mut rng, 2 * block_size * kv_dim, 2.0),
    );
    let (table_a, table_b) = ([1u32], [0u32]);
    let mut rows: Vec<QueryRow> = (4..7)
        .map(|pos| QueryRow {
            blocks: &table_a,
            pos,
        })
        .collect();
    rows.push(QueryRow {
        blocks: &table_b,
        pos: 4,
    });
    let q = values(&mut rng, rows.len() * q_dim, 2.0);
    let layer = LayerKv {
        keys: &keys,
        values: &vals,
        scales: KvScales::NONE,
        block_size,
        shape,
    };
    let slots = |block: usize, len: usize| {
        let rows = |x: &[f32]| {
            Array2::from_shape_vec(
                (len, kv_dim),
                x[block * block_size * kv_dim..][..len * kv_dim].to_vec(),
            )
            .unwrap()
        };
        (rows(&keys), rows(&vals))
    };
    let (k_a, v_a) = slots(1, 7);
    let (k_b, v_b) = slots(0, 5);
    let mut expected = Vec::new();
    let q_a = ArrayView2::from_shape((3, q_dim), &q[..3 * q_dim]).unwrap();
    expected.extend(causal_attention(q_a, k_a.view(), v_a.view(), shape));
    let q_b = ArrayView2::from_shape((1, q_dim), &q[3 * q_dim..]).unwrap();
    expected.extend(causal_attention(q_b, k_b.view(), v_b.view(), shape));

    let huge = FlashParams {
        tiles: TileSizes::new(1 << 11, 1 << 11).unwrap(),
        partitions: Partitions::fixed(1 << 12).unwrap(),
    };
    // What they come to here: every row in one query tile, every key in one K/V tile, one key
    // per partition.
    let fitted = FlashParams {
        tiles: TileSizes::new(rows.len(), 7).unwrap(),
        partitions: Partitions::fixed(5).unwrap(),
    };
    for isa in Isa::available() {
        let mut scratch = Scratch::new();
        let mut out = vec![f32::NAN; rows.len() * q_dim];
        flash_attention_paged(isa, &layer, &rows, &q, &huge, &mut scratch, &mut out);
        assert_rel_close(&format!("{isa:?} huge"), &out, &expected, F32_REL);
        assert!(
            scratch.bytes() < 16 << 10,
            "{isa:?}: {} bytes of scratch for 4 rows of 7 keys",
            scratch.bytes()
        );
        let mut fitted_out = vec![f32::NAN; rows.len() * q_dim];
        flash_attention_paged(
            isa,
            &layer,
            &rows,
            &q,
            &fitted,
            &mut Scratch::new(),
            &mut fitted_out,
        );
        assert_eq!(
            out, fitted_out,
            "{isa:?}: oversized parameters changed the result"
        );
    }
}
