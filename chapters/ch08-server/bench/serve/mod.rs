//! `kiln bench serve`: a load generator against a running `kiln serve` (or any OpenAI-compatible
//! server), in the manner of `vllm bench serve`.
//!
//! ```text
//! GET /v1/models                 the server is there; the model name (unless --model)
//! one test request               the endpoint, the model and the key work
//! for each --request-rate R:     the same prompts, sent at Poisson arrival times of rate R
//!   (inf: all at once), at most --max-concurrency in flight, every one streamed:
//!   TTFT, TPOT, ITL, E2E latency; request, output and total token throughput
//! ```
//! Prints vLLM's result block per rate; `--result-json FILE` and `--out DIR`
//! (`serve-rate-<R>.json`, and for a sweep `serve.md`, `serve-throughput.svg`,
//! `serve-latency.svg`) keep the numbers, with every request's raw timings in the JSON.
//!
//! | module      | what it does                                                     |
//! |-------------|------------------------------------------------------------------|
//! | [`abuse`]   | `--abusive-mix`: slow clients, oversized prompts, disconnects      |
//! | [`client`]  | one streamed request: SSE lines, chunks, usage, errors, timing    |
//! | [`dataset`] | prompts from the held-out corpus, lengths in words                |
//! | [`report`]  | the statistics (pure) and the block, JSON, table and plots        |

mod abuse;
mod client;
mod dataset;
mod report;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::ch04::workload::{ScaledLengths, poisson_arrivals};
use super::{RunFacts, write_figures};
use client::{Endpoint, RequestConfig};
use dataset::{Corpus, Prompt};
use report::{Metrics, RequestRecord};

/// How many failed requests' messages are printed after each run.
const ERRORS_SHOWN: usize = 5;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The server to load.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// The API to call: /v1/completions or /v1/chat/completions.
    #[arg(long, value_name = "PATH", default_value = "/v1/completions")]
    pub endpoint: Endpoint,
    /// The model name sent in every request [default: the first id of GET /v1/models].
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// API key, sent as `Authorization: Bearer KEY`.
    #[arg(long, value_name = "KEY", env = "KILN_API_KEY")]
    pub api_key: Option<String>,
    /// Prompts: `corpus` (chapter 2's long-tailed lengths, see --length-scale) or `random`
    /// (every prompt --random-input-len words, asking for --random-output-len tokens). Both
    /// are windows of fixtures/corpus/hamlet.txt at seeded offsets.
    #[arg(long, default_value = "corpus", value_parser = ["corpus", "random"])]
    pub dataset: String,
    /// Words per prompt (`--dataset random`).
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub random_input_len: usize,
    /// max_tokens per request (`--dataset random`).
    #[arg(long, value_name = "M", default_value_t = 64)]
    pub random_output_len: usize,
    /// Both medians of the ShareGPT-like lengths are multiplied by this (`--dataset corpus`).
    #[arg(long, value_name = "X", default_value_t = 0.25)]
    pub length_scale: f64,
    /// Longest prompt, in words (`--dataset corpus`).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_input_len: usize,
    /// Largest max_tokens (`--dataset corpus`).
    #[arg(long, value_name = "M", default_value_t = 128)]
    pub max_output_len: usize,
    /// Requests per rate.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub num_prompts: usize,
    /// Requests per second, arriving as a Poisson process; `inf` sends all at once. A comma
    /// list (`1,2,4,inf`) runs each rate in turn with the same prompts.
    #[arg(
        long,
        value_name = "R,...",
        value_delimiter = ',',
        default_value = "inf"
    )]
    pub request_rate: Vec<Rate>,
    /// At most this many requests in flight; later arrivals wait for a slot [default: no limit].
    #[arg(long, value_name = "C")]
    pub max_concurrency: Option<usize>,
    /// Ask the server to ignore end-of-sequence (`"ignore_eos": true`, a vLLM extension), so
    /// every request generates its max_tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature of every request.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the prompts (lengths, offsets) and of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the results as JSON: one object, or an array of them for several rates.
    #[arg(long, value_name = "FILE")]
    pub result_json: Option<PathBuf>,
    /// Write `serve-rate-<R>.json` per rate into DIR; for several rates also `serve.md`,
    /// `serve-throughput.svg` and `serve-latency.svg` (with --abusive-mix: `serve-abuse.md`
    /// and `serve-abuse.json` instead).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Run each rate twice, side by side: clean, then with F × N abusive requests besides the
    /// N normal ones (slow clients, 7 MB prompts, n = 16 streams dropped after one chunk, in
    /// turn, arriving at the same rate), and compare the normal requests' numbers.
    #[arg(long, value_name = "F")]
    pub abusive_mix: Option<f64>,
}

/// A request rate: Poisson arrivals at so many requests per second, or all at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rate {
    PerSecond(f64),
    Inf,
}

impl std::str::FromStr for Rate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("inf") {
            return Ok(Rate::Inf);
        }
        match s.parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(Rate::PerSecond(r)),
            _ => Err(format!(
                "{s:?} is not a request rate: a positive number or inf"
            )),
        }
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rate::PerSecond(r) => write!(f, "{r}"),
            Rate::Inf => write!(f, "inf"),
        }
    }
}

/// When each of `n` requests is due, from the start of the run: Poisson arrivals (the first at
/// 0), or all at 0 for `inf`.
pub fn schedule(n: usize, rate: Rate, seed: u64) -> Vec<Duration> {
    match rate {
        Rate::PerSecond(r) => poisson_arrivals(n, r, seed),
        Rate::Inf => vec![Duration::ZERO; n],
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if args.num_prompts == 0 || args.max_concurrency == Some(0) {
        bail!("--num-prompts and --max-concurrency must be at least 1");
    }
    if args.request_rate.is_empty() {
        bail!("--request-rate needs at least one rate");
    }
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        bail!("--temperature must be a number >= 0");
    }
    if !(args.length_scale > 0.0 && args.length_scale.is_finite()) {
        bail!("--length-scale must be a positive number");
    }
    if args
        .abusive_mix
        .is_some_and(|f| !(f > 0.0 && f.is_finite()))
    {
        bail!("--abusive-mix must be a positive number");
    }
    // The root binary runs commands on a rayon worker; this one needs an async runtime.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(bench(args))
}

async fn bench(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let base_url = args.base_url.trim_end_matches('/').to_string();
    let api_key = args.api_key.clone().filter(|k| !k.is_empty());
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()?;
    let models = client::list_models(&http, &base_url, api_key.as_deref()).await?;
    let model = match (&args.model, models.first()) {
        (Some(model), _) => model.clone(),
        (None, Some(first)) => first.clone(),
        (None, None) => bail!("{base_url}/v1/models lists no model; name one with --model"),
    };
    let config = Arc::new(RequestConfig {
        url: format!("{base_url}{}", args.endpoint.path()),
        endpoint: args.endpoint,
        model: model.clone(),
        api_key,
        temperature: args.temperature,
        ignore_eos: args.ignore_eos,
    });

    let corpus_path = ch01::fixtures_dir().join("corpus/hamlet.txt");
    let corpus = Corpus::new(
        std::fs::read_to_string(&corpus_path)
            .with_context(|| format!("reading {}", corpus_path.display()))?,
    );
    let lengths = ScaledLengths {
        scale: args.length_scale,
        max_prompt: args.max_input_len,
        max_output: args.max_output_len,
    };
    let prompts = Arc::new(match args.dataset.as_str() {
        "random" => dataset::random(
            &corpus,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.seed,
        )?,
        _ => {
            if args.max_input_len == 0 || args.max_output_len == 0 {
                bail!("--max-input-len and --max-output-len must be at least 1");
            }
            dataset::sharegpt_like(&corpus, args.num_prompts, &lengths, args.seed)?
        }
    });
    let dataset_text = dataset_text(&args, &prompts);
    eprintln!(
        "kiln bench serve: {model} at {}, {dataset_text}",
        config.url
    );

    // One request first, as vLLM does: a wrong model name or key fails here, once.
    let test = &prompts[0];
    if let Err(e) = client::send(&http, &config, &test.text, test.max_tokens).await {
        bail!("the test request to {} failed: {e}", config.url);
    }

    let run_config = json!({
        "date": facts.date,
        "command": facts.command,
        "base_url": base_url,
        "endpoint": args.endpoint.path(),
        "model": model,
        "dataset": args.dataset,
        "dataset_description": dataset_text,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "seed": args.seed,
        "client_cpu": facts.cpu,
        "client_nproc": facts.nproc,
    });
    if let Some(mix) = args.abusive_mix {
        let abused = AbusedRun {
            http: &http,
            config: &config,
            prompts: &prompts,
            addr: abuse::host_port(&base_url)?,
            mix,
        };
        return abused
            .sweep(&args, &run_config, &facts, &dataset_text)
            .await;
    }
    let mut runs = Vec::new();
    let mut jsons = Vec::new();
    for &rate in &args.request_rate {
        eprintln!("== request rate {rate} (req/s)");
        let (records, duration) = run_rate(
            &http,
            &config,
            &prompts,
            rate,
            args.max_concurrency,
            args.seed,
        )
        .await?;
        let metrics = Metrics::of(&records, duration);
        print!(
            "{}",
            report::result_block(rate, args.max_concurrency, &metrics)
        );
        let errors: Vec<(usize, &String)> = records
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.result.as_ref().err().map(|e| (i, e)))
            .collect();
        for (i, e) in errors.iter().take(ERRORS_SHOWN) {
            eprintln!("   request {i} failed: {e}");
        }
        if errors.len() > ERRORS_SHOWN {
            eprintln!("   … and {} more failed", errors.len() - ERRORS_SHOWN);
        }
        if metrics.missing_usage > 0 {
            eprintln!(
                "   {} responses had no usage chunk: their tokens were counted as text chunks",
                metrics.missing_usage
            );
        }
        let run_json = report::run_json(&run_config, rate, &metrics, &records);
        if let Some(dir) = &args.out {
            write_json(&dir.join(format!("serve-rate-{rate}.json")), &run_json)?;
        }
        jsons.push(run_json);
        runs.push((rate, metrics));
    }

    if let Some(path) = &args.result_json {
        let value = match jsons.len() {
            1 => jsons.pop().expect("one run"),
            _ => Value::Array(jsons),
        };
        write_json(path, &value)?;
    }
    if let (Some(dir), true) = (&args.out, runs.len() > 1) {
        let rates: Vec<Rate> = runs.iter().map(|(r, _)| *r).collect();
        let inf_at = rates
            .iter()
            .zip(report::plot_x(&rates))
            .find(|(r, _)| **r == Rate::Inf)
            .map(|(_, x)| x);
        let caption = format!(
            "_{model} served at {base_url}; load generated on {} ({} CPUs), {}.{} \
             Command: `{}`._",
            facts.cpu.as_deref().unwrap_or("an unknown CPU"),
            facts.nproc,
            facts.date,
            inf_at.map_or(String::new(), |x| format!(
                " In the plots, rate `inf` (all {} requests at once) is drawn at {x} req/s.",
                args.num_prompts
            )),
            facts.command
        );
        let text = sweep_text(&args, &dataset_text, args.endpoint.path());
        let (md, throughput, latency) = report::sweep_figures(&runs, &model, &text, &caption);
        write_figures(
            dir,
            &[
                ("serve-throughput", None, &throughput),
                ("serve-latency", None, &latency),
            ],
        )?;
        let md_path = dir.join("serve.md");
        std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
        println!("{md}");
    }
    Ok(())
}

/// Sends every prompt at its scheduled time and waits for all of them. Returns the records,
/// in prompt order, and the run's duration in seconds (start → last request done).
async fn run_rate(
    http: &reqwest::Client,
    config: &Arc<RequestConfig>,
    prompts: &Arc<Vec<Prompt>>,
    rate: Rate,
    max_concurrency: Option<usize>,
    seed: u64,
) -> anyhow::Result<(Vec<RequestRecord>, f64)> {
    // More permits than a semaphore holds (2^61 − 1) is no limit at all: clamped.
    let slots = max_concurrency.map(|c| {
        Arc::new(tokio::sync::Semaphore::new(
            c.min(tokio::sync::Semaphore::MAX_PERMITS),
        ))
    });
    let progress = Arc::new(Progress::new(prompts.len()));
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = schedule(prompts.len(), rate, seed)
        .into_iter()
        .enumerate()
        .map(|(i, at)| {
            let (http, config, prompts) = (http.clone(), config.clone(), prompts.clone());
            let (slots, progress) = (slots.clone(), progress.clone());
            tokio::spawn(async move {
                tokio::time::sleep_until(start + at).await;
                let _slot = match slots {
                    Some(slots) => Some(slots.acquire_owned().await.expect("never closed")),
                    None => None,
                };
                let prompt = &prompts[i];
                let sent = start.elapsed().as_secs_f64();
                let result = client::send(&http, &config, &prompt.text, prompt.max_tokens).await;
                progress.tick();
                RequestRecord {
                    prompt_words: prompt.words,
                    max_tokens: prompt.max_tokens,
                    sent,
                    result,
                }
            })
        })
        .collect();
    let mut records = Vec::with_capacity(tasks.len());
    for task in tasks {
        records.push(task.await.context("a request task panicked")?);
    }
    let duration = start.elapsed().as_secs_f64();
    progress.finish();
    Ok((records, duration))
}

/// `--abusive-mix`: each rate clean, then abused, side by side.
struct AbusedRun<'a> {
    http: &'a reqwest::Client,
    config: &'a Arc<RequestConfig>,
    prompts: &'a Arc<Vec<Prompt>>,
    /// The server's `host:port`, for the slow clients' raw sockets.
    addr: String,
    mix: f64,
}

impl AbusedRun<'_> {
    async fn sweep(
        &self,
        args: &Args,
        run_config: &Value,
        facts: &RunFacts,
        dataset_text: &str,
    ) -> anyhow::Result<()> {
        let longest = self.prompts.iter().map(|p| p.max_tokens).max().unwrap_or(1);
        let count = (self.mix * self.prompts.len() as f64).ceil() as usize;
        let mut runs = Vec::new();
        let mut jsons = Vec::new();
        for &rate in &args.request_rate {
            // The normal requests, the same in both runs.
            let normal = || {
                run_rate(
                    self.http,
                    self.config,
                    self.prompts,
                    rate,
                    args.max_concurrency,
                    args.seed,
                )
            };
            eprintln!("== request rate {rate} (req/s), clean");
            let (records, duration) = normal().await?;
            let clean = Metrics::of(&records, duration);
            print!(
                "{}",
                report::result_block(rate, args.max_concurrency, &clean)
            );

            eprintln!("== request rate {rate} (req/s), with {count} abusive requests");
            let start = tokio::time::Instant::now();
            let abusers: Vec<_> = schedule(count, rate, args.seed.wrapping_add(1))
                .into_iter()
                .enumerate()
                .map(|(i, at)| {
                    let (http, config) = (self.http.clone(), Arc::clone(self.config));
                    let addr = self.addr.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep_until(start + at).await;
                        abuse::send(&http, &config, &addr, abuse::Abuse::nth(i), longest).await
                    })
                })
                .collect();
            let (records, duration) = normal().await?;
            let abused = Metrics::of(&records, duration);
            print!(
                "{}",
                report::result_block(rate, args.max_concurrency, &abused)
            );
            let mut outcomes = Vec::with_capacity(abusers.len());
            for abuser in abusers {
                outcomes.push(abuser.await.context("an abusive request's task panicked")?);
            }
            eprintln!("   abusive requests: {}", abuse::summary(&outcomes));
            jsons.push(json!({
                "request_rate": rate.to_string(),
                "clean": clean,
                "abusive": abused,
                "abusive_requests": outcomes,
            }));
            runs.push((rate, clean, abused, outcomes));
        }
        let table = abuse::table(&runs);
        println!("{table}");
        if let Some(dir) = &args.out {
            let mut config = run_config.clone();
            config["abusive_mix"] = json!(self.mix);
            write_json(
                &dir.join("serve-abuse.json"),
                &json!({"config": config, "runs": jsons}),
            )?;
            let text = format!(
                "Each rate sends the same {dataset_text}, streamed from `{}` at temperature {}, \
                 twice: clean, then beside {count} abusive requests ({} × {}) arriving at the \
                 same rate (seed {}), one kind after another: a slow client that sends a \
                 request's headers one byte every 500 ms, a prompt of {} bytes, a stream of \
                 n = 16 choices at max_tokens {longest} dropped after its first chunk. The \
                 numbers are the normal requests'; the last column says what the server \
                 answered the abusive ones and how long each was held (slow clients: until the \
                 server closed them).",
                args.endpoint.path(),
                args.temperature,
                self.mix,
                self.prompts.len(),
                args.seed.wrapping_add(1),
                abuse::OVERSIZED_PROMPT_BYTES,
            );
            let caption = format!(
                "_{} served at {}; load generated on {} ({} CPUs), {}. Command: `{}`._",
                self.config.model,
                args.base_url,
                facts.cpu.as_deref().unwrap_or("an unknown CPU"),
                facts.nproc,
                facts.date,
                facts.command
            );
            let path = dir.join("serve-abuse.md");
            std::fs::write(
                &path,
                format!(
                    "{table}
{text}

{caption}
"
                ),
            )
            .with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        Ok(())
    }
}

/// A progress line on stderr, redrawn in place on a terminal, printed once at the end
/// otherwise.
struct Progress {
    done: AtomicUsize,
    total: usize,
    terminal: bool,
}

impl Progress {
    fn new(total: usize) -> Self {
        Progress {
            done: AtomicUsize::new(0),
            total,
            terminal: std::io::stderr().is_terminal(),
        }
    }

    fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if self.terminal {
            eprint!("\r{}", progress_bar(done, self.total));
        }
    }

    fn finish(&self) {
        let done = self.done.load(Ordering::Relaxed);
        if self.terminal {
            eprintln!();
        } else {
            eprintln!("{}", progress_bar(done, self.total));
        }
    }
}

/// `[#########.....................] 37/100`: 30 cells.
fn progress_bar(done: usize, total: usize) -> String {
    const CELLS: usize = 30;
    let filled = (CELLS * done)
        .checked_div(total)
        .unwrap_or(CELLS)
        .min(CELLS);
    format!(
        "[{}{}] {done}/{total}",
        "#".repeat(filled),
        ".".repeat(CELLS - filled)
    )
}

/// The prompts, in words.
fn dataset_text(args: &Args, prompts: &[Prompt]) -> String {
    let n = prompts.len();
    if args.dataset == "random" {
        return format!(
            "{n} prompts of {} words of Hamlet, each asking for {} tokens",
            args.random_input_len, args.random_output_len
        );
    }
    let mean = |f: fn(&Prompt) -> usize| prompts.iter().map(f).sum::<usize>() as f64 / n as f64;
    format!(
        "{n} prompts cut from Hamlet with chapter 2's ShareGPT-like lengths scaled by {} \
         (at most {} words and {} max_tokens; mean {:.0} words, mean max_tokens {:.0})",
        args.length_scale,
        args.max_input_len,
        args.max_output_len,
        mean(|p| p.words),
        mean(|p| p.max_tokens),
    )
}

/// The sweep table's explanation.
fn sweep_text(args: &Args, dataset: &str, endpoint: &str) -> String {
    format!(
        "Each rate sends the same {dataset}, streamed from `{endpoint}` at temperature {}{}{}. \
         Requests arrive as a Poisson process at the given rate (seed {}); `inf` sends them all \
         at once. Throughput: tokens of the successful requests over the run's duration. \
         TTFT: send → first text chunk. TPOT: (E2E − TTFT) / (completion tokens − 1), per \
         request. Token counts are the server's `usage`; prompt lengths were chosen in words.",
        args.temperature,
        if args.ignore_eos {
            ", with ignore_eos (every request generates its max_tokens)"
        } else {
            ""
        },
        args.max_concurrency.map_or(String::new(), |c| format!(
            ", at most {c} requests in flight"
        )),
        args.seed,
    )
}

fn write_json(path: &std::path::Path, value: &Value) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_and_print() {
        assert_eq!("inf".parse(), Ok(Rate::Inf));
        assert_eq!(" INF".parse(), Ok(Rate::Inf));
        assert_eq!("2.5".parse(), Ok(Rate::PerSecond(2.5)));
        for bad in ["0", "-1", "nan", "fast", ""] {
            assert!(bad.parse::<Rate>().is_err(), "{bad}");
        }
        assert_eq!(Rate::PerSecond(4.0).to_string(), "4");
        assert_eq!(Rate::PerSecond(0.5).to_string(), "0.5");
        assert_eq!(Rate::Inf.to_string(), "inf");
    }

    #[test]
    fn a_comma_list_of_rates_on_the_command_line() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            args: Args,
        }
        let cli = Cli::try_parse_from(["kiln", "--request-rate", "1,2,inf"]).unwrap();
        assert_eq!(
            cli.args.request_rate,
            [Rate::PerSecond(1.0), Rate::PerSecond(2.0), Rate::Inf]
        );
        assert_eq!(cli.args.endpoint, Endpoint::Completions);
        let cli = Cli::try_parse_from(["kiln"]).unwrap();
        assert_eq!(cli.args.request_rate, [Rate::Inf]);
        assert!(Cli::try_parse_from(["kiln", "--request-rate", "1,0"]).is_err());
        assert!(Cli::try_parse_from(["kiln", "--endpoint", "/v1/x"]).is_err());
    }

    #[test]
    fn the_schedule_is_poisson_or_all_at_once() {
        assert_eq!(schedule(3, Rate::Inf, 0), vec![Duration::ZERO; 3]);
        let at = schedule(2000, Rate::PerSecond(10.0), 5);
        assert_eq!(at, poisson_arrivals(2000, 10.0, 5));
        assert_eq!(at, schedule(2000, Rate::PerSecond(10.0), 5), "seeded");
        assert_eq!(at[0], Duration::ZERO);
        assert!(at.windows(2).all(|w| w[0] <= w[1]));
        let rate = (at.len() - 1) as f64 / at[at.len() - 1].as_secs_f64();
        assert!((rate - 10.0).abs() < 0.7, "rate {rate}");
    }

    #[test]
    fn progress_bars() {
        assert_eq!(progress_bar(0, 10), format!("[{}] 0/10", ".".repeat(30)));
        assert_eq!(
            progress_bar(5, 10),
            format!("[{}{}] 5/10", "#".repeat(15), ".".repeat(15))
        );
        assert_eq!(progress_bar(10, 10), format!("[{}] 10/10", "#".repeat(30)));
        assert_eq!(progress_bar(0, 0), format!("[{}] 0/0", "#".repeat(30)));
    }
}
