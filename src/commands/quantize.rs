//! `kiln quantize`: a Hugging Face checkpoint → a GGUF file that kiln and llama.cpp both load
//! (chapter 5's `gguf::convert`, `--type`), or → a GPTQ / AWQ / round-to-nearest Hugging Face
//! directory that kiln, vLLM and transformers load (chapter 5 part 2, `--method`), with sizes
//! and time on stdout.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use ch05::GgmlType;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json,
    /// tokenizer_config.json). Defaults to the embedded shakespeare-small.
    #[arg(long, value_name = "DIR", default_value_os_t = ch01::default_model_dir())]
    pub model: PathBuf,
    /// Type of the projection weights. K-quants fall back as llama.cpp does for layers whose
    /// input size is not a multiple of 256; the output matrix (or tied embedding) follows
    /// llama.cpp's rule (Q6_K, or Q8_0); norms stay f32.
    #[arg(long = "type", value_name = "TYPE", value_parser = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"], required_unless_present = "method", conflicts_with = "part2")]
    pub ty: Option<String>,
    /// The GGUF file (`--type`) or the model directory (`--method`) to write: a new file, or a
    /// new or empty directory (an existing one is refused, never replaced).
    #[arg(long, value_name = "FILE.gguf|DIR")]
    pub out: PathBuf,
    #[command(flatten)]
    pub part2: super::quantize_hf::Args,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    refuse_quantized(&args.model)?;
    let Some(ty_name) = &args.ty else {
        return super::quantize_hf::run(&args.model, &args.out, &args.part2);
    };
    let ty = GgmlType::from_name(ty_name).with_context(|| format!("unknown --type {ty_name}"))?;
    if args.model.is_file() {
        anyhow::bail!(
            "--model {} is a file: kiln quantize reads a Hugging Face directory (re-quantizing a \
             GGUF file is not supported)",
            args.model.display()
        );
    }
    // Refused before the conversion's minutes, not after; the writer refuses again at the end
    // (a file created meanwhile), and never replaces one.
    ch05::gguf::writer::refuse_existing(&args.out)
        .map_err(|e| anyhow::anyhow!("--out {}: {e}", args.out.display()))?;
    let start = Instant::now();
    let report = ch05::gguf::quantize_hf_dir(&args.model, ty, &args.out).with_context(|| {
        format!(
            "quantizing {} to {}",
            args.model.display(),
            args.out.display()
        )
    })?;
    let seconds = start.elapsed().as_secs_f64();
    let file_bytes = std::fs::metadata(&args.out)
        .with_context(|| format!("reading {}", args.out.display()))?
        .len();

    for warning in &report.warnings {
        eprintln!("warning: {warning}");
    }
    let fallbacks: Vec<String> = report
        .fallbacks()
        .map(|t| format!("{} ({})", t.name, t.ty))
        .collect();
    if !fallbacks.is_empty() {
        eprintln!(
            "{} projections fell back from {ty} (rows not whole blocks): {}",
            fallbacks.len(),
            fallbacks.join(", ")
        );
    }
    let mib = |b: f64| b / (1024.0 * 1024.0);
    let params = report.parameters() as f64;
    let types: Vec<String> = report
        .type_counts()
        .iter()
        .map(|(t, n)| format!("{n} {t}"))
        .collect();
    // Written, not printed: a closed pipe or a full disk is an error to report, not a panic.
    let mut stdout = std::io::stdout().lock();
    writeln!(
        stdout,
        "wrote {} ({} tensors: {})",
        args.out.display(),
        report.tensors.len(),
        types.join(", ")
    )?;
    writeln!(
        stdout,
        "before: {:.2} MiB of tensors ({:.2} bits per weight) in {}",
        mib(report.source_bytes() as f64),
        report.source_bytes() as f64 * 8.0 / params.max(1.0),
        args.model.display()
    )?;
    writeln!(
        stdout,
        "after:  {:.2} MiB of tensors ({:.2} bits per weight), file {:.2} MiB ({file_bytes} bytes)",
        mib(report.tensor_bytes() as f64),
        report.bits_per_weight(),
        mib(file_bytes as f64)
    )?;
    writeln!(stdout, "{:.0} weights in {seconds:.2} s", params)?;
    Ok(())
}

/// Refuses a checkpoint that is already quantized (its config.json has a
/// `quantization_config`): both quantizers read dense weights, which it does not have.
fn refuse_quantized(model: &std::path::Path) -> anyhow::Result<()> {
    let path = model.join("config.json");
    if model.is_file() || !path.is_file() {
        return Ok(()); // a GGUF file or a missing config: the quantizer says what is wrong
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    if let Some(quantization) = config.get("quantization_config").filter(|q| !q.is_null()) {
        let method = quantization.get("quant_method").and_then(|m| m.as_str());
        anyhow::bail!(
            "--model {} is already quantized ({}): kiln quantize reads a dense checkpoint",
            model.display(),
            method.unwrap_or("its config.json has a quantization_config")
        );
    }
    Ok(())
}
