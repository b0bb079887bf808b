//! A step whose every sampled token is greedy asks the executor for each logit row's argmax
//! (`Executor::execute_argmax`: a GPU copies back one id a row), any other step for the rows.
//! An executor that answers the argmax path with a marked token shows which path each request
//! took; the default `execute_argmax` equals sampling from the rows.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ch01::sampler::SamplingError;
use ch01::{Llama, SamplingParams, fixtures_dir};
use ch03::KvPool;
use ch04_continuous_batching::executor::{Executor, ExecutorError, KvLayout, ModelSpec};
use ch04_continuous_batching::{
    CpuExecutor, Engine, EngineConfig, EngineError, Request, SchedulerOutput,
};
use ndarray::ArrayView2;

/// Chapter 4's CPU executor, whose argmax path returns `mark` for every row.
struct Marked<'m> {
    inner: CpuExecutor<'m, f32>,
    mark: Option<u32>,
    argmax_steps: Arc<AtomicUsize>,
}

impl Executor for Marked<'_> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn model_spec(&self) -> ModelSpec {
        self.inner.model_spec()
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        self.inner.execute(step)
    }

    fn execute_argmax(
        &mut self,
        step: &SchedulerOutput,
    ) -> Result<Vec<Option<u32>>, ExecutorError> {
        self.argmax_steps.fetch_add(1, Ordering::Relaxed);
        let rows = self.inner.execute(step)?.nrows();
        Ok(vec![self.mark; rows])
    }
}

const MARK: u32 = 5;

fn prompt(i: u32) -> Vec<u32> {
    (0..12 + 3 * i)
        .map(|t| (t * 37 + i * 11) % 300 + 1)
        .collect()
}

/// Runs `requests` on `model` through `Marked`; each request's tokens (or the engine's error),
/// and how many steps took the argmax path.
fn run(
    model: &Llama,
    mark: Option<u32>,
    requests: Vec<Request>,
) -> (Result<Vec<Vec<u32>>, EngineError>, usize) {
    let pool = KvPool::<f32>::new(&model.config, 4, 128).unwrap();
    let argmax_steps = Arc::new(AtomicUsize::new(0));
    let executor = Marked {
        inner: CpuExecutor::new(model, pool),
        mark,
        argmax_steps: argmax_steps.clone(),
    };
    let mut engine = Engine::new(executor, EngineConfig::default()).unwrap();
    let tokens = engine
        .generate(requests)
        .map(|done| done.into_iter().map(|c| c.tokens).collect());
    (tokens, argmax_steps.load(Ordering::Relaxed))
}

fn load() -> Llama {
    Llama::load(&fixtures_dir().join("shakespeare-tiny")).unwrap()
}

#[test]
fn greedy_steps_take_the_argmax_path() {
    let model = load();
    let requests = (0..3).map(|i| Request::greedy(prompt(i), 5)).collect();
    let (tokens, argmax_steps) = run(&model, Some(MARK), requests);
    assert!(argmax_steps > 0);
    for output in tokens.unwrap() {
        assert_eq!(output, [MARK; 5], "every token from the argmax path");
    }
}

#[test]
fn a_step_that_needs_more_than_the_argmax_takes_the_rows() {
    let model = load();
    // Each of these needs the rows: logprobs, a temperature, a penalty. A greedy neighbour in
    // the same steps takes the rows with them.
    let mut logprobs = Request::greedy(prompt(0), 5);
    logprobs.logprobs = Some(2);
    let mut sampled = Request::greedy(prompt(1), 5);
    sampled.params = SamplingParams {
        temperature: 0.8,
        seed: 3,
        ..SamplingParams::default()
    };
    let mut penalised = Request::greedy(prompt(2), 5);
    penalised.params.repetition_penalty = 1.3;
    for request in [logprobs, sampled, penalised] {
        let neighbour = Request::greedy(prompt(3), 5);
        let (tokens, argmax_steps) = run(&model, Some(MARK), vec![request, neighbour]);
        assert_eq!(argmax_steps, 0, "no step of these is argmax only");
        for output in tokens.unwrap() {
            assert_ne!(output, [MARK; 5]);
        }
    }
}

#[test]
fn the_default_argmax_path_samples_as_the_rows_do() {
    // The CPU executor's own execute_argmax against an engine that sees only rows: a request
    // with logprobs samples from the rows, and its tokens are the greedy ones.
    let model = load();
    let pool = KvPool::<f32>::new(&model.config, 4, 128).unwrap();
    let mut engine = Engine::new(CpuExecutor::new(&model, pool), EngineConfig::default()).unwrap();
    let through_argmax = engine
        .generate((0..3).map(|i| Request::greedy(prompt(i), 8)).collect())
        .unwrap();
    for (i, done) in through_argmax.into_iter().enumerate() {
        let mut request = Request::greedy(prompt(i as u32), 8);
        request.logprobs = Some(1); // rows, not argmaxes
        let (tokens, argmax_steps) = run(&model, Some(MARK), vec![request]);
        assert_eq!(argmax_steps, 0);
        assert_eq!(done.tokens, tokens.unwrap()[0], "request {i}");
    }
}

#[test]
fn a_row_with_nothing_to_sample_is_an_error() {
    let model = load();
    let (tokens, _) = run(&model, None, vec![Request::greedy(prompt(0), 3)]);
    assert!(
        matches!(
            tokens,
            Err(EngineError::Sampling(SamplingError::NoCandidates { .. }))
        ),
        "{tokens:?}"
    );
}
