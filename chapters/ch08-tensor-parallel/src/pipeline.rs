//! A pipeline-parallel sketch: the layers split into `p` stages, each on its own thread, and a
//! batch cut into `m` micro-batches that flow through them.
//!
//! ```text
//! stage 0: [mb0][mb1][mb2][mb3]                   time ─▶
//! stage 1:      [mb0][mb1][mb2][mb3]
//! stage 2:           [mb0][mb1][mb2][mb3]         idle boxes at the start and the end: the
//!                                                 bubble, (p − 1) / (m + p − 1) of p · makespan
//! ```
//! Only the forward of whole prompts (chapter 1's recomputing layers, no KV cache): enough to
//! measure the bubble beside tensor parallelism, not a serving path. Stage `s` holds layers
//! `s · L / p ..` (the remainder to the first stages); the last stage applies the final norm and
//! the head.

use std::ops::Range;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use ch01::Llama;
use ndarray::Array2;

/// Why a pipeline could not run.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("{stages} pipeline stages for {layers} layers: need 1 ..= layers stages")]
    Stages { stages: usize, layers: usize },
    #[error(transparent)]
    Tokens(#[from] ch01::Error),
    #[error("pipeline stage {0} was lost")]
    StageLost(usize),
}

/// What a pipeline run produced: each micro-batch's logits, and when each stage worked.
pub struct PipelineRun {
    /// Per micro-batch, in order: [tokens, vocab].
    pub logits: Vec<Array2<f32>>,
    /// Per stage: the intervals (from the start) it spent on each micro-batch.
    pub busy: Vec<Vec<Range<Duration>>>,
    /// From the first stage's start to the last stage's end.
    pub makespan: Duration,
}

impl PipelineRun {
    /// The share of `stages · makespan` in which a stage was idle.
    pub fn bubble_fraction(&self) -> f64 {
        let busy: f64 = self
            .busy
            .iter()
            .flatten()
            .map(|r| (r.end - r.start).as_secs_f64())
            .sum();
        1.0 - busy / (self.busy.len() as f64 * self.makespan.as_secs_f64())
    }
}

/// The bubble of an ideal pipeline with equal stages: `(p − 1) / (m + p − 1)`.
pub fn ideal_bubble(stages: usize, micro_batches: usize) -> f64 {
    (stages as f64 - 1.0) / (micro_batches as f64 + stages as f64 - 1.0)
}

/// The layers of stage `s` of `p` over `layers` layers.
pub fn stage_layers(s: usize, p: usize, layers: usize) -> Range<usize> {
    let (base, extra) = (layers / p, layers % p);
    let start = s * base + s.min(extra);
    start..start + base + usize::from(s < extra)
}

// ANCHOR: pipeline
/// Runs every micro-batch (a prompt, checked) through `stages` stages of `model`, each a thread.
pub fn run_pipeline(
    model: &Llama,
    stages: usize,
    micro_batches: &[Vec<u32>],
) -> Result<PipelineRun, PipelineError> {
    let layers = model.layers.len();
    if stages == 0 || stages > layers {
        return Err(PipelineError::Stages { stages, layers });
    }
    for tokens in micro_batches {
        model.check_tokens(tokens)?;
    }
    let start = Instant::now();
    // Channel s carries activations [tokens, hidden] from stage s − 1 (or the embedding) to s.
    let (mut senders, mut receivers): (Vec<_>, Vec<_>) =
        (0..=stages).map(|_| channel::<Array2<f32>>()).unzip();
    let first: Sender<Array2<f32>> = senders.remove(0);
    let last: Receiver<Array2<f32>> = receivers.pop().expect("stages + 1 channels");
    let busy = std::thread::scope(|scope| {
        let handles: Vec<_> = receivers
            .into_iter()
            .zip(senders)
            .enumerate()
            .map(|(s, (input, output))| {
                scope.spawn(move || {
                    let mut busy = Vec::new();
                    for mut x in input {
                        let begin = start.elapsed();
                        for layer in &model.layers[stage_layers(s, stages, layers)] {
                            x = layer.forward(&x, &model.rope); // [tokens, hidden]
                        }
                        if s + 1 == stages {
                            x = model.lm_head.forward(model.norm.forward(x.view()).view());
                        }
                        busy.push(begin..start.elapsed());
                        if output.send(x).is_err() {
                            break;
                        }
                    }
                    busy
                })
            })
            .collect();
        for tokens in micro_batches {
            // The embedding is not a stage: the first stage's input is ready at once.
            let _ = first.send(model.embed(tokens));
        }
        drop(first); // the stages end after the last micro-batch
        handles
            .into_iter()
            .enumerate()
            .map(|(s, h)| h.join().map_err(|_| PipelineError::StageLost(s)))
            .collect::<Result<Vec<_>, _>>()
    })?;
    let logits: Vec<Array2<f32>> = last.iter().collect();
    if logits.len() != micro_batches.len() {
        return Err(PipelineError::StageLost(stages - 1));
    }
    Ok(PipelineRun {
        logits,
        busy,
        makespan: start.elapsed(),
    })
}
// ANCHOR_END: pipeline
