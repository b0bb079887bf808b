//! Token sampling: turning one row of logits into the next token id.
//!
//! Every decode step in every chapter ends here. The model produces `logits: [vocab]` for the
//! last position; a [`Sampler`] picks one token from them, following the per-request
//! [`SamplingParams`] that an OpenAI-compatible client sends (same names as OpenAI and vLLM).
//!
//! # The pipeline
//!
//! The steps run in this order, which is the order of vLLM and Hugging Face `transformers`.
//! The order matters: penalties change which tokens survive top-k, and top-p is measured on
//! the distribution that top-k left.
//!
//! ```text
//! logits [vocab]
//!  1. copy into the sampler's scratch buffer        the caller's logits are never modified
//!  2. repetition penalty over the SET prompt ∪ output:  l > 0 ? l / r : l * r
//!  3. frequency / presence penalty over output tokens:  l -= f * count + p * (count > 0)
//!  4. temperature == 0  =>  argmax, lowest token id wins ties; done (steps 5-11 skipped)
//!  5. divide by temperature
//!  6. top-k     keep the k largest logits
//!  7. softmax   over the survivors
//!  8. top-p     keep the smallest set of most probable tokens whose mass reaches top_p
//!  9. min-p     drop tokens with p < min_p * p_max
//! 10. renormalise so the survivors sum to 1
//! 11. draw one uniform u in [0, 1) from the seeded RNG; return the first token whose
//!     cumulative probability exceeds u (inverse CDF)
//! ```
//!
//! Steps 1-3 are [`Sampler::penalized_logits`]; steps 6-10 are the pure function
//! [`candidates`], so tests (and later chapters) can inspect each half on its own.
//!
//! # Invariants
//!
//! - **Deterministic.** A sampler's RNG is ChaCha8 seeded from [`SamplingParams::seed`], and
//!   every non-greedy call to [`Sampler::sample`] consumes exactly one draw. Same seed and same
//!   inputs give the same tokens, on every machine.
//! - **Masked tokens are never sampled.** A logit of `-inf` (how a model or a grammar masks a
//!   token) or NaN has probability 0. If no token is left, sampling returns
//!   [`SamplingError::NoCandidates`] instead of panicking. A `+inf` logit is the limit of a very
//!   large one: the `+inf` tokens share all the probability.
//! - **Ties are broken by the lower token id**, everywhere: argmax, the top-k cut (so top-k
//!   keeps exactly `min(k, unmasked tokens)` tokens, never more) and the top-p boundary.
//! - **Every accepted parameter is honoured**; a parameter out of range is rejected by
//!   [`SamplingParams::validate`], never clamped.
//!
//! # Cost per call, for a vocabulary of V tokens and a sequence of S tokens
//!
//! Penalties are O(S): they touch only the tokens in the sequence and reset their scratch
//! entries afterwards, so no vocabulary-sized buffer is cleared. Greedy is O(V). Otherwise the
//! survivors are sorted: O(V + k log k) with top-k, O(V log V) without. After the first call
//! at a given vocabulary size a sampler allocates nothing: all work happens in its scratch
//! buffers.

use std::cmp::Ordering;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// Parameters and errors
// ---------------------------------------------------------------------------------------------

/// Per-request sampling parameters, named as OpenAI and vLLM name them.
///
/// Each one has a value that disables it (see [`Default`]), so a request only names what it
/// uses; when deserialised, missing fields take their default. Note the default temperature is
/// 0 (greedy), not OpenAI's 1.0: the server decides which default a request gets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Divides the logits before the softmax: below 1 sharpens the distribution, above 1
    /// flattens it. `0.0` means greedy: return the argmax (top-k, top-p and min-p cannot change
    /// it). Must be finite and `>= 0`.
    pub temperature: f32,
    /// Keep only the `top_k` largest logits. `0` disables it.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of most probable tokens whose total probability
    /// reaches `top_p`. `1.0` disables it. Must be in `(0, 1]`.
    pub top_p: f32,
    /// Drop every token whose probability is below `min_p` times the largest probability.
    /// `0.0` disables it. Must be in `[0, 1]`.
    pub min_p: f32,
    /// CTRL / Hugging Face repetition penalty over every token seen in prompt or output, each
    /// penalised once: a positive logit is divided by it, any other multiplied, so a value
    /// above 1 always makes a seen token less likely. `1.0` disables it. Must be finite, `> 0`.
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty: subtracted from a token's logit once per occurrence in the
    /// output. `0.0` disables it. Must be in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty: subtracted from a token's logit once if it occurs in the
    /// output at all. `0.0` disables it. Must be in `[-2, 2]`.
    pub presence_penalty: f32,
    /// Seed of the sampler's ChaCha8 RNG.
    pub seed: u64,
}

impl Default for SamplingParams {
    /// Greedy, every filter and penalty disabled, seed 0.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (argmax) with no penalties: the same as [`Default`].
    pub fn greedy() -> Self {
        Self::default()
    }

    /// True when sampling returns the argmax, so the RNG is never used.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every parameter against its documented range. NaN is rejected everywhere.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        require(
            "temperature",
            t,
            t.is_finite() && t >= 0.0,
            "a finite value >= 0",
        )?;
        validate_top_p(self.top_p)?;
        validate_min_p(self.min_p)?;
        let r = self.repetition_penalty;
        require(
            "repetition_penalty",
            r,
            r.is_finite() && r > 0.0,
            "a finite value > 0",
        )?;
        for (name, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            require(
                name,
                value,
                (-2.0..=2.0).contains(&value),
                "a value in [-2, 2]",
            )?;
        }
        Ok(())
    }
}

fn validate_top_p(top_p: f32) -> Result<(), SamplingError> {
    require(
        "top_p",
        top_p,
        top_p > 0.0 && top_p <= 1.0,
        "a value in (0, 1]",
    )
}

fn validate_min_p(min_p: f32) -> Result<(), SamplingError> {
    require(
        "min_p",
        min_p,
        (0.0..=1.0).contains(&min_p),
        "a value in [0, 1]",
    )
}

/// `Ok` when `ok`, else the error that names the parameter, its value and its range.
fn require(
    name: &'static str,
    value: f32,
    ok: bool,
    expected: &'static str,
) -> Result<(), SamplingError> {
    if ok {
        Ok(())
    } else {
        Err(SamplingError::InvalidParameter {
            name,
            value,
            expected,
        })
    }
}

/// Why a token could not be sampled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// A [`SamplingParams`] field is outside its documented range.
    #[error("invalid sampling parameter {name} = {value}: expected {expected}")]
    InvalidParameter {
        name: &'static str,
        value: f32,
        expected: &'static str,
    },
    /// The logits row has no entries.
    #[error("cannot sample from an empty logits row (vocabulary size 0)")]
    EmptyLogits,
    /// Every logit is `-inf` or NaN, so no token has a probability above 0.
    #[error("no token can be sampled: all {vocab_size} logits are -inf or NaN")]
    NoCandidates { vocab_size: usize },
    /// A prompt or output token id is not a row of the logits.
    #[error("{sequence} token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab {
        sequence: &'static str,
        token: u32,
        vocab_size: usize,
    },
}

// ---------------------------------------------------------------------------------------------
// Candidate filtering: steps 6-10, a pure function
// ---------------------------------------------------------------------------------------------

/// A token that survived top-k, top-p and min-p.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Token id: the index into the logits row.
    pub token: u32,
    /// Its logit as given to [`candidates`] (after penalties and temperature).
    pub logit: f32,
    /// Its probability, renormalised over the candidates: in `(0, 1]`, summing to 1.
    pub prob: f32,
}

/// Steps 6-10 of the pipeline: top-k, softmax, top-p, min-p, renormalise.
///
/// `logits` are the scores after penalties and temperature, `[vocab]`. Returns the surviving
/// tokens with their renormalised probabilities: never empty, every `prob > 0`, the probabilities
/// summing to 1 (up to rounding), sorted by probability, highest first, equal logits by lower
/// token id. `top_k == 0`, `top_p == 1.0` and `min_p == 0.0` each disable their filter.
///
/// Errors: `top_p` or `min_p` out of range, an empty row, or every logit `-inf` or NaN.
pub fn candidates(
    logits: &[f32],
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> Result<Vec<Candidate>, SamplingError> {
    validate_top_p(top_p)?;
    validate_min_p(min_p)?;
    let mut out = Vec::new();
    filter_candidates(logits, top_k, top_p, min_p, &mut out)?;
    Ok(out)
}

/// [`candidates`] into a reusable buffer; `top_p` and `min_p` are already validated.
fn filter_candidates(
    logits: &[f32],
    top_k: usize,
    top_p: f32,
    min_p: f32,
    out: &mut Vec<Candidate>,
) -> Result<(), SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }

    // Every token that can be sampled at all: -inf and NaN are masked.
    out.clear();
    out.extend(
        logits
            .iter()
            .enumerate()
            .filter(|&(_, &logit)| is_unmasked(logit))
            .map(|(token, &logit)| Candidate {
                token: token as u32,
                logit,
                prob: 0.0,
            }),
    );
    if out.is_empty() {
        return Err(SamplingError::NoCandidates {
            vocab_size: logits.len(),
        });
    }

    // 6. top-k: partition so the k best come first (O(V)), drop the rest.
    if top_k > 0 && top_k < out.len() {
        out.select_nth_unstable_by(top_k - 1, by_rank);
        out.truncate(top_k);
    }
    // Sort the survivors best first; from here on out[0] is the most probable token.
    out.sort_unstable_by(by_rank);

    // 7. softmax over the survivors. Sums run in f64 so long vocabularies still sum to 1.
    let max_logit = out[0].logit;
    let mut total = 0.0f64;
    for c in out.iter_mut() {
        c.prob = softmax_weight(c.logit, max_logit);
        total += f64::from(c.prob);
    }
    for c in out.iter_mut() {
        c.prob = (f64::from(c.prob) / total) as f32;
    }
    // Tokens whose weight underflowed to 0 can never be drawn; out[0] always has weight 1.
    out.retain(|c| c.prob > 0.0);

    // 8. top-p: the shortest prefix (best first) whose cumulative probability reaches top_p.
    // If rounding keeps the sum below top_p, everything stays.
    if top_p < 1.0 {
        let mut cumulative = 0.0f64;
        if let Some(last) = out.iter().position(|c| {
            cumulative += f64::from(c.prob);
            cumulative >= f64::from(top_p)
        }) {
            out.truncate(last + 1);
        }
    }

    // 9. min-p: relative to the most probable token, which always survives (min_p <= 1).
    if min_p > 0.0 {
        let threshold = min_p * out[0].prob;
        out.retain(|c| c.prob >= threshold);
    }

    // 10. renormalise over what is left.
    let total: f64 = out.iter().map(|c| f64::from(c.prob)).sum();
    for c in out.iter_mut() {
        c.prob = (f64::from(c.prob) / total) as f32;
    }
    Ok(())
}

/// A logit that can be sampled: not `-inf` (masked) and not NaN.
fn is_unmasked(logit: f32) -> bool {
    !logit.is_nan() && logit != f32::NEG_INFINITY
}

/// `after`, what a penalty or the temperature made of logit `before`, kept sampleable if
/// `before` was: they change how likely a token is, never whether it can be drawn. A finite
/// logit driven past f32's range (a repetition penalty of 1e38) stops at the lowest finite
/// value instead of becoming a mask, so a request whose every other token is masked (by a
/// grammar, `allowed_token_ids`) still has a token to sample. Logits driven there together
/// tie there: f32 cannot keep their order.
fn keep_unmasked(before: f32, after: f32) -> f32 {
    if is_unmasked(before) {
        after.max(f32::MIN)
    } else {
        after
    }
}

/// Best first: higher logit, then lower token id. A total order on unmasked logits, so the
/// sort and the top-k partition are deterministic. (`-0.0` and `0.0` count as equal.)
fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal) // unreachable: NaN was filtered out
        .then(a.token.cmp(&b.token))
}

/// `exp(logit - max_logit)`, the unnormalised softmax weight. When the maximum is `+inf`
/// the formula gives NaN, so take the limit instead: the `+inf` tokens get weight 1, the rest 0.
fn softmax_weight(logit: f32, max_logit: f32) -> f32 {
    if max_logit == f32::INFINITY {
        if logit == f32::INFINITY { 1.0 } else { 0.0 }
    } else {
        (logit - max_logit).exp()
    }
}

/// Step 4: the first index of the largest unmasked logit, or `None` if all are masked (NaN or
/// −∞): what greedy sampling with no penalty returns. An executor that keeps its logits on a
/// device computes the same there (chapter 7's `argmax_rows` kernel), and chapter 4's engine
/// then copies back one id a row instead of the row.
///
/// Two passes that the compiler vectorises, where one pass keeping (index, logit) does not:
/// the largest logit (a comparison is false for NaN, and −∞ never wins, so masked logits are
/// passed over), then the first index holding a value equal to it. Equal values (`0.0` and
/// `-0.0` included) tie to the lower id, as one pass with a strict `>` would.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    const LANES: usize = 8;
    let (chunks, tail) = logits.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for chunk in chunks {
        for (best, &logit) in lanes.iter_mut().zip(chunk) {
            *best = if logit > *best { logit } else { *best };
        }
    }
    let largest =
        lanes
            .into_iter()
            .chain(tail.iter().copied())
            .fold(
                f32::NEG_INFINITY,
                |best, logit| if logit > best { logit } else { best },
            );
    if largest == f32::NEG_INFINITY {
        return None; // every logit is NaN or −∞
    }
    let first = chunks
        .iter()
        .position(|chunk| chunk.contains(&largest))
        .map_or(chunks.len() * LANES, |c| c * LANES);
    let token = first + logits[first..].iter().position(|&l| l == largest)?;
    Some(token as u32)
}

/// Step 11, inverse-CDF sampling: the first candidate whose cumulative probability exceeds
/// `u` in `[0, 1)`. `None` only for an empty slice.
fn draw(candidates: &[Candidate], u: f64) -> Option<u32> {
    let mut cumulative = 0.0f64;
    for c in candidates {
        cumulative += f64::from(c.prob);
        if u < cumulative {
            return Some(c.token);
        }
    }
    // Rounding can leave the total a hair below 1 and u in that gap: take the last token.
    candidates.last().map(|c| c.token)
}

// ---------------------------------------------------------------------------------------------
// The sampler: one per request
// ---------------------------------------------------------------------------------------------

/// Samples the tokens of one request: its parameters, its seeded RNG and scratch buffers that
/// are reused on every call. Create one per request; it is not shared between requests,
/// because the RNG stream is part of the request's reproducibility.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Steps 1-5 work here: a copy of the logits, penalised and scaled in place. `[vocab]`.
    logits: Vec<f32>,
    /// Steps 6-10 work here: the surviving candidates, best first.
    candidates: Vec<Candidate>,
    /// Step 2: "already penalised this call" per token. `[vocab]`, all false between calls.
    seen: Vec<bool>,
    /// Step 3: occurrences in the output per token. `[vocab]`, all zero between calls.
    output_counts: Vec<u32>,
}

impl Sampler {
    /// A sampler for `params`, its RNG seeded from `params.seed`. Rejects invalid parameters.
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = ChaCha8Rng::seed_from_u64(params.seed);
        Ok(Self {
            params,
            rng,
            logits: Vec::new(),
            candidates: Vec::new(),
            seen: Vec::new(),
            output_counts: Vec::new(),
        })
    }

    /// The parameters this sampler was built with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` is `[vocab]` for the last position; `prompt_tokens` and
    /// `output_tokens` are the sequence so far (for the penalties). Runs the whole pipeline of
    /// the module docs. Same seed and same inputs give the same token sequence.
    ///
    /// Errors: an empty row, every logit `-inf` or NaN, or a token id `>= vocab`.
    // ANCHOR: sample
    pub fn sample(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Result<u32, SamplingError> {
        let no_candidates = SamplingError::NoCandidates {
            vocab_size: logits.len(),
        };
        // Steps 1-3.
        self.apply_penalties(logits, prompt_tokens, output_tokens)?;

        // 4. Greedy: the filters below all keep the argmax, so skip them (and the RNG).
        let p = &self.params;
        if p.is_greedy() {
            return argmax(&self.logits).ok_or(no_candidates);
        }

        // 5-10.
        self.filter_scaled()?;

        // 11. Exactly one draw per call, even when only one candidate is left, so the RNG
        // stream advances the same way whatever the logits were.
        let u: f64 = self.rng.random();
        draw(&self.candidates, u).ok_or(no_candidates)
    }
    // ANCHOR_END: sample

    /// Steps 1-10 without the draw: the distribution [`sample`](Self::sample) would draw
    /// from, as candidates (best first, probabilities summing to 1). Greedy: the argmax alone,
    /// with probability 1. Uses no randomness. Speculative decoding (chapter 6) compares it
    /// with a drafter's distribution.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Result<&[Candidate], SamplingError> {
        self.apply_penalties(logits, prompt_tokens, output_tokens)?;
        if self.params.is_greedy() {
            let token = argmax(&self.logits).ok_or(SamplingError::NoCandidates {
                vocab_size: logits.len(),
            })?;
            self.candidates.clear();
            self.candidates.push(Candidate {
                token,
                logit: self.logits[token as usize],
                prob: 1.0,
            });
        } else {
            self.filter_scaled()?;
        }
        Ok(&self.candidates)
    }

    /// One uniform draw in `[0, 1)` from the request's RNG stream (what step 11 uses), for
    /// callers that decide with the sampler's randomness themselves (chapter 6's
    /// acceptance test).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random()
    }

    /// Steps 5-10 on the penalised logits: temperature, then the candidate filters.
    fn filter_scaled(&mut self) -> Result<(), SamplingError> {
        let p = &self.params;
        // 5. Temperature. (-inf stays -inf.) A temperature so small that a finite logit
        // overflows is applied to the logits less their largest, the same distribution: the
        // largest stays at 0 and the others fall towards f32's lowest, their order kept
        // wherever f32 can hold it.
        let t = p.temperature;
        // Dividing a finite f32 by t ≥ 1 cannot overflow: no pass over the vocabulary then.
        let overflows = t < 1.0
            && self
                .logits
                .iter()
                .any(|&logit| logit.is_finite() && !(logit / t).is_finite());
        let shift = if overflows {
            let finite = self.logits.iter().copied().filter(|l| l.is_finite());
            finite.fold(f32::NEG_INFINITY, f32::max)
        } else {
            0.0
        };
        for logit in self.logits.iter_mut() {
            *logit = keep_unmasked(*logit, (*logit - shift) / t);
        }
        // 6-10.
        filter_candidates(
            &self.logits,
            p.top_k,
            p.top_p,
            p.min_p,
            &mut self.candidates,
        )
    }

    /// Steps 1-3 only: the logits after the repetition, frequency and presence penalties
    /// (before temperature). Uses no randomness. Exposed so the penalties can be checked
    /// value by value, and for later chapters that need the processed scores.
    pub fn penalized_logits(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Result<&[f32], SamplingError> {
        self.apply_penalties(logits, prompt_tokens, output_tokens)?;
        Ok(&self.logits)
    }

    /// Steps 1-3 into `self.logits`.
    fn apply_penalties(
        &mut self,
        logits: &[f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) -> Result<(), SamplingError> {
        let vocab_size = logits.len();
        if vocab_size == 0 {
            return Err(SamplingError::EmptyLogits);
        }
        // Check every id before touching the scratch buffers, so they stay clean on error.
        check_in_vocab("prompt", prompt_tokens, vocab_size)?;
        check_in_vocab("output", output_tokens, vocab_size)?;

        // 1. Copy.
        self.logits.clear();
        self.logits.extend_from_slice(logits);

        // 2. Repetition penalty, once per distinct token of prompt ∪ output.
        let r = self.params.repetition_penalty;
        if r != 1.0 {
            self.seen.resize(vocab_size, false);
            for &token in prompt_tokens.iter().chain(output_tokens) {
                let token = token as usize;
                if !self.seen[token] {
                    self.seen[token] = true;
                    let logit = &mut self.logits[token];
                    *logit =
                        keep_unmasked(*logit, if *logit > 0.0 { *logit / r } else { *logit * r });
                }
            }
            // Clear only the entries we set: O(sequence), not O(vocab).
            for &token in prompt_tokens.iter().chain(output_tokens) {
                self.seen[token as usize] = false;
            }
        }

        // 3. Frequency and presence penalties, over the output only.
        let (frequency, presence) = (self.params.frequency_penalty, self.params.presence_penalty);
        if frequency != 0.0 || presence != 0.0 {
            self.output_counts.resize(vocab_size, 0);
            for &token in output_tokens {
                self.output_counts[token as usize] += 1;
            }
            for &token in output_tokens {
                // Taking the count resets it to zero, so each distinct token is penalised
                // once and the buffer is clean for the next call.
                let count = std::mem::take(&mut self.output_counts[token as usize]);
                if count > 0 {
                    let logit = &mut self.logits[token as usize];
                    *logit = keep_unmasked(*logit, *logit - (frequency * count as f32 + presence));
                }
            }
        }
        Ok(())
    }
}

/// Every id in `tokens` must index a logit.
fn check_in_vocab(
    sequence: &'static str,
    tokens: &[u32],
    vocab_size: usize,
) -> Result<(), SamplingError> {
    match tokens.iter().find(|&&token| token as usize >= vocab_size) {
        Some(&token) => Err(SamplingError::TokenOutOfVocab {
            sequence,
            token,
            vocab_size,
        }),
        None => Ok(()),
    }
}
