//! [`SpeculativeDecoding`]: a [`Drafter`] and this chapter's verification, as chapter 4's
//! [`Speculator`] seam wants them.

use ch01::Sampler;
use ch01::sampler::SamplingError;
use ch04::{Draft, DraftSeq, ExecutorError, RequestId, Speculator};
use ndarray::ArrayView2;

use crate::drafter::Drafter;
use crate::verify::{VerifyScratch, verify};

/// How much to speculate, named as vLLM's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// `--num-speculative-tokens`: most drafts per sequence and step (k).
    pub num_speculative_tokens: usize,
    /// `--speculative-disable-by-batch-size`: no drafts in steps where more sequences run.
    pub disable_by_batch_size: Option<usize>,
}

/// Speculative decoding with drafter `D`.
pub struct SpeculativeDecoding<D> {
    pub config: SpecConfig,
    pub drafter: D,
    scratch: VerifyScratch,
}

impl<D: Drafter> SpeculativeDecoding<D> {
    pub fn new(drafter: D, config: SpecConfig) -> Self {
        SpeculativeDecoding {
            config,
            drafter,
            scratch: VerifyScratch::default(),
        }
    }
}

impl<D: Drafter> Speculator for SpeculativeDecoding<D> {
    fn num_speculative_tokens(&self) -> usize {
        self.config.num_speculative_tokens
    }

    fn disable_by_batch_size(&self) -> Option<usize> {
        self.config.disable_by_batch_size
    }

    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), ExecutorError> {
        self.drafter
            .propose(seqs, drafts)
            .map_err(|e| ExecutorError(e.to_string()))
    }

    fn verify(
        &mut self,
        sampler: &mut Sampler,
        rows: ArrayView2<f32>,
        prompt: &[u32],
        output: &[u32],
        draft: &Draft,
        accepted: &mut Vec<u32>,
    ) -> Result<(), SamplingError> {
        verify(
            sampler,
            rows,
            prompt,
            output,
            draft,
            &mut self.scratch,
            accepted,
        )
    }

    fn release(&mut self, id: RequestId) {
        self.drafter.release(id);
    }
}
