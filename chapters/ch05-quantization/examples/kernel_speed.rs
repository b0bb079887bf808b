//! Kernel throughput on SmolLM2-135M-sized weights, one format at a time:
//!
//! - `matvec` (decode, one token): GB/s of weights, on a `[~28M / cols, cols]` matrix that
//!   streams from memory (as a whole model does) and on a `[1536, cols]` one that stays in cache;
//! - `matmul` (prefill, 128 tokens) on the `[1536, cols]` matrix: GMAC/s.
//!
//! `cols` is 576 (SmolLM2's hidden size) for the 32-element formats, 1536 for the K-quants.
//! Each figure is the fastest of repeated runs: on a shared machine, the run least disturbed
//! by other processes. `THREADS` (default 1) sets the rayon pool.
//!
//! `cargo run --release -p ch05-quantization --example kernel_speed [TYPE...]`

use std::time::Instant;

use ch05_quantization::GgmlType;
use ch05_quantization::kernels::{Isa, QuantMatrix, Scratch, matmul, matvec};

/// The fastest of `reps` runs of `f`, in seconds.
fn fastest(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names = if args.is_empty() {
        ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]
            .map(String::from)
            .to_vec()
    } else {
        args
    };
    let threads = std::env::var("THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let isa = Isa::detect();
    println!("{isa:?}, {threads} thread(s)");
    for name in names {
        let Some(ty) = GgmlType::from_name(&name) else {
            continue;
        };
        let cols = if ty.block_elems() == 256 { 1536 } else { 576 };
        let big_rows = 49152 * 576 / cols;
        let small_rows = 1536;
        let value = |i: usize| ((i * 2_654_435_761) % 1000) as f32 / 500.0 - 1.0;
        let w: Vec<f32> = (0..big_rows * cols).map(value).collect();
        let Ok(big) = QuantMatrix::quantize(ty, &w, big_rows, cols) else {
            continue;
        };
        let small = QuantMatrix::quantize(ty, &w[..small_rows * cols], small_rows, cols).unwrap();
        let x: Vec<f32> = (0..128 * cols).map(|i| value(i * 7 + 3)).collect();
        let mut scratch = Scratch::default();
        pool.install(|| {
            let mut y = vec![0.0f32; big_rows];
            let t = fastest(15, || matvec(isa, &big, &x[..cols], &mut y, &mut scratch));
            let streamed = big.stored_bytes() as f64 / t / 1e9;
            let mut y = vec![0.0f32; small_rows];
            let t = fastest(200, || {
                matvec(isa, &small, &x[..cols], &mut y, &mut scratch)
            });
            let cached = small.stored_bytes() as f64 / t / 1e9;
            let mut y = vec![0.0f32; 128 * small_rows];
            let t = fastest(9, || matmul(isa, &small, &x, &mut y, 128, &mut scratch));
            let gmacs = (128 * small_rows * cols) as f64 / t / 1e9;
            println!(
                "{name:5} matvec {streamed:6.2} GB/s streamed, {cached:6.2} GB/s in cache; \
                 matmul(128) {gmacs:6.2} GMAC/s"
            );
        });
    }
}
