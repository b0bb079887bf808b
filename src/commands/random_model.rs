//! `kiln random-model`: a Hugging Face Llama directory with random weights (chapter 1's
//! `random_model`), for GPU benchmarks at a real size (`--preset llama-1b`, nothing to
//! download) and tests of shapes the fixtures lack (`--preset tiny-d64`: `head_dim` 64).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use ch01::{RandomModelSpec, write_random_model};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The shape: llama-1b (Llama-3.2-1B: 16 layers, head_dim 64, vocab 128256, bf16, 2.5 GB)
    /// or tiny-d64 (2 layers, head_dim 64, vocab 4096, f32, 9 MB).
    #[arg(long, default_value = "llama-1b", value_parser = RandomModelSpec::PRESETS)]
    pub preset: String,
    /// Number of decoder layers instead of the preset's (a smaller model of the same width).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub layers: Option<u32>,
    /// Storage of the weights instead of the preset's.
    #[arg(long, value_parser = ["f32", "bf16"])]
    pub dtype: Option<String>,
    /// Seed of the weights: the same seed writes the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The directory to write (created if missing; refused if it is not empty).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let spec = spec(&args)?;
    super::refuse_non_empty(&args.out)?;
    // The weights are generated in memory, then written.
    let bytes = spec.parameter_count() as u64 * spec.dtype.size() as u64;
    if let Some(available) = super::available_memory()
        && bytes > available
    {
        anyhow::bail!(
            "the weights take {:.1} GiB, generated in memory before they are written, and \
             {:.1} GiB are available: use fewer --layers",
            bytes as f64 / f64::from(1u32 << 30),
            available as f64 / f64::from(1u32 << 30)
        );
    }
    let start = Instant::now();
    // All at once: a failure (a full disk) leaves no directory that a rerun would refuse.
    ch01::new_dir::write_new_dir(
        &args.out,
        |dir| write_random_model(&spec, dir).map_err(anyhow::Error::from),
        |path, e| anyhow::Error::from(e).context(format!("writing {}", path.display())),
    )
    .with_context(|| format!("writing a random model to {}", args.out.display()))?;
    let seconds = start.elapsed().as_secs_f64();

    let weights = args.out.join("model.safetensors");
    let bytes = std::fs::metadata(&weights)
        .with_context(|| format!("reading {}", weights.display()))?
        .len();
    eprintln!(
        "wrote {} ({}, {} layers, head_dim {}, {}, seed {}): {} parameters, \
         model.safetensors {:.1} MiB, in {seconds:.1} s",
        args.out.display(),
        args.preset,
        spec.num_hidden_layers,
        spec.head_dim,
        spec.dtype.hf_name(),
        spec.seed,
        millions_or_billions(spec.parameter_count()),
        bytes as f64 / (1024.0 * 1024.0),
    );
    Ok(())
}

/// `2.23M`, `1.236B`.
fn millions_or_billions(n: usize) -> String {
    match n as f64 {
        n if n >= 1e9 => format!("{:.3}B", n / 1e9),
        n => format!("{:.2}M", n / 1e6),
    }
}

/// Most `--layers` (Llama-3.1-405B has 126).
const MAX_LAYERS: u32 = 1024;

/// The preset with the flags' overrides applied.
fn spec(args: &Args) -> anyhow::Result<RandomModelSpec> {
    let mut spec = RandomModelSpec::preset(&args.preset)?;
    if let Some(layers) = args.layers {
        anyhow::ensure!(
            (1..=MAX_LAYERS).contains(&layers),
            "--layers must be from 1 to {MAX_LAYERS}"
        );
        spec.num_hidden_layers = layers as usize;
    }
    if let Some(dtype) = &args.dtype {
        spec.dtype = dtype.parse()?;
    }
    spec.seed = args.seed;
    Ok(spec)
}
