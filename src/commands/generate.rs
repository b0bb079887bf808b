//! `kiln generate`: stream a completion to stdout, timings to stderr (as llama.cpp prints them).
//! With `--prompts-file`, the file's prompts run through chapter 4's engine, fed to it as it
//! makes room.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use ch01::{FinishReason, GenerateOptions, Llama, OutputText, SamplingParams, Tokenizer};
use ch03::{KvDtype, PagedKv};
use ch04::{Engine, EngineClient, Request, RequestId, RequestOutput, StepTrace};

use super::engine_args::{AttentionArgs, EngineArgs, KvArgs, PreemptionMode};
use super::speculative_args::{self, SpeculativeArgs, TargetWeights};
use super::tensor_parallel::TensorParallelArgs;
use super::{HostSide, ModelArgs};
use ch07::cuda::DeviceSpec;

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompts_file"])))]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt, tokenized with the tokenizer's own special-token rules.
    // "EngineArgs": the group clap makes of that struct's flags, which only the engine uses
    // --attention-backend too: one prompt runs chapter 2's attention, which no backend replaces.
    #[arg(long, conflicts_with_all = ["EngineArgs", "attention_backend"])]
    pub prompt: Option<String>,
    /// A file of prompts, one per line (empty lines skipped), run through chapter 4's engine,
    /// twice --max-num-seqs of them (at least 64) in it at a time, in line order; prompt i
    /// (from 0) samples with seed + i. Completions are printed in order once all have finished;
    /// a prompt that cannot be tokenized or admitted ends the run with an error naming it (its
    /// index from 0 and its text).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["recompute", "contiguous"])]
    pub prompts_file: Option<PathBuf>,
    /// Maximum number of tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// 0 disables.
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// 1.0 disables.
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// 0.0 disables.
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// 1.0 disables.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Random seed; a fresh one (printed) when omitted.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating after the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Chapter 1's loop: recompute the whole sequence for every token instead of using the KV cache.
    // (Neither it nor --contiguous has a paged cache to size, or an engine to speculate on.)
    #[arg(long, conflicts_with_all = ["contiguous", "KvArgs", "speculation"])]
    pub recompute: bool,
    /// Chapter 2's cache: one contiguous buffer reserved for the model's whole context, instead
    /// of chapter 3's paged blocks.
    #[arg(long, conflicts_with_all = ["KvArgs", "speculation"])]
    pub contiguous: bool,
    #[command(flatten)]
    pub kv: KvArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub tensor_parallel: TensorParallelArgs,
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// Speculative decoding (chapter 6); with one --prompt it runs on the engine too.
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
    /// With --prompts-file: print on stderr, for each engine step, what it ran, admitted and
    /// preempted.
    // Conflicting with --prompt means requiring --prompts-file: one of the two is given.
    #[arg(long, conflicts_with = "prompt")]
    pub trace: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    // A bad prompts file fails before the model loads.
    let prompts = match &args.prompts_file {
        Some(path) => Some(read_prompts(path)?),
        None => None,
    };
    if args.tensor_parallel.is_parallel() && (args.recompute || args.contiguous) {
        anyhow::bail!(
            "{} runs on the engine's paged cache: drop --recompute/--contiguous",
            args.tensor_parallel.flags()
        );
    }
    if args.model.device != DeviceSpec::Cpu && (args.recompute || args.contiguous) {
        anyhow::bail!(
            "--device {} runs on the engine's paged cache on the GPU: drop --recompute/--contiguous",
            args.model.device
        );
    }
    // On a GPU the host reads no weights: the executor loads them onto the device. Nor with
    // tensor parallelism, whose ranks load their own shards, unless the drafter runs the
    // target's own layers from host memory (layer skip).
    let (host, model) = args
        .tensor_parallel
        .load_host(&args.model, args.speculative.needs_target_weights()?)?;
    let seed = args.seed.unwrap_or_else(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        nanos.as_nanos() as u64
    });
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            frequency_penalty: args.frequency_penalty,
            presence_penalty: args.presence_penalty,
            seed,
        },
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        eos_token_ids: host.eos_token_ids.clone(),
    };
    options.sampling.validate()?;
    let model = model.as_ref();
    match (&args.prompt, prompts, model) {
        // Speculation, tensor parallelism and a GPU run on the engine, even for one prompt.
        (Some(prompt), None, Some(model))
            if args.speculative.method()?.is_none() && !args.tensor_parallel.is_parallel() =>
        {
            run_one(&args, prompt, model, &host, &options)
        }
        (Some(prompt), None, _) => {
            run_many(&args, std::slice::from_ref(prompt), model, &host, &options)
        }
        (None, Some(prompts), _) => run_many(&args, &prompts, model, &host, &options),
        _ => unreachable!("clap requires exactly one of --prompt and --prompts-file"),
    }
}

/// One prompt, streamed: chapter 3's paged cache (or chapter 2's, or chapter 1's loop).
fn run_one(
    args: &Args,
    prompt: &str,
    model: &Llama,
    host: &HostSide,
    options: &GenerateOptions,
) -> anyhow::Result<()> {
    let seed = options.sampling.seed;
    let prompt_tokens = host.tokenizer.encode(prompt, true)?;
    eprintln!(
        "kiln: {} | prompt {} tokens | seed {seed}",
        args.model.model.display(),
        prompt_tokens.len()
    );

    // The prompt must fit the context, before anything is printed.
    let context = model.config.max_position_embeddings;
    anyhow::ensure!(
        prompt_tokens.len() <= context,
        "the prompt has {} tokens, more than the model's context of {context} positions",
        prompt_tokens.len()
    );
    // Chapter 3's paged pool, checked before anything is printed.
    let mut paged = None;
    if !(args.recompute || args.contiguous) {
        let config = &model.config;
        // Chapter 3's pool stores f32, so `auto` means f32 here whatever the weights' dtype.
        let cache = args.kv.cache(config, "f32")?;
        if cache.dtype != KvDtype::F32 {
            anyhow::bail!(
                "one prompt runs on chapter 3's f32 cache: --kv-cache-dtype {} needs chapter 4's \
                 engine (--prompts-file)",
                cache.dtype
            );
        }
        let kv = PagedKv::with_budget(config, cache.block_size, cache.memory, false)?;
        let capacity = kv.pool().token_capacity();
        let needed = (prompt_tokens.len().saturating_add(args.max_tokens))
            .min(config.max_position_embeddings);
        if needed > capacity {
            anyhow::bail!(
                "the KV cache holds {capacity} tokens, but the prompt ({}) plus --max-tokens ({}) \
                 needs {needed}: raise --kv-cache-memory",
                prompt_tokens.len(),
                args.max_tokens
            );
        }
        paged = Some(kv);
    }

    let mut stdout = std::io::stdout().lock();
    write!(stdout, "{prompt}")?;
    stdout.flush()?;
    let mut write_error = None;
    let mut on_text = |text: &str| {
        if let Err(e) = write!(stdout, "{text}").and_then(|()| stdout.flush()) {
            write_error.get_or_insert(e);
        }
    };
    let tokenizer = &host.tokenizer;
    let generation = if args.recompute {
        ch01::generate(model, tokenizer, &prompt_tokens, options, &mut on_text)?
    } else if args.contiguous {
        // Chapter 2's cache reserves the whole context at once: refused, saying so, where that
        // is more memory than there is (an 8B model's 128k context takes 34 GB in f32).
        let c = &model.config;
        let reserve = ch02::ContiguousKvCache::bytes_for(c, c.max_position_embeddings);
        if let Some(available) = super::available_memory()
            && reserve > available
        {
            anyhow::bail!(
                "--contiguous reserves the whole context of {} positions, {:.1} GiB, and {:.1} \
                 GiB are available: drop --contiguous for the paged cache",
                c.max_position_embeddings,
                reserve as f64 / f64::from(1u32 << 30),
                available as f64 / f64::from(1u32 << 30)
            );
        }
        let mut cache = ch02::ContiguousKvCache::for_max_len(&model.config);
        ch02::generate_cached(
            model,
            tokenizer,
            &prompt_tokens,
            &mut cache,
            options,
            &mut on_text,
        )?
    } else {
        let kv = paged
            .as_mut()
            .expect("made above unless --recompute or --contiguous");
        ch03::generate_paged(model, tokenizer, &prompt_tokens, kv, options, &mut on_text)?
    };
    writeln!(stdout)?;
    if let Some(e) = write_error {
        return Err(e.into());
    }

    let rate = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let prompt_secs = generation.prompt_time.as_secs_f64();
    let gen_secs = generation.generation_time.as_secs_f64();
    eprintln!(
        "prompt eval: {} tokens in {:.1} ms ({:.1} tokens/s)",
        prompt_tokens.len(),
        prompt_secs * 1e3,
        rate(prompt_tokens.len(), prompt_secs)
    );
    eprintln!(
        "generation:  {} tokens in {:.1} ms ({:.1} tokens/s) | finish: {}",
        generation.output_tokens.len(),
        (prompt_secs + gen_secs) * 1e3,
        rate(generation.decode_steps, gen_secs),
        match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    );
    Ok(())
}

/// A prompt as an error names it: quoted, its first 80 characters at most (a prompt of a
/// megabyte must not make a megabyte of error message).
fn quoted(prompt: &str) -> String {
    const SHOWN: usize = 80;
    match prompt.char_indices().nth(SHOWN) {
        Some((end, _)) => format!(
            "{:?}… ({} characters)",
            &prompt[..end],
            prompt.chars().count()
        ),
        None => format!("{prompt:?}"),
    }
}

/// The prompts of a `--prompts-file`: one per line, empty lines skipped.
fn read_prompts(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = super::read_text_file(path)
        .with_context(|| format!("reading prompts from {}", path.display()))?;
    let prompts: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    if prompts.is_empty() {
        anyhow::bail!(
            "{} holds no prompt: write one per line (empty lines are skipped)",
            path.display()
        );
    }
    Ok(prompts)
}

/// Every prompt through chapter 4's engine, fed to it as it makes room (`Feed`); the
/// completions in line order. `model`:
/// the host weights (`None` on a GPU, whose executor loads its own, and on tensor-parallel
/// ranks, which load their shards, unless a layer-skip drafter needs them).
fn run_many(
    args: &Args,
    prompts: &[String],
    model: Option<&Llama>,
    host: &HostSide,
    options: &GenerateOptions,
) -> anyhow::Result<()> {
    let tokenizer = &host.tokenizer;
    let cache = args.kv.cache(&host.config, &args.model.dtype)?;
    let attention = args.attention.kind_on(args.model.device)?;
    let executor = match args.model.device {
        DeviceSpec::Cuda(_) if args.tensor_parallel.is_parallel() => {
            anyhow::bail!("tensor parallelism does not run on the GPU yet")
        }
        DeviceSpec::Cuda(_) => args.model.gpu_executor(&host.config, &cache)?,
        DeviceSpec::Cpu => args
            .tensor_parallel
            .executor(&args.model, model, &cache, attention)?,
    };
    // The draft model (on the CPU; a GPU's executor loads its own) lives as long as the
    // engine that borrows it.
    let draft = match args.model.device {
        DeviceSpec::Cpu => args
            .speculative
            .load_draft(&args.model.dtype, &host.config)?,
        DeviceSpec::Cuda(_) => None,
    };
    let engine_config = args.engine.config();
    let mut engine = Engine::boxed(executor, engine_config)?;
    let target = match (model, args.model.device) {
        (Some(model), _) => TargetWeights::Host(model),
        (None, DeviceSpec::Cpu) => TargetWeights::Ranks(&host.config),
        (None, DeviceSpec::Cuda(_)) => TargetWeights::Gpu(&args.model, &host.config),
    };
    if let Some(speculator) =
        args.speculative
            .speculator(target, draft.as_ref(), &cache, &engine_config)?
    {
        engine = engine.with_speculator(speculator);
    }
    eprintln!(
        "kiln: {} | {} prompts | seed {} (+ i for prompt i)\nkiln: {} | attention {}",
        args.model.model.display(),
        prompts.len(),
        options.sampling.seed,
        args.engine.describe(),
        attention,
    );
    if let Some(line) = args.speculative.describe()? {
        eprintln!("kiln: {line}");
    }

    let start = Instant::now();
    let mut client = Prompts {
        texts: Vec::with_capacity(prompts.len()),
        index: BTreeMap::new(),
        recomputing: BTreeSet::new(),
        trace: args.trace,
        recompute: args.engine.preemption_mode == PreemptionMode::Recompute,
        error: None,
        feed: Feed {
            prompts,
            window: (engine_config.max_num_seqs.saturating_mul(2)).max(FEED_AHEAD_AT_LEAST),
            tokenizer,
            options,
        },
        unfinished: 0,
    };
    ch04::drive(&mut engine, &mut client)?;
    if let Some(error) = client.error {
        return Err(error);
    }
    anyhow::ensure!(
        client.texts.len() == prompts.len(),
        "the engine went idle with {} of {} prompts added",
        client.texts.len(),
        prompts.len()
    );
    let wall = start.elapsed().as_secs_f64();

    let mut stdout = std::io::stdout().lock();
    for (i, (prompt, text)) in prompts.iter().zip(&client.texts).enumerate() {
        writeln!(stdout, "=== [{i}] {prompt}")?;
        writeln!(stdout, "{}", text.text())?;
    }
    stdout.flush()?;

    let counters = engine.scheduler().counters();
    let prefix = engine.scheduler().prefix_stats();
    eprintln!(
        "requests: {} | prompt tokens: {} | generated tokens: {} | wall: {:.2} s | {:.1} output tokens/s",
        prompts.len(),
        counters.prompt_tokens,
        counters.generation_tokens,
        wall,
        if wall > 0.0 {
            counters.generation_tokens as f64 / wall
        } else {
            0.0
        },
    );
    eprintln!(
        "steps: {} | preemptions: {} | prefix cache hits: {} of {} blocks",
        counters.steps, counters.preemptions, prefix.hit_blocks, prefix.queried_blocks
    );
    if let Some(line) = speculative_args::summary(&counters) {
        eprintln!("{line}");
    }
    Ok(())
}

/// The fewest unfinished requests the engine is fed (otherwise twice `--max-num-seqs`).
const FEED_AHEAD_AT_LEAST: usize = 64;

/// `--prompts-file` as chapter 4's engine loop sees it: requests are added in line order, up to
/// `feed.window` unfinished at once; each step's tokens go through its completion's text, a stop
/// string aborts it.
struct Prompts<'t> {
    /// Per prompt added so far (line order), its completion's text: `texts.len()` is the next
    /// prompt to add.
    texts: Vec<OutputText<'t>>,
    /// Engine id → line.
    index: BTreeMap<RequestId, usize>,
    /// Requests preempted by recomputation: their next prompt-sized runs recompute K/V.
    recomputing: BTreeSet<RequestId>,
    trace: bool,
    recompute: bool,
    /// A tokenizer, admission or detokenizer error: the loop stops at the next poll.
    error: Option<anyhow::Error>,
    feed: Feed<'t>,
    /// Requests added and not finished.
    unfinished: usize,
}

/// The file's prompts, added to the engine from `Prompts::texts.len()` on. Adding them all at once made the time of a step
/// grow with the waiting list (the scheduler looks through it every step) and tokenized the
/// whole file first: 40,000 one-token completions took 22-23 s against 9-10 s fed, and
/// 1,000,000 held 1.9 GB at once.
struct Feed<'t> {
    prompts: &'t [String],
    /// Unfinished requests kept in the engine while prompts remain.
    window: usize,
    tokenizer: &'t Tokenizer,
    options: &'t GenerateOptions,
}

impl EngineClient for Prompts<'_> {
    fn poll(&mut self, engine: &mut Engine<'_>) -> ControlFlow<()> {
        while self.error.is_none()
            && self.unfinished < self.feed.window
            && self.texts.len() < self.feed.prompts.len()
        {
            if let Err(error) = self.add_next(engine) {
                self.error = Some(error);
            }
        }
        if self.error.is_some() || !engine.has_unfinished() {
            return ControlFlow::Break(());
        }
        ControlFlow::Continue(())
    }

    fn on_step(&mut self, engine: &mut Engine<'_>, outputs: Vec<RequestOutput>) {
        if self.recompute {
            let preempted = &engine.scheduler().last_step().preempted;
            self.recomputing.extend(preempted.iter().copied());
        }
        if self.trace {
            let sampled: Vec<RequestId> = outputs.iter().map(|o| o.id).collect();
            eprintln!("{}", trace_line(engine, &sampled, &self.recomputing));
        }
        for output in outputs {
            if let Err(error) = self.fold(engine, output) {
                self.error.get_or_insert(error);
            }
        }
    }
}

impl Prompts<'_> {
    /// The next prompt of the file, tokenized, into the engine.
    fn add_next(&mut self, engine: &mut Engine<'_>) -> anyhow::Result<()> {
        let Feed {
            prompts,
            tokenizer,
            options,
            ..
        } = self.feed;
        let i = self.texts.len(); // prompts are added in line order, one text each
        let prompt = &prompts[i];
        let context = || format!("prompt {i} ({})", quoted(prompt));
        let tokens = tokenizer.encode(prompt, true).with_context(context)?;
        let text = OutputText::after(tokenizer, options.stop.clone(), &tokens);
        let request = Request {
            prompt: tokens,
            params: SamplingParams {
                seed: options.sampling.seed.wrapping_add(i as u64),
                ..options.sampling.clone()
            },
            max_tokens: options.max_tokens,
            stop_token_ids: options.eos_token_ids.clone(),
            ignore_eos: options.ignore_eos,
            priority: 0,
            logprobs: None,
        };
        let id = engine
            .add_request(request)
            .map_err(|e| admission_error(e, context()))?;
        self.index.insert(id, i);
        self.texts.push(text);
        self.unfinished += 1;
        Ok(())
    }

    /// One request's new tokens into its text; a completed stop string aborts the request.
    fn fold(&mut self, engine: &mut Engine<'_>, output: RequestOutput) -> anyhow::Result<()> {
        let text = &mut self.texts[self.index[&output.id]];
        let mut tokens = output.new_tokens;
        if output.finished == Some(ch04::FinishReason::Stop) {
            tokens.pop(); // the stop token (EOS) is not text
        }
        for token in tokens {
            if text.push(token)?.stopped {
                engine.abort(output.id);
                self.unfinished -= 1;
                return Ok(());
            }
        }
        if output.finished.is_some() {
            self.unfinished -= 1;
            text.finish()?;
        }
        Ok(())
    }
}

/// One line per engine step, e.g.
/// `step 3: run [0] prefill 16 (chunk), [1] decode 1 | admitted [1] | preempted [2] | KV 94%, 1 waiting`.
/// `sampled`: the requests that produced a token this step (a prompt run that did not is a chunk).
fn trace_line(engine: &Engine, sampled: &[RequestId], recomputing: &BTreeSet<RequestId>) -> String {
    let scheduler = engine.scheduler();
    let StepTrace {
        scheduled,
        preempted,
        admitted,
        speculated,
        ..
    } = scheduler.last_step();
    let ids = |ids: &[RequestId]| {
        ids.iter()
            .map(|id| format!("[{id}]"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let runs: Vec<String> = scheduled
        .iter()
        .map(|&(id, n, prompt)| {
            if let Some(&(_, drafts, accepted)) = speculated.iter().find(|s| s.0 == id) {
                return format!("[{id}] decode 1+{drafts} drafts ({accepted} accepted)");
            }
            if !prompt && n == 1 {
                return format!("[{id}] decode 1");
            }
            let kind = if recomputing.contains(&id) {
                "recompute"
            } else {
                "prefill"
            };
            let chunk = if sampled.contains(&id) {
                ""
            } else {
                " (chunk)"
            };
            format!("[{id}] {kind} {n}{chunk}")
        })
        .collect();
    let mut line = format!(
        "step {}: run {}",
        scheduler.counters().steps,
        runs.join(", ")
    );
    if !admitted.is_empty() {
        line += &format!(" | admitted {}", ids(admitted));
    }
    if !preempted.is_empty() {
        line += &format!(" | preempted {}", ids(preempted));
    }
    let (waiting, _, swapped) = scheduler.queue_lengths();
    line += &format!(" | KV {:.0}%", scheduler.kv_usage() * 100.0);
    if waiting > 0 {
        line += &format!(", {waiting} waiting");
    }
    if swapped > 0 {
        line += &format!(", {swapped} swapped");
    }
    line
}

/// `e`, refusing prompt `prompt` (described), with the flag that would admit it where one would:
/// a cache too small for prompt and output, or a step too small for an unchunked prompt. A
/// prompt past the model's context says so itself; no flag helps it.
fn admission_error(e: ch04::EngineError, prompt: String) -> anyhow::Error {
    let advice = match e {
        ch04::EngineError::TooLong { .. } => Some("raise --kv-cache-memory, or lower --max-tokens"),
        ch04::EngineError::OverBudget { .. } => {
            Some("raise --max-num-batched-tokens, or drop --no-enable-chunked-prefill")
        }
        _ => None,
    };
    let e = anyhow::Error::new(e).context(prompt);
    match advice {
        Some(advice) => e.context(advice),
        None => e,
    }
}
