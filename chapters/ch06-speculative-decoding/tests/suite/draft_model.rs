//! The draft model's own cache under pressure, driven directly (no engine): a dropped state
//! continues its request's random stream, the least recently used state is dropped first, a
//! sequence that cannot draft lets go of its blocks (so that others still draft), nothing is
//! dropped for a sequence that could never fit, and catching up is chunked within the budget.

use crate::common;

use std::sync::{Arc, Mutex};

use ch01::{Llama, SamplingParams};
use ch03::KvPool;
use ch04::{
    CpuExecutor, Draft, DraftSeq, Executor, ExecutorError, KvLayout, ModelSpec, RequestId,
    SchedulerOutput,
};
use ch06_speculative_decoding::{Drafter, ModelDrafter};
use common::{Checked, load};
use ndarray::ArrayView2;

/// Per draft forward: each scheduled request and how many tokens it ran.
type Log = Arc<Mutex<Vec<Vec<(RequestId, usize)>>>>;

/// An executor that records what each step ran.
struct Recording<E> {
    inner: E,
    log: Log,
}

impl<E: Executor> Executor for Recording<E> {
    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn model_spec(&self) -> ModelSpec {
        self.inner.model_spec()
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<ArrayView2<'_, f32>, ExecutorError> {
        let ran = step.seqs.iter().map(|s| (s.id, s.tokens.len())).collect();
        self.log.lock().unwrap().push(ran);
        self.inner.execute(step)
    }
}

const BLOCK_SIZE: usize = 4;

/// A drafter over all of `model`, and what its draft model ran since the last proposal began.
struct Harness<'m> {
    d: ModelDrafter<'m>,
    log: Log,
}

/// A harness with a cache of `blocks` blocks of four positions.
fn drafter(model: &Llama, blocks: usize) -> Harness<'_> {
    let pool = KvPool::<f32>::new(&model.config, BLOCK_SIZE, blocks).unwrap();
    let log = Log::default();
    let executor = Recording {
        inner: Checked(CpuExecutor::new(model, pool)),
        log: log.clone(),
    };
    let vocab = model.config.vocab_size;
    let d = ModelDrafter::new(Box::new(executor), vocab).unwrap();
    Harness { d, log }
}

impl Harness<'_> {
    /// One proposal; each request `(id, tokens, max_drafts)`, its prompt the first 4 tokens.
    fn propose(
        &mut self,
        params: &SamplingParams,
        seqs: &[(RequestId, &[u32], usize)],
    ) -> Vec<Draft> {
        self.log.lock().unwrap().clear();
        let views: Vec<DraftSeq> = seqs
            .iter()
            .map(|&(id, tokens, max_drafts)| DraftSeq {
                id,
                tokens,
                prompt_len: 4,
                params,
                max_drafts,
            })
            .collect();
        let mut drafts = vec![Draft::default(); seqs.len()];
        self.d.propose(&views, &mut drafts).unwrap();
        self.d.check_invariants().unwrap();
        drafts
    }

    /// Tokens of `id` the last proposal's first forward ran (0: none).
    fn caught_up(&self, id: RequestId) -> usize {
        let log = self.log.lock().unwrap();
        let first = log.first().map_or(&[][..], |step| &step[..]);
        first
            .iter()
            .filter(|(s, _)| *s == id)
            .map(|&(_, n)| n)
            .sum()
    }

    /// Tokens the last proposal's first forward ran, for every request.
    fn first_forward(&self) -> usize {
        let log = self.log.lock().unwrap();
        log.first()
            .map_or(0, |step| step.iter().map(|&(_, n)| n).sum())
    }
}

/// Tokens in the fixture vocabulary, different for each `salt`.
fn tokens(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 2 + (i * 7 + salt * 13) % 60)
        .collect()
}

fn greedy() -> SamplingParams {
    SamplingParams::greedy()
}

#[test]
fn a_dropped_draft_state_continues_its_random_stream() {
    let model = load("shakespeare-tiny");
    let (a, b) = (tokens(1, 20), tokens(2, 20));
    for seed in 0..8 {
        let params = SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        };
        // Request 1 drafts, the target keeps its first draft and adds a token; request 2
        // drafts in between. A cache of 8 blocks holds one of them (6 blocks each).
        let run = |blocks: usize| {
            let mut d = drafter(&model, blocks);
            let first = d.propose(&params, &[(1, &a, 3)]).remove(0);
            let mut a2 = a.clone();
            a2.extend([first.tokens[0], 5]);
            d.propose(&params, &[(2, &b, 3)]);
            let second = d.propose(&params, &[(1, &a2, 3)]).remove(0);
            d.d.release(1);
            d.d.release(2);
            assert_eq!(d.d.kv_usage(), 0.0);
            (first, second, d.caught_up(1))
        };
        let (first, second, ran) = run(64);
        let (first_small, second_small, ran_small) = run(8);
        assert_eq!(ran, 1, "kept: only the new token runs");
        assert_eq!(ran_small, a.len() + 2, "dropped: recomputed from the start");
        assert_eq!(first.tokens, first_small.tokens, "seed {seed}");
        assert_eq!(
            second.tokens, second_small.tokens,
            "seed {seed}: drafts after the state was dropped are those of a run that kept it"
        );
        let gap = (second.probs.iter().zip(&second_small.probs))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(gap < 1e-4, "seed {seed}: q differs by {gap}");
    }
}

#[test]
fn the_least_recently_used_state_is_dropped_first() {
    let model = load("shakespeare-tiny");
    let (a, b, c) = (tokens(1, 10), tokens(2, 10), tokens(3, 10));
    // Fresh drafters, each with its own hash order: the choice must not depend on it.
    for _ in 0..8 {
        // Each state takes 3 blocks (10 tokens and 2 drafts); 7 blocks hold two of them.
        let mut d = drafter(&model, 7);
        d.propose(&greedy(), &[(1, &a, 3)]);
        let drafts = d.propose(&greedy(), &[(2, &b, 3)]);
        d.propose(&greedy(), &[(3, &c, 3)]);
        let mut b2 = b.clone();
        b2.extend([drafts[0].tokens[0], 5]);
        d.propose(&greedy(), &[(2, &b2, 3)]);
        assert_eq!(d.caught_up(2), 1, "request 2's state was kept");
        d.propose(&greedy(), &[(1, &a, 3)]);
        assert_eq!(d.caught_up(1), a.len(), "request 1's state was dropped");
    }
}

#[test]
fn a_request_that_outgrew_the_draft_cache_lets_it_go_and_others_still_draft() {
    let model = load("shakespeare-tiny");
    let (long, short) = (tokens(1, 40), tokens(2, 8));
    // 7 blocks: 28 positions. Request 1 first fits (20 tokens and 2 drafts: 6 blocks), then
    // has 40 tokens: it can never fit again, and request 2 needs 3 blocks.
    let mut d = drafter(&model, 7);
    let drafts = d.propose(&greedy(), &[(1, &long[..20], 3)]);
    assert_eq!(drafts[0].tokens.len(), 3);
    let drafts = d.propose(&greedy(), &[(1, &long, 3), (2, &short, 3)]);
    assert!(drafts[0].tokens.is_empty(), "request 1 cannot fit");
    assert_eq!(drafts[1].tokens.len(), 3, "request 2 still drafts");
    d.d.release(2);
    assert_eq!(d.d.kv_usage(), 0.0, "request 1 holds no block for nothing");
    d.d.release(1);
}

#[test]
fn a_request_past_the_draft_models_context_lets_go_of_its_blocks() {
    let model = load("shakespeare-tiny");
    let max_len = model.config.max_position_embeddings;
    let (long, short) = (tokens(1, max_len), tokens(2, 8));
    // Request 1 at max_len - 8 takes 127 of 128 blocks; then reaches the context's end.
    let blocks = (max_len - 8 + 2).div_ceil(BLOCK_SIZE) + 1;
    let mut d = drafter(&model, blocks);
    let drafts = d.propose(&greedy(), &[(1, &long[..max_len - 8], 3)]);
    assert_eq!(drafts[0].tokens.len(), 3);
    let drafts = d.propose(&greedy(), &[(1, &long, 3), (2, &short, 3)]);
    assert!(drafts[0].tokens.is_empty(), "no room in the context");
    assert_eq!(drafts[1].tokens.len(), 3, "request 2 still drafts");
    d.d.release(2);
    assert_eq!(d.d.kv_usage(), 0.0, "request 1 holds no block for nothing");
    d.d.release(1);
}

#[test]
fn no_state_is_dropped_for_a_request_that_could_never_fit() {
    let model = load("shakespeare-tiny");
    let (long, other) = (tokens(1, 40), tokens(3, 8));
    // 10 blocks: request 3 takes 3, request 1 (20 tokens) 6; at 40 tokens it needs 11.
    let mut d = drafter(&model, 10);
    let drafts = d.propose(&greedy(), &[(3, &other, 3)]);
    d.propose(&greedy(), &[(1, &long[..20], 3)]);
    let none = d.propose(&greedy(), &[(1, &long, 3)]);
    assert!(none[0].tokens.is_empty());
    let mut other2 = other.clone();
    other2.extend([drafts[0].tokens[0], 5]);
    d.propose(&greedy(), &[(3, &other2, 3)]);
    assert_eq!(d.caught_up(3), 1, "request 3's state was kept");
    d.d.release(3);
    assert_eq!(d.d.kv_usage(), 0.0, "request 1 holds no block for nothing");
    d.d.release(1);
}

#[test]
fn catching_up_runs_in_chunks_within_the_budget_and_drafts_once_caught_up() {
    let model = load("shakespeare-tiny");
    let (long, short) = (tokens(1, 30), tokens(2, 3));
    let mut whole = drafter(&model, 64);
    let expected = whole.propose(&greedy(), &[(1, &long, 3)]);
    let mut d = drafter(&model, 64);
    d.d = d.d.with_catch_up_budget(8);
    // Request 2 comes first and drafts every step; request 1 catches up with what is left.
    let mut steps = 0;
    loop {
        let drafts = d.propose(&greedy(), &[(2, &short, 3), (1, &long, 3)]);
        steps += 1;
        let ran = d.first_forward();
        assert!(ran <= 8, "step {steps}: {ran} tokens");
        assert_eq!(drafts[0].tokens.len(), 3, "step {steps}: request 2 drafts");
        if !drafts[1].tokens.is_empty() {
            assert_eq!(drafts[1].tokens, expected[0].tokens, "as if run at once");
            break;
        }
        assert!(steps < 10, "request 1 never caught up");
    }
    // 3 + 5, then 1 + 7 three times (to 26 of 30), then the last 4 with drafts.
    assert_eq!(steps, 5);
    d.d.release(1);
    d.d.release(2);
    assert_eq!(d.d.kv_usage(), 0.0);
}

/// A layer-skip draft keeps 1 to n − 1 of the target's n layers; a one-layer model has none to
/// skip, and says so rather than offering "1 to 0".
#[test]
fn layer_skip_keeps_fewer_layers_than_the_target() {
    use ch06_speculative_decoding::layer_skip_config;
    let mut config = load("shakespeare-tiny").config.clone();
    let total = config.num_hidden_layers;
    assert!(total >= 2);
    assert_eq!(layer_skip_config(&config, 1).unwrap().num_hidden_layers, 1);
    for bad in [0, total, total + 1] {
        let err = layer_skip_config(&config, bad).unwrap_err().to_string();
        assert!(err.contains(&format!("keeps 1 to {}", total - 1)), "{err}");
    }
    config.num_hidden_layers = 1;
    let err = layer_skip_config(&config, 1).unwrap_err().to_string();
    assert!(err.contains("at least 2 layers"), "{err}");
}
