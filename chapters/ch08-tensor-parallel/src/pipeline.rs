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
    /// Per stage: the intervals it spent on each micro-batch, from the moment the first stage
    /// began its first micro-batch (so the earliest interval starts at zero).
    pub busy: Vec<Vec<Range<Duration>>>,
    /// From the first stage's start to the last stage's end: the latest end among `busy`.
    /// Spawning the threads and joining them lie outside it, so they do not count as idle.
    pub makespan: Duration,
}

impl PipelineRun {
    /// The share of `stages · makespan` in which a stage was idle (0 when nothing ran).
    pub fn bubble_fraction(&self) -> f64 {
        if self.makespan.is_zero() {
            return 0.0;
        }
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
    // The stages' clock. The makespan runs from the first stage's start, not from here:
    // spawning the threads is not pipeline time (see `from_first_start`).
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
    let (busy, makespan) = from_first_start(busy);
    Ok(PipelineRun {
        logits,
        busy,
        makespan,
    })
}
// ANCHOR_END: pipeline

/// `busy` (times since any instant before the first) moved to start at the earliest start, and
/// the makespan: the latest end, so measured. Empty intervals give a makespan of zero.
fn from_first_start(busy: Vec<Vec<Range<Duration>>>) -> (Vec<Vec<Range<Duration>>>, Duration) {
    let intervals = || busy.iter().flatten();
    let Some(first) = intervals().map(|r| r.start).min() else {
        return (busy, Duration::ZERO);
    };
    let last = intervals().map(|r| r.end).max().unwrap_or(first);
    let moved = busy
        .iter()
        .map(|stage| {
            stage
                .iter()
                .map(|r| r.start - first..r.end - first)
                .collect()
        })
        .collect();
    (moved, last - first)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two equal stages and one micro-batch, started late (thread start-up) and joined later
    /// still: the stages' own span is the makespan, and the bubble is exactly the ideal 1/2.
    #[test]
    fn setup_before_the_first_stage_starts_is_not_bubble() {
        let ms = Duration::from_millis;
        let busy = vec![vec![ms(7)..ms(17)], vec![ms(17)..ms(27)]];
        let (busy, makespan) = from_first_start(busy);
        assert_eq!(busy, [vec![ms(0)..ms(10)], vec![ms(10)..ms(20)]]);
        assert_eq!(makespan, ms(20));
        let run = PipelineRun {
            logits: Vec::new(),
            busy,
            makespan,
        };
        assert_eq!(run.bubble_fraction(), ideal_bubble(2, 1));
        assert_eq!(from_first_start(vec![Vec::new(); 3]).1, Duration::ZERO);
    }
}
