//! Whether products that read the same input should run joined (`rayon::join`, one parallel
//! region) or one after the other, on a model's own projections: q/k/v as `join(q, join(k, v))`
//! against `q` then `join(k, v)`, and gate/up joined against one after the other, each a pass
//! over every layer, for several token counts. The orders alternate within one process, so the
//! machine's drift falls on all alike; prints the mean and the fastest of the rounds in ms.
//! Each pass runs inside [`awake`], as the engine's steps do (the pool's other threads spinning
//! between the products), unless `--asleep` is given; `--bf16` stores the weights in bf16.
//!
//! `cargo run --release -p ch02-kv-cache --example product_order -- MODEL_DIR [--bf16]
//! [--asleep] [TOKENS...]`

use std::time::Instant;

use ch02_kv_cache::awake::awake;
use ch02_kv_cache::{WeightDtype, load_fast};
use ndarray::Array2;

/// Total ms and fastest ms of one order over the rounds.
#[derive(Clone, Copy)]
struct Times {
    total: f64,
    best: f64,
}

impl Times {
    fn add(&mut self, ms: f64) {
        self.total += ms;
        self.best = self.best.min(ms);
    }
}

fn timed(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: product_order MODEL_DIR [--bf16] [--asleep] [TOKENS...]")?;
    let (flags, numbers): (Vec<String>, Vec<String>) = args.partition(|a| a.starts_with("--"));
    if let Some(unknown) = flags
        .iter()
        .find(|f| !["--bf16", "--asleep"].contains(&f.as_str()))
    {
        return Err(format!("unknown flag {unknown}: --bf16 and --asleep are known").into());
    }
    let dtype = match flags.iter().any(|f| f == "--bf16") {
        true => WeightDtype::Bf16,
        false => WeightDtype::F32,
    };
    let asleep = flags.iter().any(|f| f == "--asleep");
    let model = load_fast(std::path::Path::new(&dir), dtype)?;
    let mut tokens: Vec<usize> = numbers
        .iter()
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    if tokens.is_empty() {
        tokens = vec![1, 8, 16, 32, 124];
    }
    let c = &model.config;
    let head_dim = c.hidden_size / c.num_attention_heads;
    let (q_dim, kv_dim) = (
        c.num_attention_heads * head_dim,
        c.num_key_value_heads * head_dim,
    );
    println!("| tokens | q/k/v joined | q, then k/v joined | gate/up joined | gate, then up |");
    println!("|---:|---:|---:|---:|---:|");
    for n in tokens {
        let h = Array2::from_shape_fn((n, c.hidden_size), |(i, j)| {
            ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5
        }); // [n, hidden]
        let (mut q, mut k, mut v) = (
            Array2::zeros((n, q_dim)),
            Array2::zeros((n, kv_dim)),
            Array2::zeros((n, kv_dim)),
        );
        let mut gate = Array2::zeros((n, c.intermediate_size));
        let mut up = Array2::zeros((n, c.intermediate_size));
        let rounds = (2000 / n).clamp(20, 400);
        let mut times = [Times {
            total: 0.0,
            best: f64::INFINITY,
        }; 4];
        for round in 0..rounds + 2 {
            let mut ms = [0.0; 4];
            for order in 0..4 {
                // Each order over every layer in turn (a pass reads more weights than the
                // caches hold, so no order finds another's weights there), starting with a
                // different one each round.
                let order = (order + round) % 4;
                let mut pass = || {
                    for layer in &model.layers {
                        let (a, m) = (&layer.self_attn, &layer.mlp);
                        let kv = |k: &mut Array2<f32>, v: &mut Array2<f32>| {
                            rayon::join(
                                || a.k_proj.forward_into(h.view(), k.view_mut()),
                                || a.v_proj.forward_into(h.view(), v.view_mut()),
                            )
                        };
                        match order {
                            0 => {
                                rayon::join(
                                    || a.q_proj.forward_into(h.view(), q.view_mut()),
                                    || kv(&mut k, &mut v),
                                );
                            }
                            1 => {
                                a.q_proj.forward_into(h.view(), q.view_mut());
                                kv(&mut k, &mut v);
                            }
                            2 => {
                                rayon::join(
                                    || m.gate_proj.forward_into(h.view(), gate.view_mut()),
                                    || m.up_proj.forward_into(h.view(), up.view_mut()),
                                );
                            }
                            _ => {
                                m.gate_proj.forward_into(h.view(), gate.view_mut());
                                m.up_proj.forward_into(h.view(), up.view_mut());
                            }
                        }
                    }
                };
                ms[order] = timed(|| if asleep { pass() } else { awake(pass) });
            }
            if round >= 2 {
                // the first two rounds warm the caches and the thread pool
                times.iter_mut().zip(ms).for_each(|(t, ms)| t.add(ms));
            }
        }
        let cell = |t: Times| format!("{:.2} (best {:.2})", t.total / rounds as f64, t.best);
        println!(
            "| {n} | {} | {} | {} | {} |",
            cell(times[0]),
            cell(times[1]),
            cell(times[2]),
            cell(times[3])
        );
    }
    Ok(())
}
