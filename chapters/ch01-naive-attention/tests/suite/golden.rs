//! The forward pass against PyTorch: logits and greedy continuations computed by `transformers`
//! (fixtures/scripts/make_golden.py) for every fixture model.

use ch01_naive_attention::testing::{assert_greedy_agrees, assert_rel_close, load_golden};
use ch01_naive_attention::{GenerateOptions, Llama, Tokenizer, generate};

/// The logits' relative L2 error against transformers' (a different kernel and summation order).
const LOGITS_REL_L2: f64 = 1e-4;

/// f32 forward: relative L2 error of the logits under 1e-4; greedy continuations identical up
/// to the first near tie (exact tokens across two kernels hold only where the top-2 margin
/// exceeds what the logits' tolerance allows: see `assert_greedy_agrees`).
fn check_model(name: &str) {
    let golden = load_golden(name);
    let model = Llama::load(&golden.model_dir).unwrap();
    let tokenizer = Tokenizer::from_dir(&golden.model_dir).unwrap();
    for (case, expected) in golden.cases.iter().zip(&golden.logits) {
        assert_eq!(
            tokenizer.encode(&case.prompt, true).unwrap(),
            case.input_ids,
            "{name}: tokenization of {:?}",
            case.prompt
        );

        let logits = model.forward(&case.input_ids).unwrap(); // [T, vocab]
        assert_eq!(
            logits.dim(),
            (case.input_ids.len(), model.config.vocab_size)
        );
        assert_rel_close(
            &format!("{name} logits for {:?}", case.prompt),
            logits.as_slice().unwrap(),
            expected,
            LOGITS_REL_L2,
        );

        // Teacher forcing: the logits that predict each golden token, with the golden tokens
        // fed in, checked wherever the margin is wider than the kernels can disagree by.
        let fed: Vec<u32> = case
            .input_ids
            .iter()
            .chain(&case.greedy_ids)
            .copied()
            .collect();
        let forced = model.forward(&fed[..fed.len() - 1]).unwrap(); // [T, vocab]
        let vocab = model.config.vocab_size;
        let predicting = &forced.as_slice().unwrap()[(case.input_ids.len() - 1) * vocab..];
        let agreed = assert_greedy_agrees(
            &format!("{name}: greedy continuation of {:?}", case.prompt),
            predicting,
            vocab,
            &case.greedy_ids,
            LOGITS_REL_L2,
        );

        let options = GenerateOptions {
            max_tokens: case.greedy_ids.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let generation =
            generate(&model, &tokenizer, &case.input_ids, &options, &mut |_| {}).unwrap();
        // Different kernels: equal by margin, up to the first near tie (usually all of it).
        assert_eq!(
            generation.output_tokens[..agreed],
            case.greedy_ids[..agreed],
            "{name}: greedy continuation of {:?}",
            case.prompt
        );
        if agreed == case.greedy_ids.len() {
            assert_eq!(
                tokenizer.decode(&generation.output_tokens).unwrap(),
                case.greedy_text,
                "{name}: decoded continuation"
            );
        }
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
    random_untied => "random-untied",
    random_qwen2_bias => "random-qwen2",
    random_llama3_rope_hub_style_config => "random-llama3-rope",
    random_sharded => "random-sharded",
    random_bf16 => "random-bf16",
    shakespeare_small => "shakespeare-small",
    shakespeare_tiny => "shakespeare-tiny",
}
