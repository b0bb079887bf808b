//! `kiln bench ch01`: what recomputing everything costs.
//!
//! Chapter 1 produces the token at position T by running `Llama::forward` over all T tokens.
//! This benchmark times that forward for a range of T (the cost of one token at position T)
//! and one whole recompute-everything generation from a 1-token prompt (the cost of T tokens),
//! then writes `latency.md` (table) and `latency.svg` (log-log plot) for the chapter page.
//!
//! ```text
//! per length T:   1 untimed warm-up forward(T), then `reps` timed forward(T); report the median
//! cumulative:     one pass t = 1, 2, …, T_max timing forward(t) once each; report Σ_{t ≤ T}
//! ```

use std::time::Duration;

use anyhow::bail;
use ch01::Llama;

use super::svg::LinePlot;
use super::table::Table;
use super::{Output, RunFacts, bench_tokens, model_name, ms, parameter_count, time, write_figures};
use crate::commands::ModelArgs;

const DEFAULT_LENGTHS: [usize; 6] = [16, 32, 64, 128, 256, 512];
const QUICK_LENGTHS: [usize; 2] = [8, 16];
const DEFAULT_REPS: usize = 5;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// Sequence lengths to time, comma-separated [default: 16,32,64,128,256,512, those within
    /// the model's context].
    #[arg(long, value_delimiter = ',', value_name = "T,..")]
    pub lengths: Vec<usize>,
}

/// The measurements at one sequence length.
struct Row {
    len: usize,
    /// Median of the timed forwards over `len` tokens.
    median: Duration,
    /// Σ forward(t) for t = 1..=len, from the cumulative pass.
    cumulative: Duration,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let reps = args.output.reps(DEFAULT_REPS)?;
    let out = args.output.dir("ch01");

    // Chapter 1's model as chapter 1 builds it: dense ndarray projections, whatever --dtype says.
    let loaded = args.model.load_with(&ch01::linear::DenseLoader)?;
    let model = &loaded.model;
    let max_len = model.config.max_position_embeddings;
    let mut lengths = if !args.lengths.is_empty() {
        if let Some(&bad) = args.lengths.iter().find(|&&t| t == 0 || t > max_len) {
            bail!(
                "--lengths: {bad} is outside 1..={max_len} (the model's max_position_embeddings)"
            );
        }
        args.lengths.clone()
    } else if args.output.quick {
        QUICK_LENGTHS.to_vec()
    } else {
        DEFAULT_LENGTHS.to_vec()
    };
    lengths.retain(|&t| t <= max_len);
    lengths.sort_unstable();
    lengths.dedup();
    let Some(&longest) = lengths.last() else {
        bail!("no benchmark length fits the model's context of {max_len} tokens");
    };

    let model_name = model_name(&args.model.model);
    let tokens = bench_tokens(
        longest,
        model.config.vocab_size,
        loaded.tokenizer.bos_token_id(),
    );
    eprintln!(
        "kiln bench ch01: {model_name} ({:.2}M parameters), lengths {lengths:?}, {reps} timed reps each",
        parameter_count(model) as f64 / 1e6
    );

    // Warm-up: the longest forward touches every buffer size the runs below will need.
    model.forward(&tokens)?;
    let mut medians = Vec::with_capacity(lengths.len());
    for &len in &lengths {
        model.forward(&tokens[..len])?; // untimed warm-up at this length
        let mut times: Vec<Duration> = (0..reps)
            .map(|_| time(|| model.forward(&tokens[..len])))
            .collect::<Result<_, _>>()?;
        times.sort_unstable();
        let median = times[times.len() / 2];
        eprintln!("  T = {len:4}: median {:.3} ms", ms(median));
        medians.push(median);
    }

    eprintln!("  cumulative pass: forward over 1, 2, …, {longest} tokens, one run each");
    let mut cumulative = Vec::with_capacity(lengths.len());
    let mut total = Duration::ZERO;
    for t in 1..=longest {
        total += time(|| model.forward(&tokens[..t]))?;
        if lengths.contains(&t) {
            cumulative.push(total);
        }
    }

    let rows: Vec<Row> = lengths
        .iter()
        .zip(medians)
        .zip(cumulative)
        .map(|((&len, median), cumulative)| Row {
            len,
            median,
            cumulative,
        })
        .collect();

    let markdown = format!(
        "{}\n{}\n",
        table(&rows).to_markdown(),
        caption(&rows, &facts, &model_name, model, reps)
    );
    let svg = plot(&rows, &model_name).to_svg();

    write_figures(&out, &[("latency", Some(&markdown), &svg)])?;
    Ok(())
}

fn table(rows: &[Row]) -> Table {
    let first = &rows[0];
    let mut table = Table::new([
        "T".to_string(),
        "ms per token".to_string(),
        "tokens/s".to_string(),
        format!("ratio to T={}", first.len),
        "ms to generate T tokens".to_string(),
    ]);
    for row in rows {
        let m = ms(row.median);
        table.row([
            row.len.to_string(),
            format!("{m:.2}"),
            format!("{:.1}", 1e3 / m),
            format!("{:.2}", m / ms(first.median)),
            format!("{:.1}", ms(row.cumulative)),
        ]);
    }
    table
}

/// Least-squares slope of ln(ms per token) against ln(T).
fn log_log_slope(rows: &[Row]) -> Option<f64> {
    if rows.len() < 2 {
        return None;
    }
    let pts: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| ((r.len as f64).ln(), ms(r.median).ln()))
        .collect();
    let n = pts.len() as f64;
    let (mx, my) = (
        pts.iter().map(|p| p.0).sum::<f64>() / n,
        pts.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    Some(sxy / sxx)
}

fn caption(rows: &[Row], facts: &RunFacts, model_name: &str, model: &Llama, reps: usize) -> String {
    let c = &model.config;
    let slope = match (log_log_slope(rows), rows) {
        (Some(all), [.., a, b]) => {
            let last = (ms(b.median) / ms(a.median)).ln() / (b.len as f64 / a.len as f64).ln();
            format!(
                " Log-log slope of ms per token against T: {all:.2} fitted over all lengths, \
                 {last:.2} between T={} and T={}.",
                a.len, b.len
            )
        }
        _ => String::new(),
    };
    format!(
        "*Measured with `{command}` on {date}: model {model_name} ({params:.2}M parameters, \
         {layers} layers, hidden {hidden}, {heads} query / {kv} key-value heads of {hd}), \
         f32 on {cpu}, nproc {nproc}, 1 compute thread (chapter 1's forward is single-threaded). \
         ms per token: median of {reps} timed `Llama::forward` runs over T tokens after one \
         warm-up run, i.e. the time chapter 1 spends to produce the token at position T. \
         ms to generate T tokens: measured in one pass of the recompute loop from a 1-token \
         prompt, timing forward over 1, 2, …, T tokens once each and summing.{slope}*\n",
        command = facts.command,
        date = facts.date,
        params = parameter_count(model) as f64 / 1e6,
        layers = c.num_hidden_layers,
        hidden = c.hidden_size,
        heads = c.num_attention_heads,
        kv = c.num_key_value_heads,
        hd = c.head_dim,
        cpu = facts.cpu.as_deref().unwrap_or("an unknown CPU"),
        nproc = facts.nproc,
    )
}

fn plot(rows: &[Row], model_name: &str) -> LinePlot {
    let measured: Vec<(f64, f64)> = rows.iter().map(|r| (r.len as f64, ms(r.median))).collect();
    let (x0, y0) = measured[0];
    let guide = |power: i32| -> Vec<(f64, f64)> {
        measured
            .iter()
            .map(|&(x, _)| (x, y0 * (x / x0).powi(power)))
            .collect()
    };
    LinePlot::new(format!(
        "Chapter 1, {model_name}: one forward over T tokens"
    ))
    .x_label("sequence length T (tokens)")
    .y_label("ms per token at position T")
    .log_x()
    .log_y()
    .series("measured (median)", &measured)
    .reference("∝ T (slope 1)", &guide(1))
    .reference("∝ T² (slope 2)", &guide(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_tokens_are_deterministic_and_in_vocab() {
        let a = bench_tokens(300, 50, Some(0));
        assert_eq!(a, bench_tokens(300, 50, Some(0)));
        assert_eq!(a.len(), 300);
        assert_eq!(a[0], 0);
        assert!(a.iter().all(|&t| t < 50));
        assert_eq!(bench_tokens(1, 50, Some(7)), vec![7]);
        assert_eq!(bench_tokens(5, 50, None).len(), 5);
    }

    #[test]
    fn slope_of_a_power_law_is_its_exponent() {
        let rows: Vec<Row> = [16usize, 32, 64, 128]
            .iter()
            .map(|&len| Row {
                len,
                median: Duration::from_secs_f64(1e-6 * (len * len) as f64),
                cumulative: Duration::ZERO,
            })
            .collect();
        assert!((log_log_slope(&rows).unwrap() - 2.0).abs() < 1e-6);
        assert!(log_log_slope(&rows[..1]).is_none());
    }
}
