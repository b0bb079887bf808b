//! Other engines on the same model, run from this benchmark so that their figures come from the
//! same machine in the same run: Hugging Face transformers (PyTorch, CPU) and llama.cpp.
//!
//! Both are optional: `just fixtures` makes the Python environment, and
//! `fixtures/scripts/build_llama_cpp.sh` builds llama.cpp's `llama-bench` and the F32/F16 GGUF
//! files of SmolLM2. A missing one is reported and left out of the table, never guessed.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use serde_json::Value;

use super::speed::Speed;

/// One reference measurement: which engine, at which precision, and how fast.
pub struct Reference {
    /// e.g. `transformers 5.23.0 (torch 2.15.0)`.
    pub engine: String,
    /// `f32`, `bf16` or `F16`: the weight storage, as the engine names it.
    pub dtype: String,
    pub speed: Speed,
}

/// What the references need to run.
pub struct Setup<'a> {
    pub model_dir: &'a Path,
    pub threads: usize,
    pub prompt: usize,
    pub decode: usize,
    pub reps: usize,
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// transformers at f32 and bf16, through `fixtures/scripts/bench_transformers.py`.
pub fn transformers(setup: &Setup) -> anyhow::Result<Vec<Reference>> {
    let python = fixtures().join(".venv/bin/python");
    if !python.exists() {
        bail!("{} is missing (run `just fixtures`)", python.display());
    }
    let script = fixtures().join("scripts/bench_transformers.py");
    ["f32", "bf16"]
        .into_iter()
        .map(|dtype| {
            let mut command = Command::new(&python);
            command
                .arg(&script)
                .arg("--model")
                .arg(setup.model_dir)
                .args(["--dtype", dtype])
                .args(common_args(setup));
            let json = run_json(command)?;
            let engine = format!(
                "transformers {} (torch {})",
                str_field(&json, "version")?,
                str_field(&json, "torch")?
            );
            Ok(Reference {
                engine,
                dtype: dtype.to_string(),
                speed: Speed {
                    prefill_tok_s: f64_field(&json, "prefill_tok_s")?,
                    decode_tok_s: f64_field(&json, "decode_tok_s")?,
                },
            })
        })
        .collect()
}

fn common_args(setup: &Setup) -> Vec<String> {
    [
        ("--threads", setup.threads),
        ("--prompt-tokens", setup.prompt),
        ("--decode-tokens", setup.decode),
        ("--reps", setup.reps),
    ]
    .iter()
    .flat_map(|(flag, value)| [flag.to_string(), value.to_string()])
    .collect()
}

/// llama.cpp's `llama-bench` on the F32 and F16 GGUF files of SmolLM2: `pp` (prompt processing)
/// and `tg` (text generation) tokens/s. Its `tg` test decodes from an empty context.
pub fn llama_cpp(setup: &Setup) -> anyhow::Result<Vec<Reference>> {
    let dir = fixtures().join(".cache/llama.cpp");
    let bench = dir.join("build/bin/llama-bench");
    if !bench.exists() {
        bail!(
            "{} is missing (run fixtures/scripts/build_llama_cpp.sh)",
            bench.display()
        );
    }
    ["F32", "F16"]
        .into_iter()
        .map(|dtype| {
            let gguf = dir.join(format!("SmolLM2-135M-Instruct-{dtype}.gguf"));
            let mut command = Command::new(&bench);
            command
                .arg("-m")
                .arg(&gguf)
                .args(["-t", &setup.threads.to_string()])
                .args(["-p", &setup.prompt.to_string()])
                .args(["-n", &setup.decode.to_string()])
                .args(["-r", &setup.reps.to_string()])
                .args(["-o", "json"]);
            let json = run_json(command)?;
            let tests = json
                .as_array()
                .context("llama-bench -o json prints an array")?;
            let rate = |key: &str| -> anyhow::Result<f64> {
                let test = tests
                    .iter()
                    .find(|t| t[key].as_u64().is_some_and(|n| n > 0))
                    .with_context(|| format!("no llama-bench result with {key} > 0"))?;
                f64_field(test, "avg_ts")
            };
            let build = tests
                .first()
                .and_then(|t| t["build_number"].as_u64())
                .map_or(String::new(), |b| format!(" b{b}"));
            Ok(Reference {
                engine: format!("llama.cpp{build}"),
                dtype: dtype.to_string(),
                speed: Speed {
                    prefill_tok_s: rate("n_prompt")?,
                    decode_tok_s: rate("n_gen")?,
                },
            })
        })
        .collect()
}

/// Runs `command` and parses its stdout as JSON (the last line, for tools that print more).
fn run_json(mut command: Command) -> anyhow::Result<Value> {
    let shown = format!("{command:?}");
    let output = command
        .output()
        .with_context(|| format!("running {shown}"))?;
    if !output.status.success() {
        bail!(
            "{shown} failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(stdout.trim())
        .or_else(|_| serde_json::from_str(stdout.lines().last().unwrap_or_default()))
        .with_context(|| format!("parsing the JSON printed by {shown}"))
}

fn f64_field(json: &Value, key: &str) -> anyhow::Result<f64> {
    json[key]
        .as_f64()
        .with_context(|| format!("field {key:?} missing or not a number"))
}

fn str_field<'j>(json: &'j Value, key: &str) -> anyhow::Result<&'j str> {
    json[key]
        .as_str()
        .with_context(|| format!("field {key:?} missing or not a string"))
}
