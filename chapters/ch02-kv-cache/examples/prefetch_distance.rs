//! How far ahead, and into which cache, the decode product (`panel_matvec`) must prefetch: one
//! token through every projection of every layer (the weights of a decoded token but the head,
//! streamed from memory), on one thread and on all, with bf16 and f32 weights, at prefetch
//! distances of 1 to 8 KiB the kernels' way (bf16 into L2 once per cache line, f32 into L1 at
//! every input feature), and at 4 KiB with bf16 too into L1 at every feature (the first way; for
//! f32 the same code as the 4 KiB column), alternating within one process so that the machine's
//! drift falls on all alike. Prints the median GB/s of weights read; before the
//! distance was counted in bytes it was 32 features: 1 KiB of bf16, 2 KiB of f32.
//!
//! `cargo run --release -p ch02-kv-cache --example prefetch_distance -- MODEL_DIR`

use ch02_kv_cache::kernels::{PREFETCH_BYTES, set_prefetch_distance, set_prefetch_l1};
use ch02_kv_cache::{WeightDtype, load_fast};

mod projections;

use projections::print_read_rates;

/// (distance in bytes, into L1 at every feature?)
const WAYS: [(usize, bool); 5] = [
    (1024, false),
    (2048, false),
    (4096, false),
    (8192, false),
    (4096, true),
];
const ROUNDS: usize = 15;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: prefetch_distance MODEL_DIR")?;
    let dir = std::path::Path::new(&dir);
    let models = [
        ("bf16".to_string(), load_fast(dir, WeightDtype::Bf16)?),
        ("f32".to_string(), load_fast(dir, WeightDtype::F32)?),
    ];
    let ways: Vec<String> = WAYS
        .iter()
        .map(|&(d, l1)| format!("{d} B{}", if l1 { ", L1" } else { "" }))
        .collect();
    print_read_rates(&models, &ways, ROUNDS, |i| {
        let (distance, l1) = WAYS[i];
        set_prefetch_distance(distance);
        set_prefetch_l1(l1);
    })?;
    set_prefetch_distance(PREFETCH_BYTES);
    set_prefetch_l1(false);
    Ok(())
}
