//! Server metrics in the Prometheus text format, named like vLLM's (`vllm:` becomes `kiln:`),
//! so that dashboards written for vLLM work with a prefix change.
//!
//! Three kinds of series, every one labelled `model_name="<served model name>"`:
//!
//! - gauges and cumulative counters that the engine thread reports after each step
//!   ([`EngineGauges`], replaced whole by [`Metrics::set_engine`]);
//! - `kiln:request_success_total{finished_reason=...}`, counted by the HTTP side;
//! - latency histograms (time to first token, inter-token, end to end) with vLLM's bucket
//!   boundaries. Invariants: each bucket count is cumulative (`le` = "less than or equal"), the
//!   `+Inf` bucket equals `_count`, and `_sum` is the sum of the observed values. Values that
//!   are not finite are dropped and negative ones count as 0, so one bad clock reading cannot
//!   turn `_sum` into NaN.
//!
//! Everything sits behind one mutex: an observation is a few adds, far cheaper than the
//! token it measures.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The `Content-Type` of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const INTER_TOKEN_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `vllm:e2e_request_latency_seconds` buckets.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Finish reasons that are always exported, at 0 until they happen (as vLLM does).
const FINISHED_REASONS: [&str; 3] = ["stop", "length", "abort"];

/// What the engine thread reports after each step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineGauges {
    pub running: usize,
    pub waiting: usize,
    pub swapped: usize,
    /// Fraction of KV-cache blocks in use, 0..=1.
    pub kv_cache_usage: f64,
    /// Cumulative, in blocks.
    pub prefix_cache_queries: u64,
    /// Cumulative, in blocks.
    pub prefix_cache_hits: u64,
    /// Cumulative.
    pub preemptions: u64,
    /// Cumulative.
    pub prompt_tokens: u64,
    /// Cumulative.
    pub generation_tokens: u64,
    /// Cumulative, speculative decoding (chapter 6): verifications of a sequence's drafts,
    /// draft tokens verified, draft tokens accepted.
    pub spec_decode_num_drafts: u64,
    pub spec_decode_num_draft_tokens: u64,
    pub spec_decode_num_accepted_tokens: u64,
}

/// A histogram with fixed upper bounds.
#[derive(Debug, Clone)]
struct Histogram {
    /// Ascending upper bounds (inclusive), without +Inf.
    bounds: &'static [f64],
    /// `counts[i]`: observations in (bounds[i-1], bounds[i]]; the last one is above every bound.
    /// Not cumulative here; [`Histogram::render`] accumulates.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
        }
    }

    fn observe(&mut self, value: f64) {
        if !value.is_finite() {
            return;
        }
        let value = value.max(0.0);
        let bucket = self.bounds.partition_point(|&bound| bound < value);
        self.counts[bucket] += 1;
        self.sum += value;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        header(out, name, help, "histogram");
        let mut cumulative = 0;
        let les = self.bounds.iter().map(|&b| fmt_float(b));
        for (le, count) in les.chain(["+Inf".to_string()]).zip(&self.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", fmt_float(self.sum));
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

// ANCHOR: histogram_snapshot
/// One histogram as `/metrics` renders it, for JSON readers (chapter 8's dashboard): the same
/// numbers, taken under the same lock.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct HistogramSnapshot {
    /// Ascending upper bounds (inclusive), without +Inf.
    pub bounds: Vec<f64>,
    /// Cumulative counts, one per bound and one more for +Inf: `_bucket{le=...}`.
    pub cumulative: Vec<u64>,
    /// `_sum`, in seconds.
    pub sum: f64,
    /// `_count` (equal to the +Inf bucket).
    pub count: u64,
}
// ANCHOR_END: histogram_snapshot

/// The handlers' series, all at one instant.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LatencySnapshot {
    /// `kiln:time_to_first_token_seconds`.
    pub ttft: HistogramSnapshot,
    /// `kiln:inter_token_latency_seconds` (time per output token).
    pub inter_token: HistogramSnapshot,
    /// `kiln:e2e_request_latency_seconds`.
    pub e2e: HistogramSnapshot,
    /// `kiln:request_success_total`, by `finished_reason`.
    pub finished: BTreeMap<String, u64>,
}

impl Histogram {
    fn snapshot(&self) -> HistogramSnapshot {
        let cumulative: Vec<u64> = self
            .counts
            .iter()
            .scan(0, |total, &c| {
                *total += c;
                Some(*total)
            })
            .collect();
        HistogramSnapshot {
            bounds: self.bounds.to_vec(),
            count: cumulative.last().copied().unwrap_or(0),
            cumulative,
            sum: self.sum,
        }
    }
}

#[derive(Debug)]
struct State {
    ttft: Histogram,
    inter_token: Histogram,
    e2e: Histogram,
    /// finished_reason -> count.
    finished: BTreeMap<String, u64>,
    engine: EngineGauges,
}

/// One server's metrics. Shared by the HTTP handlers and the engine thread.
#[derive(Debug)]
pub struct Metrics {
    /// `model_name="..."`, escaped, ready to put between braces.
    labels: String,
    state: Mutex<State>,
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        let finished = FINISHED_REASONS
            .iter()
            .map(|r| (r.to_string(), 0))
            .collect();
        Metrics {
            labels: format!("model_name=\"{}\"", escape_label(model_name)),
            state: Mutex::new(State {
                ttft: Histogram::new(TTFT_BUCKETS),
                inter_token: Histogram::new(INTER_TOKEN_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
                finished,
                engine: EngineGauges::default(),
            }),
        }
    }

    /// The state; a panic elsewhere while holding the lock leaves plain numbers behind, which
    /// are still valid, so a poisoned lock is used as is.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `kiln:time_to_first_token_seconds`.
    pub fn observe_ttft(&self, seconds: f64) {
        self.state().ttft.observe(seconds);
    }

    /// `kiln:inter_token_latency_seconds`.
    pub fn observe_inter_token(&self, seconds: f64) {
        self.state().inter_token.observe(seconds);
    }

    /// `kiln:e2e_request_latency_seconds`.
    pub fn observe_e2e(&self, seconds: f64) {
        self.state().e2e.observe(seconds);
    }

    /// Counts a finished request in `kiln:request_success_total{finished_reason=...}`
    /// ("stop", "length" or "abort"; another reason gets its own series).
    pub fn request_finished(&self, finished_reason: &str) {
        *self
            .state()
            .finished
            .entry(finished_reason.to_string())
            .or_insert(0) += 1;
    }

    /// Replaces the engine's gauges and counters (called by the engine thread after each step).
    pub fn set_engine(&self, engine: EngineGauges) {
        self.state().engine = engine;
    }

    /// The last values given to [`Metrics::set_engine`].
    pub fn engine(&self) -> EngineGauges {
        self.state().engine
    }

    /// The latency histograms and finish counts, as [`Metrics::render`] would write them now.
    pub fn latency(&self) -> LatencySnapshot {
        let state = self.state();
        LatencySnapshot {
            ttft: state.ttft.snapshot(),
            inter_token: state.inter_token.snapshot(),
            e2e: state.e2e.snapshot(),
            finished: state.finished.clone(),
        }
    }

    /// All series in the Prometheus text exposition format (see [`CONTENT_TYPE`]).
    pub fn render(&self) -> String {
        let state = self.state();
        let labels = &self.labels;
        let e = &state.engine;
        let mut out = String::new();

        let gauges: [(&str, &str, String); 4] = [
            (
                "kiln:num_requests_running",
                "Number of requests in model execution batches.",
                e.running.to_string(),
            ),
            (
                "kiln:num_requests_waiting",
                "Number of requests waiting to be processed.",
                e.waiting.to_string(),
            ),
            (
                "kiln:num_requests_swapped",
                "Number of requests swapped to CPU.",
                e.swapped.to_string(),
            ),
            (
                "kiln:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                fmt_float(e.kv_cache_usage),
            ),
        ];
        for (name, help, value) in gauges {
            header(&mut out, name, help, "gauge");
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }

        let counters = [
            (
                "kiln:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried blocks.",
                e.prefix_cache_queries,
            ),
            (
                "kiln:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached blocks.",
                e.prefix_cache_hits,
            ),
            (
                "kiln:num_preemptions_total",
                "Cumulative number of preemptions from the engine.",
                e.preemptions,
            ),
            (
                "kiln:prompt_tokens_total",
                "Number of prefill tokens processed.",
                e.prompt_tokens,
            ),
            (
                "kiln:generation_tokens_total",
                "Number of generation tokens processed.",
                e.generation_tokens,
            ),
            (
                "kiln:spec_decode_num_drafts_total",
                "Number of spec decoding drafts.",
                e.spec_decode_num_drafts,
            ),
            (
                "kiln:spec_decode_num_draft_tokens_total",
                "Number of draft tokens.",
                e.spec_decode_num_draft_tokens,
            ),
            (
                "kiln:spec_decode_num_accepted_tokens_total",
                "Number of accepted tokens.",
                e.spec_decode_num_accepted_tokens,
            ),
        ];
        for (name, help, value) in counters {
            header(&mut out, name, help, "counter");
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }

        let name = "kiln:request_success_total";
        header(
            &mut out,
            name,
            "Count of successfully processed requests.",
            "counter",
        );
        for (reason, count) in &state.finished {
            let reason = escape_label(reason);
            let _ = writeln!(
                out,
                "{name}{{{labels},finished_reason=\"{reason}\"}} {count}"
            );
        }

        let histograms = [
            (
                "kiln:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                &state.ttft,
            ),
            (
                "kiln:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                &state.inter_token,
            ),
            (
                "kiln:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                &state.e2e,
            ),
        ];
        for (name, help, histogram) in histograms {
            histogram.render(&mut out, name, help, labels);
        }
        out
    }
}

/// The `# HELP` and `# TYPE` lines of a metric family.
fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A label value with `\`, `"` and newline escaped, as the text format requires.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A float as Prometheus (Go's `ParseFloat`) reads it, written like Python's client does:
/// `+Inf`, `-Inf`, `NaN`, whole numbers with `.0` (so `le="1.0"` matches vLLM's), otherwise
/// the shortest decimal that round-trips.
fn fmt_float(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_string()
    } else if value == f64::INFINITY {
        "+Inf".to_string()
    } else if value == f64::NEG_INFINITY {
        "-Inf".to_string()
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.1}")
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sample line: `name{labels} value`.
    #[derive(Debug)]
    struct Sample {
        name: String,
        labels: BTreeMap<String, String>,
        value: f64,
    }

    /// Parses the text format strictly enough to catch mistakes: every metric line must have
    /// a `# TYPE` before it, label values must be quoted and escaped, values must parse as
    /// Prometheus floats.
    fn parse(text: &str) -> (Vec<Sample>, BTreeMap<String, String>) {
        let mut samples = Vec::new();
        let mut types = BTreeMap::new();
        let mut helped = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                helped.push(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert_eq!(
                    helped.last().map(String::as_str),
                    Some(name),
                    "HELP before TYPE"
                );
                types.insert(name.to_string(), kind.to_string());
                continue;
            }
            assert!(!line.starts_with('#'), "unexpected comment {line:?}");
            let (name, rest) = line.split_at(line.find('{').expect("labels"));
            let mut labels = BTreeMap::new();
            let mut chars = rest[1..].chars();
            loop {
                let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                assert_eq!(chars.next(), Some('"'), "{line}");
                let mut value = String::new();
                loop {
                    match chars.next().expect("unterminated label value") {
                        '"' => break,
                        '\\' => match chars.next() {
                            Some('n') => value.push('\n'),
                            Some(c @ ('\\' | '"')) => value.push(c),
                            other => panic!("bad escape {other:?} in {line}"),
                        },
                        c => value.push(c),
                    }
                }
                labels.insert(key, value);
                match chars.next() {
                    Some(',') => continue,
                    Some('}') => break,
                    other => panic!("unexpected {other:?} in {line}"),
                }
            }
            let value = chars
                .as_str()
                .strip_prefix(' ')
                .expect("space before value");
            let value = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
            };
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| types.contains_key(*f)))
                .unwrap_or(name);
            assert!(types.contains_key(family), "no TYPE for {name}");
            samples.push(Sample {
                name: name.to_string(),
                labels,
                value,
            });
        }
        (samples, types)
    }

    fn find<'a>(samples: &'a [Sample], name: &str) -> Vec<&'a Sample> {
        samples.iter().filter(|s| s.name == name).collect()
    }

    fn value(samples: &[Sample], name: &str) -> f64 {
        let found = find(samples, name);
        assert_eq!(found.len(), 1, "{name}");
        found[0].value
    }

    #[test]
    fn renders_every_family_with_help_type_and_model_label() {
        let m = Metrics::new("shakespeare");
        let (samples, types) = parse(&m.render());
        let expected = [
            ("kiln:num_requests_running", "gauge"),
            ("kiln:num_requests_waiting", "gauge"),
            ("kiln:num_requests_swapped", "gauge"),
            ("kiln:kv_cache_usage_perc", "gauge"),
            ("kiln:prefix_cache_queries_total", "counter"),
            ("kiln:prefix_cache_hits_total", "counter"),
            ("kiln:num_preemptions_total", "counter"),
            ("kiln:prompt_tokens_total", "counter"),
            ("kiln:generation_tokens_total", "counter"),
            ("kiln:spec_decode_num_drafts_total", "counter"),
            ("kiln:spec_decode_num_draft_tokens_total", "counter"),
            ("kiln:spec_decode_num_accepted_tokens_total", "counter"),
            ("kiln:request_success_total", "counter"),
            ("kiln:time_to_first_token_seconds", "histogram"),
            ("kiln:inter_token_latency_seconds", "histogram"),
            ("kiln:e2e_request_latency_seconds", "histogram"),
        ];
        assert_eq!(types.len(), expected.len());
        for (name, kind) in expected {
            assert_eq!(types.get(name).map(String::as_str), Some(kind), "{name}");
        }
        for s in &samples {
            assert_eq!(s.labels["model_name"], "shakespeare", "{}", s.name);
        }
        // The three usual finish reasons exist from the start, at zero.
        let reasons: Vec<_> = find(&samples, "kiln:request_success_total")
            .iter()
            .map(|s| (s.labels["finished_reason"].clone(), s.value))
            .collect();
        assert_eq!(
            reasons,
            [
                ("abort".into(), 0.0),
                ("length".into(), 0.0),
                ("stop".into(), 0.0)
            ]
        );
    }

    #[test]
    fn engine_gauges_are_exported_as_given() {
        let m = Metrics::new("m");
        let gauges = EngineGauges {
            running: 3,
            waiting: 7,
            swapped: 1,
            kv_cache_usage: 0.625,
            prefix_cache_queries: 40,
            prefix_cache_hits: 25,
            preemptions: 2,
            prompt_tokens: 1234,
            generation_tokens: 5678,
            spec_decode_num_drafts: 11,
            spec_decode_num_draft_tokens: 44,
            spec_decode_num_accepted_tokens: 30,
        };
        m.set_engine(gauges);
        assert_eq!(m.engine(), gauges);
        let (samples, _) = parse(&m.render());
        for (name, expected) in [
            ("kiln:num_requests_running", 3.0),
            ("kiln:num_requests_waiting", 7.0),
            ("kiln:num_requests_swapped", 1.0),
            ("kiln:kv_cache_usage_perc", 0.625),
            ("kiln:prefix_cache_queries_total", 40.0),
            ("kiln:prefix_cache_hits_total", 25.0),
            ("kiln:num_preemptions_total", 2.0),
            ("kiln:prompt_tokens_total", 1234.0),
            ("kiln:generation_tokens_total", 5678.0),
            ("kiln:spec_decode_num_drafts_total", 11.0),
            ("kiln:spec_decode_num_draft_tokens_total", 44.0),
            ("kiln:spec_decode_num_accepted_tokens_total", 30.0),
        ] {
            assert_eq!(value(&samples, name), expected, "{name}");
        }
    }

    #[test]
    fn finished_requests_are_counted_by_reason() {
        let m = Metrics::new("m");
        for reason in ["stop", "stop", "length", "abort", "stop", "tool_calls"] {
            m.request_finished(reason);
        }
        let (samples, _) = parse(&m.render());
        let count = |reason: &str| {
            find(&samples, "kiln:request_success_total")
                .iter()
                .find(|s| s.labels["finished_reason"] == reason)
                .map(|s| s.value)
        };
        assert_eq!(count("stop"), Some(3.0));
        assert_eq!(count("length"), Some(1.0));
        assert_eq!(count("abort"), Some(1.0));
        assert_eq!(count("tool_calls"), Some(1.0));
    }

    /// Checks one histogram family: bounds, cumulative monotone buckets, +Inf == _count,
    /// _sum; returns the bucket counts.
    fn check_histogram(samples: &[Sample], name: &str, bounds: &[f64], sum: f64) -> Vec<f64> {
        let buckets = find(samples, &format!("{name}_bucket"));
        assert_eq!(buckets.len(), bounds.len() + 1, "{name}");
        let les: Vec<_> = buckets.iter().map(|s| s.labels["le"].as_str()).collect();
        assert_eq!(les.last(), Some(&"+Inf"));
        for (le, bound) in les.iter().zip(bounds) {
            assert_eq!(le.parse::<f64>().unwrap(), *bound, "{name}");
        }
        let counts: Vec<f64> = buckets.iter().map(|s| s.value).collect();
        assert!(
            counts.windows(2).all(|w| w[0] <= w[1]),
            "{name}: {counts:?}"
        );
        assert_eq!(
            value(samples, &format!("{name}_count")),
            counts[counts.len() - 1]
        );
        let got = value(samples, &format!("{name}_sum"));
        assert!((got - sum).abs() < 1e-9, "{name}: sum {got} != {sum}");
        counts
    }

    #[test]
    fn histograms_are_cumulative_and_consistent() {
        let m = Metrics::new("m");
        let ttft = [0.0005, 0.001, 0.003, 0.2, 3.0, 5000.0];
        for v in ttft {
            m.observe_ttft(v);
        }
        let itl = [0.02, 0.02, 0.5];
        for v in itl {
            m.observe_inter_token(v);
        }
        m.observe_e2e(1.2);
        let (samples, _) = parse(&m.render());

        let ttft_counts = check_histogram(
            &samples,
            "kiln:time_to_first_token_seconds",
            TTFT_BUCKETS,
            ttft.iter().sum(),
        );
        // le is inclusive: 0.001 lands in the first bucket; 5000 only in +Inf.
        assert_eq!(ttft_counts[0], 2.0); // le="0.001"
        assert_eq!(ttft_counts[1], 3.0); // le="0.005"
        assert_eq!(ttft_counts[TTFT_BUCKETS.len() - 1], 5.0); // le="2560.0"
        assert_eq!(ttft_counts[TTFT_BUCKETS.len()], 6.0); // le="+Inf"

        let itl_counts = check_histogram(
            &samples,
            "kiln:inter_token_latency_seconds",
            INTER_TOKEN_BUCKETS,
            itl.iter().sum(),
        );
        assert_eq!(itl_counts[0], 0.0); // le="0.01"
        assert_eq!(itl_counts[1], 2.0); // le="0.025"
        assert_eq!(itl_counts[9], 3.0); // le="0.5"

        let e2e_counts = check_histogram(
            &samples,
            "kiln:e2e_request_latency_seconds",
            E2E_BUCKETS,
            1.2,
        );
        assert_eq!(e2e_counts[3], 0.0); // le="1.0"
        assert_eq!(e2e_counts[4], 1.0); // le="1.5"
    }

    #[test]
    fn latency_snapshot_has_the_rendered_numbers() {
        let m = Metrics::new("m");
        for v in [0.0005, 0.003, 0.2, 5000.0] {
            m.observe_ttft(v);
        }
        m.observe_inter_token(0.02);
        m.request_finished("length");
        let snapshot = m.latency();
        let (samples, _) = parse(&m.render());
        let rendered = check_histogram(
            &samples,
            "kiln:time_to_first_token_seconds",
            TTFT_BUCKETS,
            snapshot.ttft.sum,
        );
        let cumulative: Vec<f64> = snapshot.ttft.cumulative.iter().map(|&c| c as f64).collect();
        assert_eq!(cumulative, rendered);
        assert_eq!(snapshot.ttft.bounds, TTFT_BUCKETS);
        assert_eq!(snapshot.ttft.count, 4);
        assert_eq!(snapshot.inter_token.count, 1);
        assert_eq!(snapshot.e2e.count, 0);
        assert_eq!(snapshot.finished["length"], 1);
        assert_eq!(snapshot.finished["stop"], 0);
    }

    #[test]
    fn bad_observations_do_not_poison_the_sum() {
        let m = Metrics::new("m");
        m.observe_e2e(f64::NAN);
        m.observe_e2e(f64::INFINITY);
        m.observe_e2e(-1.0);
        m.observe_e2e(2.0);
        let (samples, _) = parse(&m.render());
        let counts = check_histogram(
            &samples,
            "kiln:e2e_request_latency_seconds",
            E2E_BUCKETS,
            2.0,
        );
        assert_eq!(counts[0], 1.0); // the negative one, as 0
        assert_eq!(counts[counts.len() - 1], 2.0);
    }

    #[test]
    fn bucket_bounds_are_written_like_vllm() {
        let text = Metrics::new("m").render();
        assert!(
            text.contains(
                r#"kiln:time_to_first_token_seconds_bucket{model_name="m",le="0.001"} 0"#
            )
        );
        assert!(
            text.contains(r#"kiln:time_to_first_token_seconds_bucket{model_name="m",le="1.0"} 0"#)
        );
        assert!(
            text.contains(r#"kiln:e2e_request_latency_seconds_bucket{model_name="m",le="+Inf"} 0"#)
        );
        assert_eq!(fmt_float(2560.0), "2560.0");
        assert_eq!(fmt_float(0.075), "0.075");
        assert_eq!(fmt_float(f64::INFINITY), "+Inf");
        assert_eq!(fmt_float(f64::NEG_INFINITY), "-Inf");
        assert_eq!(fmt_float(f64::NAN), "NaN");
        assert_eq!(fmt_float(1e-7).parse::<f64>().unwrap(), 1e-7);
        assert_eq!(fmt_float(1e300).parse::<f64>().unwrap(), 1e300);
    }

    #[test]
    fn model_name_label_is_escaped() {
        let name = "we\"ird\\name\nhere";
        let m = Metrics::new(name);
        m.request_finished("sto\"p");
        let text = m.render();
        assert!(text.contains(r#"model_name="we\"ird\\name\nhere""#));
        let (samples, _) = parse(&text);
        assert!(samples.iter().all(|s| s.labels["model_name"] == name));
        assert!(
            samples
                .iter()
                .any(|s| s.labels.get("finished_reason").map(String::as_str) == Some("sto\"p"))
        );
    }

    #[test]
    fn metrics_are_shared_across_threads() {
        let m = std::sync::Arc::new(Metrics::new("m"));
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..100 {
                        m.observe_inter_token(0.01);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let (samples, _) = parse(&m.render());
        assert_eq!(
            value(&samples, "kiln:inter_token_latency_seconds_count"),
            400.0
        );
    }
}
