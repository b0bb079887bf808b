//! A batch-32 decode step's attention as the engine runs it: 32 sequences of `T` cached
//! positions each, one query row per sequence, in each of SmolLM2-135M's 30 layers (9 query
//! heads sharing 3 KV heads of 64), through chapter 4's `batch_attention`, with f32 and bf16
//! pools. A step reads every layer's K/V once, far more than the caches hold, so they come from
//! memory as in the engine. Prints, for each row kernel this CPU runs (portable, AVX2, AVX-512),
//! the median and the fastest of `ROUNDS` steps taken in turn with the others: ms per step,
//! GB/s of K/V read and GFLOP/s (`2 · 2 · d` FLOPs per query head and position). Beside them,
//! for the f32 pool, in the same turns, a pure read: every sequence's K then V blocks summed in
//! the same order and on the same threads, with no attention: how fast this layout of the pool
//! can be read at all. (Summing a bf16 pool would time its widening, not its reading.)
//!
//! With `--warm`, every layer of a step reads layer 0's K/V instead of its own: after the first
//! layer they come from cache while one layer's K/V fit in it (32 sequences of 192 positions:
//! 9 MiB in f32, 4.5 MiB in bf16), so the step times the kernels' own work, without memory's.
//! Where a kernel's warm step takes about as long as its step from memory, memory is not what
//! limits it.
//!
//! `cargo run --release -p ch04-continuous-batching --example batch_decode_attention [--warm] [T...]`

use std::time::Instant;

use ch03::{BlockId, KvElement, KvPool};
use ch04_continuous_batching::attention::{RowKernel, batch_attention_with};
use ch04_continuous_batching::decode_workload::{
    BLOCK_SIZE, DecodeWorkload, LAYERS, SEQUENCES, SHAPE, value,
};
use half::bf16;
use rayon::prelude::*;

const ROUNDS: usize = 30;

/// What one turn of [`time_steps`] runs: a row kernel, or the pure read ([`read_blocks`]).
#[derive(Debug, Clone, Copy)]
enum Pass {
    Kernel(RowKernel),
    PureRead,
}

impl Pass {
    fn name(self) -> String {
        match self {
            Pass::Kernel(kernel) => {
                let kernel = format!("{kernel:?}");
                kernel.split('(').next().unwrap_or(&kernel).to_string()
            }
            Pass::PureRead => "pure read".to_string(),
        }
    }
}

/// The sum of every K, then every V, element of positions `0..t` in the blocks `tables` name
/// in `layer`, a sequence per task: what the attention of a decode step reads, and nothing else.
fn read_blocks<K: KvElement>(
    pool: &KvPool<K>,
    layer: usize,
    tables: &[Vec<BlockId>],
    t: usize,
) -> f32 {
    let kv_dim = pool.kv_dim();
    let (keys, values) = pool.layer_kv(layer);
    tables
        .par_iter()
        .map(|table| {
            let mut lanes = [0.0f32; 16]; // 16 sums, one per lane: a vector add per 16 elements
            for stored in [keys, values] {
                for (i, &block) in table.iter().enumerate() {
                    let rows = BLOCK_SIZE.min(t - i * BLOCK_SIZE); // the last block's positions
                    let block = &stored[block as usize * BLOCK_SIZE * kv_dim..][..rows * kv_dim];
                    for chunk in block.as_chunks::<16>().0 {
                        for (sum, e) in lanes.iter_mut().zip(chunk) {
                            *sum += e.to_f32();
                        }
                    }
                }
            }
            lanes.iter().sum::<f32>()
        })
        .sum()
}

/// (median, fastest) seconds of one step over every layer, for each of `passes`, their steps
/// taken in turn (a round is one step of each, starting one pass later each round), so that
/// a drift of the machine's bandwidth, and whatever one step leaves in cache for the next,
/// fall on all of them alike.
fn time_steps<K: KvElement>(passes: &[Pass], t: usize, warm: bool) -> Vec<(f64, f64)> {
    let q_dim = SHAPE.num_heads * SHAPE.head_dim;
    let workload = DecodeWorkload::<K>::new(t);
    let (pool, tables) = (&workload.pool, &workload.tables);
    let rows = workload.rows();
    let q: Vec<f32> = (0..SEQUENCES * q_dim).map(|i| value(i * 3) * 4.0).collect();
    let mut out = vec![0.0; q.len()];
    let mut steps = vec![Vec::new(); passes.len()];
    let mut read = 0.0;
    for round in 0..ROUNDS + 2 {
        for i in 0..passes.len() {
            let k = (round + i) % passes.len();
            let start = Instant::now();
            for layer in 0..LAYERS {
                let layer = if warm { 0 } else { layer };
                match passes[k] {
                    Pass::Kernel(kernel) => {
                        batch_attention_with(kernel, pool, layer, &rows, &q, SHAPE, &mut out)
                    }
                    Pass::PureRead => read += read_blocks(pool, layer, tables, t),
                }
            }
            if round >= 2 {
                steps[k].push(start.elapsed().as_secs_f64()); // after two rounds of warm-up
            }
        }
    }
    std::hint::black_box(read);
    steps
        .into_iter()
        .map(|mut steps| {
            steps.sort_by(f64::total_cmp);
            (steps[ROUNDS / 2], steps[0])
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let warm = args.iter().any(|a| a == "--warm");
    let lengths: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let lengths = if lengths.is_empty() {
        vec![192]
    } else {
        lengths
    };
    println!(
        "K/V {}:\n",
        if warm {
            "from cache (--warm: every layer reads layer 0's)"
        } else {
            "from memory"
        }
    );
    println!(
        "| T | pool | kernel | median ms/step | GB/s | GFLOP/s | fastest ms/step | GB/s | GFLOP/s |"
    );
    println!("|---:|:---|:---|---:|---:|---:|---:|---:|---:|");
    let kernels: Vec<Pass> = (RowKernel::available().into_iter().map(Pass::Kernel)).collect();
    let with_read: Vec<Pass> = kernels.iter().copied().chain([Pass::PureRead]).collect();
    for t in lengths {
        let flops = (LAYERS * SEQUENCES * SHAPE.num_heads * t * 4 * SHAPE.head_dim) as f64;
        let positions = (LAYERS * SEQUENCES * t * 2 * SHAPE.num_kv_heads * SHAPE.head_dim) as f64;
        for (name, passes, times, bytes) in [
            (
                "f32",
                &with_read,
                time_steps::<f32>(&with_read, t, warm),
                4.0,
            ),
            ("bf16", &kernels, time_steps::<bf16>(&kernels, t, warm), 2.0),
        ] {
            let gb = positions * bytes / 1e9;
            for (pass, (median, best)) in passes.iter().zip(times) {
                // A pure read does no arithmetic: no GFLOP/s.
                let gflops = |secs: f64| match pass {
                    Pass::Kernel(_) => format!("{:.1}", flops / secs / 1e9),
                    Pass::PureRead => "–".to_string(),
                };
                println!(
                    "| {t} | {name} | {} | {:.2} | {:.1} | {} | {:.2} | {:.1} | {} |",
                    pass.name(),
                    median * 1e3,
                    gb / median,
                    gflops(median),
                    best * 1e3,
                    gb / best,
                    gflops(best)
                );
            }
        }
    }
}
