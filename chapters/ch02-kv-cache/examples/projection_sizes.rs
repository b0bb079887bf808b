//! What one call of the decode product costs besides its bytes: one token through sets of
//! bf16 matrices of 576 inputs (SmolLM2's hidden size) and 192 to 49,152 outputs (its k/v, q/o,
//! gate/up and head shapes, and larger), each set about 453 MB so that every matrix comes from
//! memory, on every thread and on one. The sets alternate within each round, and each round
//! starts with a read probe (1 GiB of weight memory summed on every thread) that names the moment: this
//! machine's bandwidth drifts by a factor of two within minutes. Prints per round the probe and,
//! per size, the GB/s of weights read and µs per call.
//!
//! With `--awake`, each set's calls run inside [`awake`](ch02_kv_cache::awake::awake), the
//! pool's other threads spinning between them as in a decode step.
//!
//! `cargo run --release -p ch02-kv-cache --example projection_sizes [ROUNDS] [--awake]`

use std::time::Instant;

use ch01::linear::Linear;
use ch02_kv_cache::awake::awake;
use ch02_kv_cache::read_probe::ReadProbe;
use ch02_kv_cache::{FastLinear, WeightDtype};
use ndarray::Array2;

/// SmolLM2-135M's hidden size: every matrix's inputs.
const HIDDEN: usize = 576;
/// Outputs of each set's matrices.
const OUTPUTS: [usize; 6] = [192, 576, 1536, 3072, 12288, 49152];
/// Rows per set (each set holds `ROWS / outputs` matrices): 453 MB of bf16.
const ROWS: usize = 8 * 49152;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let keep_awake = args.iter().any(|a| a == "--awake");
    let rounds: usize = match args.iter().find(|a| *a != "--awake") {
        Some(n) => n.parse()?,
        None => 3,
    };
    let sets: Vec<(usize, Vec<FastLinear>)> = OUTPUTS
        .iter()
        .map(|&out| {
            let matrices = (0..ROWS / out)
                .map(|m| {
                    let w = Array2::from_shape_fn((out, HIDDEN), |(i, j)| {
                        ((i * 7 + j * 3 + m) % 11) as f32 * 0.1
                    });
                    FastLinear::new(w, None, WeightDtype::Bf16)
                })
                .collect();
            (out, matrices)
        })
        .collect();
    let x = Array2::from_shape_fn((1, HIDDEN), |(_, j)| (j % 13) as f32 / 13.0 - 0.5);
    // The benchmark's probe: 1 GiB of weight memory, where `FastLinear` packs the matrices.
    let probe = ReadProbe::new(1 << 30);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for threads in [cpus, 1] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        println!("\n{threads} thread(s): GB/s of weights read (µs per call)\n");
        let sizes: Vec<String> = OUTPUTS.iter().map(|o| format!("{o} × {HIDDEN}")).collect();
        println!("| round | probe GB/s | {} |", sizes.join(" | "));
        println!("|---:|---:|{}", "---:|".repeat(OUTPUTS.len()));
        // On a worker of the pool, as `kiln` runs every command.
        pool.install(|| {
            for round in 0..=rounds {
                let probe_gb_s = probe.gb_s();
                let cells: Vec<String> = sets
                    .iter()
                    .map(|(out, matrices)| {
                        let mut y = Array2::zeros((1, *out));
                        let start = Instant::now();
                        let mut calls = || {
                            for m in matrices {
                                m.forward_into(x.view(), y.view_mut());
                            }
                        };
                        if keep_awake {
                            awake(calls)
                        } else {
                            calls()
                        }
                        let s = start.elapsed().as_secs_f64();
                        let bytes = (matrices.len() * out * HIDDEN * 2) as f64;
                        format!(
                            "{:.1} ({:.1})",
                            bytes / s / 1e9,
                            s * 1e6 / matrices.len() as f64
                        )
                    })
                    .collect();
                if round > 0 {
                    // Round 0 warms the pool and the caches.
                    println!("| {round} | {probe_gb_s:.1} | {} |", cells.join(" | "));
                }
            }
        });
    }
    Ok(())
}
