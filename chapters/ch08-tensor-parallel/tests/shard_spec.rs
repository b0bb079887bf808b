//! What a shard spec means, checked by computing with it: a column split's rank outputs
//! concatenate to the whole product and a row split's sum to it, on random shapes and worlds;
//! and every rank's KV heads are the ones its query heads read, split or replicated.

use ch01::testing::seeded_config;
use ch01::{ShardError, ShardSpec, TensorParallel};
use proptest::prelude::*;

/// `y[t, o] = Σ_{k in cols} x[t, k] · w[o, k]` for `o in rows`: [tokens, rows.len()].
fn product(
    x: &[f32],
    w: &[f32],
    in_features: usize,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> Vec<f32> {
    let tokens = x.len() / in_features;
    let mut y = Vec::with_capacity(tokens * rows.len());
    for t in 0..tokens {
        for o in rows.clone() {
            let dot: f32 = cols
                .clone()
                .map(|k| x[t * in_features + k] * w[o * in_features + k])
                .sum();
            y.push(dot);
        }
    }
    y
}

/// `n` values drawn from `seed` in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

proptest! {
    #![proptest_config(seeded_config(64, 84))]

    /// W [out, in] split among `world` ranks: by column, rank r's output features concatenate
    /// (in rank order) to x Wᵀ, bit for bit; by row, the ranks' partial products over their
    /// input features sum to x Wᵀ. Sizes are `world` times odd-ish numbers, never tile-sized.
    #[test]
    fn column_shards_concatenate_and_row_shards_sum_to_the_whole_product(
        world in 1usize..=4, out_per in 1usize..=7, in_per in 1usize..=9,
        tokens in 1usize..=3, seed in any::<u64>(),
    ) {
        let (out_f, in_f) = (world * out_per, world * in_per);
        let x = values(tokens * in_f, seed); // [tokens, in]
        let w = values(out_f * in_f, seed ^ 1); // [out, in]
        let whole = product(&x, &w, in_f, 0..out_f, 0..in_f); // [tokens, out]

        let mut concatenated = vec![0.0f32; tokens * out_f];
        let mut summed = vec![0.0f32; tokens * out_f];
        for rank in 0..world {
            let (rows, cols) = ShardSpec::column(rank, world).ranges("w", in_f, out_f).unwrap();
            prop_assert_eq!((rows.len(), cols.clone()), (out_per, 0..in_f));
            let part = product(&x, &w, in_f, rows.clone(), cols); // [tokens, out / world]
            for t in 0..tokens {
                concatenated[t * out_f + rows.start..t * out_f + rows.end]
                    .copy_from_slice(&part[t * out_per..(t + 1) * out_per]);
            }

            let (rows, cols) = ShardSpec::row(rank, world).ranges("w", in_f, out_f).unwrap();
            prop_assert_eq!((rows.clone(), cols.len()), (0..out_f, in_per));
            let partial = product(&x, &w, in_f, rows, cols); // [tokens, out]
            for (s, p) in summed.iter_mut().zip(&partial) {
                *s += p;
            }
        }
        prop_assert_eq!(&concatenated, &whole);
        for (s, y) in summed.iter().zip(&whole) {
            prop_assert!((s - y).abs() <= 1e-5 * (1.0 + y.abs()), "{s} vs {y}");
        }
        let (rows, cols) = ShardSpec::whole().ranges("w", in_f, out_f).unwrap();
        prop_assert_eq!((rows, cols), (0..out_f, 0..in_f));

        // A split dimension the world does not divide, and a rank outside the world: errors
        // that say which.
        if world > 1 {
            let error = ShardSpec::column(0, world).ranges("w", in_f, out_f + 1).unwrap_err();
            prop_assert_eq!(error, ShardError::NotDivisible {
                what: "out_features of `w`".into(), size: out_f + 1, world,
            });
            let error = ShardSpec::row(0, world).ranges("w", in_f + 1, out_f).unwrap_err();
            prop_assert_eq!(error, ShardError::NotDivisible {
                what: "in_features of `w`".into(), size: in_f + 1, world,
            });
        }
        let error = ShardSpec::column(world, world).ranges("w", in_f, out_f).unwrap_err();
        prop_assert_eq!(error, ShardError::RankOutOfRange { rank: world, world });
        let error = ShardSpec::row(0, 0).ranges("w", in_f, out_f).unwrap_err();
        prop_assert_eq!(error, ShardError::EmptyWorld);
    }

    /// Query heads split by column; rank r's KV spec must hold exactly the KV heads its query
    /// heads read (query head h reads KV head h / (heads / kv_heads)), and, locally, its i-th
    /// query head must read its (i / local group)-th KV head, as the attention kernels assume.
    #[test]
    fn each_rank_holds_the_kv_heads_its_query_heads_read(
        kv_heads in 1usize..=4, group in 1usize..=4, world_exp in 0u32..=3,
    ) {
        let heads = kv_heads * group;
        let world = 1usize << world_exp;
        let fits = heads.is_multiple_of(world)
            && (kv_heads.is_multiple_of(world) || world.is_multiple_of(kv_heads));
        for rank in 0..world {
            let tp = TensorParallel { rank, world };
            let spec = tp.kv_spec(kv_heads);
            if !fits {
                if !kv_heads.is_multiple_of(world) && !world.is_multiple_of(kv_heads) {
                    prop_assert_eq!(spec, Err(ShardError::KvHeads { num_kv_heads: kv_heads, world }));
                }
                continue;
            }
            let spec = spec.unwrap();
            let outside = TensorParallel { rank: world, world }.kv_spec(kv_heads);
            prop_assert_eq!(outside, Err(ShardError::RankOutOfRange { rank: world, world }));
            let (q, _) = ShardSpec::column(rank, world).ranges("q_proj", 1, heads).unwrap();
            let (kv, _) = spec.ranges("k_proj", 1, kv_heads).unwrap();
            let local_group = q.len() / kv.len();
            prop_assert_eq!(local_group * kv.len(), q.len(), "whole groups on every rank");
            for (i, h) in q.clone().enumerate() {
                let reads = h / group;
                prop_assert!(kv.contains(&reads), "rank {rank}: head {h} reads KV head {reads}, not in {kv:?}");
                prop_assert_eq!(kv.start + i / local_group, reads);
            }
        }
    }
}
