//! How the integer decode product (`matvec`) should split a layer's projections across
//! threads: evenly, one contiguous run of rows per thread (the default, as chapter 2's decode
//! product), or tasks of at most 64 rows (as before): one token through every projection of every
//! layer, on one thread and on all, with SmolLM2 quantized on load to Q8_0, Q4_0 and Q4_K
//! (whose 576-wide layers fall back to Q5_0) and, given its path, a GGUF file. The two ways
//! alternate within one process, so that the machine's drift falls on both alike; the results
//! are the same bits either way. Prints the median GB/s of weights read.
//!
//! `cargo run --release -p ch05-quantization --example quant_matvec_split -- MODEL_DIR [GGUF]`

use ch02::kernels::set_even_split;

// Chapter 2's pass over every projection of every layer, shared with its examples.
#[path = "../../ch02-kv-cache/examples/projections/mod.rs"]
mod projections;
mod quant_models;

use projections::print_read_rates;

const ROUNDS: usize = 15;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: quant_matvec_split MODEL_DIR [GGUF]")?;
    let models = quant_models::load(&dir, args.next().as_deref())?;
    let ways = [
        "even split".to_string(),
        "tasks of at most 64 rows".to_string(),
    ];
    print_read_rates(&models, &ways, ROUNDS, |i| set_even_split(i == 0))?;
    set_even_split(true);
    Ok(())
}
