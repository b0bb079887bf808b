//! kiln's prefill and decode speed on one sequence, and the per-token latency against the
//! sequence length with and without the cache.

use std::time::{Duration, Instant};

use ch01::Llama;
use ch02::awake::awake;
use ch02::{CachedSession, ContiguousKvCache};

use super::machine::ReadProbe;

/// Prefill and decode rates of one configuration.
#[derive(Debug, Clone, Copy)]
pub struct Speed {
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// GB/s of a read probe taken right before and right after the decode (the mean of the
    /// two; for kiln, the median over the repetitions), where one was: the bandwidth the
    /// machine gave while it decoded.
    pub read_gb_s_at_decode: Option<f64>,
}

/// A cache of `capacity` positions whose memory is backed before any clock starts
/// ([`ContiguousKvCache::populate`]), as llama.cpp makes and clears its KV buffers before its
/// benchmarks' timers.
fn backed_cache(model: &Llama, capacity: usize) -> ContiguousKvCache {
    let mut cache = ContiguousKvCache::new(&model.config, capacity);
    cache.populate();
    cache
}

/// Median over `reps` runs of: prefill `tokens[..prompt]` into a fresh cache, then decode the
/// next `decode` tokens one by one (fed, not sampled: the cost is the same).
pub fn measure(model: &Llama, tokens: &[u32], prompt: usize, decode: usize, reps: usize) -> Speed {
    measure_around(model, tokens, prompt, decode, reps, None)
}

/// [`measure`], with `probe` (if given) taken right before and right after each repetition's
/// decode.
pub fn measure_around(
    model: &Llama,
    tokens: &[u32],
    prompt: usize,
    decode: usize,
    reps: usize,
    probe: Option<&ReadProbe>,
) -> Speed {
    let mut prefill = Vec::new();
    let mut decode_times = Vec::new();
    let mut read_gb_s = Vec::new();
    for _ in 0..reps.max(1) {
        let mut session = CachedSession::new(model, backed_cache(model, prompt + decode));
        // As `kiln`'s engine runs each step: the pool's other threads spinning (`awake`).
        let start = Instant::now();
        awake(|| {
            session
                .prefill(&tokens[..prompt])
                .expect("benchmark tokens are valid");
        });
        prefill.push(start.elapsed());
        let mut decode_all = || {
            let start = Instant::now();
            awake(|| {
                for &token in &tokens[prompt..prompt + decode] {
                    session
                        .decode(token)
                        .expect("benchmark tokens fit the cache");
                }
            });
            start.elapsed()
        };
        match probe {
            Some(probe) => {
                let (took, gb_s) = probe.around(decode_all);
                decode_times.push(took);
                read_gb_s.push(gb_s);
            }
            None => decode_times.push(decode_all()),
        }
    }
    read_gb_s.sort_by(f64::total_cmp);
    Speed {
        prefill_tok_s: prompt as f64 / median(prefill).as_secs_f64(),
        decode_tok_s: decode as f64 / median(decode_times).as_secs_f64(),
        read_gb_s_at_decode: read_gb_s.get(read_gb_s.len() / 2).copied(),
    }
}

/// Seconds of a prefill of `len` tokens into a fresh cache, median of `reps`.
pub fn prefill_seconds(model: &Llama, tokens: &[u32], len: usize, reps: usize) -> f64 {
    let times = (0..=reps.max(1)) // the first run is a warm-up
        .map(|_| {
            let mut session = CachedSession::new(model, backed_cache(model, len));
            let start = Instant::now();
            awake(|| {
                session
                    .prefill(&tokens[..len])
                    .expect("benchmark tokens are valid");
            });
            start.elapsed()
        })
        .skip(1)
        .collect();
    median(times).as_secs_f64()
}

/// The cost of the token at position `T`, for each `T` in `lengths` (ascending).
pub struct LatencyRow {
    pub len: usize,
    /// Chapter 1: `forward(tokens[..T])` with dense ndarray projections.
    pub recompute_dense: Duration,
    /// Chapter 1's recompute, on this chapter's kernels: isolates what the kernels buy.
    pub recompute_fast: Duration,
    /// Chapter 2: one decode step at position `T − 1` against a cache of `T − 1` positions.
    pub cached: Duration,
}

/// Times the three ways of producing the token at each length `T` (a context of `T` positions).
/// The cached decode runs one sequence from position 0 past the longest length and reports, for
/// each `T`, the median of the five steps with contexts `T − 3 ..= T + 1` (fewer at the start).
pub fn latency(
    dense: &Llama,
    fast: &Llama,
    tokens: &[u32],
    lengths: &[usize],
    reps: usize,
) -> Vec<LatencyRow> {
    let longest = *lengths.last().expect("at least one length");
    let mut session = CachedSession::new(fast, backed_cache(fast, longest + 2));
    let mut steps = Vec::with_capacity(longest + 2);
    awake(|| {
        for &token in tokens.iter().take((longest + 2).min(tokens.len())) {
            let start = Instant::now();
            session
                .decode(token)
                .expect("benchmark tokens fit the cache");
            steps.push(start.elapsed()); // steps[p]: the step at position p (context p + 1)
        }
    });
    let recompute = |model: &Llama, len: usize| {
        model.forward(&tokens[..len]).expect("valid tokens"); // warm-up
        let times = (0..reps.max(1))
            .map(|_| {
                let start = Instant::now();
                std::hint::black_box(model.forward(&tokens[..len]).expect("valid tokens"));
                start.elapsed()
            })
            .collect();
        median(times)
    };
    lengths
        .iter()
        .map(|&len| {
            let around = steps[len.saturating_sub(4)..(len + 1).min(steps.len())].to_vec();
            LatencyRow {
                len,
                recompute_dense: recompute(dense, len),
                recompute_fast: recompute(fast, len),
                cached: median(around),
            }
        })
        .collect()
}

/// The middle of `times` (the upper one of an even count).
pub(crate) fn median(mut times: Vec<Duration>) -> Duration {
    times.sort_unstable();
    times[times.len() / 2]
}
