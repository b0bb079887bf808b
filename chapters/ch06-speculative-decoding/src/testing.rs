//! Drafters for tests: an adversary whose drafts are random tokens (almost all rejected), and
//! an oracle that knows what the target will produce (all accepted). Speculation must be
//! exact with both: verification alone decides the output.

use std::collections::HashMap;

use ch04::{Draft, DraftSeq};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::drafter::{DraftError, Drafter};

/// Proposes `max_drafts` uniformly random tokens. With `sampled`, it says so: each draft
/// comes with its distribution (uniform over the vocabulary), as a sampling drafter would.
pub struct RandomDrafter {
    pub vocab: usize,
    pub sampled: bool,
    rng: ChaCha8Rng,
}

impl RandomDrafter {
    pub fn new(vocab: usize, seed: u64, sampled: bool) -> Self {
        RandomDrafter {
            vocab,
            sampled,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
}

impl Drafter for RandomDrafter {
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        for (seq, draft) in seqs.iter().zip(drafts) {
            for _ in 0..seq.max_drafts {
                draft
                    .tokens
                    .push(self.rng.random_range(0..self.vocab as u32));
            }
            if self.sampled {
                let uniform = 1.0 / self.vocab as f32;
                draft.probs.resize(seq.max_drafts * self.vocab, uniform);
            }
        }
        Ok(())
    }
}

/// Knows every request's whole sequence (prompt followed by the target's output): proposes
/// its next tokens. Right every time for greedy requests whose references came from the
/// target alone.
#[derive(Default)]
pub struct OracleDrafter {
    /// Prompt → prompt followed by the target's output.
    references: HashMap<Vec<u32>, Vec<u32>>,
}

impl OracleDrafter {
    pub fn new(references: impl IntoIterator<Item = (Vec<u32>, Vec<u32>)>) -> Self {
        let references = references
            .into_iter()
            .map(|(prompt, output)| {
                let mut whole = prompt.clone();
                whole.extend(output);
                (prompt, whole)
            })
            .collect();
        OracleDrafter { references }
    }
}

impl Drafter for OracleDrafter {
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        for (seq, draft) in seqs.iter().zip(drafts) {
            let Some(whole) = self.references.get(&seq.tokens[..seq.prompt_len]) else {
                continue;
            };
            let len = seq.tokens.len();
            if whole.len() > len && whole[..len] == *seq.tokens {
                let end = (len + seq.max_drafts).min(whole.len());
                draft.tokens.extend_from_slice(&whole[len..end]);
            }
        }
        Ok(())
    }
}
