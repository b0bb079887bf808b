//! What asking ahead for weights saves a step of several tokens, in two tables: the next weight
//! panels, into L2 (`kernels::ahead`), and the rows of the panels being multiplied, into L1
//! (`kernels::ROWS_AHEAD`), the first with the stretches below off (pairs in stretches ask for
//! no next panels); and in a third, what going through each pair of panels in stretches of
//! `kernels::STRETCH_ROWS` features, every tile in turn, saves against whole tiles one after
//! another (`kernels::set_stretches`). Each times every projection of every layer (q, k, v, o,
//! gate, up, down) on `T` tokens, the weights from memory, with the change and without,
//! alternating within one process so that the machine's drift falls on both alike, in f32 and in
//! bf16. Prints the median ms of a pass and its GFLOP/s.
//!
//! `cargo run --release -p ch02-kv-cache --example panels_ahead -- MODEL_DIR [T...]`

use ch01::Llama;
use ch02_kv_cache::awake::awake;
use ch02_kv_cache::kernels::{set_panels_ahead, set_rows_ahead, set_stretches};
use ch02_kv_cache::{WeightDtype, load_fast};
use ndarray::Array2;

#[allow(dead_code)] // the read-rate table, which the prefetch examples print
mod projections;

use projections::{alternate, bytes, pass};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().ok_or("usage: panels_ahead MODEL_DIR [T...]")?;
    let dir = std::path::Path::new(&dir);
    let bf16 = load_fast(dir, WeightDtype::Bf16)?;
    let f32 = load_fast(dir, WeightDtype::F32)?;
    let mut lengths: Vec<usize> = args.map(|a| a.parse()).collect::<Result<_, _>>()?;
    if lengths.is_empty() {
        lengths = vec![8, 12, 24, 32, 64, 96, 128, 192, 512];
    }
    // Products of 2 and 3 tiles in stretches ask for no next panels: off, so that they do.
    set_stretches(false);
    table(
        (
            "Asking ahead for the next panels, into L2",
            ["without", "ahead"],
        ),
        set_panels_ahead,
        &lengths,
        &f32,
        &bf16,
    );
    set_stretches(true);
    table(
        (
            "Asking ahead for the panels' own rows, into L1",
            ["without", "ahead"],
        ),
        set_rows_ahead,
        &lengths,
        &f32,
        &bf16,
    );
    table(
        (
            "Products of 13 to 36 tokens: whole tiles, or the pairs in stretches",
            ["whole tiles", "stretches"],
        ),
        set_stretches,
        &lengths,
        &f32,
        &bf16,
    );
    Ok(())
}

/// One table, titled `title` with the ways `[off, on]` named: every pass at each length in
/// `lengths`, with what `switch` turns on and without, alternating, in f32 and in bf16; it is
/// left on.
fn table(
    (title, [off, on]): (&str, [&str; 2]),
    switch: fn(bool),
    lengths: &[usize],
    f32: &Llama,
    bf16: &Llama,
) {
    let weights = bytes(f32) / 4; // f32 weights: 4 bytes each
    println!("\n{title}:\n");
    println!(
        "| T | f32, {off}, ms | f32, {on}, ms | gain | bf16, {off}, ms | bf16, {on}, ms | gain | GFLOP/s, {on}: f32, bf16 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &t in lengths {
        let x = Array2::from_shape_fn((t, f32.config.hidden_size), |(i, j)| {
            ((i * 31 + j * 7) % 13) as f32 / 13.0 - 0.5
        }); // [T, hidden]
        let rounds = (4000 / t).clamp(7, 41);
        let ms = alternate(4, rounds, |way| {
            switch(way % 2 == 1);
            awake(|| pass(if way < 2 { f32 } else { bf16 }, &x)) // as the engine runs a step
        });
        switch(true);
        let [f_off, f_on, b_off, b_on] = ms[..] else {
            unreachable!("four ways")
        };
        let gflops = |ms: f64| 2.0 * (t * weights) as f64 / ms / 1e6;
        let gain = |off: f64, on: f64| (off / on - 1.0) * 100.0;
        println!(
            "| {t} | {f_off:.2} | {f_on:.2} | {:+.1}% | {b_off:.2} | {b_on:.2} | {:+.1}% | {:.1}, {:.1} |",
            gain(f_off, f_on),
            gain(b_off, b_on),
            gflops(f_on),
            gflops(b_on)
        );
    }
}
