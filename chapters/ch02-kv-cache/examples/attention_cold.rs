//! Decode attention as a model runs it: the keys and values come from memory, not from cache.
//! One query row against `T` cached positions in each of SmolLM2-135M's 30 layers, and before
//! each layer's attention an 8 MiB read that pushes the K/V out of the caches (what the layer's
//! weights do in a model; that read is not timed). Each layer reads the next 8 MiB of a 256 MiB
//! buffer, as each layer of a model reads its own weights: between a layer's attention at one
//! token and at the next, 240 MiB pass, far more than the last-level cache holds, so its K/V come
//! from memory. (Re-reading one 8 MiB buffer, as this example first did, leaves every layer's
//! K/V and that buffer together inside a 32 MiB L3, and measured attention from L3.) Prints
//! the median and the fastest of `ROUNDS` tokens: µs per token and the K/V GB/s.
//!
//! `cargo run --release -p ch02-kv-cache --example attention_cold [T...]`

use std::time::Instant;

use ch02_kv_cache::attention::scratch_len;
use ch02_kv_cache::decode_attention::{Stored, decode_attention};
use ch02_kv_cache::kernels::Isa;
use rayon::prelude::*;

mod support;

use support::{LAYERS, SHAPE, value};

/// Tokens timed per context length.
const ROUNDS: usize = 40;
/// Bytes read between two layers' attention: far more than the L2 caches hold.
const EVICT_BYTES: usize = 8 << 20;
/// The buffer those reads walk through, a window of [`EVICT_BYTES`] per layer: far more than
/// the last-level cache holds.
const EVICT_BUFFER_BYTES: usize = 256 << 20;

fn main() {
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    let shape = SHAPE;
    let q_dim = shape.num_heads * shape.head_dim;
    let kv_dim = shape.num_kv_heads * shape.head_dim;
    let evict = vec![1.0f32; EVICT_BUFFER_BYTES / 4];
    let windows = EVICT_BUFFER_BYTES / EVICT_BYTES;
    let mut next_window = 0;
    println!("| T | median µs/token | K/V GB/s | fastest µs/token | K/V GB/s |");
    println!("|---:|---:|---:|---:|---:|");
    for t in support::lengths(&[160, 512, 2048]) {
        let layers = support::layers(t);
        let q: Vec<f32> = (0..q_dim).map(|i| value(i * 3) * 4.0).collect();
        let mut out = vec![0.0; q_dim];
        let mut scratch = vec![0.0; scratch_len(1, t, shape)];
        let mut seconds: Vec<f64> = pool.install(|| {
            (0..ROUNDS)
                .map(|_| {
                    let mut token = 0.0;
                    for (k, v) in &layers {
                        let window = next_window % windows;
                        next_window += 1;
                        let read: f32 = evict[window * EVICT_BYTES / 4..][..EVICT_BYTES / 4]
                            .par_chunks(1 << 16)
                            .map(|c| c.iter().step_by(16).sum::<f32>()) // one value a line
                            .sum();
                        std::hint::black_box(read);
                        let row_of = |pos: usize| pos;
                        let stored = Stored {
                            k,
                            v,
                            row_of: &row_of,
                            shape,
                        };
                        let start = Instant::now();
                        decode_attention(Isa::detect(), &stored, &q, t, &mut out, &mut scratch);
                        token += start.elapsed().as_secs_f64();
                    }
                    token
                })
                .collect()
        });
        seconds.sort_by(f64::total_cmp);
        let bytes = (LAYERS * t * 2 * kv_dim * 4) as f64;
        let row = |s: f64| format!("{:8.1} | {:5.1}", s * 1e6, bytes / s / 1e9);
        println!(
            "| {t:6} | {} | {} |",
            row(seconds[ROUNDS / 2]),
            row(seconds[0])
        );
    }
}
