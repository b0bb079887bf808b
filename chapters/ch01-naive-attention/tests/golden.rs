//! The forward pass against PyTorch: logits and greedy continuations computed by `transformers`
//! (fixtures/scripts/make_golden.py) for every fixture model.

use std::path::PathBuf;

use ch01_naive_attention::testing::assert_rel_close;
use ch01_naive_attention::{GenerateOptions, Llama, Tokenizer, fixtures_dir, generate};
use safetensors::SafeTensors;
use serde::Deserialize;

#[derive(Deserialize)]
struct Golden {
    model: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    prompt: String,
    input_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    greedy_text: String,
}

fn load_golden(name: &str) -> (Golden, Vec<Vec<f32>>) {
    let dir = fixtures_dir().join("golden");
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap();
    let bytes = std::fs::read(dir.join(format!("{name}.safetensors"))).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let logits = (0..golden.cases.len())
        .map(|i| {
            let view = tensors.tensor(&format!("logits.{i}")).unwrap();
            view.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        })
        .collect();
    (golden, logits)
}

/// f32 forward: relative L2 error of the logits under 1e-4; greedy continuations identical.
fn check_model(name: &str) {
    let (golden, expected_logits) = load_golden(name);
    let dir: PathBuf = fixtures_dir().join(&golden.model);
    let model = Llama::load(&dir).unwrap();
    let tokenizer = Tokenizer::from_dir(&dir).unwrap();
    for (case, expected) in golden.cases.iter().zip(&expected_logits) {
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
