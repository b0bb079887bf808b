//! What 2 MiB pages buy decode: the projections of one token (every layer's, and the output
//! head) packed twice in one process, once on the heap (4 KiB pages) and once in weight memory
//! (`weight_memory`, 2 MiB pages where the system gives them), then alternately streamed by
//! `matvec` as one decode step streams them. Prints the median and best GB/s of each over the
//! rounds, and how much of the process is on huge pages.
//!
//! `cargo run --release -p ch02-kv-cache --example weight_pages -- MODEL_DIR [f32|bf16] [ROUNDS]`
//!
//! The weights' values are synthetic: only the model's shapes (its `config.json`) matter.

use std::path::Path;
use std::time::Instant;

use rayon::prelude::*;

use ch01::config::LlamaConfig;
use ch02_kv_cache::WeightDtype;
use ch02_kv_cache::kernels::{Isa, PackedWeight, WeightElement, matvec};
use ch02_kv_cache::weight_memory::huge_page_bytes;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    pool.install(compare)
        .map_err(|e| e as Box<dyn std::error::Error>)
}

fn compare() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: weight_pages MODEL_DIR [f32|bf16] [ROUNDS]";
    let config = LlamaConfig::from_dir(Path::new(&args.next().ok_or(usage)?))?;
    let dtype: WeightDtype = args.next().unwrap_or_else(|| "f32".into()).parse()?;
    let rounds: usize = args.next().map_or(Ok(15), |r| r.parse())?;
    match dtype {
        WeightDtype::F32 => run::<f32>(&config, rounds, "f32"),
        WeightDtype::Bf16 => run::<u16>(&config, rounds, "bf16"),
    }
    Ok(())
}

/// `(out, in)` of every projection one decode step streams, each its own weight as in the
/// model: per layer q, k, v, o, gate, up and down; then the output head.
fn shapes(c: &LlamaConfig) -> Vec<(usize, usize)> {
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let (hidden, inter) = (c.hidden_size, c.intermediate_size);
    let layer = [
        (q, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, q),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
    ];
    let mut all: Vec<_> = (0..c.num_hidden_layers).flat_map(|_| layer).collect();
    all.push((c.vocab_size, c.hidden_size));
    all
}

fn run<W: WeightElement>(config: &LlamaConfig, rounds: usize, name: &str) {
    let shapes = shapes(config);
    let widest = shapes.iter().map(|&(o, i)| o * i).max().unwrap_or(0);
    let values: Vec<f32> = (0..widest).map(|i| ((i * 7) % 13) as f32 * 0.01).collect();
    let heap: Vec<PackedWeight<W>> = shapes
        .iter()
        .map(|&(o, i)| PackedWeight::pack_rows(o, i, |r| &values[r * i..][..i]))
        .collect();
    let before = huge_page_bytes().unwrap_or(0);
    let weights: Vec<PackedWeight<W>> = shapes
        .iter()
        .map(|&(o, i)| PackedWeight::pack(&values[..o * i], o, i))
        .collect();
    let huge = huge_page_bytes().unwrap_or(0).saturating_sub(before);
    let bytes: usize = weights.iter().map(PackedWeight::bytes).sum();
    let in_memory = weights.iter().filter(|w| w.in_weight_memory()).count();

    let isa = Isa::detect();
    let x = vec![0.5f32; shapes.iter().map(|s| s.1).max().unwrap_or(0)];
    let mut y = vec![0.0f32; shapes.iter().map(|s| s.0).max().unwrap_or(0)];
    let mut sweep = |set: &[PackedWeight<W>]| {
        let start = Instant::now();
        for w in set {
            matvec(isa, w, &x[..w.in_features()], &mut y[..w.out_features()]);
        }
        bytes as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    // Reading alone, as the read probe does: every element summed, panels split across threads.
    let read = |set: &[PackedWeight<W>]| {
        let start = Instant::now();
        let mut total = 0.0f32;
        for w in set {
            total += (0..w.num_panels())
                .into_par_iter()
                .map(|p| sum(w.panel(p)))
                .sum::<f32>();
        }
        std::hint::black_box(total);
        bytes as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    sweep(&heap);
    sweep(&weights); // warm-up
    let mut rates: [Vec<f64>; 4] = Default::default();
    for _ in 0..rounds.max(1) {
        rates[0].push(sweep(&heap));
        rates[1].push(sweep(&weights));
        rates[2].push(read(&heap));
        rates[3].push(read(&weights));
    }
    println!(
        "{name}: {} projections, {:.1} MB a step; {in_memory} in weight memory, {:.1} MB of it on 2 MiB pages",
        shapes.len(),
        bytes as f64 / 1e6,
        huge as f64 / 1e6
    );
    let labels = [
        "matvec, heap (4 KiB pages)",
        "matvec, weight memory",
        "read, heap (4 KiB pages)",
        "read, weight memory",
    ];
    for (label, rates) in labels.iter().zip(&rates) {
        println!(
            "{label:>28}: median {:.1} GB/s, best {:.1}",
            median(rates),
            best(rates)
        );
    }
}

/// The elements' sum in 16 lanes, as the read probe adds (vectorised by the compiler).
fn sum<W: WeightElement>(elements: &[W]) -> f32 {
    let mut lanes = [0.0f32; 16];
    for c in elements.chunks_exact(16) {
        for l in 0..16 {
            lanes[l] += c[l].to_f32();
        }
    }
    lanes.iter().sum()
}

fn median(rates: &[f64]) -> f64 {
    let mut sorted = rates.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}

fn best(rates: &[f64]) -> f64 {
    rates.iter().copied().fold(0.0, f64::max)
}
