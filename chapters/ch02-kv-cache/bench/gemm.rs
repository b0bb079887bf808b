//! `kiln bench ch02 --only gemm`: GFLOP/s of every prefill micro-kernel this CPU has, on the
//! model's own projection shapes, at a batch-32 decode step's 32 tokens and a 128-token prefill.
//!
//! ```text
//! for each shape (tokens × in → out) and weight dtype:
//!     reps rounds, each timing every micro-kernel once (interleaved, so a slow spell of the
//!     machine falls on all alike); per kernel the median round → GFLOP/s = 2·t·in·out / s
//! ```

use std::time::Instant;

use super::speed::median;

use ch01::LlamaConfig;
use ch02::kernels::{Gemm, PackedWeight, WeightElement, matmul_with};

use crate::bench::RunFacts;
use crate::bench::table::{Align, Table};

/// The table's file stem under the chapter's folder.
pub const STEM: &str = "gemm";

/// Token counts measured: a batch-32 decode step, and a 128-token prompt.
const TOKENS: [usize; 2] = [32, 128];

/// One shape and dtype: GFLOP/s per micro-kernel, in [`Gemm::available`]'s order.
struct Row {
    label: String,
    gflop_s: Vec<f64>,
}

/// The measured table.
pub struct Measured {
    kernels: Vec<Gemm>,
    rows: Vec<Row>,
}

/// Measures every micro-kernel on the projections of `config` (q/o, gate/up, down), f32 and
/// bf16 weights, at [`TOKENS`].
pub fn measure(config: &LlamaConfig, reps: usize) -> Measured {
    let kernels = Gemm::available();
    let (h, i) = (config.hidden_size, config.intermediate_size);
    let q = config.num_attention_heads * config.head_dim;
    let shapes = [("q_proj", q, h), ("gate_proj", i, h), ("down_proj", h, i)];
    let mut rows = Vec::new();
    for tokens in TOKENS {
        for (name, out, inp) in shapes {
            // Deterministic, non-trivial values: the timing does not depend on them.
            let w: Vec<f32> = (0..out * inp)
                .map(|j| ((j * 5) % 13) as f32 * 0.1)
                .collect();
            let x: Vec<f32> = (0..tokens * inp)
                .map(|j| ((j * 7) % 11) as f32 * 0.1)
                .collect();
            let flops = 2.0 * (tokens * inp * out) as f64;
            let label = |dtype| format!("{name} {tokens} × {inp} → {out}, {dtype}");
            let f32_w = PackedWeight::<f32>::pack(&w, out, inp);
            let gflop_s = time_kernels(&kernels, &f32_w, &x, tokens, reps, flops);
            rows.push(Row {
                label: label("f32"),
                gflop_s,
            });
            let bf16_w = PackedWeight::<u16>::pack(&w, out, inp);
            let gflop_s = time_kernels(&kernels, &bf16_w, &x, tokens, reps, flops);
            rows.push(Row {
                label: label("bf16"),
                gflop_s,
            });
        }
    }
    Measured { kernels, rows }
}

/// GFLOP/s of each kernel on one product, the median of `reps` interleaved rounds; each round
/// times as many calls as take about 20 ms.
fn time_kernels<W: WeightElement>(
    kernels: &[Gemm],
    w: &PackedWeight<W>,
    x: &[f32],
    tokens: usize,
    reps: usize,
    flops: f64,
) -> Vec<f64> {
    let mut y = vec![0.0f32; tokens * w.out_features()];
    let calls = ((2e-2 * 2e11 / flops) as usize).max(1); // ~20 ms at 200 GFLOP/s
    let mut times = vec![Vec::with_capacity(reps); kernels.len()];
    for _ in 0..reps {
        for (kernel, times) in kernels.iter().zip(&mut times) {
            matmul_with(*kernel, w, x, &mut y, tokens); // warm the caches
            let start = Instant::now();
            for _ in 0..calls {
                matmul_with(*kernel, w, x, &mut y, tokens);
            }
            times.push(start.elapsed() / calls as u32);
        }
    }
    times
        .into_iter()
        .map(|t| flops / median(t).as_secs_f64() / 1e9)
        .collect()
}

impl Measured {
    pub fn markdown(
        &self,
        facts: &RunFacts,
        model_name: &str,
        threads: usize,
        reps: usize,
    ) -> String {
        let headers = std::iter::once("product (tokens × in → out)".to_string())
            .chain(self.kernels.iter().map(|k| format!("{} GFLOP/s", k.name())));
        let mut table = Table::new(headers).align(0, Align::Left);
        for row in &self.rows {
            let cells = std::iter::once(row.label.clone())
                .chain(row.gflop_s.iter().map(|g| format!("{g:.1}")));
            table.row(cells);
        }
        format!(
            "{}\n_{model_name}'s projection shapes, {}, median of {reps} interleaved rounds. \
             Command: `{}`._\n",
            table.to_markdown(),
            facts.machine(threads),
            facts.command
        )
    }
}
