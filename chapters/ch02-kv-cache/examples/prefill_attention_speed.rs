//! Prefill attention's cost on SmolLM2-135M's shape (9 query heads sharing 3 KV heads of 64,
//! 30 layers): a prompt of `T` tokens against itself, causal, in every layer, each layer's K/V
//! in its own buffer. Prints ms per prompt and GFLOP/s of the causal part (`2 · 2 · d` FLOPs
//! per query head and visible position); the fastest of 20 runs.
//!
//! `cargo run --release -p ch02-kv-cache --example prefill_attention_speed [T...]`

use std::time::Instant;

use ch02_kv_cache::prefill_attention::prefill_attention;

mod support;

use support::{LAYERS, SHAPE, value};

fn main() {
    let lengths = support::lengths(&[128, 512]);
    let shape = SHAPE;
    let q_dim = shape.num_heads * shape.head_dim;
    println!("| T | ms per prompt | GFLOP/s (causal part) |");
    println!("|---:|---:|---:|");
    for t in lengths {
        let layers = support::layers(t);
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
