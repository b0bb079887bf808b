//! Sharing is invisible in the output: a prompt served from the prefix cache gives the logits
//! of a cold run, and n forked branches sampling with their own seeds give the tokens that n
//! independent runs with those seeds give.

use ch01::testing::{assert_rel_close, seeded_runner};
use ch01::{Llama, Sampler, SamplingParams, fixtures_dir};
use ch02::cached::Workspace;
use ch02::{CachedSession, ContiguousKvCache};
use ch03_paged_blocks::{KvPool, PagedKv};
use proptest::prelude::*;

fn model(name: &str) -> Llama {
    Llama::load(&fixtures_dir().join(name)).unwrap()
}

/// Two prompts sharing a random prefix: the second one reuses the first one's full blocks and
/// still produces the logits of a cold contiguous run.
#[test]
fn prefix_cache_hits_give_the_logits_of_a_cold_run() {
    let model = model("random/gqa");
    let vocab = model.config.vocab_size as u32;
    let strategy = (
        1usize..=16,
        proptest::collection::vec(0..vocab, 1..40),
        proptest::collection::vec(0..vocab, 0..12),
    );
    seeded_runner(48, 41)
        .run(&strategy, |(block_size, shared, tail)| {
            let pool = KvPool::new(&model.config, block_size, 64).unwrap();
            let mut kv = PagedKv::new(pool, true);
            let mut ws = Workspace::new(&model.config, 1);

            let mut first = kv.start(&shared).unwrap();
            kv.step(&model, &mut first, &mut ws).unwrap();
            kv.free(first); // its full blocks stay cached

            let prompt: Vec<u32> = shared.iter().chain(&tail).copied().collect();
            let mut second = kv.start(&prompt).unwrap();
            let cached = second.table.num_tokens();
            let full_blocks = shared.len() / block_size * block_size;
            prop_assert_eq!(
                cached,
                full_blocks.min(prompt.len() - 1),
                "cached positions"
            );
            let hit = kv.step(&model, &mut second, &mut ws).unwrap().to_owned();

            let mut session =
                CachedSession::new(&model, ContiguousKvCache::new(&model.config, prompt.len()));
            let cold = session.prefill(&prompt).unwrap().to_owned();
            // The hit computes only the tail (one token may take the decode kernel), the cold
            // run the whole prompt: other summation orders, so equal within f32 rounding.
            assert_rel_close(
                &format!("{cached} cached positions"),
                hit.as_slice().unwrap(),
                cold.as_slice().unwrap(),
                1e-5,
            );
            kv.manager()
                .check_invariants(&[&second.table])
                .map_err(TestCaseError::fail)?;
            Ok(())
        })
        .unwrap();
}

/// Samples `steps` tokens from `logits` onward with `sampler`, feeding each through `next`.
fn sample_run(
    sampler: &mut Sampler,
    prompt: &[u32],
    first_logits: Vec<f32>,
    steps: usize,
    mut next: impl FnMut(u32) -> Vec<f32>,
) -> Vec<u32> {
    let mut output = Vec::new();
    let mut logits = first_logits;
    for _ in 0..steps {
        let token = sampler.sample(&logits, prompt, &output).unwrap();
        output.push(token);
        logits = next(token);
    }
    output
}

/// n = 4 parallel samples: forks of one prefilled sequence (blocks shared, the partial last
/// block copied on each branch's first write) give each seed the tokens of an independent run.
#[test]
fn forked_branches_equal_independent_runs() {
    let model = model("shakespeare-tiny");
    for (block_size, prompt_len) in [(4, 10), (16, 7), (1, 5), (8, 16)] {
        let prompt: Vec<u32> = (0..prompt_len as u32)
            .map(|i| (i * 37 + 5) % 4096)
            .collect();
        let params = |seed| SamplingParams {
            temperature: 1.0,
            seed,
            ..SamplingParams::default()
        };
        let steps = 12;

        let pool = KvPool::new(&model.config, block_size, 64).unwrap();
        let mut kv = PagedKv::new(pool, false);
        let mut ws = Workspace::new(&model.config, 1);
        let mut parent = kv.start(&prompt).unwrap();
        let first = kv.step(&model, &mut parent, &mut ws).unwrap().to_vec();
        let mut branches: Vec<_> = (0..4).map(|_| kv.fork(&parent)).collect();
        kv.free(parent);

        for (seed, branch) in branches.iter_mut().enumerate() {
            let mut sampler = Sampler::new(params(seed as u64)).unwrap();
            let forked = sample_run(&mut sampler, &prompt, first.clone(), steps, |token| {
                branch.tokens.push(token);
                kv.step(&model, branch, &mut ws).unwrap().to_vec()
            });

            let mut sampler = Sampler::new(params(seed as u64)).unwrap();
            let cache = ContiguousKvCache::new(&model.config, prompt_len + steps + 1);
            let mut alone = CachedSession::new(&model, cache);
            let first_alone = alone.prefill(&prompt).unwrap().to_vec();
            let independent = sample_run(&mut sampler, &prompt, first_alone, steps, |token| {
                alone.decode(token).unwrap().to_vec()
            });
            // Bit-identical by design: both run chapter 2's cached forward on the same chunks
            // with the same attention code (rows read through a block table or not) and the
            // same seeded draws, and copy-on-write copies K/V exactly.
            assert_eq!(forked, independent, "block size {block_size}, seed {seed}");
        }
        let tables: Vec<_> = branches.iter().map(|b| &b.table).collect();
        kv.manager().check_invariants(&tables).unwrap();
        for branch in branches {
            kv.free(branch);
        }
        assert_eq!(kv.manager().num_free_blocks(), 64);
    }
}
