//! `kiln quantize --method gptq|awq|rtn --model DIR --out DIR2`: chapter 5 part 2's
//! quantizers, calibrated on the Shakespeare training text (never Hamlet, the evaluation
//! text), written in the Hugging Face GPTQ or AWQ layout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use ch05::gptq::GptqConfig;
use ch05::hf_quant::{HfQuantConfig, QuantMethod, check_model, write_quantized_dir};
use ch05::model_quant::{Method, quantize_model};

#[derive(clap::Args, Debug, Clone)]
#[group(id = "part2")]
pub struct Args {
    /// Quantize with GPTQ, AWQ or round-to-nearest into a Hugging Face directory (instead of
    /// `--type`). rtn and gptq write GPTQ's layout, awq AWQ's GEMM layout.
    #[arg(long, value_parser = ["gptq", "awq", "rtn"])]
    pub method: Option<String>,
    /// Input columns per group [default: 128; awq: 64, since AWQ's layout needs it to divide
    /// every input size and SmolLM2's 576 is not a multiple of 128].
    #[arg(long, value_name = "G")]
    pub group_size: Option<usize>,
    /// GPTQ's act-order (`desc_act`): columns by decreasing Hessian diagonal (gptq only).
    #[arg(long)]
    pub act_order: bool,
    /// An asymmetric grid with a zero point per group (gptq, rtn; awq always has one).
    #[arg(long)]
    pub asym: bool,
    /// The layout to write [default: awq for awq, else gptq]. GPTQ's stores a zero point of 0
    /// as −1 and cannot write one: an asymmetric rtn is better written as awq.
    #[arg(long, value_parser = ["gptq", "awq"])]
    pub format: Option<String>,
    /// Calibration text [default: fixtures/.cache/train.txt, the training plays; made by
    /// `python fixtures/scripts/corpus.py`].
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Calibration samples (1 to 4096).
    #[arg(long, default_value_t = 32, value_name = "N")]
    pub samples: usize,
    /// Tokens per calibration sample (1 to 32768).
    #[arg(long, default_value_t = 512, value_name = "L")]
    pub seq_len: usize,
}

impl Args {
    /// The quantizer and the `quantization_config` these options name.
    pub fn method(&self) -> anyhow::Result<(Method, HfQuantConfig)> {
        let name = self.method.as_deref().context("--method is required")?;
        let default_group = if name == "awq" { 64 } else { 128 };
        let group_size = self.group_size.unwrap_or(default_group);
        if group_size == 0 {
            bail!("--group-size must be at least 1");
        }
        if self.act_order && name != "gptq" {
            bail!("--act-order orders GPTQ's columns: it does not apply to --method {name}");
        }
        let gptq_config = HfQuantConfig {
            method: QuantMethod::Gptq,
            group_size: Some(group_size),
            desc_act: false,
            sym: !self.asym,
            damp_percent: 0.01,
        };
        Ok(match name {
            "rtn" => (
                Method::Rtn {
                    group_size,
                    symmetric: !self.asym,
                },
                match self.format.as_deref() {
                    Some("awq") if !self.asym => bail!("AWQ's layout is asymmetric: add --asym"),
                    Some("awq") => HfQuantConfig {
                        method: QuantMethod::Awq,
                        ..gptq_config
                    },
                    _ => gptq_config,
                },
            ),
            "gptq" | "awq" if self.format.as_deref().is_some_and(|f| f != name) => {
                bail!("--method {name} writes its own layout (--format {name})")
            }
            "gptq" => (
                Method::Gptq(GptqConfig {
                    group_size,
                    symmetric: !self.asym,
                    act_order: self.act_order,
                    ..GptqConfig::default()
                }),
                HfQuantConfig {
                    desc_act: self.act_order,
                    ..gptq_config
                },
            ),
            "awq" => (
                Method::Awq {
                    group_size,
                    tokens: 512,
                },
                HfQuantConfig {
                    method: QuantMethod::Awq,
                    sym: false,
                    ..gptq_config
                },
            ),
            other => bail!("unknown --method {other}"),
        })
    }
}

/// The most calibration samples, and tokens in each: bounds on the work and memory one
/// command line asks for (the defaults are 32 and 512).
pub const MAX_SAMPLES: usize = 4096;
pub const MAX_SEQ_LEN: usize = 32768;

/// `samples` windows of `seq_len` tokens from `text`, at evenly spaced places.
pub fn calibration_samples(
    tokenizer: &ch01::Tokenizer,
    text: &str,
    samples: usize,
    seq_len: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    if !(1..=MAX_SAMPLES).contains(&samples) || !(1..=MAX_SEQ_LEN).contains(&seq_len) {
        bail!(
            "--samples {samples} and --seq-len {seq_len}: calibration takes 1 to {MAX_SAMPLES} \
             samples of 1 to {MAX_SEQ_LEN} tokens"
        );
    }
    let window = seq_len * 8; // bytes: comfortably more than seq_len tokens of English
    if text.len() < window {
        bail!(
            "the calibration text has {} bytes, fewer than {window}",
            text.len()
        );
    }
    let stride = (text.len() - window) / samples.max(1);
    let mut out = Vec::new();
    // The window's ends move forward to character boundaries, never past the text's end
    // (which is one).
    let boundary = |mut at: usize| {
        while at < text.len() && !text.is_char_boundary(at) {
            at += 1;
        }
        at.min(text.len())
    };
    for k in 0..samples {
        let start = boundary(k * stride);
        let end = boundary(start + window);
        let tokens = tokenizer.encode(&text[start..end], false)?;
        if tokens.len() < seq_len {
            bail!(
                "a calibration window of {window} bytes holds only {} tokens",
                tokens.len()
            );
        }
        out.push(tokens[..seq_len].to_vec());
    }
    Ok(out)
}

/// The default calibration text.
pub fn default_calibration() -> PathBuf {
    ch01::fixtures_dir().join(".cache/train.txt")
}

pub fn run(model_dir: &Path, out: &Path, args: &Args) -> anyhow::Result<()> {
    if model_dir.is_file() {
        bail!(
            "--method reads a Hugging Face directory, not {}",
            model_dir.display()
        );
    }
    // Before any work: the writer refuses it too, but only once every layer is quantized.
    super::refuse_non_empty(out)?;
    let start = Instant::now();
    let report = quantize_dir(model_dir, out, args)?;
    writeln!(
        std::io::stdout(),
        "wrote {} ({} projections, {}) in {:.1} s",
        out.display(),
        report.layers.len(),
        args.method.as_deref().unwrap_or(""),
        start.elapsed().as_secs_f64()
    )?;
    for (group, alpha, error, rtn) in &report.awq {
        eprintln!(
            "awq {group}: alpha {alpha:.2}, output error {error:.4e} (round-to-nearest {rtn:.4e})"
        );
    }
    Ok(())
}

/// Quantizes `model_dir` into `out`; returns what was quantized.
pub fn quantize_dir(
    model_dir: &Path,
    out: &Path,
    args: &Args,
) -> anyhow::Result<ch05::model_quant::QuantizedModel> {
    let (method, config) = args.method()?;
    let weights = ch01::Weights::open(model_dir)?;
    let mut model = ch01::Llama::load_with(
        model_dir,
        &ch02::FastLoader {
            dtype: ch02::WeightDtype::F32,
        },
    )?;
    // Before calibrating: a layout the loader could not read back (AWQ's needs the group size
    // to divide every projection's input size) is refused now, not after the work.
    check_model(&config, &model.config).with_context(|| {
        format!(
            "{} cannot be written in the {:?} layout with --group-size {}",
            model_dir.display(),
            config.method,
            config.group_size.unwrap_or(0)
        )
    })?;
    let samples = if matches!(method, Method::Rtn { .. }) {
        Vec::new()
    } else {
        let path = args.calibration.clone().unwrap_or_else(default_calibration);
        let text = super::read_text_file(&path).with_context(|| {
            format!("reading the calibration text {} (make it with `python fixtures/scripts/corpus.py`)", path.display())
        })?;
        if path.ends_with("hamlet.txt") {
            bail!("Hamlet is the held-out evaluation text: calibrate on the training text");
        }
        let tokenizer = ch01::Tokenizer::from_dir(model_dir)?;
        calibration_samples(&tokenizer, &text, args.samples, args.seq_len)?
    };
    let start = Instant::now();
    let mut progress = |l: usize| {
        eprintln!(
            "  layer {l} quantized ({:.1} s)",
            start.elapsed().as_secs_f64()
        );
    };
    let result = quantize_model(&mut model, &weights, &samples, &method, &mut progress)?;
    write_quantized_dir(model_dir, out, &config, &result.layers, &result.dense)?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::{Args, calibration_samples};

    /// `--act-order` orders GPTQ's columns: with round-to-nearest or AWQ it is refused, as the
    /// other flags that do not apply are. It used to be dropped silently (`desc_act: false`).
    #[test]
    fn act_order_is_refused_where_it_does_not_apply() {
        let args = |method: &str| Args {
            method: Some(method.into()),
            group_size: None,
            act_order: true,
            asym: method == "awq",
            format: None,
            calibration: None,
            samples: 32,
            seq_len: 512,
        };
        for method in ["rtn", "awq"] {
            let error = args(method).method().map(|(_, c)| c).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!(
                    "--act-order orders GPTQ's columns: it does not apply to --method {method}"
                )
            );
        }
        assert!(args("gptq").method().unwrap().1.desc_act);
    }

    /// A window that starts inside a character near the text's end: its end moves to the
    /// text's end (it once looked for a character boundary past it, forever).
    #[test]
    fn calibration_windows_stop_at_the_texts_end() {
        let tokenizer = ch01::Tokenizer::from_dir(&ch01::fixtures_dir().join("tokenizer")).unwrap();
        let text = format!("{}😀bbbbbb", "a".repeat(40));
        let samples = calibration_samples(&tokenizer, &text, 42, 1).unwrap();
        assert_eq!(samples.len(), 42);
        assert!(samples.iter().all(|s| s.len() == 1));
    }
}
