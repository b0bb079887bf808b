//! Populating memory changes no value: `memory::populate` on a filled buffer, and a
//! `ContiguousKvCache` populated halfway through a sequence, which then attends exactly as an
//! unpopulated one.

use ch01::testing::seeded_runner;
use ch01::{LlamaConfig, fixtures_dir};
use ch02_kv_cache::memory::populate;
use ch02_kv_cache::{ContiguousKvCache, KvStore};
use ndarray::Array2;
use proptest::prelude::*;

#[test]
fn populate_keeps_every_value() {
    seeded_runner(16, 7)
        .run(
            &proptest::collection::vec(any::<f32>(), 0..100_000),
            |values| {
                let buffer = values.clone();
                let done = populate(&buffer);
                prop_assert!(done || !cfg!(target_os = "linux") || buffer.is_empty());
                prop_assert_eq!(
                    buffer.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    values.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
                Ok(())
            },
        )
        .unwrap();
}

#[test]
fn a_populated_cache_attends_as_a_lazy_one() {
    let config = LlamaConfig::from_dir(&fixtures_dir().join("shakespeare-tiny")).unwrap();
    let shape = config.attention_shape();
    let kv_dim = config.num_key_value_heads * config.head_dim;
    let q_dim = shape.num_heads * shape.head_dim;
    let rows = |n: usize, width: usize, seed: usize| {
        Array2::from_shape_fn((n, width), |(i, j)| {
            (((i * 31 + j * 17 + seed) % 97) as f32 - 48.0) / 50.0
        })
    };
    let (capacity, first, second) = (300, 37, 5);
    let mut lazy = ContiguousKvCache::new(&config, capacity);
    let mut backed = ContiguousKvCache::new(&config, capacity);
    for (start, n) in [(0, first), (first, second)] {
        for cache in [&mut lazy, &mut backed] {
            let (k, v) = (rows(n, kv_dim, start), rows(n, kv_dim, start + 1));
            cache.write(0, start, k.view(), v.view()).unwrap();
            cache.commit(start + n);
        }
        backed.populate(); // after the first writes: they must survive
    }
    let q = rows(second, q_dim, 3);
    let mut outs = [
        Array2::zeros((second, q_dim)),
        Array2::zeros((second, q_dim)),
    ];
    for (cache, out) in [&mut lazy, &mut backed].into_iter().zip(&mut outs) {
        cache.attend(0, q.view(), first + second, shape, out.view_mut());
    }
    assert_eq!(outs[0], outs[1]);
    assert!(
        outs[0].iter().any(|&x| x != 0.0),
        "the attention read the writes"
    );
}
