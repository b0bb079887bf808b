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

use super::machine::ReadProbe;
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
    /// Taken right before and right after each engine's decode, if given
    /// ([`Speed::read_gb_s_at_decode`]).
    pub probe: Option<&'a ReadProbe>,
}

impl Setup<'_> {
    /// `measure()`'s result, and the read probe around it if this setup has one.
    fn around<T>(&self, measure: impl FnOnce() -> T) -> (T, Option<f64>) {
        match self.probe {
            Some(probe) => {
                let (result, gb_s) = probe.around(measure);
                (result, Some(gb_s))
            }
            None => (measure(), None),
        }
    }
}

pub fn fixtures() -> PathBuf {
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
            let (json, read_gb_s_at_decode) = setup.around(|| run_json(command));
            let json = json?;
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
                    read_gb_s_at_decode,
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

/// llama.cpp's `llama-bench` on the F32 and F16 GGUF files of SmolLM2 (bit-identical to kiln's
/// f32 weights; F16 rounds them).
pub fn llama_cpp(setup: &Setup) -> anyhow::Result<Vec<Reference>> {
    let dir = fixtures().join(".cache/llama.cpp");
    ["F32", "F16"]
        .into_iter()
        .map(|dtype| {
            let gguf = dir.join(format!("SmolLM2-135M-Instruct-{dtype}.gguf"));
            llama_bench(setup, &gguf, dtype)
        })
        .collect()
}

/// The `llama-bench` that `fixtures/scripts/build_llama_cpp.sh` builds, if it has.
pub fn llama_cpp_tool(name: &str) -> anyhow::Result<PathBuf> {
    let tool = fixtures().join(".cache/llama.cpp/build/bin").join(name);
    if !tool.exists() {
        bail!("{} is missing (run `just build-llama-cpp`)", tool.display());
    }
    Ok(tool)
}

/// llama.cpp's `llama-bench` on one GGUF file, labelled `dtype`. Two runs, so that the
/// positions match kiln's: `pp` (prompt processing) of the prompt into an empty cache, and `tg`
/// (text generation) of the decode tokens at depth `-d P`, after the prompt.
pub fn llama_bench(setup: &Setup, gguf: &Path, dtype: &str) -> anyhow::Result<Reference> {
    let bench = llama_cpp_tool("llama-bench")?;
    let run = |args: &[String]| -> anyhow::Result<(f64, String)> {
        let mut command = Command::new(&bench);
        command
            .arg("-m")
            .arg(gguf)
            .args(["-t", &setup.threads.to_string()])
            .args(["-r", &setup.reps.to_string()])
            .args(["-o", "json"])
            .args(args);
        let json = run_json(command)?;
        let test = json
            .as_array()
            .and_then(|tests| tests.first())
            .context("llama-bench -o json prints an array of tests")?;
        let build = test["build_number"]
            .as_u64()
            .map_or(String::new(), |b| format!(" b{b}"));
        Ok((f64_field(test, "avg_ts")?, build))
    };
    let (prefill, build) = run(&strings(&["-p", &setup.prompt.to_string(), "-n", "0"]))?;
    let decode_args = [
        "-p",
        "0",
        "-n",
        &setup.decode.to_string(),
        "-d",
        &setup.prompt.to_string(),
    ];
    let (decode, read_gb_s_at_decode) = setup.around(|| run(&strings(&decode_args)));
    let (decode, _) = decode?;
    Ok(Reference {
        engine: format!("llama.cpp{build}"),
        dtype: dtype.to_string(),
        speed: Speed {
            prefill_tok_s: prefill,
            decode_tok_s: decode,
            read_gb_s_at_decode,
        },
    })
}

/// One run of llama.cpp's `llama-batched-bench`: `sequences` prompts of `prompt` tokens
/// prefilled, then `output` tokens decoded for all of them in lock step.
#[derive(Debug, Clone)]
pub struct BatchedRun {
    /// e.g. `b11434`.
    pub build: String,
    pub sequences: usize,
    pub output: usize,
    /// Wall time of the whole run: prefill and decode.
    pub seconds: f64,
    /// Its decode phase's tokens per second (`S_TG`).
    pub decode_tok_s: f64,
}

impl BatchedRun {
    /// Generated tokens over the whole run's wall time.
    pub fn output_tok_s(&self) -> f64 {
        (self.sequences * self.output) as f64 / self.seconds
    }

    /// The run of median wall time (an upper median for an even count).
    ///
    /// # Panics
    /// If `runs` is empty.
    pub fn median(runs: &[BatchedRun]) -> BatchedRun {
        let mut sorted = runs.to_vec();
        sorted.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
        sorted[sorted.len() / 2].clone()
    }
}

/// llama.cpp's `llama-batched-bench` on `gguf`: `-npl sequences -npp prompt -ntg output`, a
/// context that holds them all, physical batches of 512 tokens, K and V cached as `kv` (a value
/// of its `--cache-type-k` and `--cache-type-v`: `f32`, `f16`, ...).
pub fn llama_batched_bench(
    gguf: &Path,
    threads: usize,
    sequences: usize,
    prompt: usize,
    output: usize,
    kv: &str,
) -> anyhow::Result<BatchedRun> {
    let bench = llama_cpp_tool("llama-batched-bench")?;
    let context = sequences * (prompt + output);
    let mut command = Command::new(&bench);
    command
        .arg("-m")
        .arg(gguf)
        .args(["-t", &threads.to_string()])
        .args(["-c", &context.to_string(), "-b", "2048", "-ub", "512"])
        .args(["-npl", &sequences.to_string()])
        .args(["-npp", &prompt.to_string(), "-ntg", &output.to_string()])
        .args(["--cache-type-k", kv, "--cache-type-v", kv])
        .args(["--output-format", "jsonl"]);
    let json = run_json(command)?;
    // The build is not in its JSON; `build_llama_cpp.sh` pins it, and `--version` prints it.
    let version = Command::new(&bench).arg("--version").output()?;
    let version = String::from_utf8_lossy(&version.stderr).to_string()
        + &String::from_utf8_lossy(&version.stdout);
    // "version: 0.6.0-dev (build 11434, commit b11434)"
    let build = version
        .split_once("(build ")
        .and_then(|(_, rest)| rest.split([',', ')']).next())
        .map_or(String::new(), |b| format!("b{b}"));
    Ok(BatchedRun {
        build,
        sequences,
        output,
        seconds: f64_field(&json, "t")?,
        decode_tok_s: f64_field(&json, "speed_tg")?,
    })
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
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
