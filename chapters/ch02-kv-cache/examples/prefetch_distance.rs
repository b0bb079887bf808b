//! How far ahead the decode product (`panel_matvec`) must prefetch: one token through every
//! projection of every layer (the weights of a decoded token but the head, streamed from memory),
//! on one thread and on all, with bf16 and f32 weights, at prefetch distances of 1 to 8 KiB,
//! alternating within one process so that the machine's drift falls on all alike. Prints the
//! median GB/s of weights read; before the distance was counted in bytes it was 32 features:
//! 1 KiB of bf16, 2 KiB of f32.
//!
//! `cargo run --release -p ch02-kv-cache --example prefetch_distance -- MODEL_DIR`

use ch02_kv_cache::kernels::{PREFETCH_BYTES, set_prefetch_distance};
use ch02_kv_cache::{WeightDtype, load_fast};

mod projections;

use projections::print_read_rates;

const DISTANCES: [usize; 4] = [1024, 2048, 4096, 8192];
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
    let ways: Vec<String> = DISTANCES.iter().map(|d| format!("{d} B")).collect();
    print_read_rates(&models, &ways, ROUNDS, |i| {
        set_prefetch_distance(DISTANCES[i])
    })?;
    set_prefetch_distance(PREFETCH_BYTES);
    Ok(())
}
