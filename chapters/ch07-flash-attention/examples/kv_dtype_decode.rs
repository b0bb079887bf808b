//! What each KV dtype costs chapter 4's decode attention: a batch-32 decode step of
//! SmolLM2-135M's 30 layers (9 query heads sharing 3 KV heads of 64, `T` cached positions per
//! sequence) through `batch_attention_with`, over pools of f32, bf16, int8 and FP8 E4M3, with
//! each row kernel this CPU runs. Prints the median and the fastest of `ROUNDS` steps in ms, and
//! GB/s of K/V read (codes and scales). The dtypes' steps are taken in turn, one of each per
//! round, so that the machine's drift falls on all of them alike.
//!
//! Beside the attention, the step's other use of the pool: writing its 32 new rows of K and V
//! into every layer (`KvPool::write`, which quantizes them for the 8-bit dtypes), timed the same
//! way: the rows "K/V write" (GB/s of the dtype's bytes written).
//!
//! With `--warm`, every layer reads layer 0's K/V, from cache after the first: the step then
//! times the kernel's own work (the 8-bit formats' widening above all), not memory's.
//!
//! `cargo run --release -p ch07-flash-attention --example kv_dtype_decode [--warm] [T...]`

use std::time::Instant;

use ch03::{KvDtype, KvElement};
use ch04::attention::{RowKernel, batch_attention_with};
use ch04::decode_workload::{DecodeWorkload, KV_DIM, LAYERS, SEQUENCES, SHAPE, value};
use ch05::fp8::F8E4M3;
use ch05::kv_cache::KvInt8;
use half::bf16;
use ndarray::ArrayView1;

const ROUNDS: usize = 30;

/// One pool of the step, of dtype `K`.
struct Step<K: KvElement>(DecodeWorkload<K>);

impl<K: KvElement> Step<K> {
    fn new(t: usize) -> Self {
        Step(DecodeWorkload::new(t))
    }

    /// Seconds of one step's writes: a row of K and V for each sequence (at its last position
    /// again), in every layer.
    fn write(&mut self, k: &[f32], v: &[f32]) -> f64 {
        let start = Instant::now();
        for layer in 0..LAYERS {
            for s in 0..SEQUENCES {
                let slot = self.0.last_slot(s);
                (self.0.pool).write(layer, slot, ArrayView1::from(k), ArrayView1::from(v));
            }
        }
        start.elapsed().as_secs_f64()
    }

    /// Seconds of one step over every layer.
    fn run(&self, kernel: RowKernel, warm: bool, q: &[f32], out: &mut [f32]) -> f64 {
        let rows = self.0.rows();
        let start = Instant::now();
        for layer in 0..LAYERS {
            let layer = if warm { 0 } else { layer };
            batch_attention_with(kernel, &self.0.pool, layer, &rows, q, SHAPE, out);
        }
        start.elapsed().as_secs_f64()
    }
}

/// A pool of any dtype, for the rounds to take in turn.
trait AnyStep {
    fn dtype(&self) -> KvDtype;
    fn run(&self, kernel: RowKernel, warm: bool, q: &[f32], out: &mut [f32]) -> f64;
    fn write(&mut self, k: &[f32], v: &[f32]) -> f64;
}

impl<K: KvElement> AnyStep for Step<K> {
    fn dtype(&self) -> KvDtype {
        K::DTYPE
    }
    fn run(&self, kernel: RowKernel, warm: bool, q: &[f32], out: &mut [f32]) -> f64 {
        Step::run(self, kernel, warm, q, out)
    }
    fn write(&mut self, k: &[f32], v: &[f32]) -> f64 {
        Step::write(self, k, v)
    }
}

/// (median, fastest) seconds of `ROUNDS` runs of `run` on each step, one of each per round,
/// starting one step later each round, after two rounds of warm-up.
fn in_turn(
    steps: &mut [Box<dyn AnyStep>],
    mut run: impl FnMut(&mut dyn AnyStep) -> f64,
) -> Vec<(f64, f64)> {
    let mut times = vec![Vec::new(); steps.len()];
    for round in 0..ROUNDS + 2 {
        for i in 0..steps.len() {
            let k = (round + i) % steps.len();
            let secs = run(steps[k].as_mut());
            if round >= 2 {
                times[k].push(secs);
            }
        }
    }
    (times.into_iter())
        .map(|mut times| {
            times.sort_by(f64::total_cmp);
            (times[ROUNDS / 2], times[0])
        })
        .collect()
}

/// The table's rows for `what` at `t` positions: ms per step and GB/s of `rows` K/V rows of
/// each dtype.
fn print_rows(t: usize, what: &str, steps: &[Box<dyn AnyStep>], times: &[(f64, f64)], rows: u64) {
    for (step, &(median, fastest)) in steps.iter().zip(times) {
        let dtype = step.dtype();
        let bytes = rows * dtype.row_bytes(SHAPE.num_kv_heads, SHAPE.head_dim);
        println!(
            "| {t} | {what} | {dtype} | {:.2} | {:.1} | {:.2} |",
            median * 1e3,
            bytes as f64 / median / 1e9,
            fastest * 1e3
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let warm = args.iter().any(|a| a == "--warm");
    let lengths: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let lengths = if lengths.is_empty() {
        vec![192, 512]
    } else {
        lengths
    };
    let from = if warm {
        "from cache (--warm)"
    } else {
        "from memory"
    };
    println!("K/V {from}, medians and fastest of {ROUNDS} steps:\n");
    println!("| T | kernel | KV dtype | median ms/step | GB/s | fastest ms/step |");
    println!("|---:|:---|:---|---:|---:|---:|");
    let q: Vec<f32> = (0..SEQUENCES * SHAPE.num_heads * SHAPE.head_dim)
        .map(|i| value(i * 3) * 4.0)
        .collect();
    let mut out = vec![0.0; q.len()];
    let k: Vec<f32> = (0..KV_DIM).map(|i| value(i * 5)).collect();
    let v: Vec<f32> = (0..KV_DIM).map(|i| value(i * 7)).collect();
    for t in lengths {
        let mut steps: Vec<Box<dyn AnyStep>> = vec![
            Box::new(Step::<f32>::new(t)),
            Box::new(Step::<bf16>::new(t)),
            Box::new(Step::<KvInt8>::new(t)),
            Box::new(Step::<F8E4M3>::new(t)),
        ];
        for kernel in RowKernel::available() {
            let times = in_turn(&mut steps, |step| step.run(kernel, warm, &q, &mut out));
            let kernel = format!("{kernel:?}");
            let kernel = kernel.split('(').next().unwrap_or(&kernel);
            // Every position's K and V row, every layer and sequence.
            print_rows(
                t,
                kernel,
                &steps,
                &times,
                (LAYERS * SEQUENCES * t * 2) as u64,
            );
        }
        let times = in_turn(&mut steps, |step| step.write(&k, &v));
        // A row of K and V a sequence, every layer.
        print_rows(
            t,
            "K/V write",
            &steps,
            &times,
            (LAYERS * SEQUENCES * 2) as u64,
        );
    }
    std::hint::black_box(&out);
}
