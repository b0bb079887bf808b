//! `kiln bench ch07 --device cuda`: the model end to end on a GPU, beside `transformers` on the
//! same GPU and the same checkpoint in the same run.
//!
//! ```text
//! model     --model DIR, else a Llama-1B-shaped random bf16 checkpoint that this command writes
//!           (as `kiln random-model --preset llama-1b` does) under target/ when it is missing
//! kiln      chapter 7's CUDA executor, bf16 weights and bf16 K/V, inside chapter 4's engine:
//!           B requests of P prompt tokens arrive at once, each generates exactly D tokens
//!           (greedy, EOS ignored); B = 1, 32, 64
//! measured  batch 1: decode tokens/s = (D − 1) / (time of the last token − time of the first)
//!           every B: output tokens/s = B·D / wall time of the whole run (prefill included)
//! peer      fixtures/scripts/bench_transformers_gpu.py: transformers' generate with a static
//!           cache at B = 1 and 32, the same P and D (its batch-1 decode: (D − 1) / (wall time −
//!           one forward of the prompt)); when it cannot run, the table says why
//! ```
//! Writes `gpu-e2e.md` and `gpu-e2e.svg`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use ch04::{Engine, EngineConfig, Executor, ExecutorError, KvLayout, ModelSpec, SchedulerOutput};
use ch07::cuda::{CudaExecutor, DeviceSpec, GpuDevice};
use ndarray::ArrayView2;

use super::super::RunFacts;
use super::super::bars::BarChart;
use super::super::ch04::workload::fixed_length;
use super::super::table::Table;

/// Where the default checkpoint is written: the Llama-1B shape, or with `--quick` the tiny
/// one (a folder of its own, so that a quick run never leaves it where a full run looks).
const DEFAULT_MODEL: &str = "target/llama-1b-random";
const DEFAULT_QUICK_MODEL: &str = "target/tiny-d64-random";
/// Batch-1 decode the issue asks for, tokens/s.
const DECODE_TARGET: f64 = 500.0;
/// Continuous batching at 64 against transformers' static batch of 32.
const THROUGHPUT_TARGET: f64 = 1.5;

/// What one configuration served.
#[derive(Debug, Clone, Copy)]
struct Served {
    /// Output tokens per second of wall time, prefill included.
    output_tok_s: f64,
    /// Batch 1 only: tokens per second after the first token.
    decode_tok_s: f64,
}

/// Lends an executor to one engine run, so that the weights are uploaded once for every run.
struct Lent<'a>(&'a mut (dyn Executor + Send));

impl Executor for Lent<'_> {
    fn kv_layout(&self) -> KvLayout {
        self.0.kv_layout()
    }
    fn model_spec(&self) -> ModelSpec {
        self.0.model_spec()
    }
    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.0.execute(step)
    }
    fn execute_argmax(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<Vec<Option<u32>>, ExecutorError> {
        self.0.execute_argmax(step)
    }
}

/// Runs the GPU part; `quick` uses the small head-64 preset and short requests.
pub fn run(
    device: DeviceSpec,
    model: Option<PathBuf>,
    quick: bool,
    reps: usize,
    facts: &RunFacts,
    out: &Path,
) -> anyhow::Result<(String, String)> {
    let DeviceSpec::Cuda(ordinal) = device else {
        anyhow::bail!("the GPU part needs --device cuda");
    };
    let (prompt, output, batches): (usize, usize, &[usize]) = match quick {
        true => (16, 8, &[1, 4]),
        false => (128, 128, &[1, 32, 64]),
    };
    // The GPU first: without one, nothing is written.
    let gpu = GpuDevice::open(ordinal).with_context(|| format!("--device {device}"))?;
    let dir = model.unwrap_or_else(|| {
        PathBuf::from(match quick {
            true => DEFAULT_QUICK_MODEL,
            false => DEFAULT_MODEL,
        })
    });
    if !dir.join("config.json").exists() {
        let spec = match quick {
            true => ch01::random_model::RandomModelSpec::tiny_d64(),
            false => ch01::random_model::RandomModelSpec::llama_1b(),
        };
        eprintln!("== writing a random checkpoint to {}", dir.display());
        ch01::random_model::write_random_model(&spec, &dir)?;
    }
    let config = ch01::LlamaConfig::from_dir(&dir)?;
    let weights = ch01::Weights::open(&dir)?;
    let gpu_name = gpu.name.clone();
    let most = batches.iter().max().copied().unwrap_or(1);
    let kv_memory =
        2 * ch03::KvDtype::Bf16.bytes_per_token(&config) * (most * (prompt + output)) as u64;
    eprintln!(
        "== uploading {} (bf16 weights) to {gpu_name}",
        dir.display()
    );
    let mut executor = CudaExecutor::<half::bf16>::new(
        gpu,
        config.clone(),
        &weights,
        ch02::WeightDtype::Bf16,
        16,
        ch07::cuda::KvBudget::Bytes(kv_memory),
    )?;

    let mut kiln = Vec::new();
    for &batch in batches {
        serve(&mut executor, batch, prompt.min(8), 2, config.vocab_size)?; // warm-up
        let mut runs: Vec<Served> = (0..reps)
            .map(|_| serve(&mut executor, batch, prompt, output, config.vocab_size))
            .collect::<anyhow::Result<_>>()?;
        runs.sort_by(|a, b| a.output_tok_s.total_cmp(&b.output_tok_s));
        let median = runs[runs.len() / 2];
        eprintln!(
            "  kiln B = {batch:2}: {:.0} output tokens/s, batch-1 decode {:.0} tokens/s",
            median.output_tok_s, median.decode_tok_s
        );
        kiln.push((batch, median));
    }
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let log = out.join("gpu-e2e-transformers.log");
    let peer = transformers(&python, &dir, prompt, output, reps, &log);

    let mut table = Table::new([
        "engine",
        "batch",
        "output tokens/s",
        "decode tokens/s (batch 1)",
    ]);
    let row = |table: &mut Table, engine: &str, batch: usize, s: Served| {
        let decode = match batch {
            1 => format!("{:.0}", s.decode_tok_s),
            _ => "-".into(),
        };
        let cells = [
            engine.to_string(),
            batch.to_string(),
            format!("{:.0}", s.output_tok_s),
        ];
        table.row(cells.into_iter().chain([decode]));
    };
    for &(batch, s) in &kiln {
        row(&mut table, "kiln (chapter 7, CUDA)", batch, s);
    }
    let mut verdicts = Vec::new();
    let kiln_b1 = kiln
        .iter()
        .find(|(b, _)| *b == 1)
        .map(|(_, s)| s.decode_tok_s);
    if let Some(d) = kiln_b1 {
        verdicts.push(format!(
            "batch-1 decode {d:.0} tokens/s against a target of {DECODE_TARGET:.0}: {}",
            if d >= DECODE_TARGET { "met" } else { "not met" }
        ));
    }
    match &peer {
        Ok(rows) => {
            for &(batch, s) in rows {
                row(&mut table, "transformers, static cache", batch, s);
            }
            let peer32 = rows
                .iter()
                .find(|(b, _)| *b == 32)
                .map(|(_, s)| s.output_tok_s);
            let kiln64 = kiln
                .iter()
                .find(|(b, _)| *b == 64)
                .map(|(_, s)| s.output_tok_s);
            if let (Some(p), Some(k)) = (peer32, kiln64) {
                verdicts.push(format!(
                    "kiln at 64 concurrent / transformers at batch 32: {:.2}x against a target of \
                     {THROUGHPUT_TARGET}x: {}",
                    k / p,
                    if k / p >= THROUGHPUT_TARGET {
                        "met"
                    } else {
                        "not met"
                    }
                ));
            }
        }
        Err(why) => verdicts.push(format!("transformers was not run: {why}")),
    }
    let markdown = format!(
        "{}\n{}\n\nOn {gpu_name}: `{}` ({} layers, hidden {}, {} heads of {}, {} KV heads, \
         vocabulary {}), bf16 weights, bf16 K/V. Each of B requests has {prompt} prompt tokens \
         and generates exactly {output} (greedy, EOS ignored), all arriving at once. Output \
         tokens/s = B·{output} / wall time, prefill included; batch-1 decode = ({output} − 1) / \
         time from the first token to the last. Median of {reps} runs after a warm-up. \
         transformers: `fixtures/scripts/bench_transformers_gpu.py`, `generate` with a static \
         cache, same checkpoint and lengths, in the same run; its batch-1 decode is ({output} − \
         1) / (wall time − one forward of the prompt).\n\n_{}. Command: \
         `{}`._\n",
        table.to_markdown(),
        verdicts
            .iter()
            .map(|v| format!("- {v}"))
            .collect::<Vec<_>>()
            .join("\n"),
        dir.display(),
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.head_dim,
        config.num_key_value_heads,
        config.vocab_size,
        facts.date,
        facts.command,
    );
    let mut chart =
        BarChart::new(format!("Output tokens/s on {gpu_name}")).x_label("output tokens per second");
    let bars: Vec<(String, f64)> = kiln
        .iter()
        .map(|(b, s)| (format!("B = {b}"), s.output_tok_s))
        .collect();
    chart = chart.group("kiln", &bars);
    if let Ok(rows) = &peer {
        let bars: Vec<(String, f64)> = rows
            .iter()
            .map(|(b, s)| (format!("B = {b}"), s.output_tok_s))
            .collect();
        chart = chart.group("transformers (static cache)", &bars);
    }
    Ok((markdown, chart.to_svg()))
}

/// B requests of `prompt` random token ids (seeded) arriving at once, each generating exactly
/// `output` tokens, through chapter 4's engine on `executor`.
fn serve(
    executor: &mut (dyn Executor + Send),
    batch: usize,
    prompt: usize,
    output: usize,
    vocab: usize,
) -> anyhow::Result<Served> {
    let config = EngineConfig {
        max_num_seqs: batch.max(1),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(Lent(executor), config)?;
    let mut rng = ch02::workload::WorkloadRng::new(batch as u64);
    for _ in 0..batch {
        let ids: Vec<u32> = (0..prompt)
            .map(|_| (rng.next_u64() % vocab as u64) as u32)
            .collect();
        engine.add_request(fixed_length(ids, output))?;
    }
    let start = Instant::now();
    let (mut first, mut tokens) = (None, 0usize);
    while engine.has_unfinished() {
        let outputs = engine.step()?;
        let produced: usize = outputs.iter().map(|o| o.new_tokens.len()).sum();
        if produced > 0 && first.is_none() {
            first = Some(start.elapsed().as_secs_f64());
        }
        tokens += produced;
    }
    let wall = start.elapsed().as_secs_f64();
    anyhow::ensure!(
        tokens == batch * output,
        "served {tokens} tokens, expected {}",
        batch * output
    );
    let after_first = wall - first.unwrap_or(wall);
    Ok(Served {
        output_tok_s: tokens as f64 / wall,
        decode_tok_s: if batch == 1 && after_first > 0.0 {
            (output - 1) as f64 / after_first
        } else {
            f64::NAN
        },
    })
}

/// How long transformers may take, warm-up and compilation included (`KILN_PEER_TIMEOUT`
/// seconds): kiln's own figures are written only after it, so it must not take the run's
/// whole time.
const PEER_TIMEOUT_S: u64 = 240;

/// Seconds transformers may take: `KILN_PEER_TIMEOUT` (else [`PEER_TIMEOUT_S`]), cut to what is
/// left before `KILN_PEER_DEADLINE` (seconds since the Unix epoch) when that is set, so that a
/// run under a time budget still writes its table.
fn peer_limit() -> u64 {
    let var = |name| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let limit = var("KILN_PEER_TIMEOUT").unwrap_or(PEER_TIMEOUT_S);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    match var("KILN_PEER_DEADLINE") {
        Some(deadline) => limit.min(deadline.saturating_sub(now)),
        None => limit,
    }
}

/// transformers on the same GPU, run by `python` (`$KILN_PYTHON`, else `python3`) under
/// `timeout`: `(batch, served)` for B = 1 and 32, or why it did not run. Its stderr goes to
/// `log`.
fn transformers(
    python: &str,
    model: &Path,
    prompt: usize,
    output: usize,
    reps: usize,
    log: &Path,
) -> Result<Vec<(usize, Served)>, String> {
    let limit = peer_limit();
    if limit < 10 {
        return Err(format!(
            "{limit} s were left before KILN_PEER_DEADLINE, too few to start it"
        ));
    }
    let result = Command::new("timeout")
        .args(["-k", "10", &limit.to_string(), python])
        .args(["fixtures/scripts/bench_transformers_gpu.py", "--model"])
        .arg(model)
        .args([
            "--prompt-tokens",
            &prompt.to_string(),
            "--output-tokens",
            &output.to_string(),
        ])
        .args(["--batches", "1,32", "--reps", &reps.to_string()])
        .output()
        .map_err(|e| format!("timeout {limit} {python}: {e}"))?;
    let stderr = String::from_utf8_lossy(&result.stderr);
    if let Err(e) = std::fs::write(log, stderr.as_bytes()) {
        eprintln!("  could not write {}: {e}", log.display());
    }
    if !result.status.success() {
        return Err(match result.status.code() {
            Some(124) => format!("it took more than {limit} s (KILN_PEER_TIMEOUT)"),
            _ => stderr.lines().last().map_or_else(
                || format!("{python} failed, saying nothing"),
                str::to_string,
            ),
        });
    }
    // The last line that parses: libraries may write to stdout after the result.
    let stdout = String::from_utf8_lossy(&result.stdout);
    let json: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .ok_or("no JSON line in its output")?;
    let rows = json["runs"].as_array().ok_or("no `runs` in its output")?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            Some((
                r["batch"].as_u64()? as usize,
                Served {
                    output_tok_s: r["output_tok_s"].as_f64()?,
                    decode_tok_s: r["decode_tok_s"].as_f64().unwrap_or(f64::NAN),
                },
            ))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The workload and its arithmetic, on chapter 4's CPU executor (the same `Executor` seam
    /// the GPU's fills): every request generates exactly its tokens, and the rates are finite.
    #[test]
    fn the_end_to_end_workload_serves_every_token() {
        let model = ch01::Llama::load(&ch01::default_model_dir()).unwrap();
        let cache = ch04::CacheConfig {
            memory: ch03::KvDtype::F32.bytes_per_token(&model.config) * 4 * 64,
            block_size: 16,
            dtype: ch03::KvDtype::F32,
        };
        let mut executor = ch07::cpu_executor(&model, &cache, ch07::AttentionKind::Naive).unwrap();
        let one = serve(&mut *executor, 1, 12, 5, model.config.vocab_size).unwrap();
        assert!(one.output_tok_s > 0.0 && one.decode_tok_s.is_finite() && one.decode_tok_s > 0.0);
        let four = serve(&mut *executor, 4, 12, 5, model.config.vocab_size).unwrap();
        assert!(four.output_tok_s > 0.0 && four.decode_tok_s.is_nan());
    }

    /// Without a working Python the peer is reported as not run, with the reason.
    #[test]
    fn a_missing_peer_is_reported_not_invented() {
        let tmp = tempfile::tempdir().unwrap();
        let log = tmp.path().join("peer.log");
        let why =
            transformers("/nonexistent/python3", Path::new("unused"), 8, 8, 1, &log).unwrap_err();
        assert!(why.contains("/nonexistent/python3"), "{why}");
        let logged = std::fs::read_to_string(&log).unwrap();
        assert!(logged.contains("/nonexistent/python3"), "{logged}");
    }
}
