//! Where and how far ahead the integer decode tiles must prefetch: one token through every
//! projection of every layer (the weights of a decoded token but the head, streamed from
//! memory), on one thread and on all, with SmolLM2 quantized on load to Q8_0, Q4_0 and Q4_K
//! (whose 576-wide layers fall back to Q5_0: only down_proj is Q4_K) and, given its path,
//! llama.cpp's Q4_K_M file (down_proj Q4_K or Q6_K, the others Q5_0 or Q8_0). The variants
//! alternate within one process, so that the machine's drift falls on all alike: the tiles'
//! first setting (into L1, the K-quant tiles two super-blocks ahead), then into L2 with the
//! K-quant tiles 2 super-blocks to 32 KiB ahead (the 32-element tiles always ask for the next
//! tile's block: Q8_0's and Q4_0's last five columns run the same code). Prints the median GB/s
//! of weights read.
//!
//! `cargo run --release -p ch05-quantization --example quant_prefetch_distance -- MODEL_DIR [GGUF]`

use ch05_quantization::kernels::{K_PREFETCH_BYTES, PrefetchInto, set_prefetch};

// Chapter 2's pass over every projection of every layer, shared with its examples.
#[path = "../../ch02-kv-cache/examples/projections/mod.rs"]
mod projections;
mod quant_models;

use projections::print_read_rates;

/// Two Q6_K super-blocks, rounded down to two of Q4_K too: the K-quant tiles' first distance.
const TWO_BLOCKS: usize = 3360;
const VARIANTS: [(PrefetchInto, usize); 6] = [
    (PrefetchInto::L1, TWO_BLOCKS),
    (PrefetchInto::L2, TWO_BLOCKS),
    (PrefetchInto::L2, 4096),
    (PrefetchInto::L2, 8192),
    (PrefetchInto::L2, 16384),
    (PrefetchInto::L2, 32768),
];
const ROUNDS: usize = 25;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: quant_prefetch_distance MODEL_DIR [GGUF]")?;
    let models = quant_models::load(&dir, args.next().as_deref())?;
    let ways: Vec<String> = VARIANTS
        .iter()
        .map(|&(into, d)| match d {
            TWO_BLOCKS => format!("{into:?}, 2 blocks"),
            d => format!("{into:?}, {} KiB", d / 1024),
        })
        .collect();
    print_read_rates(&models, &ways, ROUNDS, |i| {
        let (into, k_bytes) = VARIANTS[i];
        set_prefetch(into, k_bytes);
    })?;
    set_prefetch(PrefetchInto::L2, K_PREFETCH_BYTES);
    Ok(())
}
