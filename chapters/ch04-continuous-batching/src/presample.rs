//! Sampling a step's sequences on several threads at once, before `update` walks them in order;
//! with each token its [`TokenLogprobs`] when the request asked for them.
//!
//! ```text
//! logits [S, vocab] ──▶ seq 0: sample(row 0) ┐
//!                       seq 1: sample(row 1) ├─ in parallel, one task per few sequences
//!                       …                    ┘
//!                  ──▶ update: in step order, each sequence takes its token (stop checks, blocks)
//! ```
//! Each sequence samples from its own row with its own seeded [`Sampler`](ch01::Sampler), so
//! which thread samples it, and in which order, changes no token: the result equals the serial
//! loop's. Only plain decodes are sampled here (one logit row, no drafts, no logits processor);
//! speculative verification and processors, which keep more state, stay in `update`.
//! A sampling error is reported by `update` when it reaches that sequence, as in the serial
//! loop; the one difference is that the sequences after it have then been sampled too (the
//! step fails either way).
//!
//! Whether it splits is chapter 2's one rule ([`items_per_task`]): each sequence's row is a
//! whole vocabulary, thousands of elements, so a step that samples two or more sequences splits
//! (unless [`set_parallel_elementwise`](ch02::elementwise::set_parallel_elementwise) is off).

use std::collections::{BTreeMap, HashMap};

use ch01::sampler::SamplingError;
use ch02::elementwise::items_per_task;
use ndarray::ArrayView2;
use rayon::prelude::*;

use crate::logprobs::TokenLogprobs;
use crate::request::{RequestId, Sequence};
use crate::scheduler::SchedulerOutput;

/// One sequence's sampled token, and its logprobs when its request wants them (of the token,
/// when it was sampled): what `update` would have computed from the same row.
pub(crate) struct Presampled {
    pub token: Result<u32, SamplingError>,
    pub logprobs: Option<TokenLogprobs>,
}

/// The token of each of `step`'s sequences that can be sampled ahead, by its index in
/// `step.seqs`; `None` for the others, and for all of them when the step samples serially.
/// `logits`: [num_logit_rows, vocab].
pub(crate) fn presample(
    seqs: &mut BTreeMap<RequestId, Sequence>,
    step: &SchedulerOutput,
    logits: ArrayView2<f32>,
) -> Vec<Option<Presampled>> {
    let mut tokens: Vec<Option<Presampled>> = (0..step.seqs.len()).map(|_| None).collect();
    // (index in the step, logit row) of every plain decode.
    let mut wanted = HashMap::new();
    let mut first_row = 0;
    for (i, scheduled) in step.seqs.iter().enumerate() {
        if scheduled.logit_rows == 1 {
            wanted.insert(scheduled.id, (i, first_row));
        }
        first_row += scheduled.logit_rows;
    }
    let Some(per_task) = items_per_task(wanted.len(), logits.ncols()) else {
        return tokens; // one sequence, or the split is off: `update` samples each in turn
    };
    let jobs: Vec<(usize, usize, &mut Sequence)> = seqs
        .iter_mut()
        .filter(|(_, seq)| seq.processor.is_none())
        .filter_map(|(id, seq)| wanted.get(id).map(|&(i, row)| (i, row, seq)))
        .collect();
    let sampled: Vec<(usize, Presampled)> = jobs
        .into_par_iter()
        .with_min_len(per_task)
        .map(|(i, row, seq)| {
            let row = logits.row(row);
            let row = row.as_slice().expect("contiguous rows"); // [vocab]
            let prompt = &seq.request.prompt;
            let output = &seq.tokens[prompt.len()..];
            let token = seq.sampler.sample(row, prompt, output);
            let logprobs = match (&token, seq.request.logprobs) {
                (Ok(token), Some(top)) => Some(TokenLogprobs::of(row, *token, top)),
                _ => None,
            };
            (i, Presampled { token, logprobs })
        })
        .collect();
    for (i, token) in sampled {
        tokens[i] = Some(token);
    }
    tokens
}
