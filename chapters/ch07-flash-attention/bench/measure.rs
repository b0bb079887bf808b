//! The measurements of `kiln bench ch07`: attention alone, on random Q, K, V of one layer.

use std::path::Path;
use std::time::{Duration, Instant};

use ch01::LlamaConfig;
use ch01::attention::AttentionShape;
use ch02::kernels::Isa;
use ch02::workload::WorkloadRng;
use ch03::KvPool;
use ch04::attention::{AttentionBackend, QueryRow, batch_attention};
use ch07::{FlashAttention, FlashParams, Partitions};
use ndarray::Array2;

use crate::bench::alloc::peak_during;

/// SmolLM2-135M's attention: 9 query heads sharing 3 KV heads of 64 (GQA), the shape of the
/// model the other chapters measure.
pub const SHAPE: AttentionShape = AttentionShape {
    num_heads: 9,
    num_kv_heads: 3,
    head_dim: 64,
};

/// Block size of the pools (vLLM's default, and `kiln`'s).
pub const BLOCK_SIZE: usize = 16;

fn random(rng: &mut WorkloadRng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| rng.uniform_open0() as f32 * 2.0 - 1.0)
        .collect()
}

/// One layer's random K/V for `len` positions in a paged f32 pool, the sequence's blocks in
/// reverse order (scattered), and `rows` query rows at its last positions.
pub struct Layer {
    pub pool: KvPool<f32>,
    pub blocks: Vec<u32>,
    pub q: Vec<f32>, // [rows, num_heads · d]
    pub first_pos: usize,
}

impl Layer {
    pub fn new(shape: AttentionShape, len: usize, rows: usize, seed: u64) -> anyhow::Result<Layer> {
        let json = format!(
            r#"{{"model_type": "llama", "vocab_size": 8, "hidden_size": {hidden},
                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": {heads},
                "num_key_value_heads": {kv}, "head_dim": {d}, "max_position_embeddings": {len},
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0}}"#,
            hidden = shape.num_heads * shape.head_dim,
            heads = shape.num_heads,
            kv = shape.num_kv_heads,
            d = shape.head_dim,
        );
        let config = LlamaConfig::from_json(&json, Path::new("bench/config.json"))?;
        let num_blocks = len.div_ceil(BLOCK_SIZE);
        let mut pool = KvPool::<f32>::new(&config, BLOCK_SIZE, num_blocks)?;
        let blocks: Vec<u32> = (0..num_blocks as u32).rev().collect();
        let kv_dim = shape.num_kv_heads * shape.head_dim;
        let mut rng = WorkloadRng::new(seed);
        for pos in 0..len {
            let k = Array2::from_shape_vec((1, kv_dim), random(&mut rng, kv_dim))?;
            let v = Array2::from_shape_vec((1, kv_dim), random(&mut rng, kv_dim))?;
            let slot = blocks[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE;
            pool.write(0, slot, k.row(0), v.row(0));
        }
        let q = random(&mut rng, rows * shape.num_heads * shape.head_dim);
        Ok(Layer {
            pool,
            blocks,
            q,
            first_pos: len - rows,
        })
    }

    pub fn rows(&self) -> Vec<QueryRow<'_>> {
        let n = self.q.len() / (SHAPE.num_heads * SHAPE.head_dim);
        (0..n)
            .map(|i| QueryRow {
                blocks: &self.blocks,
                pos: self.first_pos + i,
            })
            .collect()
    }
}

/// Median wall time of `reps` runs of `f` after one untimed run.
pub fn median(reps: usize, mut f: impl FnMut()) -> Duration {
    f();
    let mut times: Vec<Duration> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}

/// Prefill attention of one `len`-token sequence: (chapter 4's batch_attention, flash).
pub fn prefill(len: usize, reps: usize) -> anyhow::Result<(Duration, Duration)> {
    let layer = Layer::new(SHAPE, len, len, len as u64)?;
    let rows = layer.rows();
    let mut out = vec![0.0; layer.q.len()];
    let isa = Isa::detect();
    let naive = median(reps, || {
        batch_attention(isa, &layer.pool, 0, &rows, &layer.q, SHAPE, &mut out)
    });
    let mut flash = FlashAttention::new();
    let flash_time = median(reps, || {
        flash.attend(&layer.pool, 0, &rows, &layer.q, SHAPE, &mut out)
    });
    Ok((naive, flash_time))
}

/// Decode of one sequence at context `len` (one query row at position len − 1):
/// (batch_attention, flash with one partition, flash split-K with automatic partitions).
pub fn decode(len: usize, reps: usize) -> anyhow::Result<(Duration, Duration, Duration, usize)> {
    let layer = Layer::new(SHAPE, len, 1, len as u64 + 1)?;
    let rows = layer.rows();
    let mut out = vec![0.0; layer.q.len()];
    let isa = Isa::detect();
    let naive = median(reps, || {
        batch_attention(isa, &layer.pool, 0, &rows, &layer.q, SHAPE, &mut out)
    });
    let one = FlashParams {
        partitions: Partitions::Fixed(1),
        ..FlashParams::default()
    };
    let mut single = FlashAttention::with_params(isa, one);
    let single_time = median(reps, || {
        single.attend(&layer.pool, 0, &rows, &layer.q, SHAPE, &mut out)
    });
    let mut split = FlashAttention::new();
    let split_time = median(reps, || {
        split.attend(&layer.pool, 0, &rows, &layer.q, SHAPE, &mut out)
    });
    let parts = Partitions::Auto.count(len, 1);
    Ok((naive, single_time, split_time, parts))
}

/// Peak heap bytes beyond the inputs during one attention call over a `len`-token prompt of
/// one head of 64 (`MEMORY_SHAPE`): chapter 1's naive attention (if `run_naive`), and flash.
pub fn memory(len: usize, run_naive: bool) -> anyhow::Result<(Option<usize>, usize)> {
    let shape = MEMORY_SHAPE;
    let mut rng = WorkloadRng::new(len as u64);
    let d = shape.head_dim;
    let q = Array2::from_shape_vec((len, d), random(&mut rng, len * d))?;
    let k = Array2::from_shape_vec((len, d), random(&mut rng, len * d))?;
    let v = Array2::from_shape_vec((len, d), random(&mut rng, len * d))?;
    let naive = if run_naive {
        let (out, peak) =
            peak_during(|| ch07::naive_attention(q.view(), k.view(), v.view(), shape));
        std::hint::black_box(out?);
        Some(peak)
    } else {
        None
    };
    let (out, flash) = peak_during(|| ch07::flash_attention(q.view(), k.view(), v.view(), shape));
    std::hint::black_box(out?);
    Ok((naive, flash))
}

/// One head of 64: the naive path's score matrix is per head, so one head shows it whole.
pub const MEMORY_SHAPE: AttentionShape = AttentionShape {
    num_heads: 1,
    num_kv_heads: 1,
    head_dim: 64,
};
