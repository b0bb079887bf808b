//! The forward pass against PyTorch: logits and greedy continuations computed by `transformers`
//! (fixtures/scripts/make_golden.py) for every fixture model.

use ch01_naive_attention::testing::{assert_rel_close, load_golden};
use ch01_naive_attention::{GenerateOptions, Llama, Tokenizer, generate};

/// f32 forward: relative L2 error of the logits under 1e-4; greedy continuations identical.
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
            1e-4,
        );

        let options = GenerateOptions {
            max_tokens: case.greedy_ids.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let generation =
            generate(&model, &tokenizer, &case.input_ids, &options, &mut |_| {}).unwrap();
        assert_eq!(
            generation.output_tokens, case.greedy_ids,
            "{name}: greedy continuation of {:?}",
            case.prompt
        );
        assert_eq!(
            tokenizer.decode(&generation.output_tokens).unwrap(),
            case.greedy_text,
            "{name}: decoded continuation"
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
    random_untied => "random-untied",
    random_qwen2_bias => "random-qwen2",
    random_llama3_rope_hub_style_config => "random-llama3-rope",
    random_sharded => "random-sharded",
    random_bf16 => "random-bf16",
    shakespeare_small => "shakespeare-small",
    shakespeare_tiny => "shakespeare-tiny",
}
