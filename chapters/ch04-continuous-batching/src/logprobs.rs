//! Log-probabilities of sampled tokens, for callers that ask for them (the server's `logprobs`).
//!
//! They are the model's own distribution: `log_softmax` of the raw logits, before penalties,
//! temperature and top-k/top-p/min-p filtering, as vLLM reports by default. So a token's
//! logprob does not depend on how it was sampled, and greedy and sampled runs agree on it.

use std::cmp::Ordering;

use ch01::attention::log_sum_exp;

/// The sampled token's log-probability and the `top` most likely tokens' (best first; ties in
/// token order). Invariant: every logprob is `<= 0`, and `top` is sorted by descending logprob.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    /// From one row of logits `[vocab]`, the token sampled from it, and how many alternatives
    /// to list (clamped to the vocabulary). A `-inf` logit has logprob `-inf`.
    pub fn of(logits: &[f32], token: u32, top: usize) -> Self {
        let log_z = log_sum_exp(logits);
        let logprob = |l: f32| (l as f64 - log_z) as f32;

        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let n = top.min(ids.len());
        if n > 0 && n < ids.len() {
            ids.select_nth_unstable_by(n - 1, by_logit);
        }
        ids.truncate(n);
        ids.sort_unstable_by(|a, b| match by_logit(a, b) {
            Ordering::Equal => a.cmp(b),
            order => order,
        });
        TokenLogprobs {
            token,
            logprob: logprob(logits[token as usize]),
            top: ids
                .into_iter()
                .map(|id| (id, logprob(logits[id as usize])))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_a_normalised_log_softmax() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let lp = TokenLogprobs::of(&logits, 4, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((lp.logprob as f64 - (0.5 - z.ln())).abs() < 1e-6);
        // Ties (tokens 1 and 3) in token order, then the next best.
        let ids: Vec<u32> = lp.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(ids, [1, 3, 0]);
        let total: f64 = logits
            .iter()
            .enumerate()
            .map(|(i, _)| (TokenLogprobs::of(&logits, i as u32, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_is_clamped_to_the_vocabulary_and_masked_tokens_are_minus_infinity() {
        let logits = [0.0f32, f32::NEG_INFINITY];
        let lp = TokenLogprobs::of(&logits, 1, 10);
        assert_eq!(lp.logprob, f32::NEG_INFINITY);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0], (0, 0.0));
    }
}
