//! Prefill attention's cost on SmolLM2-135M's shape (9 query heads sharing 3 KV heads of 64,
//! 30 layers): a prompt of `T` tokens against itself, causal, in every layer, each layer's K/V
//! in its own buffer. Prints ms per prompt and GFLOP/s of the causal part (`2 · 2 · d` FLOPs
//! per query head and visible position); the fastest of 20 runs.
//!
//! `cargo run --release -p ch02-kv-cache --example prefill_attention_speed [T...]`

use std::time::Instant;

use ch01::attention::AttentionShape;
use ch02_kv_cache::prefill_attention::prefill_attention;

const LAYERS: usize = 30;

fn main() {
    let lengths: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let lengths = if lengths.is_empty() {
        vec![128, 512]
    } else {
        lengths
    };
    let shape = AttentionShape {
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
    };
    let (q_dim, kv_dim) = (9 * 64, 3 * 64);
    let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0;
    println!("| T | ms per prompt | GFLOP/s (causal part) |");
    println!("|---:|---:|---:|");
    for t in lengths {
        let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..LAYERS)
            .map(|l| {
                let kv = |o: usize| (0..t * kv_dim).map(|i| value(i + o)).collect();
                (kv(l * 7), kv(l * 11 + 3))
            })
            .collect();
        let q: Vec<f32> = (0..t * q_dim).map(|i| value(i * 3) * 4.0).collect();
        let mut out = vec![0.0; t * q_dim];
        let mut best = f64::INFINITY;
        for _ in 0..20 {
            let start = Instant::now();
            for (k, v) in &layers {
                prefill_attention(&q, k, v, &|pos| pos, t, shape, &mut out);
            }
            best = best.min(start.elapsed().as_secs_f64());
        }
        let flops = (LAYERS * shape.num_heads * t * (t + 1) / 2 * 4 * shape.head_dim) as f64;
        println!("| {t} | {:.2} | {:.1} |", best * 1e3, flops / best / 1e9);
    }
}
