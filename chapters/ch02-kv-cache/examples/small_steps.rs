//! Steps of a few tokens (speculative decoding's checks, a batch at low concurrency), 1 to 7
//! tokens, bf16 and f32 weights, three ways: the GEMM micro-kernel; the AVX2 several-token
//! matvec (`kernels::set_tokens_matvec`, which runs 2 and 3 tokens); and the AVX-512 one
//! (`kernels::set_tokens_matvec_512`, 2 to 6 tokens, where the CPU has AVX-512F). A way that
//! does not take a step's token count runs it on the GEMM micro-kernel. The ways alternate
//! within one process, so that the machine's drift falls on all alike.
//!
//! Two tables, in GB/s of weights read (medians):
//! - **from memory**: one pass through every projection of every layer of the model, on every
//!   thread: a step that streams its weights as a decode does reads them at a decode's rate;
//! - **from cache**: one 384 × 576 matrix (442 KB in bf16), again and again, on one thread and on
//!   every thread: the kernel's own speed, which bounds the step when the memory is faster.
//!
//! `cargo run --release -p ch02-kv-cache --example small_steps -- MODEL_DIR`

use std::time::Instant;

use ch01::linear::Linear;
use ch02_kv_cache::kernels::{set_tokens_matvec, set_tokens_matvec_512};
use ch02_kv_cache::{FastLinear, WeightDtype, load_fast};
use ndarray::Array2;

#[allow(dead_code)] // the read-rate table, which the prefetch examples print
mod projections;

use projections::{alternate, bytes, pass};

const ROUNDS: usize = 15;
/// Products per timed run from cache.
const REPEATS: usize = 200;
const WAYS: [&str; 3] = [
    "GEMM micro-kernel",
    "AVX2 several-token matvec",
    "AVX-512 several-token matvec",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: small_steps MODEL_DIR")?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // On a worker of the pool, as `kiln` runs every command.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    println!("From memory, {cpus} threads: GB/s of weights read\n");
    header("");
    for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
        let model = load_fast(dir.as_ref(), dtype)?;
        let gb = bytes(&model) as f64 / 1e6;
        for tokens in 1..=7 {
            let x = input(tokens, model.config.hidden_size);
            let ms =
                pool.install(|| alternate(WAYS.len(), ROUNDS, |way| set(way, || pass(&model, &x))));
            row(&format!("{dtype:?} | {tokens}"), gb, &ms);
        }
    }

    println!("\nFrom cache: GB/s of weights read\n");
    header("threads | ");
    let w = Array2::from_shape_fn((384, 576), |(i, j)| ((i * 7 + j * 3) % 11) as f32 * 0.1);
    for threads in [1, cpus] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
            let layer = FastLinear::new(w.clone(), None, dtype);
            let gb = layer.weight_bytes() as f64 / 1e6;
            for tokens in 1..=7 {
                let x = input(tokens, w.ncols());
                let mut y = Array2::zeros((tokens, w.nrows()));
                let ms = pool.install(|| {
                    alternate(WAYS.len(), ROUNDS, |way| {
                        set(way, || {
                            let start = Instant::now();
                            for _ in 0..REPEATS {
                                layer.forward_into(x.view(), y.view_mut());
                            }
                            start.elapsed().as_secs_f64() * 1e3 / REPEATS as f64
                        })
                    })
                });
                row(&format!("{threads} | {dtype:?} | {tokens}"), gb, &ms);
            }
        }
    }
    set_tokens_matvec(true);
    set_tokens_matvec_512(true);
    Ok(())
}

/// Runs `f` the way `way` of [`WAYS`] names.
fn set(way: usize, f: impl FnOnce() -> f64) -> f64 {
    set_tokens_matvec(way >= 1);
    set_tokens_matvec_512(way == 2);
    f()
}

/// `[tokens, features]`, a fixed pattern.
fn input(tokens: usize, features: usize) -> Array2<f32> {
    Array2::from_shape_fn((tokens, features), |(t, j)| {
        ((t + 3 * j) % 13) as f32 / 13.0 - 0.5
    })
}

fn header(first: &str) {
    let ways: Vec<String> = WAYS.iter().map(|w| format!("{w}, GB/s")).collect();
    println!("| {first}weights | tokens | {} |", ways.join(" | "));
    let first_cols = "---:|".repeat(first.matches('|').count());
    println!("|{first_cols}---|---:|{}", "---:|".repeat(WAYS.len()));
}

/// A table row: `gb` GB read in each way's `ms`.
fn row(first: &str, gb: f64, ms: &[f64]) {
    let cells: Vec<String> = ms.iter().map(|ms| format!("{:.1}", gb / ms)).collect();
    println!("| {first} | {} |", cells.join(" | "));
}
