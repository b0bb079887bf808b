//! Steps of a few tokens (speculative decoding's checks, a batch at low concurrency): one pass
//! of 1 to 4 tokens through every projection of every layer, with bf16 and f32 weights, on the
//! GEMM micro-kernel and on the several-token matvec (`kernels::set_tokens_matvec`, which runs
//! 2 and 3 tokens), alternating within one process so that the machine's drift falls on both
//! alike. Prints the median GB/s of weights read: a step that streams its weights as a decode
//! does reads them at a decode's rate.
//!
//! `cargo run --release -p ch02-kv-cache --example small_steps -- MODEL_DIR`

use ch02_kv_cache::kernels::set_tokens_matvec;
use ch02_kv_cache::{WeightDtype, load_fast};
use ndarray::Array2;

#[allow(dead_code)] // the read-rate table, which the prefetch examples print
mod projections;

use projections::{alternate, bytes, pass};

const ROUNDS: usize = 15;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: small_steps MODEL_DIR")?;
    // On a worker of the pool, as `kiln` runs every command.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    println!("| weights | tokens | GEMM micro-kernel, GB/s | several-token matvec, GB/s |");
    println!("|---|---:|---:|---:|");
    for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
        let model = load_fast(dir.as_ref(), dtype)?;
        let gb = bytes(&model) as f64 / 1e6;
        for tokens in 1..=4 {
            let x = Array2::from_shape_fn((tokens, model.config.hidden_size), |(t, j)| {
                ((t + 3 * j) % 13) as f32 / 13.0 - 0.5
            });
            let ms = pool.install(|| {
                alternate(2, ROUNDS, |way| {
                    set_tokens_matvec(way == 1);
                    pass(&model, &x)
                })
            });
            println!(
                "| {dtype:?} | {tokens} | {:.1} | {:.1} |",
                gb / ms[0],
                gb / ms[1]
            );
        }
    }
    set_tokens_matvec(true);
    Ok(())
}
