//! A synthetic request workload, and how much of a contiguous KV reservation it really uses.
//!
//! [`ContiguousKvCache`](crate::ContiguousKvCache) reserves room for the longest sequence the
//! model allows, whatever the request will really use. This module measures that waste on a
//! realistic mix of requests; chapter 3 measures paged blocks on the same workload, and chapter 4
//! drives arrivals with it.
//!
//! # The workload
//!
//! Prompt and output lengths of chat traffic are long-tailed: most requests are short, a few
//! are very long. [`LogNormalLengths`] draws each from a log-normal distribution,
//! `len = median × exp(sigma × z)` with `z ~ N(0, 1)`, rounded to a whole token and clipped
//! (see [`LogNormalLengths::sample`]). Prompt and output lengths are drawn independently.
//!
//! The defaults ([`LogNormalLengths::sharegpt_like`]) are chosen in the spirit of ShareGPT chat
//! traffic, not fitted to it: the PagedAttention paper (Kwon et al., SOSP 2023, §6.1, Fig. 11)
//! reports ShareGPT means of about 161 prompt and 338 output tokens. A log-normal's mean is
//! `median × exp(sigma² / 2)`, so:
//!
//! | length | median | sigma | mean (before clipping) | p99 (before clipping) |
//! |--------|-------:|------:|-----------------------:|----------------------:|
//! | prompt |    100 |   1.0 |                    165 |                 1 024 |
//! | output |    225 |   0.9 |                    337 |                 1 826 |
//!
//! # The measure
//!
//! Each request reserves a number of token slots for its whole life ([`Reservation`]); every
//! slot costs [`bytes_per_token`] bytes. [`ContiguousUtilisation`] reports two shares:
//!
//! - **lifetime utilisation**, `used / reserved`: the share of reserved slots that *ever* hold a
//!   token. The rest is **internal fragmentation**: reserved, never written, because the
//!   request finished before reaching the end of its reservation.
//! - **time-weighted utilisation**: the share of reserved slot-steps in which a slot holds a
//!   token. This is what a snapshot of KV memory sees, as in the paper's Fig. 2 (20.4%–38.2%
//!   of KV memory holding token states in Orca/FasterTransformer-like systems). It splits the
//!   waste as the paper does, into slots **reserved** for the request's own future tokens and
//!   **internal fragmentation**.
//!
//! Time model, stated once: a request with `p` prompt and `o` output tokens lives `o` engine
//! steps. Step 1 is the prefill, which writes the prompt and produces output token 1; step `k`
//! produces output token `k`. A token's slot counts as holding from the step that produced it,
//! so after step `k` the request holds `p + k` slots. Requests are assumed to keep memory full
//! (no idle time, no queueing), so the aggregate share is `Σ holding / Σ reserved` over every
//! request's slot-steps. External fragmentation (gaps between reservations of different sizes)
//! is not modelled: with [`Reservation::Fixed`] every reservation has the same size and there
//! is none.

use ch01::LlamaConfig;

/// Errors of the workload generator and of the utilisation measure.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WorkloadError {
    #[error("log-normal median must be finite and > 0, got {0}")]
    BadMedian(f64),
    #[error("log-normal sigma must be finite and >= 0, got {0}")]
    BadSigma(f64),
    #[error("max_len must be at least 2 (one prompt and one output token), got {0}")]
    MaxLenTooSmall(usize),
    #[error("cannot measure the utilisation of an empty workload")]
    EmptyWorkload,
    #[error(
        "request {index} has prompt_len {prompt_len} and output_len {output_len}; both must be >= 1"
    )]
    EmptyRequest {
        index: usize,
        prompt_len: usize,
        output_len: usize,
    },
    #[error("request {index} needs {needed} token slots but its reservation holds {reserved}")]
    DoesNotFit {
        index: usize,
        needed: usize,
        reserved: usize,
    },
}

// ───────────────────────────── requests and the seeded RNG ─────────────────────────────

/// One request's lengths, in tokens. From the generator: `prompt_len >= 1`, `output_len >= 1`,
/// `prompt_len + output_len <= max_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestLengths {
    pub prompt_len: usize,
    pub output_len: usize,
}

impl RequestLengths {
    /// Token slots the request ever fills: `prompt_len + output_len`.
    pub fn total(&self) -> usize {
        self.prompt_len.saturating_add(self.output_len)
    }
}

/// SplitMix64 (Steele, Lea & Flood 2014): a 64-bit counter passed through a mixing function.
/// Small, fast, and the same on every platform and every version of every crate, so a seed
/// names one workload forever. Not for cryptography.
#[derive(Debug, Clone)]
pub struct WorkloadRng {
    state: u64,
}

impl WorkloadRng {
    pub fn new(seed: u64) -> Self {
        WorkloadRng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `(0, 1]`, on a grid of 2⁻⁵³ (never 0, so `ln` of it is finite).
    pub fn uniform_open0(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal `N(0, 1)` by Box–Muller: `sqrt(-2 ln u₁) · cos(2π u₂)`.
    /// (The sine half of the pair is dropped, to keep the generator stateless between calls.)
    pub fn standard_normal(&mut self) -> f64 {
        let u1 = self.uniform_open0();
        let u2 = self.uniform_open0();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

// ───────────────────────────── the log-normal length distribution ─────────────────────────────

// ANCHOR: lognormal
/// A log-normal distribution: `X = median × exp(sigma × Z)`, `Z ~ N(0, 1)`; so `ln X ~ N(ln median, sigma²)`.
/// Invariant (checked by [`LogNormal::new`]): `median` finite and > 0, `sigma` finite and >= 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormal {
    median: f64,
    sigma: f64,
}

impl LogNormal {
    pub fn new(median: f64, sigma: f64) -> Result<Self, WorkloadError> {
        if !(median.is_finite() && median > 0.0) {
            return Err(WorkloadError::BadMedian(median));
        }
        if !(sigma.is_finite() && sigma >= 0.0) {
            return Err(WorkloadError::BadSigma(sigma));
        }
        Ok(LogNormal { median, sigma })
    }

    pub fn median(&self) -> f64 {
        self.median
    }

    pub fn sigma(&self) -> f64 {
        self.sigma
    }

    /// `median × exp(sigma² / 2)`.
    pub fn mean(&self) -> f64 {
        self.median * (self.sigma * self.sigma / 2.0).exp()
    }

    /// One draw, a real number > 0 (it may overflow to +∞ for absurd sigmas).
    pub fn sample(&self, rng: &mut WorkloadRng) -> f64 {
        self.median * (self.sigma * rng.standard_normal()).exp()
    }
}

/// Prompt and output lengths, each log-normal, clipped to a context of `max_len` tokens.
/// Invariant (checked by [`LogNormalLengths::new`]): `max_len >= 2`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogNormalLengths {
    prompt: LogNormal,
    output: LogNormal,
    max_len: usize,
}

impl LogNormalLengths {
    /// ShareGPT-like prompts: median 100 tokens, sigma 1.0 (mean ≈ 165). See the module docs.
    pub const SHAREGPT_PROMPT: LogNormal = LogNormal {
        median: 100.0,
        sigma: 1.0,
    };
    /// ShareGPT-like outputs: median 225 tokens, sigma 0.9 (mean ≈ 337). See the module docs.
    pub const SHAREGPT_OUTPUT: LogNormal = LogNormal {
        median: 225.0,
        sigma: 0.9,
    };

    pub fn new(
        prompt: LogNormal,
        output: LogNormal,
        max_len: usize,
    ) -> Result<Self, WorkloadError> {
        if max_len < 2 {
            return Err(WorkloadError::MaxLenTooSmall(max_len));
        }
        Ok(LogNormalLengths {
            prompt,
            output,
            max_len,
        })
    }

    /// The documented defaults ([`Self::SHAREGPT_PROMPT`], [`Self::SHAREGPT_OUTPUT`]) in a
    /// context of `max_len` tokens.
    pub fn sharegpt_like(max_len: usize) -> Result<Self, WorkloadError> {
        Self::new(Self::SHAREGPT_PROMPT, Self::SHAREGPT_OUTPUT, max_len)
    }

    pub fn prompt(&self) -> LogNormal {
        self.prompt
    }

    pub fn output(&self) -> LogNormal {
        self.output
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// `n` requests from seed `seed`; the same `(self, n, seed)` always gives the same list, and
    /// the first `k` requests of `sample(n, seed)` are `sample(k, seed)`.
    ///
    /// Each length is rounded to the nearest token, then clipped as a server would:
    /// the prompt to `[1, max_len - 1]` (room for at least one output token), the output to
    /// `[1, max_len - prompt_len]` (generation stops at the end of the context). So every
    /// request has `prompt_len >= 1`, `output_len >= 1` and `prompt_len + output_len <= max_len`.
    pub fn sample(&self, n: usize, seed: u64) -> Vec<RequestLengths> {
        let mut rng = WorkloadRng::new(seed);
        (0..n)
            .map(|_| {
                // Draw both before clipping, so one request always consumes the same draws.
                let prompt_raw = self.prompt.sample(&mut rng);
                let output_raw = self.output.sample(&mut rng);
                // `as usize` saturates: +∞ → usize::MAX, then the clamp applies.
                let prompt_len = (prompt_raw.round() as usize).clamp(1, self.max_len - 1);
                let output_len = (output_raw.round() as usize).clamp(1, self.max_len - prompt_len);
                RequestLengths {
                    prompt_len,
                    output_len,
                }
            })
            .collect()
    }
}
// ANCHOR_END: lognormal

// ───────────────────────────── reservations and bytes ─────────────────────────────

/// How many token slots a system reserves for a request when it is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reservation {
    /// Every request reserves the same `slots`: the model's context (`max_position_embeddings`),
    /// as [`ContiguousKvCache::for_max_len`](crate::ContiguousKvCache::for_max_len) does, or a
    /// smaller configured `max_model_len` (then sample the workload with that `max_len`).
    Fixed(usize),
    /// `prompt_len + max_tokens`, where the client's `max_tokens` is its `output_len` rounded up
    /// to a power of two (a client that knows the answer's order of magnitude), capped so the
    /// reservation never exceeds `max_len`. What a system reserving up to `max_tokens` wastes.
    PromptPlusPow2MaxTokens { max_len: usize },
    /// `prompt_len + output_len`: an oracle that knows every output length in advance. Its
    /// lifetime utilisation is 1; its time-weighted utilisation is not, since slots wait
    /// reserved for tokens not yet generated.
    Exact,
}

impl Reservation {
    /// Token slots reserved for `request` under this policy.
    pub fn slots_for(&self, request: RequestLengths) -> usize {
        match *self {
            Reservation::Fixed(slots) => slots,
            Reservation::PromptPlusPow2MaxTokens { max_len } => {
                let max_tokens = request
                    .output_len
                    .checked_next_power_of_two()
                    .unwrap_or(usize::MAX);
                request.prompt_len.saturating_add(max_tokens).min(max_len)
            }
            Reservation::Exact => request.total(),
        }
    }
}

/// Bytes of KV cache one token occupies: `2 (K and V) × layers × kv_heads × head_dim × dtype_bytes`.
/// `dtype_bytes` is 4 for chapter 2's f32 cache, 2 for bf16/f16. Saturates rather than overflows.
pub fn bytes_per_token(config: &LlamaConfig, dtype_bytes: usize) -> u64 {
    [
        2,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        dtype_bytes,
    ]
    .iter()
    .fold(1u64, |acc, &x| acc.saturating_mul(x as u64))
}

/// How many requests, each reserving `slots_per_request` token slots contiguously, fit in
/// `budget_bytes` of KV memory: `⌊budget / (bytes_per_token × slots)⌋`. `None` when a request
/// would need no memory at all (either factor is 0), as then there is no limit to state.
pub fn contiguous_requests_that_fit(
    budget_bytes: u64,
    bytes_per_token: u64,
    slots_per_request: usize,
) -> Option<u64> {
    let per_request = u128::from(bytes_per_token) * slots_per_request as u128;
    (u128::from(budget_bytes).checked_div(per_request)).map(|n| n as u64) // n <= budget: fits
}

// ───────────────────────────── utilisation ─────────────────────────────

/// How much of a contiguous reservation a workload uses, lifetime and time-weighted.
///
/// Units: `*_slots` are token slots (multiply by [`bytes_per_token`] for bytes); `*_slot_steps`
/// are token slots × engine steps. Invariants: `used_slots <= reserved_slots`;
/// `holding + future + fragmentation == reserved_slot_steps`; every share is in `[0, 1]`, and the
/// utilisations are > 0. Sums are exact for lengths below 2³² and fewer than 2³² requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContiguousUtilisation {
    pub requests: usize,
    /// `Σ reservation`.
    pub reserved_slots: u64,
    /// `Σ (prompt_len + output_len)`: slots that ever hold a token.
    pub used_slots: u64,
    /// `Σ reservation × output_len`: each reservation lives `output_len` steps.
    pub reserved_slot_steps: u128,
    /// `Σ_k (prompt_len + k)` for `k = 1..=output_len`: slot-steps holding a token.
    pub holding_slot_steps: u128,
    /// `Σ output_len × (output_len - 1) / 2`: slot-steps kept for the request's own future tokens.
    pub future_slot_steps: u128,
    /// `Σ (reservation - prompt_len - output_len) × output_len`: slot-steps of slots never used.
    pub fragmentation_slot_steps: u128,
}

// ANCHOR: utilisation
impl ContiguousUtilisation {
    /// Measures `requests` under `reservation`. Errors on an empty list, on a request with a zero
    /// length, and on a request longer than its reservation (a system would have rejected or
    /// truncated it; sample the workload with the `max_len` the system serves).
    pub fn measure(
        requests: &[RequestLengths],
        reservation: Reservation,
    ) -> Result<Self, WorkloadError> {
        if requests.is_empty() {
            return Err(WorkloadError::EmptyWorkload);
        }
        let mut m = ContiguousUtilisation {
            requests: requests.len(),
            reserved_slots: 0,
            used_slots: 0,
            reserved_slot_steps: 0,
            holding_slot_steps: 0,
            future_slot_steps: 0,
            fragmentation_slot_steps: 0,
        };
        for (index, &r) in requests.iter().enumerate() {
            let (p, o) = (r.prompt_len, r.output_len);
            if p == 0 || o == 0 {
                return Err(WorkloadError::EmptyRequest {
                    index,
                    prompt_len: p,
                    output_len: o,
                });
            }
            let reserved = reservation.slots_for(r);
            if p as u128 + o as u128 > reserved as u128 {
                return Err(WorkloadError::DoesNotFit {
                    index,
                    needed: r.total(),
                    reserved,
                });
            }
            // Lifetime: of `reserved` slots, `p + o` are ever written.
            m.reserved_slots += reserved as u64;
            m.used_slots += r.total() as u64;
            // Over the request's `o` steps: after step k, `p + k` slots hold tokens, `o - k`
            // wait for this request's later tokens, `reserved - p - o` will never be written.
            let (p, o, reserved) = (p as u128, o as u128, reserved as u128);
            m.reserved_slot_steps += reserved * o;
            m.holding_slot_steps += o * p + o * (o + 1) / 2;
            m.future_slot_steps += o * (o - 1) / 2;
            m.fragmentation_slot_steps += (reserved - p - o) * o;
        }
        Ok(m)
    }

    /// Share of reserved slots that ever hold a token: `used / reserved`, in `(0, 1]`.
    pub fn utilisation(&self) -> f64 {
        self.used_slots as f64 / self.reserved_slots as f64
    }

    /// Share of reserved slots never written (internal fragmentation, lifetime view): `1 - utilisation`.
    pub fn wasted(&self) -> f64 {
        (self.reserved_slots - self.used_slots) as f64 / self.reserved_slots as f64
    }

    /// Share of reserved slot-steps holding a token: what a snapshot of KV memory sees, averaged
    /// over time. In `(0, 1]`; compare with the paper's 20.4%–38.2%.
    pub fn time_weighted_utilisation(&self) -> f64 {
        self.holding_slot_steps as f64 / self.reserved_slot_steps as f64
    }

    /// Share of reserved slot-steps waiting for the request's own future tokens ("reserved").
    pub fn time_weighted_future(&self) -> f64 {
        self.future_slot_steps as f64 / self.reserved_slot_steps as f64
    }

    /// Share of reserved slot-steps in slots that are never written ("internal fragmentation").
    pub fn time_weighted_fragmentation(&self) -> f64 {
        self.fragmentation_slot_steps as f64 / self.reserved_slot_steps as f64
    }
}
// ANCHOR_END: utilisation
