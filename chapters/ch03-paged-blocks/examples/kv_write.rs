//! What writing a step's new K/V into the pool costs: `KvPool::write` for every row of a step of
//! `ROWS` tokens in each of SmolLM2-135M's 30 layers (3 KV heads of 64), four rows to a block,
//! four positions apart, into an f32 pool and into a bf16 one (which rounds each value). Prints the median and fastest ms of a step's writes over `ROUNDS` steps,
//! the pools taking turns, and the GB/s of K/V written.
//!
//! `cargo run --release -p ch03-paged-blocks --example kv_write [ROWS...]`

use std::time::Instant;

use ch01::LlamaConfig;
use ch03_paged_blocks::{KvElement, KvPool};
use half::bf16;
use ndarray::Array2;

const BLOCK_SIZE: usize = 16;
const ROUNDS: usize = 31;

/// One step's writes: row `r` of `k`, `v` [rows, kv_dim] into `slots[r]`, in every layer.
fn write_step<K: KvElement>(
    pool: &mut KvPool<K>,
    slots: &[usize],
    k: &Array2<f32>,
    v: &Array2<f32>,
) {
    for layer in 0..pool.num_layers() {
        for (r, &slot) in slots.iter().enumerate() {
            pool.write(layer, slot, k.row(r), v.row(r));
        }
    }
}

fn main() {
    let rows: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rows = if rows.is_empty() { vec![32, 512] } else { rows };
    let config = LlamaConfig::smollm2_135m();
    let (layers, kv_dim) = (
        config.num_hidden_layers,
        config.num_key_value_heads * config.head_dim,
    );
    println!("| rows a step | pool | median ms/step | fastest ms/step | GB/s written |");
    println!("|---:|:---|---:|---:|---:|");
    for n in rows {
        // Row r writes position r % 16 of block 4 · (r / 16) + r % 4: sixteen rows to four
        // blocks, four to a block, four positions apart (every slot distinct, inside the pool).
        let blocks = 4 * n.div_ceil(BLOCK_SIZE);
        let slots: Vec<usize> = (0..n)
            .map(|r| (4 * (r / BLOCK_SIZE) + r % 4) * BLOCK_SIZE + r % BLOCK_SIZE)
            .collect();
        let k = Array2::from_shape_fn((n, kv_dim), |(r, c)| ((r * 31 + c * 7) % 97) as f32 / 97.0);
        let v = k.mapv(|x| 1.0 - x);
        let mut f32_pool = KvPool::<f32>::new(&config, BLOCK_SIZE, blocks).expect("a pool");
        let mut bf16_pool = KvPool::<bf16>::new(&config, BLOCK_SIZE, blocks).expect("a pool");
        f32_pool.populate();
        bf16_pool.populate();
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            let start = Instant::now();
            write_step(&mut f32_pool, &slots, &k, &v);
            times[0].push(start.elapsed().as_secs_f64());
            let start = Instant::now();
            write_step(&mut bf16_pool, &slots, &k, &v);
            times[1].push(start.elapsed().as_secs_f64());
        }
        for ((name, bytes), mut t) in [("f32", 4), ("bf16", 2)].into_iter().zip(times) {
            t.sort_by(f64::total_cmp);
            let written = (layers * n * 2 * kv_dim * bytes) as f64;
            let median = t[ROUNDS / 2];
            println!(
                "| {n} | {name} | {:.3} | {:.3} | {:.1} |",
                median * 1e3,
                t[0] * 1e3,
                written / median / 1e9
            );
        }
    }
}
