//! How the decode product (`matvec`) should split a layer's projections across threads: evenly,
//! one contiguous task per thread (the default), or four tasks per thread (as before). First one
//! token through every projection of every layer, on one thread and on all, with bf16 and f32
//! weights (median GB/s of weights read); then whole decodes on every thread, a 128-token
//! prompt and 64 greedy tokens (median tokens/s). The two ways alternate within one process, so
//! that the machine's drift falls on both alike; the results are the same bits either way.
//!
//! `cargo run --release -p ch02-kv-cache --example matvec_split -- MODEL_DIR`

use ch02_kv_cache::kernels::set_even_split;
use ch02_kv_cache::{WeightDtype, load_fast};

mod decode;
mod projections;

use decode::decode_ms;
use projections::{alternate, print_read_rates};

const ROUNDS: usize = 15;
/// Whole decodes per way.
const DECODE_ROUNDS: usize = 7;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: matvec_split MODEL_DIR")?;
    let dir = std::path::Path::new(&dir);
    let models = [
        ("bf16".to_string(), load_fast(dir, WeightDtype::Bf16)?),
        ("f32".to_string(), load_fast(dir, WeightDtype::F32)?),
    ];
    let ways = ["even split", "4 tasks per thread"];
    let headers: Vec<String> = ways.iter().map(|w| w.to_string()).collect();
    print_read_rates(&models, &headers, ROUNDS, |i| set_even_split(i == 0))?;

    println!("\n| weights | {} (tokens/s) |", ways.join(" (tokens/s) | "));
    println!("|---|{}", "---:|".repeat(ways.len()));
    // On a worker of the pool, as `kiln` runs every command.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    for (name, model) in &models {
        let ms = pool.install(|| {
            alternate(ways.len(), DECODE_ROUNDS, |way| {
                set_even_split(way == 0);
                decode_ms(model)
            })
        });
        let cells: Vec<String> = ms.iter().map(|ms| format!("{:.1}", 1e3 / ms)).collect();
        println!("| {name} | {} |", cells.join(" | "));
    }
    set_even_split(true);
    Ok(())
}
