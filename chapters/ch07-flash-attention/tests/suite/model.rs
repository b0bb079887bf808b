//! The whole model with the flash backend: its logits equal the golden outputs of
//! `transformers` for every fixture model, and the naive backend's, when a prompt runs as
//! chunks (start position > 0, several query and key tiles) and its last token as a split-K
//! decode, on an f32 and on a bf16 pool with scattered blocks.

use ch01::testing::{assert_rel_close, load_golden};
use ch01::{Llama, fixtures_dir};
use ch02::kernels::Isa;
use ch03::{KvElement, KvPool};
use ch04::attention::{AttentionBackend, BatchAttention};
use ch04::{CpuExecutor, Executor, ScheduledSeq, SchedulerOutput};
use ch07_flash_attention::{FlashAttention, FlashParams, Partitions, TileSizes};
use half::bf16;

/// The golden tolerance of chapter 1's forward (a different kernel and summation order).
const LOGITS_REL_L2: f64 = 1e-4;

/// Small tiles and three partitions, so that prompts of 14 and 20 tokens cross many tiles and
/// a decode merges partitions.
fn flash() -> FlashAttention {
    FlashAttention::with_params(
        Isa::detect(),
        FlashParams {
            tiles: TileSizes::new(4, 3).unwrap(),
            partitions: Partitions::fixed(3).unwrap(),
        },
    )
}

/// Logits [T, vocab] of every position of `tokens`, run as three steps on one executor: the
/// first half (prefill), the rest but the last token (a chunk at a start position > 0), the
/// last token alone (a decode).
fn logits_in_three_steps<K: KvElement>(
    model: &Llama,
    backend: Box<dyn AttentionBackend<K> + '_>,
    tokens: &[u32],
) -> Vec<f32> {
    let block_size = 4;
    let num_blocks = tokens.len().div_ceil(block_size) + 3;
    let pool = KvPool::<K>::new(&model.config, block_size, num_blocks).unwrap();
    let mut executor = CpuExecutor::with_backend(model, pool, backend);
    let blocks: Vec<u32> = (0..num_blocks as u32).rev().collect(); // scattered: any order
    let (a, b) = (tokens.len() / 2, tokens.len() - 1);
    let mut logits = Vec::new();
    for (start, end) in [(0, a), (a, b), (b, tokens.len())] {
        let step = SchedulerOutput {
            seqs: vec![ScheduledSeq {
                id: 0,
                tokens: tokens[start..end].to_vec(),
                start_pos: start,
                block_table: blocks.clone(),
                logit_rows: end - start,
            }],
            ..SchedulerOutput::default()
        };
        logits.extend(executor.execute(&step).unwrap().iter().copied());
    }
    logits
}

fn check_model(name: &str) {
    let golden = load_golden(name);
    let model = ch02::load_fast(&golden.model_dir, ch02::WeightDtype::F32).unwrap();
    for (case, expected) in golden.cases.iter().zip(&golden.logits) {
        let tokens = &case.input_ids;
        let what = format!("{name}, {:?}", case.prompt);
        let flash_logits = logits_in_three_steps::<f32>(&model, Box::new(flash()), tokens);
        assert_rel_close(
            &format!("{what}: flash vs golden"),
            &flash_logits,
            expected,
            LOGITS_REL_L2,
        );
        let naive_logits =
            logits_in_three_steps::<f32>(&model, Box::new(BatchAttention::default()), tokens);
        // Two summation orders of the same f32 arithmetic through every layer.
        assert_rel_close(
            &format!("{what}: flash vs naive"),
            &flash_logits,
            &naive_logits,
            1e-5,
        );
        let flash_bf16 = logits_in_three_steps::<bf16>(&model, Box::new(flash()), tokens);
        let naive_bf16 =
            logits_in_three_steps::<bf16>(&model, Box::new(BatchAttention::default()), tokens);
        // A bf16 pool rounds every layer's new K/V: where the backends' f32 outputs (1e-7 apart)
        // straddle a bf16 rounding boundary, an element of the next layer's K/V moves by up to
        // 2⁻⁸ of itself. A few such flips per layer stay within 10⁻⁴ of the logits.
        assert_rel_close(
            &format!("{what}: bf16 pool, flash vs naive"),
            &flash_bf16,
            &naive_bf16,
            1e-4,
        );
    }
}

macro_rules! golden_tests {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(#[test] fn $test() { check_model($name); })*
    };
}

golden_tests! {
    random_mha => "random-mha",
    random_gqa => "random-gqa",
    random_head_dim => "random-head-dim",
    random_qwen2_bias => "random-qwen2",
    random_llama3_rope => "random-llama3-rope",
    random_bf16 => "random-bf16",
    shakespeare_small => "shakespeare-small",
    shakespeare_tiny => "shakespeare-tiny",
}

#[test]
fn long_prompt_flash_equals_naive_backend() {
    // 300 positions with the default tiles and automatic split-K: many full tiles, the
    // diagonal ones, and a 300-key decode.
    let model = ch02::load_fast(
        &fixtures_dir().join("shakespeare-tiny"),
        ch02::WeightDtype::F32,
    )
    .unwrap();
    let tokens: Vec<u32> = (0..300u32)
        .map(|i| (i * 37 + 11) % model.config.vocab_size as u32)
        .collect();
    let flash = logits_in_three_steps::<f32>(&model, Box::new(FlashAttention::new()), &tokens);
    let naive = logits_in_three_steps::<f32>(&model, Box::new(BatchAttention::default()), &tokens);
    assert_rel_close("300 tokens: flash vs naive", &flash, &naive, 1e-5);
}
