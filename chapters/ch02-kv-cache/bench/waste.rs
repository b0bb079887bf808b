//! The waste of contiguous preallocation, on chapter 2's synthetic workload
//! (`ch02::workload`): 1,000 requests with log-normal prompt and output lengths.

use ch01::LlamaConfig;
use ch02::workload::{
    ContiguousUtilisation, LogNormalLengths, RequestLengths, Reservation, bytes_per_token,
};

use crate::bench::svg::LinePlot;
use crate::bench::table::{Align, Table};

pub const REQUESTS: usize = 1000;
pub const SEED: u64 = 0;

/// One reservation policy measured on the workload.
pub struct Row {
    pub policy: String,
    pub utilisation: ContiguousUtilisation,
}

pub struct Waste {
    pub max_len: usize,
    /// Bytes of KV one token takes in chapter 2's f32 cache.
    pub bytes_per_token: u64,
    pub workload: Vec<RequestLengths>,
    pub rows: Vec<Row>,
    /// (reserved slots per request, lifetime utilisation, time-weighted utilisation) for fixed
    /// reservations from 256 tokens up to the model's context, each on the workload sampled
    /// with that context.
    pub sweep: Vec<(usize, f64, f64)>,
}

pub fn measure(config: &LlamaConfig) -> anyhow::Result<Waste> {
    let max_len = config.max_position_embeddings;
    let workload = LogNormalLengths::sharegpt_like(max_len)?.sample(REQUESTS, SEED);
    let mut rows = vec![Row {
        policy: format!("fixed: the model's context, {max_len} tokens (chapter 2)"),
        utilisation: ContiguousUtilisation::measure(&workload, Reservation::Fixed(max_len))?,
    }];
    rows.push(Row {
        policy: "prompt + max_tokens (output rounded up to a power of two)".into(),
        utilisation: ContiguousUtilisation::measure(
            &workload,
            Reservation::PromptPlusPow2MaxTokens { max_len },
        )?,
    });
    rows.push(Row {
        policy: "oracle: prompt + the exact output length".into(),
        utilisation: ContiguousUtilisation::measure(&workload, Reservation::Exact)?,
    });
    let mut sweep = Vec::new();
    let mut slots = 256.min(max_len);
    loop {
        let clipped = LogNormalLengths::sharegpt_like(slots)?.sample(REQUESTS, SEED);
        let u = ContiguousUtilisation::measure(&clipped, Reservation::Fixed(slots))?;
        sweep.push((slots, u.utilisation(), u.time_weighted_utilisation()));
        if slots >= max_len {
            break;
        }
        slots = (slots * 2).min(max_len);
    }
    Ok(Waste {
        max_len,
        bytes_per_token: bytes_per_token(config, 4),
        workload,
        rows,
        sweep,
    })
}

impl Waste {
    pub fn table(&self) -> String {
        let mut table = Table::new([
            "reservation per request",
            "reserved GB",
            "ever holds a token",
            "holds a token (time-weighted)",
            "waits for own future tokens",
            "never written",
        ])
        .align(0, Align::Left);
        let gb = |slots: u64| slots as f64 * self.bytes_per_token as f64 / 1e9;
        let pct = |x: f64| format!("{:.1}%", 100.0 * x);
        for row in &self.rows {
            let u = &row.utilisation;
            table.row([
                row.policy.clone(),
                format!("{:.1}", gb(u.reserved_slots)),
                pct(u.utilisation()),
                pct(u.time_weighted_utilisation()),
                pct(u.time_weighted_future()),
                pct(u.time_weighted_fragmentation()),
            ]);
        }
        let (prompts, outputs): (Vec<usize>, Vec<usize>) = self
            .workload
            .iter()
            .map(|r| (r.prompt_len, r.output_len))
            .unzip();
        format!(
            "{}\n{REQUESTS} requests (seed {SEED}): prompt lengths log-normal with median 100 and \
             σ 1.0, outputs median 225 and σ 0.9, clipped to a context of {} tokens; measured \
             prompt mean {:.0} (p99 {}), output mean {:.0} (p99 {}). A token of this model's f32 \
             cache takes {} bytes (2 × layers × kv_heads × head_dim × 4). \"Ever holds a token\": \
             reserved slots that some token fills before the request ends; time-weighted: the \
             share of reserved memory holding tokens at an average moment, split into slots \
             waiting for the request's later tokens and slots never written.\n\n_Command: `kiln \
             bench ch02` (the workload is seeded: the same figures on every machine)._\n",
            table.to_markdown(),
            self.max_len,
            mean(&prompts),
            p99(&prompts),
            mean(&outputs),
            p99(&outputs),
            self.bytes_per_token,
        )
    }

    pub fn plot(&self) -> String {
        let lifetime: Vec<(f64, f64)> = self
            .sweep
            .iter()
            .map(|&(s, u, _)| (s as f64, 100.0 * u))
            .collect();
        let timed: Vec<(f64, f64)> = self
            .sweep
            .iter()
            .map(|&(s, _, t)| (s as f64, 100.0 * t))
            .collect();
        LinePlot::new("Contiguous KV reservation: share that holds tokens")
            .x_label("tokens reserved per request (the context served)")
            .y_label("% of reserved KV memory")
            .log_x()
            .series("ever holds a token", &lifetime)
            .series("holds a token, time-weighted", &timed)
            .to_svg()
    }
}

fn mean(v: &[usize]) -> f64 {
    v.iter().sum::<usize>() as f64 / v.len().max(1) as f64
}

fn p99(v: &[usize]) -> usize {
    let mut sorted = v.to_vec();
    sorted.sort_unstable();
    sorted.get(sorted.len() * 99 / 100).copied().unwrap_or(0)
}
