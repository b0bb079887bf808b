//! What widening each bf16 weight panel once per product saves a prefill: every projection of
//! every layer (q, k, v, o, gate, up, down) on `T` tokens, with bf16 weights widened at every
//! load of the micro-kernel (as before) and once per panel into f32 (now), alternating within
//! one process so that the machine's drift falls on both alike; and the same pass on the f32
//! weights, the speed the widened panels can at most reach. Prints the median ms of a pass and
//! its GFLOP/s.
//!
//! `cargo run --release -p ch02-kv-cache --example bf16_widening -- MODEL_DIR [T...]`

use ch02_kv_cache::kernels::set_panel_widening;
use ch02_kv_cache::{WeightDtype, load_fast};
use ndarray::Array2;

#[allow(dead_code)] // the read-rate table, which the prefetch examples print
mod projections;

use projections::{alternate, bytes, pass};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: bf16_widening MODEL_DIR [T...]")?;
    let dir = std::path::Path::new(&dir);
    let bf16 = load_fast(dir, WeightDtype::Bf16)?;
    let f32 = load_fast(dir, WeightDtype::F32)?;
    let mut lengths: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    if lengths.is_empty() {
        lengths = vec![24, 48, 72, 124, 512];
    }
    let c = &bf16.config;
    let weights = bytes(&f32) / 4; // f32 weights: 4 bytes each
    println!(
        "| T | bf16, widened at every load, ms | bf16, widened once per product, ms | gain | f32, ms | GFLOP/s: every load, once, f32 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for t in lengths {
        let x = Array2::from_shape_fn((t, c.hidden_size), |(i, j)| {
            ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5
        }); // [T, hidden]
        let rounds = (4000 / t).clamp(7, 41);
        let ms = alternate(3, rounds, |way| match way {
            0 | 1 => {
                set_panel_widening(way == 1);
                pass(&bf16, &x)
            }
            _ => pass(&f32, &x),
        });
        set_panel_widening(true);
        let [every, once, full] = ms[..] else {
            unreachable!("three ways")
        };
        let gflops = |ms: f64| 2.0 * (t * weights) as f64 / ms / 1e6;
        println!(
            "| {t} | {every:.2} | {once:.2} | {:+.1}% | {full:.2} | {:.1}, {:.1}, {:.1} |",
            (every / once - 1.0) * 100.0,
            gflops(every),
            gflops(once),
            gflops(full)
        );
    }
    Ok(())
}
