//! The engine's logprobs are the model's own: `log_softmax` of chapter 1's logits at each
//! generated position, whatever else shares the step.

use ch01::attention::log_sum_exp;
use ch01::{Llama, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::{CpuExecutor, Engine, EngineConfig, Request};

#[test]
fn reported_logprobs_match_a_log_softmax_of_the_reference_logits() {
    let dir = fixtures_dir().join("shakespeare-tiny");
    let model = Llama::load(&dir).unwrap();
    let pool = KvPool::<f32>::new(&model.config, 4, 64).unwrap();
    let config = EngineConfig {
        max_num_batched_tokens: 16, // chunks the longer prompt
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(CpuExecutor::new(&model, pool), config).unwrap();
    let prompt: Vec<u32> = vec![0, 412, 306, 13, 534, 325, 291, 306, 13, 330];
    let mut request = Request::greedy(prompt.clone(), 6);
    request.logprobs = Some(3);
    let id = engine.add_request(request).unwrap();
    // A neighbour without logprobs, so the batch mixes both kinds.
    engine
        .add_request(Request::greedy((1..30).collect(), 6))
        .unwrap();
    let mut reported = Vec::new();
    while engine.has_unfinished() {
        for out in engine.step_or_stall().unwrap() {
            if out.id == id {
                assert_eq!(out.logprobs.len(), out.new_tokens.len());
                reported.extend(out.logprobs);
            } else {
                assert!(out.logprobs.is_empty(), "not asked for, not computed");
            }
        }
    }
    assert_eq!(reported.len(), 6);

    let mut tokens = prompt;
    for lp in &reported {
        let logits = model.forward(&tokens).unwrap(); // [T, vocab], chapter 1's recompute
        let last = logits.row(tokens.len() - 1);
        let last = last.as_slice().unwrap(); // [vocab]
        let expected = last[lp.token as usize] as f64 - log_sum_exp(last);
        assert!(
            (lp.logprob as f64 - expected).abs() < 1e-4,
            "{lp:?} vs {expected}"
        );
        // Greedy: the sampled token is the most likely, first in the top list.
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, lp.token);
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        tokens.push(lp.token);
    }
}
