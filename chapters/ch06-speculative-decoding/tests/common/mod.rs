//! What the chapter's engine tests share: the fixture models, the target alone, and an
//! executor that checks every step it is handed.
#![allow(dead_code)]

use std::collections::HashSet;

use ch01::{Llama, fixtures_dir};
use ch02::{CachedSession, ContiguousKvCache};
use ch04::{Executor, ExecutorError, KvLayout, ModelSpec, SchedulerOutput};
use ndarray::ArrayView2;

/// A fixture model with chapter 2's fast layers, as the binary runs them.
pub fn load(name: &str) -> Llama {
    ch02::load_fast(&fixtures_dir().join(name), ch02::WeightDtype::F32).unwrap()
}

/// Prompts in the fixture tokenizer: Shakespeare lines, some repeating themselves (n-gram
/// lookup finds drafts there).
pub fn prompts() -> Vec<Vec<u32>> {
    let tokenizer = ch01::Tokenizer::from_dir(&fixtures_dir().join("shakespeare-small")).unwrap();
    [
        "HAMLET.\nTo be, or not to be, that is the question:",
        "ROMEO. But soft, what light through yonder window breaks?",
        "KING. Blow, winds, blow! Blow, winds, blow! Blow, winds,",
        "OPHELIA.",
        "MACBETH. Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace",
    ]
    .iter()
    .map(|p| tokenizer.encode(p, true).unwrap())
    .collect()
}

fn argmax(logits: ndarray::ArrayView1<f32>) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
            if v > best.1 { (i, v) } else { best }
        })
        .0 as u32
}

/// Greedy generation of one request alone, on chapter 2's contiguous cache.
pub fn alone(model: &Llama, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let cache = ContiguousKvCache::new(&model.config, prompt.len() + max_tokens + 1);
    let mut session = CachedSession::new(model, cache);
    let mut out = vec![argmax(session.prefill(prompt).unwrap())];
    while out.len() < max_tokens {
        let next = argmax(session.decode(*out.last().unwrap()).unwrap());
        out.push(next);
    }
    out
}

/// An executor that checks each step before running it: blocks in the pool and covering every
/// position run, no slot written twice in a step, logit rows within the tokens.
pub struct Checked<E>(pub E);

impl<E: Executor> Checked<E> {
    fn check(&self, step: &SchedulerOutput) -> Result<(), String> {
        let (kv, model) = (self.0.kv_layout(), self.0.model_spec());
        let mut written = HashSet::new();
        for seq in &step.seqs {
            let end = seq.start_pos + seq.tokens.len();
            if seq.tokens.is_empty() || end > model.max_model_len {
                return Err(format!("request {}: positions ..{end}", seq.id));
            }
            if seq.block_table.len() * kv.block_size < end
                || seq.block_table.iter().any(|&b| b as usize >= kv.num_blocks)
            {
                return Err(format!("request {}: table does not cover ..{end}", seq.id));
            }
            if seq.logit_rows > seq.tokens.len() {
                return Err(format!("request {}: more logit rows than tokens", seq.id));
            }
            for pos in seq.start_pos..end {
                let slot = seq.block_table[pos / kv.block_size] as usize * kv.block_size
                    + pos % kv.block_size;
                if !written.insert(slot) {
                    return Err(format!("slot {slot} written twice in one step"));
                }
            }
        }
        Ok(())
    }
}

impl<E: Executor> Executor for Checked<E> {
    fn kv_layout(&self) -> KvLayout {
        self.0.kv_layout()
    }

    fn model_spec(&self) -> ModelSpec {
        self.0.model_spec()
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.check(step).map_err(ExecutorError)?;
        self.0.execute(step)
    }
}
