//! Whether the pool's threads should spin through a decode (`awake::awake`) or sleep between
//! its parallel regions, with each split of the small products (`kernels::set_even_split`):
//! whole greedy decodes, a 128-token prompt and 64 tokens timed, bf16 and f32 weights, on every
//! thread, the four ways alternating within one process so that the machine's drift falls on
//! all alike (medians of tokens/s). The results are the same bits every way.
//!
//! `cargo run --release -p ch02-kv-cache --example keep_awake -- MODEL_DIR`

use ch02_kv_cache::awake::set_keep_awake;
use ch02_kv_cache::kernels::set_even_split;
use ch02_kv_cache::{WeightDtype, load_fast};

mod decode;
#[allow(dead_code)] // the per-projection tables, which other examples print
mod projections;

use decode::decode_ms;
use projections::alternate;

/// Whole decodes per way.
const ROUNDS: usize = 7;
/// (threads spin, small products split evenly)
const WAYS: [(bool, bool); 4] = [(true, true), (true, false), (false, true), (false, false)];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: keep_awake MODEL_DIR")?;
    let dir = std::path::Path::new(&dir);
    let name = |(spin, even): (bool, bool)| {
        let split = if even {
            "even split"
        } else {
            "4 tasks per thread"
        };
        format!("{}, {split}", if spin { "spinning" } else { "sleeping" })
    };
    let names: Vec<String> = WAYS.iter().map(|&way| name(way)).collect();
    println!("| weights | {} (tokens/s) |", names.join(" (tokens/s) | "));
    println!("|---|{}", "---:|".repeat(WAYS.len()));
    // On a worker of the pool, as `kiln` runs every command.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
        let model = load_fast(dir, dtype)?;
        let ms = pool.install(|| {
            alternate(WAYS.len(), ROUNDS, |way| {
                let (spin, even) = WAYS[way];
                set_keep_awake(spin);
                set_even_split(even);
                decode_ms(&model)
            })
        });
        let cells: Vec<String> = ms.iter().map(|ms| format!("{:.1}", 1e3 / ms)).collect();
        println!("| {dtype:?} | {} |", cells.join(" | "));
    }
    set_keep_awake(true);
    set_even_split(true);
    Ok(())
}
