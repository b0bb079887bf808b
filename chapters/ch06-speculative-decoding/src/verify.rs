//! Verification: which drafts the target keeps, from the k + 1 logit rows of one forward over
//! the last token and the k drafts.
//!
//! ```text
//! rows:    p0 = target(· | x)   p1 = target(· | x d1)   …   pk = target(· | x d1 … dk)
//! greedy:  accept d1 … da while di = argmax p(i-1); then argmax pa (a correction, or the
//!          bonus token when a = k): exactly what the target alone would have produced
//! sampled: for i = 1 ..= k: accept di with probability min(1, p(i-1)(di) / q(i-1)(di));
//!          on the first rejection draw from norm(max(0, p(i-1) − q(i-1))) and stop;
//!          if all k were accepted, draw the bonus token from pk
//! ```
//!
//! Invariant (the theorem of modified rejection sampling): whatever q is, every token this
//! step emits is distributed as the target's own sampling would have drawn it, given the
//! tokens before it. The module's enumeration test checks it exactly, to 1e-12, on random
//! small p and q, by running [`speculative_step`] down every branch of its random choices.
//!
//! The distributions and the randomness are behind [`Target`], so one body serves the engine (the request's seeded
//! sampler) and the exact enumeration (every branch, with its probability).

use ch01::Sampler;
use ch01::sampler::SamplingError;
use ch04::Draft;
use ndarray::ArrayView2;

/// What one verification step consults: the target's distributions and the random choices.
pub trait Target {
    /// Writes into `p` `[vocab]` the target's distribution at draft position `i`, after the
    /// accepted `prefix` (the first `i` drafts).
    fn distribution(
        &mut self,
        i: usize,
        prefix: &[u32],
        p: &mut Vec<f64>,
    ) -> Result<(), SamplingError>;
    /// True with probability `prob` (in `[0, 1]`).
    fn accept(&mut self, prob: f64) -> bool;
    /// An index `i` with probability `weights[i] / Σ weights` (`Σ > 0`, every weight `>= 0`).
    fn pick(&mut self, weights: &[f64]) -> usize;
}

// ANCHOR: accept_probability
/// Probability of keeping a draft token with target probability `p` and draft probability `q`:
/// `min(1, p / q)`. A token the drafter could not have proposed (`q = 0`) is kept iff `p > 0`.
pub fn accept_probability(p: f64, q: f64) -> f64 {
    // ANCHOR: task_6_3
    if q <= 0.0 {
        return if p > 0.0 { 1.0 } else { 0.0 };
    }
    (p / q).min(1.0)
    // ANCHOR_END: task_6_3
}
// ANCHOR_END: accept_probability

// ANCHOR: speculative_step
/// One verification step of modified rejection sampling, on dense distributions.
///
/// `drafts` were drawn from `q(i, ·)` (row `i` the drafter's distribution of `drafts[i]`).
/// Appends the emitted tokens to `accepted`: the accepted drafts, then one drawn token.
/// `p` and `residual` are scratch `[vocab]`.
pub fn speculative_step(
    drafts: &[u32],
    q: &dyn Fn(usize, u32) -> f64,
    target: &mut dyn Target,
    p: &mut Vec<f64>,
    residual: &mut Vec<f64>,
    accepted: &mut Vec<u32>,
) -> Result<(), SamplingError> {
    // ANCHOR: task_6_3
    for (i, &draft) in drafts.iter().enumerate() {
        target.distribution(i, &drafts[..i], p)?;
        let p_d = p.get(draft as usize).copied().unwrap_or(0.0);
        if target.accept(accept_probability(p_d, q(i, draft))) {
            accepted.push(draft);
            continue;
        }
        // Rejected: draw from norm(max(0, p − q)), the mass the drafter under-proposed.
        residual.clear();
        residual.extend(
            p.iter()
                .enumerate()
                .map(|(t, &p_t)| (p_t - q(i, t as u32)).max(0.0)),
        );
        let from = if residual.iter().sum::<f64>() > 0.0 {
            &*residual
        } else {
            &*p // p = q up to rounding: the residual is empty
        };
        accepted.push(target.pick(from) as u32);
        return Ok(());
    }
    // Every draft accepted: the bonus token, from the target after all of them.
    target.distribution(drafts.len(), drafts, p)?;
    accepted.push(target.pick(p) as u32);
    Ok(())
    // ANCHOR_END: task_6_3
}
// ANCHOR_END: speculative_step

/// Scratch of [`verify`]: dense target and residual distributions, the extended output.
#[derive(Debug, Default)]
pub struct VerifyScratch {
    p: Vec<f64>,
    residual: Vec<f64>,
    output: Vec<u32>,
}

/// The engine's [`Target`]: a request's sampler over the verification rows.
struct SamplerTarget<'a, 'r> {
    sampler: &'a mut Sampler,
    rows: ArrayView2<'r, f32>,
    prompt: &'a [u32],
    output: &'a [u32],
    /// `output` followed by the accepted prefix, for the penalties.
    extended: &'a mut Vec<u32>,
}

impl Target for SamplerTarget<'_, '_> {
    fn distribution(
        &mut self,
        i: usize,
        prefix: &[u32],
        p: &mut Vec<f64>,
    ) -> Result<(), SamplingError> {
        self.extended.clear();
        self.extended.extend_from_slice(self.output);
        self.extended.extend_from_slice(prefix);
        let row = self.rows.row(i);
        let row = row.to_slice().ok_or(SamplingError::EmptyLogits)?;
        let dist = self.sampler.distribution(row, self.prompt, self.extended)?;
        p.clear();
        p.resize(row.len(), 0.0);
        for c in dist {
            p[c.token as usize] = f64::from(c.prob);
        }
        Ok(())
    }

    fn accept(&mut self, prob: f64) -> bool {
        self.sampler.uniform() < prob
    }

    fn pick(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let u = self.sampler.uniform() * total;
        let mut cumulative = 0.0;
        let mut last = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w > 0.0 {
                cumulative += w;
                last = i;
                if u < cumulative {
                    return i;
                }
            }
        }
        last // rounding left u in the gap below the total
    }
}

// ANCHOR: verify
/// The engine's verification of `draft` against `rows` `[draft.tokens.len() + 1, vocab]` with
/// the request's `sampler` (its penalties, temperature, filters and seeded randomness).
/// Greedy: the longest prefix matching the target's argmax, then the target's token.
/// Sampled: [`speculative_step`]. Appends the emitted tokens to `accepted`.
pub fn verify(
    sampler: &mut Sampler,
    rows: ArrayView2<f32>,
    prompt: &[u32],
    output: &[u32],
    draft: &Draft,
    scratch: &mut VerifyScratch,
    accepted: &mut Vec<u32>,
) -> Result<(), SamplingError> {
    let VerifyScratch {
        p,
        residual,
        output: extended,
    } = scratch;
    if sampler.params().is_greedy() {
        // ANCHOR: task_6_1
        extended.clear();
        extended.extend_from_slice(output);
        for i in 0..=draft.tokens.len() {
            let row = rows.row(i);
            let row = row.to_slice().ok_or(SamplingError::EmptyLogits)?;
            let token = sampler.sample(row, prompt, extended)?;
            accepted.push(token);
            extended.push(token);
            if draft.tokens.get(i) != Some(&token) {
                break; // a correction, or the bonus token after the last draft
            }
        }
        return Ok(());
        // ANCHOR_END: task_6_1
    }
    let vocab = rows.ncols();
    let q = |i: usize, t: u32| -> f64 {
        if draft.probs.is_empty() {
            f64::from(u8::from(draft.tokens[i] == t)) // proposed with certainty
        } else {
            f64::from(draft.probs[i * vocab + t as usize])
        }
    };
    let mut target = SamplerTarget {
        sampler,
        rows,
        prompt,
        output,
        extended,
    };
    speculative_step(&draft.tokens, &q, &mut target, p, residual, accepted)
}
// ANCHOR_END: verify

#[cfg(test)]
mod tests {
    //! The theorem, checked exactly: run [`speculative_step`] down every branch of its random
    //! choices (each with its probability), for every draft sequence the drafter could have
    //! drawn, and compare the distribution of what it emits with the target's.
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::collections::HashMap;

    /// A distribution over `vocab` tokens: random, some entries 0, sometimes one-hot.
    fn random_dist(rng: &mut ChaCha8Rng, vocab: usize) -> Vec<f64> {
        if rng.random_bool(0.2) {
            let mut d = vec![0.0; vocab];
            d[rng.random_range(0..vocab)] = 1.0;
            return d;
        }
        let mut d: Vec<f64> = (0..vocab)
            .map(|_| {
                if rng.random_bool(0.25) {
                    0.0
                } else {
                    rng.random()
                }
            })
            .collect();
        if d.iter().all(|&x| x == 0.0) {
            d[0] = 1.0;
        }
        let total: f64 = d.iter().sum();
        d.iter_mut().for_each(|x| *x /= total);
        d
    }

    /// Distributions indexed by the prefix (the tokens after the step's start).
    struct Tables {
        vocab: usize,
        p: HashMap<Vec<u32>, Vec<f64>>,
        q: HashMap<Vec<u32>, Vec<f64>>,
    }

    fn prefixes(vocab: usize, max_len: usize) -> Vec<Vec<u32>> {
        let mut all = vec![Vec::new()];
        let mut level = vec![Vec::new()];
        for _ in 0..max_len {
            let mut next = Vec::new();
            for prefix in &level {
                for t in 0..vocab as u32 {
                    let mut longer: Vec<u32> = prefix.clone();
                    longer.push(t);
                    next.push(longer);
                }
            }
            all.extend(next.iter().cloned());
            level = next;
        }
        all
    }

    fn tables(rng: &mut ChaCha8Rng, vocab: usize, k: usize) -> Tables {
        let mut t = Tables {
            vocab,
            p: HashMap::new(),
            q: HashMap::new(),
        };
        for prefix in prefixes(vocab, k) {
            t.p.insert(prefix.clone(), random_dist(rng, vocab));
            if prefix.len() < k {
                t.q.insert(prefix, random_dist(rng, vocab));
            }
        }
        t
    }

    /// A [`Target`] that follows a scripted path of choices and records each choice's options
    /// and probability, so that a depth-first walk visits every branch.
    struct Scripted<'t> {
        tables: &'t Tables,
        path: Vec<usize>,
        /// Per decision taken: how many options it had.
        options: Vec<usize>,
        prob: f64,
    }

    impl Scripted<'_> {
        fn choose(&mut self, probs: &[f64]) -> usize {
            let live: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
            let depth = self.options.len();
            let choice = self.path.get(depth).copied().unwrap_or(0);
            self.options.push(live.len());
            self.prob *= probs[live[choice]];
            live[choice]
        }
    }

    impl Target for Scripted<'_> {
        fn distribution(
            &mut self,
            _i: usize,
            prefix: &[u32],
            p: &mut Vec<f64>,
        ) -> Result<(), SamplingError> {
            p.clear();
            p.extend_from_slice(&self.tables.p[prefix]);
            Ok(())
        }

        fn accept(&mut self, prob: f64) -> bool {
            self.choose(&[prob, 1.0 - prob]) == 0
        }

        fn pick(&mut self, weights: &[f64]) -> usize {
            let total: f64 = weights.iter().sum();
            let probs: Vec<f64> = weights.iter().map(|w| w / total).collect();
            self.choose(&probs)
        }
    }

    /// Every output of one verification step with these tables, with its exact probability.
    fn output_distribution(t: &Tables, k: usize) -> HashMap<Vec<u32>, f64> {
        let mut out: HashMap<Vec<u32>, f64> = HashMap::new();
        // Every draft sequence, drawn token by token from q.
        for drafts in prefixes(t.vocab, k).into_iter().filter(|d| d.len() == k) {
            let q_drafts: f64 = (0..k)
                .map(|i| t.q[&drafts[..i]][drafts[i] as usize])
                .product();
            if q_drafts == 0.0 {
                continue;
            }
            let q = |i: usize, tok: u32| t.q[&drafts[..i]][tok as usize];
            // Depth-first over the step's choices.
            let mut path: Vec<usize> = Vec::new();
            loop {
                let mut target = Scripted {
                    tables: t,
                    path: path.clone(),
                    options: Vec::new(),
                    prob: 1.0,
                };
                let (mut p, mut r, mut emitted) = (Vec::new(), Vec::new(), Vec::new());
                speculative_step(&drafts, &q, &mut target, &mut p, &mut r, &mut emitted).unwrap();
                *out.entry(emitted).or_default() += q_drafts * target.prob;
                // The next path: advance the deepest decision that has options left.
                let mut taken: Vec<usize> = (0..target.options.len())
                    .map(|d| path.get(d).copied().unwrap_or(0))
                    .collect();
                while let Some(last) = taken.pop() {
                    if last + 1 < target.options[taken.len()] {
                        taken.push(last + 1);
                        break;
                    }
                }
                if taken.is_empty() {
                    break;
                }
                path = taken;
            }
        }
        out
    }

    #[test]
    fn one_verification_step_emits_the_targets_distribution_exactly() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        for case in 0..150 {
            let (vocab, k) = if case % 3 == 0 { (4, 2) } else { (3, 3) };
            let t = tables(&mut rng, vocab, k);
            let emitted = output_distribution(&t, k);
            let total: f64 = emitted.values().sum();
            assert!((total - 1.0).abs() < 1e-12, "case {case}: total {total}");
            // Continue every output with the target alone to k + 1 tokens: the result must be
            // distributed as k + 1 tokens of the target alone.
            for seq in prefixes(vocab, k + 1)
                .into_iter()
                .filter(|s| s.len() == k + 1)
            {
                let target_alone = |from: usize| -> f64 {
                    (from..=k)
                        .map(|j| t.p[&seq[..j]][seq[j] as usize])
                        .product()
                };
                let expected = target_alone(0);
                let actual: f64 = (1..=k + 1)
                    .filter_map(|len| emitted.get(&seq[..len]).map(|w| w * target_alone(len)))
                    .sum();
                assert!(
                    (expected - actual).abs() < 1e-12,
                    "case {case}: {seq:?}: target {expected}, speculative {actual}"
                );
            }
        }
    }

    #[test]
    fn a_drafter_equal_to_the_target_is_always_accepted() {
        assert_eq!(accept_probability(0.3, 0.3), 1.0);
        assert_eq!(accept_probability(0.1, 0.4), 0.25);
        assert_eq!(accept_probability(0.5, 0.0), 1.0);
        assert_eq!(accept_probability(0.0, 0.0), 0.0);
    }
}
