//! The tensor-parallel cost model on Llama-3 8B and 70B shapes, 8 GPUs on NVLink: every number
//! here is a prediction from the assumptions below, none is measured.

use super::super::RunFacts;
use super::super::svg::LinePlot;
use super::super::table::Table;

/// A Llama shape.
struct Shape {
    name: &'static str,
    hidden: f64,
    layers: f64,
    heads: f64,
    kv_heads: f64,
    intermediate: f64,
    vocab: f64,
}

const LLAMA_8B: Shape = Shape {
    name: "Llama-3-8B",
    hidden: 4096.0,
    layers: 32.0,
    heads: 32.0,
    kv_heads: 8.0,
    intermediate: 14336.0,
    vocab: 128256.0,
};

const LLAMA_70B: Shape = Shape {
    name: "Llama-3-70B",
    hidden: 8192.0,
    layers: 80.0,
    heads: 64.0,
    kv_heads: 8.0,
    intermediate: 28672.0,
    vocab: 128256.0,
};

// ANCHOR: assumptions
/// The assumptions of every prediction.
const BYTES: f64 = 2.0; // bf16 weights, activations and KV
const HBM: f64 = 4.3e12; // bytes/s a GPU reads: the device-copy rate kiln measured on an H200 (4,268 GB/s, book/src/ch07/gpu-attention.md)
const HBM_CAPACITY: f64 = 141e9; // bytes of one H200
const FLOPS: f64 = 790e12; // bf16 GEMM rate of an H200 with cuBLAS: assumed, not measured by kiln
const LINK: f64 = 900e9; // NVLink bytes/s per GPU
const ALPHA: f64 = 10e-6; // seconds of fixed cost per all-reduce: assumed, not measured
const CONTEXT: f64 = 4096.0; // positions each sequence has in its KV cache
// ANCHOR_END: assumptions

impl Shape {
    fn head_dim(&self) -> f64 {
        self.hidden / self.heads
    }

    fn params(&self) -> f64 {
        let d = self.head_dim();
        let attn = 2.0 * self.hidden * self.hidden + 2.0 * self.hidden * self.kv_heads * d;
        let mlp = 3.0 * self.hidden * self.intermediate;
        self.layers * (attn + mlp) + 2.0 * self.vocab * self.hidden
    }

    /// KV bytes of one position: K and V, every layer.
    fn kv_bytes_per_token(&self) -> f64 {
        2.0 * self.layers * self.kv_heads * self.head_dim() * BYTES
    }

    /// Bytes one all-reduce moves per token: the `[hidden]` row in bf16.
    fn all_reduce_bytes_per_token(&self) -> f64 {
        self.hidden * BYTES
    }

    // ANCHOR: step_time
    /// Predicted seconds of one decode step of `batch` sequences on `n` GPUs, and the part of
    /// it spent all-reducing. Each GPU reads 1/n of the weights and of the KV (memory-bound
    /// unless the FLOPs take longer); each layer all-reduces twice a [batch, hidden] row
    /// block, a ring moving 2 (n − 1) / n of it over each GPU's link.
    fn step(&self, n: f64, batch: f64) -> (f64, f64) {
        let weights = self.params() * BYTES / n;
        let kv = batch * CONTEXT * self.kv_bytes_per_token() / n;
        let compute = ((weights + kv) / HBM).max(2.0 * self.params() * batch / n / FLOPS);
        let message = batch * self.all_reduce_bytes_per_token();
        let comm = if n > 1.0 {
            2.0 * self.layers * (ALPHA + 2.0 * (n - 1.0) / n * message / LINK)
        } else {
            0.0
        };
        (compute + comm, comm)
    }
    // ANCHOR_END: step_time
}

/// The cost-model table and plot.
pub fn figures(facts: &RunFacts) -> (String, String) {
    let mut table = Table::new([
        "model",
        "weights (GB)",
        "KV per token (KiB)",
        "all-reduced per layer per token",
        "GPUs",
        "batch",
        "fits one H200",
        "predicted ms/step",
        "of it all-reduce",
        "predicted speed-up",
    ]);
    let mut plot = LinePlot::new("Predicted decode speed-up, 8 x H200 on NVLink")
        .x_label("GPUs (tensor-parallel size)")
        .y_label("speed-up over 1 GPU")
        .reference("ideal", &[(1.0, 1.0), (8.0, 8.0)]);
    for shape in [LLAMA_8B, LLAMA_70B] {
        for batch in [1.0, 64.0] {
            let (one, _) = shape.step(1.0, batch);
            let mut points = Vec::new();
            for n in [1.0, 2.0, 4.0, 8.0] {
                let (t, comm) = shape.step(n, batch);
                let need =
                    (shape.params() * BYTES + batch * CONTEXT * shape.kv_bytes_per_token()) / n;
                table.row([
                    shape.name.to_string(),
                    format!("{:.1}", shape.params() * BYTES / 1e9),
                    format!("{:.0}", shape.kv_bytes_per_token() / 1024.0),
                    format!("2 x {:.0} KiB", shape.all_reduce_bytes_per_token() / 1024.0),
                    format!("{n}"),
                    format!("{batch}"),
                    if need <= HBM_CAPACITY { "yes" } else { "no" }.to_string(),
                    format!("{:.2}", t * 1e3),
                    format!("{:.0}%", 100.0 * comm / t),
                    format!("{:.2}x", one / t),
                ]);
                points.push((n, one / t));
            }
            plot = plot.series(format!("{} batch {batch}", shape.name), &points);
        }
    }
    let markdown = format!(
        "{}\n**Predicted, not measured.** Assumptions: bf16 weights, activations and KV; each GPU \
         reads its share of weights and KV at {:.1} TB/s unless its FLOPs at {:.0} TFLOP/s take \
         longer (the read rate is the device-to-device copy kiln measured on an H200, chapter 7's \
         table; the GEMM rate an assumption for cuBLAS bf16 on an H200, never measured by kiln); \
         {CONTEXT} positions of KV per sequence; two ring all-reduces of [batch, hidden] per \
         layer over {:.0} GB/s NVLink per GPU plus an assumed {:.0} µs fixed cost each; no \
         overlap of communication with compute; the embedding's all-reduce and the logits' \
         all-gather left out. \"Fits\": weights + KV of the batch per GPU within {:.0} GB. \
         Written by `{}` ({}).\n",
        table.to_markdown(),
        HBM / 1e12,
        FLOPS / 1e12,
        LINK / 1e9,
        ALPHA * 1e6,
        HBM_CAPACITY / 1e9,
        facts.command,
        facts.date,
    );
    (markdown, plot.to_svg())
}
