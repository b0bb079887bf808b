//! The `LogitsProcessor` seam: a sequence's processor decides what it may sample, its
//! `accept` can end it, and the sequences beside it are untouched.

use ch01::{Llama, SamplingParams, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::{
    CpuExecutor, Engine, EngineConfig, FinishReason, LogitsProcessor, Request,
};

/// Allows only the tokens of `script`, one after the other; says stop after the last.
struct Script {
    script: Vec<u32>,
    next: usize,
    prepared: usize,
}

impl LogitsProcessor for Script {
    fn prepare(&mut self) {
        self.prepared += 1;
    }

    fn process(&mut self, output: &[u32], logits: &mut [f32]) {
        assert_eq!(
            output.len(),
            self.next,
            "the processor sees the output so far"
        );
        let allowed = self.script[self.next];
        for (token, logit) in logits.iter_mut().enumerate() {
            if token as u32 != allowed {
                *logit = f32::NEG_INFINITY;
            }
        }
    }

    fn accept(&mut self, token: u32) -> bool {
        assert_eq!(token, self.script[self.next]);
        assert_eq!(self.prepared, self.next + 1, "prepared once per token");
        self.next += 1;
        self.next == self.script.len()
    }
}

#[test]
fn a_processor_masks_its_own_sequence_and_may_end_it() {
    let model = Llama::load(&fixtures_dir().join("random/gqa")).unwrap();
    let pool = KvPool::<f32>::new(&model.config, 4, 64).unwrap();
    let mut engine = Engine::new(CpuExecutor::new(&model, pool), EngineConfig::default()).unwrap();
    let sampled = |seed| Request {
        params: SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        },
        ..Request::greedy(vec![1, 2, 3], 10)
    };
    let alone = Engine::new(
        CpuExecutor::new(&model, KvPool::<f32>::new(&model.config, 4, 64).unwrap()),
        EngineConfig::default(),
    )
    .unwrap()
    .generate(vec![sampled(7)])
    .unwrap();

    let script = vec![5, 9, 5, 2];
    let constrained = engine
        .add_request_with(
            sampled(3),
            Box::new(Script {
                script: script.clone(),
                next: 0,
                prepared: 0,
            }),
        )
        .unwrap();
    let free = engine.add_request(sampled(7)).unwrap();
    while engine.has_unfinished() {
        engine.step_or_stall().unwrap();
    }
    let constrained = engine.take(constrained).unwrap();
    assert_eq!(constrained.tokens, script);
    assert_eq!(constrained.finish_reason, FinishReason::Stop);
    let free = engine.take(free).unwrap();
    assert_eq!(
        free.tokens, alone[0].tokens,
        "the unconstrained neighbour is unchanged"
    );
}
