//! The batched paged attention kernel against chapter 1's naive causal attention, per sequence
//! (1 to 40 positions, some 60 to 150):
//! random head counts (GQA groups of 1 to 5), even head sizes 2 to 20 (mostly not multiples of
//! the 8-lane vectors) and the 64 and 128 of the AVX2 path's own loops, block sizes 1 to 17,
//! batches mixing prefill chunks and decodes, physical blocks scattered by earlier allocations,
//! in every row kernel this CPU runs; with an f32 pool, and with a bf16 pool against the
//! naive attention of the bf16-rounded K/V. On a CPU with AVX-512, its rows equal the AVX2
//! rows bit for bit.

use std::path::Path;

use ch01::LlamaConfig;
use ch01::attention::{AttentionShape, causal_attention};
use ch01::testing::{assert_rel_close, seeded_runner};
use ch02::workload::WorkloadRng;
use ch03::{BlockManager, KvPool};
use ch04_continuous_batching::attention::{QueryRow, RowKernel, batch_attention_with};
use half::bf16;
use ndarray::{Array2, ArrayView2};
use proptest::prelude::*;

/// Shape, block size, and per sequence (context length, query rows at its end).
type Case = (AttentionShape, usize, Vec<(usize, usize)>, Vec<usize>, u64);

fn case() -> impl Strategy<Value = Case> {
    // Half the head size: 2 to 20 (mostly not multiples of the 8-lane vectors), or the 64 and
    // 128 that have their own AVX2 loops.
    let half_dim = prop_oneof![3 => 1usize..=10, 1 => Just(32usize), 1 => Just(64usize)];
    // Groups of up to 5 query heads: the AVX-512 rows take them in batches of at most 4 (2 for
    // the outputs at d = 128), so 5 leaves a short batch.
    (1usize..=3, 1usize..=5, half_dim, 1usize..=17).prop_flat_map(
        |(num_kv_heads, group, half_dim, block_size)| {
            // Mostly short sequences; some longer than a span of the values' pass (64).
            let len = prop_oneof![3 => 1usize..=40, 1 => 60usize..=150];
            let seq = len.prop_flat_map(|len| (Just(len), 1usize..=len.min(9)));
            (
                Just(AttentionShape {
                    num_heads: num_kv_heads * group,
                    num_kv_heads,
                    head_dim: 2 * half_dim, // RoPE needs it even
                }),
                Just(block_size),
                proptest::collection::vec(seq, 1..=5),
                proptest::collection::vec(1usize..30, 0..4), // earlier sequences, freed
                any::<u64>(),
            )
        },
    )
}

fn config(shape: AttentionShape) -> LlamaConfig {
    let json = format!(
        r#"{{"model_type": "llama", "vocab_size": 8, "hidden_size": {hidden},
            "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": {heads},
            "num_key_value_heads": {kv_heads}, "head_dim": {d}, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0}}"#,
        hidden = shape.num_heads * shape.head_dim,
        heads = shape.num_heads,
        kv_heads = shape.num_kv_heads,
        d = shape.head_dim,
    );
    LlamaConfig::from_json(&json, Path::new("test/config.json")).unwrap()
}

/// `len` values in (−2, 2] from chapter 2's seeded generator.
fn values(rng: &mut WorkloadRng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| rng.uniform_open0() as f32 * 4.0 - 2.0)
        .collect()
}

#[test]
fn batch_attention_equals_naive_attention_per_sequence() {
    seeded_runner(64, 41)
        .run(&case(), |(shape, block_size, seqs, earlier, seed)| {
            let mut rng = WorkloadRng::new(seed);
            let (q_dim, kv_dim) = (
                shape.num_heads * shape.head_dim,
                shape.num_kv_heads * shape.head_dim,
            );
            let num_blocks = 8 + earlier
                .iter()
                .chain(seqs.iter().map(|(l, _)| l))
                .sum::<usize>();
            let mut pool = KvPool::<f32>::new(&config(shape), block_size, num_blocks).unwrap();
            let mut pool_bf16 =
                KvPool::<bf16>::new(&config(shape), block_size, num_blocks).unwrap();
            let mut manager = BlockManager::new(num_blocks, block_size, false);
            // Scatter the free list, then give every sequence its blocks.
            let held: Vec<_> = earlier
                .iter()
                .map(|&len| manager.allocate_prompt(&vec![0; len]).unwrap())
                .collect();
            let tables: Vec<_> = seqs
                .iter()
                .map(|&(len, _)| manager.allocate_prompt(&vec![0; len]).unwrap())
                .collect();
            held.into_iter().for_each(|t| manager.free(t));

            // Every sequence's K/V [len, kv_dim] in layer 1 (layer 0 holds other values).
            let mut kv = Vec::new();
            for (&(len, _), table) in seqs.iter().zip(&tables) {
                let k =
                    Array2::from_shape_vec((len, kv_dim), values(&mut rng, len * kv_dim)).unwrap();
                let v =
                    Array2::from_shape_vec((len, kv_dim), values(&mut rng, len * kv_dim)).unwrap();
                for pos in 0..len {
                    let slot = table.slot(pos);
                    pool.write(1, slot, k.row(pos), v.row(pos));
                    pool_bf16.write(1, slot, k.row(pos), v.row(pos));
                    let noise = values(&mut rng, kv_dim);
                    let noise = ArrayView2::from_shape((1, kv_dim), &noise).unwrap();
                    pool.write(0, slot, noise.row(0), noise.row(0));
                    pool_bf16.write(0, slot, noise.row(0), noise.row(0));
                }
                kv.push((k, v));
            }

            // The batch: each sequence's last `rows` positions, flattened.
            let mut rows = Vec::new();
            for (&(len, n), table) in seqs.iter().zip(&tables) {
                let blocks = table.blocks();
                rows.extend((len - n..len).map(|pos| QueryRow { blocks, pos }));
            }
            let q = values(&mut rng, rows.len() * q_dim);
            // The oracle per sequence, on K/V as given and as a bf16 pool rounds them.
            let round = |a: &Array2<f32>| a.mapv(|x| bf16::from_f32(x).to_f32());
            let (mut expected, mut expected_bf16) = (Vec::new(), Vec::new());
            let mut first = 0;
            for (&(_, n), (k, v)) in seqs.iter().zip(&kv) {
                let q_seq =
                    ArrayView2::from_shape((n, q_dim), &q[first * q_dim..][..n * q_dim]).unwrap();
                let out = causal_attention(q_seq, k.view(), v.view(), shape); // [n, q_dim]
                expected.extend(out.iter().copied());
                let out = causal_attention(q_seq, round(k).view(), round(v).view(), shape);
                expected_bf16.extend(out.iter().copied());
                first += n;
            }
            let mut outputs = Vec::new(); // (kernel, f32 pool's, bf16 pool's)
            for kernel in RowKernel::available() {
                let mut out = vec![f32::NAN; rows.len() * q_dim];
                batch_attention_with(kernel, &pool, 1, &rows, &q, shape, &mut out);
                assert_rel_close(&format!("{kernel:?}"), &out, &expected, 1e-5);
                let mut out_bf16 = vec![f32::NAN; rows.len() * q_dim];
                batch_attention_with(kernel, &pool_bf16, 1, &rows, &q, shape, &mut out_bf16);
                let name = format!("{kernel:?}, bf16");
                assert_rel_close(&name, &out_bf16, &expected_bf16, 1e-5);
                // What storing K/V in bf16 costs: 8 bits of mantissa, about 2⁻⁹ relative per
                // element, which attention averages rather than accumulates.
                assert_rel_close(&format!("{name} vs f32"), &out_bf16, &expected, 1e-2);
                outputs.push((kernel, out, out_bf16));
            }
            // The AVX-512 rows repeat the AVX2 rows' arithmetic in the same order: equal bits.
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = outputs
                    .iter()
                    .find(|o| matches!(o.0, RowKernel::Avx2Fma(_)));
                let avx512 = outputs
                    .iter()
                    .find(|o| matches!(o.0, RowKernel::Avx512(..)));
                if let (Some(avx2), Some(avx512)) = (avx2, avx512) {
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    prop_assert_eq!(bits(&avx512.1), bits(&avx2.1), "f32 pool");
                    prop_assert_eq!(bits(&avx512.2), bits(&avx2.2), "bf16 pool");
                }
            }
            Ok(())
        })
        .unwrap();
}
