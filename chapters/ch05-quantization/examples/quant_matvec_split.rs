//! How the integer decode product (`matvec`) should split a layer's projections across
//! threads: evenly, one contiguous run of rows per thread (the default, as chapter 2's decode
//! product), or four tasks per thread (as before): one token through every projection of every
//! layer, on one thread and on all, with SmolLM2 quantized on load to Q8_0, Q4_0 and Q4_K
//! (whose 576-wide layers fall back to Q5_0) and, given its path, a GGUF file. The two ways
//! alternate within one process, so that the machine's drift falls on both alike; the results
//! are the same bits either way. Prints the median GB/s of weights read.
//!
//! `cargo run --release -p ch05-quantization --example quant_matvec_split -- MODEL_DIR [GGUF]`

use ch01::{Llama, LlamaConfig};
use ch02::kernels::set_even_split;
use ch05_quantization::{GgmlType, QuantLoader, load_gguf};
use ndarray::Array2;

// Chapter 2's pass over every projection of every layer, shared with its examples.
#[path = "../../ch02-kv-cache/examples/projections/mod.rs"]
mod projections;

use projections::print_read_rates;

const ROUNDS: usize = 15;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: quant_matvec_split MODEL_DIR [GGUF]")?;
    let mut models = Vec::new();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K] {
        let model = Llama::load_with(dir.as_ref(), &QuantLoader::to(ty)?)?;
        models.push((ty.to_string(), model));
    }
    if let Some(gguf) = args.next() {
        let model = load_gguf(gguf.as_ref(), &QuantLoader::native())?.model;
        let name = std::path::Path::new(&gguf)
            .file_name()
            .map_or(gguf.clone(), |n| n.to_string_lossy().into_owned());
        models.push((name, model));
    }
    let c: &LlamaConfig = &models[0].1.config;
    let x = Array2::from_shape_fn((1, c.hidden_size), |(_, j)| (j % 13) as f32 / 13.0 - 0.5);
    let ways = ["even split".to_string(), "4 tasks per thread".to_string()];
    print_read_rates(&models, &x, &ways, ROUNDS, |i| set_even_split(i == 0))?;
    set_even_split(true);
    Ok(())
}
