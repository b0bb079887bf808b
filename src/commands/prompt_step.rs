//! A whole prompt through an executor: what perplexity and `kiln forward` need when the model
//! runs behind chapter 4's `Executor` (on a GPU, or over tensor-parallel ranks) rather than as
//! chapter 1's `Llama::forward`.

use ch01::LlamaConfig;
use ch03::KvDtype;
use ch04::{CacheConfig, Executor, ScheduledSeq, SchedulerOutput};
use ndarray::Array2;

/// Positions per KV block of the pools made here.
const BLOCK_SIZE: usize = 16;

/// A KV pool of `dtype` that holds exactly one sequence of `tokens` positions (rounded up to
/// whole blocks).
pub fn cache_for(config: &LlamaConfig, tokens: usize, dtype: KvDtype) -> CacheConfig {
    let blocks = tokens.div_ceil(BLOCK_SIZE).max(1);
    let positions = blocks.saturating_mul(BLOCK_SIZE) as u64;
    CacheConfig {
        memory: dtype.bytes_per_token(config).saturating_mul(positions),
        block_size: BLOCK_SIZE,
        dtype,
    }
}

// ANCHOR: prompt_logits
/// Every position's logits `[T, vocab]` of `tokens`, run as one prefill step of a lone sequence
/// from position 0, its K/V written to blocks 0, 1, ... (a later call overwrites them).
/// Errors: an empty, out-of-vocabulary or too long input, a pool too small for it, or the
/// executor's own.
pub fn prompt_logits(executor: &mut dyn Executor, tokens: &[u32]) -> anyhow::Result<Array2<f32>> {
    let spec = executor.model_spec();
    ch01::model::check_tokens(tokens, spec.vocab_size, spec.max_model_len)?;
    let layout = executor.kv_layout();
    let blocks = tokens.len().div_ceil(layout.block_size);
    anyhow::ensure!(
        blocks <= layout.num_blocks,
        "{} tokens need {blocks} KV blocks of {} positions; the pool holds {}",
        tokens.len(),
        layout.block_size,
        layout.num_blocks
    );
    let step = SchedulerOutput {
        seqs: vec![ScheduledSeq {
            id: 0,
            tokens: tokens.to_vec(),
            start_pos: 0,
            block_table: (0..blocks as u32).collect(),
            logit_rows: tokens.len(),
        }],
        ..SchedulerOutput::default()
    };
    Ok(executor.execute(&step)?.to_owned())
}
// ANCHOR_END: prompt_logits

#[cfg(test)]
mod tests {
    use super::*;

    /// Through chapter 4's CPU executor the prompt's logits are chapter 1's forward's; input
    /// the pool cannot hold, or out of the vocabulary, is an error.
    #[test]
    fn prompt_logits_equal_the_forward_and_bad_input_is_refused() {
        let model = ch01::Llama::load(&ch01::default_model_dir()).unwrap();
        let tokens: Vec<u32> = (0..37).map(|i| (i * 97 % 4096) as u32).collect();
        let cache = cache_for(&model.config, tokens.len(), KvDtype::F32);
        let mut executor = ch07::cpu_executor(&model, &cache, ch07::AttentionKind::Naive).unwrap();
        let got = prompt_logits(&mut *executor, &tokens).unwrap();
        let want = model.forward(&tokens).unwrap();
        assert_eq!(got.dim(), want.dim());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * w.abs().max(1.0), "{g} vs {w}");
        }
        let longer: Vec<u32> = (0..tokens.len() as u32 + 16).collect();
        assert!(prompt_logits(&mut *executor, &longer).is_err());
        assert!(prompt_logits(&mut *executor, &[]).is_err());
        assert!(prompt_logits(&mut *executor, &[model.config.vocab_size as u32]).is_err());
    }
}
