//! The request stream of `kiln bench ch04`: Poisson arrivals, chapter 2's long-tailed
//! (ShareGPT-like) lengths scaled down to what two CPU cores serve in minutes, and prompts cut
//! from real text.

use std::time::Duration;

use super::static_batch::Arrival;
use ch02::workload::{LogNormal, LogNormalLengths, RequestLengths, WorkloadRng};
use ch04::Request;

/// Arrival times of `n` requests from a Poisson process of `rate` requests per second:
/// exponential gaps of mean `1 / rate`, by inversion (`-ln u / rate`). Times count from the
/// first arrival, which is at 0. The same `(n, rate, seed)` always gives the same times.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<Duration> {
    assert!(rate > 0.0 && rate.is_finite(), "rate must be > 0");
    let mut rng = WorkloadRng::new(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += -rng.uniform_open0().ln() / rate;
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// Chapter 2's ShareGPT-like lengths with both medians multiplied by `scale` (the shapes, the
/// sigmas, stay), each length then clipped to `max_prompt` and `max_output`.
#[derive(Debug, Clone, Copy)]
pub struct ScaledLengths {
    pub scale: f64,
    pub max_prompt: usize,
    pub max_output: usize,
}

impl ScaledLengths {
    pub fn prompt(&self) -> LogNormal {
        let p = LogNormalLengths::SHAREGPT_PROMPT;
        LogNormal::new(p.median() * self.scale, p.sigma()).expect("scale > 0")
    }

    pub fn output(&self) -> LogNormal {
        let o = LogNormalLengths::SHAREGPT_OUTPUT;
        LogNormal::new(o.median() * self.scale, o.sigma()).expect("scale > 0")
    }

    /// `n` requests' lengths from `seed`.
    pub fn sample(&self, n: usize, seed: u64) -> Vec<RequestLengths> {
        LogNormalLengths::new(
            self.prompt(),
            self.output(),
            self.max_prompt + self.max_output,
        )
        .expect("max_len >= 2")
        .sample(n, seed)
        .into_iter()
        .map(|r| RequestLengths {
            prompt_len: r.prompt_len.min(self.max_prompt),
            output_len: r.output_len.min(self.max_output),
        })
        .collect()
    }
}

/// A prompt of `len` tokens: a window of `corpus` starting at a seeded random offset.
pub fn window(corpus: &[u32], len: usize, rng: &mut WorkloadRng) -> Vec<u32> {
    assert!(len <= corpus.len(), "the corpus is shorter than a prompt");
    let start = (rng.next_u64() % (corpus.len() - len + 1) as u64) as usize;
    corpus[start..start + len].to_vec()
}

/// A greedy request that generates exactly `output_len` tokens (`ignore_eos`, as serving
/// benchmarks do, so that every engine does the same work).
pub fn fixed_length(prompt: Vec<u32>, output_len: usize) -> Request {
    let mut request = Request::greedy(prompt, output_len);
    request.ignore_eos = true;
    request
}

/// `requests` prompts of `prompt` tokens (corpus windows from `seed`), each generating exactly
/// `output` tokens, all arriving at time 0.
pub fn at_once(
    corpus: &[u32],
    requests: usize,
    prompt: usize,
    output: usize,
    seed: u64,
) -> Vec<Arrival> {
    let mut rng = WorkloadRng::new(seed);
    (0..requests)
        .map(|_| Arrival {
            at: Duration::ZERO,
            request: fixed_length(window(corpus, prompt, &mut rng), output),
        })
        .collect()
}

/// The whole workload: lengths, Poisson arrival times and corpus windows, all from `seed`.
pub fn arrivals(lengths: &[RequestLengths], rate: f64, corpus: &[u32], seed: u64) -> Vec<Arrival> {
    let times = poisson_arrivals(lengths.len(), rate, seed);
    let mut rng = WorkloadRng::new(seed ^ 0x5eed);
    lengths
        .iter()
        .zip(times)
        .map(|(l, at)| Arrival {
            at,
            request: fixed_length(window(corpus, l.prompt_len, &mut rng), l.output_len),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_arrivals_are_deterministic_and_have_the_right_rate() {
        let a = poisson_arrivals(10_000, 4.0, 7);
        assert_eq!(a, poisson_arrivals(10_000, 4.0, 7));
        assert_ne!(a, poisson_arrivals(10_000, 4.0, 8));
        assert_eq!(a[..100], poisson_arrivals(100, 4.0, 7)[..]);
        assert_eq!(a[0], Duration::ZERO);
        assert!(a.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = a[a.len() - 1].as_secs_f64() / (a.len() - 1) as f64;
        assert!((mean_gap - 0.25).abs() < 0.01, "mean gap {mean_gap}");
        // Exponential gaps: about e^-1 of them exceed the mean.
        let long = a
            .windows(2)
            .filter(|w| (w[1] - w[0]).as_secs_f64() > 0.25)
            .count();
        let share = long as f64 / (a.len() - 1) as f64;
        assert!((share - (-1f64).exp()).abs() < 0.02, "share {share}");
    }

    #[test]
    fn scaled_lengths_are_clipped_and_long_tailed() {
        let lengths = ScaledLengths {
            scale: 0.25,
            max_prompt: 256,
            max_output: 128,
        };
        let sample = lengths.sample(2000, 0);
        assert_eq!(sample.len(), 2000);
        assert!(sample.iter().all(|r| (1..=256).contains(&r.prompt_len)));
        assert!(sample.iter().all(|r| (1..=128).contains(&r.output_len)));
        let mut outputs: Vec<usize> = sample.iter().map(|r| r.output_len).collect();
        outputs.sort_unstable();
        let median = outputs[outputs.len() / 2] as f64;
        assert!((median - 56.25).abs() < 6.0, "median {median}");
        assert!(outputs.contains(&128) && outputs[0] < 10, "long-tailed");
    }

    #[test]
    fn windows_are_inside_the_corpus() {
        let corpus: Vec<u32> = (0..100).collect();
        let mut rng = WorkloadRng::new(1);
        for len in [1, 50, 100] {
            let w = window(&corpus, len, &mut rng);
            assert_eq!(w.len(), len);
            assert!(w.windows(2).all(|p| p[1] == p[0] + 1));
        }
    }
}
