//! Decode attention's cost per token on SmolLM2-135M's shape (9 query heads sharing 3 KV heads
//! of 64, 30 layers): one query row against `T` cached positions in every layer, each layer's
//! K/V in its own buffer (so a token streams `30 · T · 2 · 3 · 64 · 4` bytes, as a model does).
//! Prints µs per token and the K/V GB/s each reaches, for the chapter's first decode (heads in
//! parallel, `decode_by_heads`) and for `decode_attention` (chunks of positions), alternating
//! run by run on the same buffers; the fastest of 200 runs each.
//!
//! `cargo run --release -p ch02-kv-cache --example attention_speed [T...]`

use std::time::Instant;

use ch02_kv_cache::attention::{decode_by_heads, scratch_len};
use ch02_kv_cache::decode_attention::{Stored, decode_attention};
use ch02_kv_cache::kernels::Isa;

mod support;

use support::{LAYERS, SHAPE, value};

fn main() {
    let lengths = support::lengths(&[64, 160, 512, 2048]);
    let threads = std::env::var("THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let shape = SHAPE;
    let q_dim = shape.num_heads * shape.head_dim;
    println!("| T | by heads µs/token | GB/s | chunks µs/token | GB/s | speed-up |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for t in lengths {
        let layers = support::layers(t);
        let q: Vec<f32> = (0..q_dim).map(|i| value(i * 3) * 4.0).collect();
        let mut out = vec![0.0; q_dim];
        let mut scores = vec![0.0; scratch_len(1, t, shape)];
        let mut best = [f64::INFINITY; 2];
        pool.install(|| {
            for _ in 0..200 {
                for (way, best) in best.iter_mut().enumerate() {
                    let start = Instant::now();
                    for (k, v) in &layers {
                        let stored = Stored {
                            k,
                            v,
                            row_of: &|pos: usize| pos,
                            shape,
                        };
                        if way == 0 {
                            decode_by_heads(&stored, &q, t, &mut out, &mut scores);
                        } else {
                            decode_attention(Isa::detect(), &stored, &q, t, &mut out, &mut scores);
                        }
                    }
                    *best = best.min(start.elapsed().as_secs_f64());
                }
            }
        });
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        let bytes = (LAYERS * t * 2 * kv_dim * 4) as f64;
        let [heads, chunks] = best.map(|s| (s * 1e6, bytes / s / 1e9));
        println!(
            "| {t:6} | {:8.1} | {:5.1} | {:8.1} | {:5.1} | {:5.2}x |",
            heads.0,
            heads.1,
            chunks.0,
            chunks.1,
            heads.0 / chunks.0
        );
    }
}
