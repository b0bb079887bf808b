//! `kiln bench ch02 --only profile`: where one engine step's time goes, op by op, with the
//! row-wise ops between the products serial and threaded (`ch02::elementwise`).
//!
//! ```text
//! prefill   one request of PREFILL_TOKENS prompt tokens: the step that runs its prompt
//! decode    DECODE_BATCH requests, all decoding: one step of DECODE_BATCH rows
//! each      reps × {serial, threaded}, alternating on the same engine; per op the median
//! ```
//! The ops are timed by `ch02::profile` spans around each op of the decoder layer and of the
//! executor's step; "other" is the rest of the step (scheduling, the step's bookkeeping).

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use ch01::Llama;
use ch02::elementwise::{parallel_elementwise, set_parallel_elementwise};
use ch02::profile::{self, Op};
use ch03::KvPool;
use ch04::{CpuExecutor, Engine, EngineConfig, Request};

use crate::bench::table::{Align, Table};
use crate::bench::{RunFacts, ms};

/// The figure's file stem: `profile.md`.
pub const STEM: &str = "profile";
/// Prompt tokens of the profiled prefill step.
pub const PREFILL_TOKENS: usize = 124;
/// Sequences of the profiled decode step.
pub const DECODE_BATCH: usize = 32;
/// Prompt tokens of each decoding sequence (they are prefilled before the profile starts).
const DECODE_PROMPT: usize = 16;
/// Positions per KV block.
const BLOCK_SIZE: usize = 16;

/// The medians of one kind of step, serial and threaded.
pub struct StepProfile {
    pub label: String,
    /// (op, serial, threaded), in step order.
    pub ops: Vec<(Op, Duration, Duration)>,
    /// The whole step: serial, threaded.
    pub step: (Duration, Duration),
}

/// Both profiled steps of one run.
pub struct Profile {
    pub prefill: StepProfile,
    pub decode: StepProfile,
}

/// Profiles the two steps, `reps` times each way. `tokens`: a pseudo-random walk long enough for
/// the prompts.
pub fn measure(model: &Llama, tokens: &[u32], reps: usize) -> anyhow::Result<Profile> {
    let max_len = model.config.max_position_embeddings;
    let prefill_tokens = PREFILL_TOKENS.min(max_len.saturating_sub(2));
    ensure!(
        prefill_tokens >= 1 && DECODE_PROMPT + 2 * reps + 4 <= max_len,
        "the model's context of {max_len} positions is too short for the profile"
    );
    ensure!(
        tokens.len() >= prefill_tokens.max(DECODE_PROMPT + DECODE_BATCH),
        "too few benchmark tokens"
    );
    let before = parallel_elementwise();
    let measured = profile_prefill(model, &tokens[..prefill_tokens], reps)
        .and_then(|prefill| Ok((prefill, profile_decode(model, tokens, reps)?)));
    set_parallel_elementwise(before);
    let (prefill, decode) = measured?;
    Ok(Profile { prefill, decode })
}

/// An engine whose pool holds `seqs` sequences of `len` positions each, with room to spare, its
/// memory backed.
fn engine(
    model: &Llama,
    seqs: usize,
    len: usize,
    step_tokens: usize,
) -> anyhow::Result<Engine<'_>> {
    let blocks = seqs * len.div_ceil(BLOCK_SIZE);
    let mut pool = KvPool::<f32>::new(&model.config, BLOCK_SIZE, blocks + blocks / 10 + 4)?;
    pool.populate(); // backed before any step is timed, as a server's is at start-up
    let config = EngineConfig {
        max_num_seqs: seqs,
        max_num_batched_tokens: step_tokens,
        ..EngineConfig::default()
    };
    Ok(Engine::new(CpuExecutor::new(model, pool), config)?)
}

/// A greedy request that never stops early.
fn request(prompt: &[u32], max_tokens: usize) -> Request {
    let mut request = Request::greedy(prompt.to_vec(), max_tokens);
    request.ignore_eos = true;
    request
}

/// One profiled `engine.step()` with the row-wise ops `threaded` or not: each op's time and
/// the step's.
fn profiled_step(
    engine: &mut Engine<'_>,
    threaded: bool,
) -> anyhow::Result<(Vec<(Op, Duration)>, Duration)> {
    set_parallel_elementwise(threaded);
    profile::take(); // start from zero
    profile::set_enabled(true);
    let start = Instant::now();
    let stepped = engine.step();
    let step = start.elapsed();
    profile::set_enabled(false);
    stepped?;
    Ok((profile::take(), step))
}

/// The prefill of `prompt` in one step, on a fresh engine each time.
fn profile_prefill(model: &Llama, prompt: &[u32], reps: usize) -> anyhow::Result<StepProfile> {
    let mut runs = Runs::default();
    for rep in 0..=reps {
        for threaded in [false, true] {
            let mut engine = engine(model, 1, prompt.len() + 2, prompt.len())?;
            engine.add_request(request(prompt, 2))?;
            let measured = profiled_step(&mut engine, threaded)?;
            let scheduled = &engine.scheduler().last_step().scheduled;
            ensure!(
                scheduled.len() == 1 && scheduled[0].1 == prompt.len(),
                "the prefill step ran {scheduled:?}, not the whole prompt"
            );
            if rep > 0 {
                runs.push(threaded, measured); // rep 0 warms the caches up
            }
        }
    }
    Ok(runs.medians(format!("prefill, {} tokens", prompt.len())))
}

/// One step of `DECODE_BATCH` sequences decoding, alternating serial and threaded on one engine.
fn profile_decode(model: &Llama, tokens: &[u32], reps: usize) -> anyhow::Result<StepProfile> {
    let max_tokens = 2 * reps + 4;
    let step_tokens = DECODE_BATCH * DECODE_PROMPT;
    let mut engine = engine(model, DECODE_BATCH, DECODE_PROMPT + max_tokens, step_tokens)?;
    for i in 0..DECODE_BATCH {
        engine.add_request(request(&tokens[i..i + DECODE_PROMPT], max_tokens))?;
    }
    engine.step().context("prefilling the decode batch")?;
    let mut runs = Runs::default();
    for rep in 0..=reps {
        for threaded in [false, true] {
            let measured = profiled_step(&mut engine, threaded)?;
            let scheduled = &engine.scheduler().last_step().scheduled;
            ensure!(
                scheduled.len() == DECODE_BATCH && scheduled.iter().all(|s| s.1 == 1 && !s.2),
                "the decode step ran {scheduled:?}, not {DECODE_BATCH} decodes"
            );
            if rep > 0 {
                runs.push(threaded, measured);
            }
        }
    }
    Ok(runs.medians(format!("decode, batch {DECODE_BATCH}")))
}

/// Every measured step, serial and threaded.
#[derive(Default)]
struct Runs {
    serial: Vec<(Vec<(Op, Duration)>, Duration)>,
    threaded: Vec<(Vec<(Op, Duration)>, Duration)>,
}

impl Runs {
    fn push(&mut self, threaded: bool, run: (Vec<(Op, Duration)>, Duration)) {
        if threaded {
            self.threaded.push(run);
        } else {
            self.serial.push(run);
        }
    }

    fn medians(&self, label: String) -> StepProfile {
        let op_median = |runs: &[(Vec<(Op, Duration)>, Duration)], i: usize| {
            median(runs.iter().map(|(ops, _)| ops[i].1).collect())
        };
        let step_median = |runs: &[(Vec<(Op, Duration)>, Duration)]| {
            median(runs.iter().map(|&(_, step)| step).collect())
        };
        let ops = Op::ALL
            .iter()
            .enumerate()
            .map(|(i, &op)| (op, op_median(&self.serial, i), op_median(&self.threaded, i)))
            .collect();
        StepProfile {
            label,
            ops,
            step: (step_median(&self.serial), step_median(&self.threaded)),
        }
    }
}

/// The median (the lower middle for an even count); zero for none.
fn median(mut values: Vec<Duration>) -> Duration {
    values.sort_unstable();
    values
        .get(values.len().saturating_sub(1) / 2)
        .copied()
        .unwrap_or_default()
}

impl Profile {
    /// `profile.md`: one table per step, and how it was measured.
    pub fn markdown(
        &self,
        facts: &RunFacts,
        model_name: &str,
        threads: usize,
        reps: usize,
    ) -> String {
        let caption = format!(
            "_{model_name}, {}, median of {reps} steps each way. Command: `{}`._",
            facts.machine(threads),
            facts.command
        );
        let mut text = String::new();
        for step in [&self.prefill, &self.decode] {
            text += &format!("**{}**\n\n{}\n", step.label, step.table());
        }
        text += &format!(
            "{caption}\n\nSerial: every op between the matrix products on the calling thread \
             (`set_parallel_elementwise(false)`); threaded: split across rows above \
             `MIN_ELEMENTS_PER_TASK`. The projections and attention were threaded in both. \
             sampling: the scheduler's whole update (sampling, stop checks, blocks); other: the \
             rest of the step (scheduling, bookkeeping). Each op's median is taken on its own, \
             so the rows need not add up to the step's median exactly.\n"
        );
        text
    }
}

impl StepProfile {
    fn table(&self) -> String {
        let mut table = Table::new([
            "op",
            "ms serial",
            "ms threaded",
            "share of step (serial)",
            "share of step (threaded)",
        ])
        .align(0, Align::Left);
        let (serial, threaded) = self.step;
        let share = |d: Duration, of: Duration| format!("{:.1}%", 100.0 * ratio(d, of));
        let mut row = |name: &str, s: Duration, t: Duration| {
            table.row([
                name.to_string(),
                format!("{:.3}", ms(s)),
                format!("{:.3}", ms(t)),
                share(s, serial),
                share(t, threaded),
            ]);
        };
        for &(op, s, t) in &self.ops {
            row(op.name(), s, t);
        }
        let (timed_s, timed_t) = self
            .ops
            .iter()
            .fold((Duration::ZERO, Duration::ZERO), |(a, b), &(_, s, t)| {
                (a + s, b + t)
            });
        row(
            "other",
            serial.saturating_sub(timed_s),
            threaded.saturating_sub(timed_t),
        );
        row("**step**", serial, threaded);
        table.to_markdown()
    }
}

fn ratio(part: Duration, whole: Duration) -> f64 {
    if whole.is_zero() {
        0.0
    } else {
        part.as_secs_f64() / whole.as_secs_f64()
    }
}
