//! What the projection examples share: one pass over every projection of every layer of a
//! model (q, k, v, o, gate, up, down), each into its own output, the bytes of its weights,
//! ways of a measurement alternated round by round within one process, and a table of the
//! rates at which one token's pass reads each model's weights, way by way.

use std::time::Instant;

use ch01::Llama;
use ndarray::Array2;

/// One pass: every projection of every layer on `x` [T, hidden], each into its own output.
pub fn pass(model: &Llama, x: &Array2<f32>) -> f64 {
    let c = &model.config;
    let n = x.nrows();
    let head_dim = c.hidden_size / c.num_attention_heads;
    let kv_dim = c.num_key_value_heads * head_dim;
    let mut q = Array2::zeros((n, c.num_attention_heads * head_dim));
    let mut kv = Array2::zeros((n, kv_dim));
    let mut wide = Array2::zeros((n, c.intermediate_size));
    let mut narrow = Array2::zeros((n, c.hidden_size));
    let h = Array2::from_shape_fn((n, c.intermediate_size), |(i, j)| {
        ((i * 17 + j * 5) % 11) as f32 / 11.0 - 0.5
    }); // down_proj's input [T, intermediate]
    let start = Instant::now();
    for layer in &model.layers {
        let (a, m) = (&layer.self_attn, &layer.mlp);
        a.q_proj.forward_into(x.view(), q.view_mut());
        a.k_proj.forward_into(x.view(), kv.view_mut());
        a.v_proj.forward_into(x.view(), kv.view_mut());
        a.o_proj.forward_into(q.view(), narrow.view_mut());
        m.gate_proj.forward_into(x.view(), wide.view_mut());
        m.up_proj.forward_into(x.view(), wide.view_mut());
        m.down_proj.forward_into(h.view(), narrow.view_mut());
    }
    start.elapsed().as_secs_f64() * 1e3
}

/// Bytes of weights one [`pass`] reads: the model's projections without its output head.
pub fn bytes(model: &Llama) -> usize {
    model.projection_bytes() - model.lm_head.weight_bytes()
}

/// The median ms of each of `ways` ways of a measurement: `run(way)` sets the way up and
/// returns its ms. Every round runs each way once, a different one first each round, so that
/// this machine's drift falls on all alike; a first round, which warms the caches and the
/// thread pool, is not counted.
pub fn alternate(ways: usize, rounds: usize, mut run: impl FnMut(usize) -> f64) -> Vec<f64> {
    let mut ms = vec![Vec::new(); ways];
    for round in 0..rounds + 1 {
        for way in 0..ways {
            let way = (way + round) % ways;
            let took = run(way);
            if round > 0 {
                ms[way].push(took);
            }
        }
    }
    ms.into_iter()
        .map(|mut v| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        })
        .collect()
}

/// Prints a markdown table of GB/s of weights read by one token's [`pass`] (the same fixed
/// input [1, hidden] for every model), a row per model (named) and thread count (one, then
/// every CPU), a column per way (`ways`, their headers): `set(way)` sets a way up before each
/// pass, and the ways alternate ([`alternate`], `rounds` rounds, medians).
pub fn print_read_rates(
    models: &[(String, Llama)],
    ways: &[String],
    rounds: usize,
    set: impl Fn(usize) + Sync,
) -> Result<(), rayon::ThreadPoolBuildError> {
    let hidden = models.first().map_or(0, |(_, m)| m.config.hidden_size);
    let x = &Array2::from_shape_fn((1, hidden), |(_, j)| (j % 13) as f32 / 13.0 - 0.5);
    println!("| weights | threads | {} |", ways.join(" | "));
    println!("|---|---:|{}", "---:|".repeat(ways.len()));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for threads in [1, cpus] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()?;
        for (name, model) in models {
            let bytes = bytes(model) as f64;
            let ms = pool.install(|| {
                alternate(ways.len(), rounds, |way| {
                    set(way);
                    pass(model, x)
                })
            });
            let cells: Vec<String> = ms
                .into_iter()
                .map(|ms| format!("{:.1}", bytes / ms / 1e6))
                .collect();
            println!("| {name} | {threads} | {} |", cells.join(" | "));
        }
    }
    Ok(())
}
