//! The statistics of `kiln bench serve`, in vLLM's definitions, and the ways they are shown: a
//! result block on stdout, JSON with every request's raw timings, and a sweep's table and plots.
//!
//! ```text
//! TTFT   sent → first chunk with text                              (per request)
//! TPOT   (E2E − TTFT) / (completion_tokens − 1)                    (per request, ≥ 2 tokens)
//! ITL    every gap between two consecutive text chunks             (pooled over requests)
//! E2E    sent → data: [DONE]                                       (per request)
//! throughput = totals of the successful requests / the run's duration (first send → last end)
//! ```
//! Token counts are the server's `usage`; a request without one counts its text chunks.

use serde::Serialize;
use serde_json::{Value, json};

use super::Rate;
use super::client::Timed;
use crate::bench::ch04::serve::percentile;
use crate::bench::svg::LinePlot;
use crate::bench::table::Table;

/// One request of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    pub prompt_words: usize,
    pub max_tokens: usize,
    /// When it was sent, seconds from the start of the run.
    pub sent: f64,
    /// The timings, or why it failed.
    pub result: Result<Timed, String>,
}

impl Timed {
    /// Generated tokens: the server's count, else the text chunks.
    pub fn output_tokens(&self) -> usize {
        self.usage
            .map_or(self.chunk_times.len(), |u| u.completion_tokens)
    }

    pub fn input_tokens(&self) -> usize {
        self.usage.map_or(0, |u| u.prompt_tokens)
    }

    pub fn ttft(&self) -> Option<f64> {
        self.chunk_times.first().copied()
    }

    /// Time per output token after the first: `(e2e − ttft) / (tokens − 1)`.
    pub fn tpot(&self) -> Option<f64> {
        let tokens = self.output_tokens();
        let ttft = self.ttft()?;
        (tokens > 1).then(|| (self.e2e - ttft) / (tokens - 1) as f64)
    }

    /// Gaps between consecutive text chunks.
    pub fn itls(&self) -> Vec<f64> {
        self.chunk_times.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Mean, median and 99th percentile, in milliseconds (NaN, written as null, when empty).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stat {
    pub mean_ms: f64,
    pub median_ms: f64,
    pub p99_ms: f64,
}

impl Stat {
    /// Of values in seconds.
    pub fn of(seconds: &[f64]) -> Self {
        let mean = if seconds.is_empty() {
            f64::NAN
        } else {
            seconds.iter().sum::<f64>() / seconds.len() as f64
        };
        Stat {
            mean_ms: 1e3 * mean,
            median_ms: 1e3 * percentile(seconds, 50.0),
            p99_ms: 1e3 * percentile(seconds, 99.0),
        }
    }
}

/// What one run (one request rate) measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    /// First send → last request's end, seconds.
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    /// Successful requests that had no `usage` chunk (their output counted in chunks).
    pub missing_usage: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stat,
    pub tpot: Stat,
    pub itl: Stat,
    pub e2el: Stat,
}

impl Metrics {
    pub fn of(records: &[RequestRecord], duration_s: f64) -> Self {
        let ok: Vec<&Timed> = records
            .iter()
            .filter_map(|r| r.result.as_ref().ok())
            .collect();
        let input: usize = ok.iter().map(|t| t.input_tokens()).sum();
        let output: usize = ok.iter().map(|t| t.output_tokens()).sum();
        let per_second = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                f64::NAN
            }
        };
        let ttfts: Vec<f64> = ok.iter().filter_map(|t| t.ttft()).collect();
        let tpots: Vec<f64> = ok.iter().filter_map(|t| t.tpot()).collect();
        let itls: Vec<f64> = ok.iter().flat_map(|t| t.itls()).collect();
        let e2es: Vec<f64> = ok.iter().map(|t| t.e2e).collect();
        Metrics {
            completed: ok.len(),
            failed: records.len() - ok.len(),
            duration_s,
            total_input_tokens: input,
            total_output_tokens: output,
            missing_usage: ok.iter().filter(|t| t.usage.is_none()).count(),
            request_throughput: per_second(ok.len() as f64),
            output_throughput: per_second(output as f64),
            total_token_throughput: per_second((input + output) as f64),
            ttft: Stat::of(&ttfts),
            tpot: Stat::of(&tpots),
            itl: Stat::of(&itls),
            e2el: Stat::of(&e2es),
        }
    }
}

/// The result block printed after each run, laid out like `vllm bench serve`'s.
pub fn result_block(rate: Rate, max_concurrency: Option<usize>, m: &Metrics) -> String {
    const WIDTH: usize = 50;
    let mut out = format!("{:=^WIDTH$}\n", " Serving Benchmark Result ");
    let mut line = |key: &str, value: String| out += &format!("{key:<40} {value:>9}\n");
    line("Request rate (req/s):", rate.to_string());
    line(
        "Max concurrency:",
        max_concurrency.map_or("none".to_string(), |c| c.to_string()),
    );
    line("Successful requests:", m.completed.to_string());
    line("Failed requests:", m.failed.to_string());
    line("Benchmark duration (s):", format!("{:.2}", m.duration_s));
    line("Total input tokens:", m.total_input_tokens.to_string());
    line("Total generated tokens:", m.total_output_tokens.to_string());
    line(
        "Request throughput (req/s):",
        format!("{:.2}", m.request_throughput),
    );
    line(
        "Output token throughput (tok/s):",
        format!("{:.2}", m.output_throughput),
    );
    line(
        "Total token throughput (tok/s):",
        format!("{:.2}", m.total_token_throughput),
    );
    for (title, short, stat) in [
        ("Time to First Token", "TTFT", &m.ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", &m.tpot),
        ("Inter-token Latency", "ITL", &m.itl),
        ("End-to-end Latency", "E2EL", &m.e2el),
    ] {
        out += &format!("{:-^WIDTH$}\n", title);
        for (what, value) in [
            ("Mean", stat.mean_ms),
            ("Median", stat.median_ms),
            ("P99", stat.p99_ms),
        ] {
            out += &format!("{:<40} {:>9.2}\n", format!("{what} {short} (ms):"), value);
        }
    }
    out += &"=".repeat(WIDTH);
    out.push('\n');
    out
}

/// The JSON of one run: its configuration, its metrics and every request's raw numbers
/// (seconds; null where a request failed or had no such number).
pub fn run_json(config: &Value, rate: Rate, metrics: &Metrics, records: &[RequestRecord]) -> Value {
    let ok = |r: &RequestRecord| r.result.as_ref().ok().cloned();
    let column = |f: &dyn Fn(&Timed) -> Value| -> Vec<Value> {
        records
            .iter()
            .map(|r| ok(r).map_or(Value::Null, |t| f(&t)))
            .collect()
    };
    let mut config = config.clone();
    config["request_rate"] = match rate {
        Rate::PerSecond(r) => json!(r),
        Rate::Inf => json!("inf"),
    };
    json!({
        "config": config,
        "metrics": metrics,
        "requests": {
            "sent_s": records.iter().map(|r| r.sent).collect::<Vec<_>>(),
            "prompt_words": records.iter().map(|r| r.prompt_words).collect::<Vec<_>>(),
            "max_tokens": records.iter().map(|r| r.max_tokens).collect::<Vec<_>>(),
            "prompt_tokens": column(&|t| t.usage.map_or(Value::Null, |u| json!(u.prompt_tokens))),
            "completion_tokens": column(&|t| json!(t.output_tokens())),
            "output_chars": column(&|t| json!(t.output_chars)),
            "ttft_s": column(&|t| json!(t.ttft())),
            "tpot_s": column(&|t| json!(t.tpot())),
            "itl_s": column(&|t| json!(t.itls())),
            "e2el_s": column(&|t| json!(t.e2e)),
            "errors": records.iter().map(|r| r.result.as_ref().err()).collect::<Vec<_>>(),
        },
    })
}

/// Where each rate sits on a plot's x axis: itself, and `inf` at twice the largest finite
/// rate (at 1 when every rate is `inf`).
pub fn plot_x(rates: &[Rate]) -> Vec<f64> {
    let max_finite = rates
        .iter()
        .filter_map(|r| match r {
            Rate::PerSecond(r) => Some(*r),
            Rate::Inf => None,
        })
        .fold(f64::NAN, f64::max);
    let inf_at = if max_finite.is_nan() {
        1.0
    } else {
        2.0 * max_finite
    };
    rates
        .iter()
        .map(|r| match r {
            Rate::PerSecond(r) => *r,
            Rate::Inf => inf_at,
        })
        .collect()
}

/// A sweep's figures: the markdown table (with `text` and `caption` below it), the
/// throughput plot and the latency plot.
pub fn sweep_figures(
    runs: &[(Rate, Metrics)],
    model: &str,
    text: &str,
    caption: &str,
) -> (String, String, String) {
    let mut table = Table::new([
        "request rate (req/s)",
        "completed",
        "failed",
        "req/s",
        "output tok/s",
        "total tok/s",
        "TTFT p50 (ms)",
        "TTFT p99 (ms)",
        "TPOT p50 (ms)",
        "TPOT p99 (ms)",
        "E2E p99 (s)",
    ]);
    for (rate, m) in runs {
        table.row([
            rate.to_string(),
            m.completed.to_string(),
            m.failed.to_string(),
            format!("{:.2}", m.request_throughput),
            format!("{:.1}", m.output_throughput),
            format!("{:.1}", m.total_token_throughput),
            format!("{:.0}", m.ttft.median_ms),
            format!("{:.0}", m.ttft.p99_ms),
            format!("{:.1}", m.tpot.median_ms),
            format!("{:.1}", m.tpot.p99_ms),
            format!("{:.2}", m.e2el.p99_ms / 1e3),
        ]);
    }
    let markdown = format!("{}\n{text}\n\n{caption}\n", table.to_markdown());

    let rates: Vec<Rate> = runs.iter().map(|(r, _)| *r).collect();
    let xs = plot_x(&rates);
    let points = |f: fn(&Metrics) -> f64| -> Vec<(f64, f64)> {
        xs.iter().zip(runs).map(|(&x, (_, m))| (x, f(m))).collect()
    };
    let throughput = LinePlot::new(format!("Throughput vs request rate, {model}"))
        .x_label("request rate (req/s); inf at the right")
        .y_label("tokens/s")
        .log_x()
        .series("output tok/s", &points(|m| m.output_throughput))
        .series("total tok/s", &points(|m| m.total_token_throughput))
        .to_svg();
    let latency = LinePlot::new(format!("Latency vs request rate, {model}"))
        .x_label("request rate (req/s); inf at the right")
        .y_label("ms")
        .log_x()
        .log_y()
        .series("TTFT p50", &points(|m| m.ttft.median_ms))
        .series("TTFT p99", &points(|m| m.ttft.p99_ms))
        .series("TPOT p50", &points(|m| m.tpot.median_ms))
        .series("TPOT p99", &points(|m| m.tpot.p99_ms))
        .to_svg();
    (markdown, throughput, latency)
}

#[cfg(test)]
mod tests {
    use super::super::client::Usage;
    use super::*;

    fn timed(chunks: &[f64], e2e: f64, tokens: Option<(usize, usize)>) -> Timed {
        Timed {
            chunk_times: chunks.to_vec(),
            e2e,
            usage: tokens.map(|(p, c)| Usage {
                prompt_tokens: p,
                completion_tokens: c,
            }),
            output_chars: 0,
        }
    }

    fn record(result: Result<Timed, String>) -> RequestRecord {
        RequestRecord {
            prompt_words: 10,
            max_tokens: 4,
            sent: 0.0,
            result,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn per_request_ttft_tpot_and_itl() {
        // 4 tokens in 3 chunks (two arrived in one read): TPOT uses the token count, ITL the chunks.
        let t = timed(&[0.1, 0.2, 0.4], 0.45, Some((7, 4)));
        assert_eq!(t.ttft(), Some(0.1));
        assert!(close(t.tpot().unwrap(), (0.45 - 0.1) / 3.0));
        let itls = t.itls();
        assert!(close(itls[0], 0.1) && close(itls[1], 0.2) && itls.len() == 2);
        assert_eq!((t.input_tokens(), t.output_tokens()), (7, 4));
        // One token: no TPOT. No usage: tokens are the chunks.
        assert_eq!(timed(&[0.1], 0.1, Some((7, 1))).tpot(), None);
        let no_usage = timed(&[0.1, 0.3], 0.3, None);
        assert_eq!((no_usage.input_tokens(), no_usage.output_tokens()), (0, 2));
        assert!(close(no_usage.tpot().unwrap(), 0.2));
        // No text at all: no TTFT, no TPOT.
        let empty = timed(&[], 0.2, Some((7, 0)));
        assert_eq!((empty.ttft(), empty.tpot()), (None, None));
    }

    #[test]
    fn run_metrics_from_synthetic_timings() {
        let records = vec![
            record(Ok(timed(&[0.1, 0.2, 0.3], 0.3, Some((10, 3))))),
            record(Ok(timed(&[0.3, 0.5], 0.5, Some((20, 2))))),
            record(Err("HTTP 400: bad".into())),
        ];
        let m = Metrics::of(&records, 2.0);
        assert_eq!((m.completed, m.failed, m.missing_usage), (2, 1, 0));
        assert_eq!((m.total_input_tokens, m.total_output_tokens), (30, 5));
        assert!(close(m.request_throughput, 1.0));
        assert!(close(m.output_throughput, 2.5));
        assert!(close(m.total_token_throughput, 17.5));
        assert!(close(m.ttft.mean_ms, 200.0) && close(m.ttft.median_ms, 200.0));
        assert!(close(m.ttft.p99_ms, 100.0 + 200.0 * 0.99)); // numpy's linear interpolation
        // TPOT: (0.3 − 0.1)/2 = 0.1 and (0.5 − 0.3)/1 = 0.2.
        assert!(close(m.tpot.mean_ms, 150.0));
        // ITL pooled: 0.1, 0.1, 0.2.
        assert!(close(m.itl.mean_ms, 400.0 / 3.0) && close(m.itl.median_ms, 100.0));
        assert!(close(m.e2el.median_ms, 400.0));
        let all_failed = Metrics::of(&records[2..], 1.0);
        assert_eq!(all_failed.completed, 0);
        assert!(all_failed.ttft.median_ms.is_nan() && all_failed.output_throughput == 0.0);
    }

    #[test]
    fn stats_match_numpy() {
        let s = Stat::of(&[0.004, 0.001, 0.003, 0.002]);
        assert!(close(s.mean_ms, 2.5) && close(s.median_ms, 2.5));
        assert!(close(s.p99_ms, 3.97)); // np.percentile([1, 2, 3, 4], 99)
        assert!(Stat::of(&[]).mean_ms.is_nan());
    }

    #[test]
    fn json_has_the_config_the_metrics_and_raw_arrays() {
        let records = vec![
            record(Ok(timed(&[0.1, 0.2], 0.2, Some((10, 2))))),
            record(Err("HTTP 503: busy".into())),
        ];
        let m = Metrics::of(&records, 1.0);
        let v = run_json(&json!({"model": "m"}), Rate::Inf, &m, &records);
        assert_eq!(v["config"]["model"], "m");
        assert_eq!(v["config"]["request_rate"], "inf");
        assert_eq!(v["metrics"]["completed"], 1);
        assert_eq!(v["metrics"]["ttft"]["median_ms"], 100.0);
        assert_eq!(v["requests"]["completion_tokens"], json!([2, null]));
        assert_eq!(v["requests"]["errors"], json!([null, "HTTP 503: busy"]));
        assert_eq!(v["requests"]["itl_s"][0].as_array().unwrap().len(), 1);
        // The statistics of nothing are NaN, written as null.
        let failed = Metrics::of(&records[1..], 1.0);
        let v = run_json(&json!({}), Rate::PerSecond(2.0), &failed, &records[1..]);
        assert_eq!(v["metrics"]["ttft"]["mean_ms"], Value::Null);
        assert_eq!(v["config"]["request_rate"], 2.0);
    }

    #[test]
    fn inf_is_plotted_at_twice_the_largest_rate() {
        let rates = [
            Rate::PerSecond(1.0),
            Rate::PerSecond(4.0),
            Rate::Inf,
            Rate::PerSecond(2.0),
        ];
        assert_eq!(plot_x(&rates), vec![1.0, 4.0, 8.0, 2.0]);
        assert_eq!(plot_x(&[Rate::Inf]), vec![1.0]);
    }

    #[test]
    fn the_result_block_names_every_figure() {
        let records = vec![record(Ok(timed(&[0.1, 0.2], 0.2, Some((10, 2)))))];
        let block = result_block(Rate::Inf, Some(4), &Metrics::of(&records, 1.0));
        for key in [
            "Successful requests:",
            "Mean TTFT (ms):",
            "P99 TPOT (ms):",
            "Median ITL",
        ] {
            assert!(block.contains(key), "{key} missing from\n{block}");
        }
        assert!(block.lines().all(|l| l.chars().count() <= 50), "{block}");
        let (md, throughput, latency) = sweep_figures(
            &[(Rate::PerSecond(1.0), Metrics::of(&records, 1.0))],
            "m",
            "text",
            "caption",
        );
        assert!(md.contains("| request rate") && md.ends_with("caption\n"));
        assert!(throughput.starts_with("<svg") && latency.starts_with("<svg"));
    }
}
