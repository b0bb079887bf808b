//! Sampled speculation through the engine's own path (a request's seeded sampler, its
//! temperature, filters and penalties): the first token one verification step emits, and the
//! first two tokens verification emits over one or two steps, are distributed as the target's
//! sampling would draw them, measured over many seeds; and a sampled speculative engine is
//! reproducible from its seeds and leaks no block.

mod common;

use ch01::{Sampler, SamplingParams};
use ch03::KvPool;
use ch04::{CpuExecutor, Draft, Engine, EngineConfig, Request};
use ch06_speculative_decoding::testing::RandomDrafter;
use ch06_speculative_decoding::verify::{VerifyScratch, verify};
use ch06_speculative_decoding::{ModelDrafter, SpecConfig, SpeculativeDecoding, draft_executor};
use common::{Checked, load, prompts};
use ndarray::Array2;

#[test]
fn the_first_emitted_token_follows_the_targets_sampling_distribution() {
    let vocab = 5;
    // Target logits for positions 0..=2, and a drafter's q for drafts 0 and 1.
    let rows = Array2::from_shape_vec(
        (3, vocab),
        vec![
            1.0, 0.5, -1.0, 2.0, 0.0, //
            0.0, 0.0, 1.0, 1.0, -2.0, //
            3.0, 1.0, 0.0, 0.0, 0.0,
        ],
    )
    .unwrap();
    let q = [0.1f32, 0.6, 0.1, 0.1, 0.1, 0.3, 0.3, 0.2, 0.1, 0.1];
    let params = SamplingParams {
        temperature: 0.8,
        ..SamplingParams::default()
    };
    // p0: softmax(row 0 / 0.8).
    let scaled: Vec<f64> = rows.row(0).iter().map(|&l| f64::from(l) / 0.8).collect();
    let z: f64 = scaled.iter().map(|l| l.exp()).sum();
    let p0: Vec<f64> = scaled.iter().map(|l| l.exp() / z).collect();

    let n = 40_000;
    let mut counts = vec![0usize; vocab];
    let mut scratch = VerifyScratch::default();
    let mut accepted = Vec::new();
    for seed in 0..n {
        let mut sampler = Sampler::new(SamplingParams {
            seed: seed as u64,
            ..params.clone()
        })
        .unwrap();
        // The drafts are drawn from q with their own stream.
        let mut draw = Sampler::new(SamplingParams {
            seed: seed as u64 ^ 0xABCD,
            ..params.clone()
        })
        .unwrap();
        let pick = |u: f64, row: &[f32]| {
            let mut c = 0.0;
            row.iter()
                .position(|&p| {
                    c += f64::from(p);
                    u < c
                })
                .unwrap_or(vocab - 1) as u32
        };
        let draft = Draft {
            tokens: vec![
                pick(draw.uniform(), &q[..vocab]),
                pick(draw.uniform(), &q[vocab..]),
            ],
            probs: q.to_vec(),
        };
        accepted.clear();
        verify(
            &mut sampler,
            rows.view(),
            &[0],
            &[],
            &draft,
            &mut scratch,
            &mut accepted,
        )
        .unwrap();
        counts[accepted[0] as usize] += 1;
    }
    for (t, (&count, &p)) in counts.iter().zip(&p0).enumerate() {
        let freq = count as f64 / n as f64;
        let sigma = (p * (1.0 - p) / n as f64).sqrt();
        assert!(
            (freq - p).abs() < 5.0 * sigma,
            "token {t}: frequency {freq}, target probability {p}"
        );
    }
}

/// `p` for `logits` after `seen` (the prompt and output): the repetition penalty `r` on each
/// distinct seen token, temperature `t`, softmax. Written out here, not taken from the sampler.
fn penalised(logits: &[f32], seen: &[u32], r: f64, t: f64) -> Vec<f64> {
    let scaled: Vec<f64> = (0..logits.len())
        .map(|i| {
            let l = f64::from(logits[i]);
            let l = if !seen.contains(&(i as u32)) {
                l
            } else if l > 0.0 {
                l / r
            } else {
                l * r
            };
            l / t
        })
        .collect();
    let z: f64 = scaled.iter().map(|l| l.exp()).sum();
    scaled.iter().map(|l| l.exp() / z).collect()
}

/// The token at which `u` falls in the cumulative distribution `row`.
fn pick(u: f64, row: &[f32]) -> u32 {
    let mut c = 0.0;
    row.iter()
        .position(|&p| {
            c += f64::from(p);
            u < c
        })
        .unwrap_or(row.len() - 1) as u32
}

/// A toy target over three tokens whose logits depend on the last token only (row = that
/// token), with a repetition penalty and k = 2 drafts from a fixed q: the first two tokens
/// emitted (by one verification step, or by two when the first draft is rejected) are
/// distributed as the target's, p(x1) · p(x2 | x1), the penalty seeing x1. This reads rows past
/// the first and the penalties over the accepted drafts, as the engine's verification does.
#[test]
fn the_first_two_emitted_tokens_follow_the_targets_joint_distribution() {
    const VOCAB: usize = 3;
    // Each token favours itself next: the penalty on a repeated token matters.
    let logits = [[1.0f32, 0.5, -0.5], [0.0, 3.0, 1.0], [0.5, 1.0, 3.0]];
    let q = [0.3f32, 0.4, 0.3, 0.2, 0.4, 0.4];
    let (r, t) = (1.5, 0.9);
    let params = SamplingParams {
        temperature: t as f32,
        repetition_penalty: r as f32,
        ..SamplingParams::default()
    };
    let prompt = [0u32];
    let mut expected = [0.0f64; VOCAB * VOCAB];
    let p1 = penalised(&logits[0], &prompt, r, t);
    for x1 in 0..VOCAB {
        let p2 = penalised(&logits[x1], &[0, x1 as u32], r, t);
        for x2 in 0..VOCAB {
            expected[x1 * VOCAB + x2] = p1[x1] * p2[x2];
        }
    }

    let n = 40_000;
    let mut counts = [0usize; VOCAB * VOCAB];
    let mut scratch = VerifyScratch::default();
    let (mut output, mut accepted) = (Vec::new(), Vec::new());
    for seed in 0..n {
        let mut sampler = Sampler::new(SamplingParams {
            seed,
            ..params.clone()
        })
        .unwrap();
        let mut draw = Sampler::new(SamplingParams {
            seed: seed ^ 0xABCD,
            ..params.clone()
        })
        .unwrap();
        output.clear();
        while output.len() < 2 {
            let last = output.last().copied().unwrap_or(prompt[0]) as usize;
            let drafts = [
                pick(draw.uniform(), &q[..VOCAB]),
                pick(draw.uniform(), &q[VOCAB..]),
            ];
            // Row i: the target after the last token and drafts[..i].
            let mut rows = Array2::zeros((3, VOCAB));
            for (i, context) in [last, drafts[0] as usize, drafts[1] as usize]
                .into_iter()
                .enumerate()
            {
                rows.row_mut(i).assign(&ndarray::aview1(&logits[context]));
            }
            let draft = Draft {
                tokens: drafts.to_vec(),
                probs: q.to_vec(),
            };
            accepted.clear();
            verify(
                &mut sampler,
                rows.view(),
                &prompt,
                &output,
                &draft,
                &mut scratch,
                &mut accepted,
            )
            .unwrap();
            output.extend_from_slice(&accepted);
        }
        counts[output[0] as usize * VOCAB + output[1] as usize] += 1;
    }
    for (pair, (&count, &p)) in counts.iter().zip(&expected).enumerate() {
        let freq = count as f64 / n as f64;
        let sigma = (p * (1.0 - p) / n as f64).sqrt();
        assert!(
            (freq - p).abs() < 5.0 * sigma,
            "tokens {:?}: frequency {freq}, target probability {p}",
            (pair / VOCAB, pair % VOCAB)
        );
    }
}

#[test]
fn a_sampled_speculative_engine_is_reproducible_and_leaks_nothing() {
    let target = load("shakespeare-small");
    let draft = load("shakespeare-tiny");
    let run = |with_model: bool| {
        let pool = KvPool::<f32>::new(&target.config, 4, 200).unwrap();
        let executor = draft_executor(&draft, 4, 4 << 20).unwrap();
        let mut model_drafter = ModelDrafter::new(executor, target.config.vocab_size).unwrap();
        let config = SpecConfig {
            num_speculative_tokens: 3,
            disable_by_batch_size: None,
        };
        let mut engine = Engine::new(
            Checked(CpuExecutor::new(&target, pool)),
            EngineConfig::default(),
        )
        .unwrap();
        engine = if with_model {
            engine.with_speculator(Box::new(SpeculativeDecoding::new(
                &mut model_drafter,
                config,
            )))
        } else {
            let random = RandomDrafter::new(target.config.vocab_size, 3, true);
            engine.with_speculator(Box::new(SpeculativeDecoding::new(random, config)))
        };
        let requests = prompts()
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let mut r = Request::greedy(p, 20);
                r.params = SamplingParams {
                    temperature: 0.8,
                    top_k: 40,
                    seed: i as u64,
                    ..SamplingParams::default()
                };
                r
            })
            .collect();
        let done = engine.generate(requests).unwrap();
        assert_eq!(engine.scheduler().kv_usage(), 0.0);
        let counters = engine.scheduler().counters();
        drop(engine);
        assert_eq!(model_drafter.kv_usage(), 0.0);
        (done, counters)
    };
    for with_model in [false, true] {
        let (a, counters) = run(with_model);
        let (b, _) = run(with_model);
        assert_eq!(a, b, "same seeds, same tokens");
        assert!(counters.spec_decode_num_draft_tokens > 0);
        if with_model {
            assert!(counters.spec_decode_num_accepted_tokens > 0);
        }
    }
}
