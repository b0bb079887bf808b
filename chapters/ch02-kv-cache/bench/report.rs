//! The tables and plots of `kiln bench ch02`, from its measurements.

use ch01::LlamaConfig;

use super::Part;
use super::machine::Machine;
use super::references::Reference;
use super::speed::{LatencyRow, Speed};
use super::waste::Waste;
use crate::bench::bars::BarChart;
use crate::bench::svg::LinePlot;
use crate::bench::table::{Align, Table};
use crate::bench::{RunFacts, ms};

/// Everything one run measured.
pub struct Report<'a> {
    pub facts: &'a RunFacts,
    pub model_name: &'a str,
    pub config: &'a LlamaConfig,
    pub threads: usize,
    pub reps: usize,
    pub prompt: usize,
    pub decode: usize,
    /// Bytes of projection and head weights one decode step reads, f32 and bf16 storage.
    pub f32_bytes: usize,
    pub bf16_bytes: usize,
    pub measured: Option<Measured>,
    pub latency: Option<Vec<LatencyRow>>,
    pub waste: Option<Waste>,
}

/// The speed and roofline measurements (they share the machine probes and kiln's rates).
pub struct Measured {
    /// Which of [`Part::Speed`] and [`Part::Roofline`] to write.
    pub parts: Vec<Part>,
    pub machine: Machine,
    pub kiln_f32: Speed,
    pub kiln_bf16: Speed,
    pub references: Vec<Reference>,
    pub missing: Vec<String>,
    /// (T, seconds) of a T-token prefill, f32.
    pub prefill_seconds: Vec<(usize, f64)>,
    /// Bytes of the read probe taken around each decode ([`Speed::read_gb_s_at_decode`]).
    pub around_bytes: usize,
}

impl Report<'_> {
    /// (file stem, markdown, svg) for each part measured.
    pub fn files(&self) -> Vec<(&'static str, String, String)> {
        let mut files = Vec::new();
        if let Some(m) = &self.measured {
            if m.parts.contains(&Part::Speed) {
                files.push(("speed", self.speed_table(m), self.speed_plot(m)));
            }
            if m.parts.contains(&Part::Roofline) {
                files.push(("roofline", self.roofline_table(m), self.roofline_plot(m)));
            }
        }
        if let Some(rows) = &self.latency {
            files.push(("latency", self.latency_table(rows), self.latency_plot(rows)));
        }
        if let Some(waste) = &self.waste {
            files.push(("waste", waste.table(), waste.plot()));
        }
        files
    }

    /// The common caption line: when, where, how.
    fn caption(&self) -> String {
        let f = self.facts;
        format!(
            "_{}, {} on {} ({} CPUs), {}, median of {} runs. Command: `{}`._",
            self.model_name,
            plural(self.threads, "thread"),
            f.cpu.as_deref().unwrap_or("an unknown CPU"),
            f.nproc,
            f.date,
            self.reps,
            f.command
        )
    }

    fn speed_table(&self, m: &Measured) -> String {
        let best_read = m.machine.read_gb_s;
        let mut table = Table::new([
            "engine",
            "weights",
            "prefill tok/s",
            "decode tok/s",
            "MB read / token",
            "decode GB/s",
            "read probe around it, GB/s",
            "of read bandwidth",
        ])
        .align(0, Align::Left)
        .align(1, Align::Left);
        let mut row = |engine: &str, dtype: &str, speed: Speed, bytes: Option<usize>| {
            let read = speed.read_gb_s_at_decode.unwrap_or(best_read);
            let (mb, gb_s, share) = match bytes {
                Some(b) => {
                    let gb_s = b as f64 * speed.decode_tok_s / 1e9;
                    (
                        format!("{:.0}", b as f64 / 1e6),
                        format!("{gb_s:.1}"),
                        format!("{:.0}%", 100.0 * gb_s / read),
                    )
                }
                None => ("".into(), "".into(), "".into()),
            };
            table.row([
                engine.to_string(),
                dtype.to_string(),
                format!("{:.1}", speed.prefill_tok_s),
                format!("{:.1}", speed.decode_tok_s),
                mb,
                gb_s,
                format!("{read:.1}"),
                share,
            ]);
        };
        row("kiln", "f32", m.kiln_f32, Some(self.f32_bytes));
        row("kiln", "bf16", m.kiln_bf16, Some(self.bf16_bytes));
        for r in &m.references {
            let bytes = match r.dtype.as_str() {
                "f32" | "F32" => Some(self.f32_bytes),
                _ => Some(self.bf16_bytes), // bf16 and F16: two bytes a weight
            };
            row(&r.engine, &r.dtype, r.speed, bytes);
        }
        let (missing, around_mib) = (&m.missing, m.around_bytes >> 20);
        let m = &m.machine;
        let mut text = format!(
            "{}\nBatch 1; prefill of {} prompt tokens, then {} decode steps. MB read per token: \
             the projection and output-head weights one decode step streams. Of read \
             bandwidth: the decode's GB/s against a read probe (a sum over {} MiB of the memory the weights are in, on 2 MiB pages where the system gives them, the best of \
             two passes right before and two right after) around kiln's decode, the median \
             over its repetitions, and around each reference engine's decode run, whose process \
             also loads the model (llama.cpp's `llama-bench` runs its decode apart from its \
             prefill; transformers' script does both). Machine, same run \
             (each probe's best, before and after kiln's runs): read bandwidth **{:.1} GB/s** \
             (sum over 1 GiB), copy {:.1} GB/s (read + write), \
             so f32 decode cannot exceed {:.1} tokens/s and bf16 {:.1}.\n",
            table.to_markdown(),
            self.prompt,
            self.decode,
            around_mib,
            m.read_gb_s,
            m.copy_gb_s,
            m.read_gb_s * 1e9 / self.f32_bytes as f64,
            m.read_gb_s * 1e9 / self.bf16_bytes as f64,
        );
        for line in missing {
            text += &format!("\nNot in this run: {line}.\n");
        }
        text + "\n" + &self.caption() + "\n"
    }

    fn speed_plot(&self, m: &Measured) -> String {
        let mut full = vec![("kiln".to_string(), m.kiln_f32.decode_tok_s)];
        let mut half = vec![("kiln".to_string(), m.kiln_bf16.decode_tok_s)];
        for r in &m.references {
            let name = r
                .engine
                .split_whitespace()
                .next()
                .unwrap_or(&r.engine)
                .to_string();
            match r.dtype.as_str() {
                "f32" | "F32" => full.push((name, r.speed.decode_tok_s)),
                _ => half.push((name, r.speed.decode_tok_s)),
            }
        }
        let read = m.machine.read_gb_s * 1e9;
        BarChart::new(format!(
            "Decode, {}, batch 1, {} threads",
            self.model_name, self.threads
        ))
        .x_label("tokens/s")
        .group("f32 weights", &full)
        .group("16-bit weights (bf16; llama.cpp F16)", &half)
        .reference("bandwidth limit, f32", read / self.f32_bytes as f64)
        .reference("bandwidth limit, 16-bit", read / self.bf16_bytes as f64)
        .to_svg()
    }

    /// FLOPs of the projections for a step over `tokens` new tokens that computes the logits of
    /// the last one only: 2 per weight per token in the layers, 2 per weight of the head once.
    fn projection_flops(&self, tokens: usize) -> f64 {
        let c = self.config;
        let (h, q, kv, i) = (
            c.hidden_size,
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
            c.intermediate_size,
        );
        let layer = h * q + 2 * h * kv + q * h + 3 * h * i;
        let head = c.vocab_size * h;
        2.0 * (tokens * c.num_hidden_layers * layer + head) as f64
    }

    /// (label, GFLOP/s, FLOP per weight byte, the read probe around it if one was taken) of
    /// every measured point, f32 unless named.
    fn roofline_points(&self, m: &Measured) -> Vec<(String, f64, f64, Option<f64>)> {
        let bytes = self.f32_bytes as f64;
        let mut points = vec![
            (
                "decode, f32".to_string(),
                self.projection_flops(1) * m.kiln_f32.decode_tok_s / 1e9,
                self.projection_flops(1) / bytes,
                m.kiln_f32.read_gb_s_at_decode,
            ),
            (
                "decode, bf16".to_string(),
                self.projection_flops(1) * m.kiln_bf16.decode_tok_s / 1e9,
                self.projection_flops(1) / self.bf16_bytes as f64,
                m.kiln_bf16.read_gb_s_at_decode,
            ),
        ];
        for &(t, seconds) in &m.prefill_seconds {
            let flops = self.projection_flops(t);
            points.push((
                format!("prefill T={t}"),
                flops / seconds / 1e9,
                flops / bytes,
                None,
            ));
        }
        points
    }

    fn roofline_table(&self, measured: &Measured) -> String {
        let m = &measured.machine;
        let mut table = Table::new([
            "step",
            "FLOP / weight byte",
            "GFLOP/s",
            "of GEMM peak",
            "weight GB/s",
            "read GB/s",
            "of read bandwidth",
        ])
        .align(0, Align::Left);
        for (label, gflop_s, intensity, read_around) in self.roofline_points(measured) {
            let gb_s = gflop_s / intensity;
            let read = read_around.unwrap_or(m.read_gb_s);
            table.row([
                label,
                format!("{intensity:.1}"),
                format!("{gflop_s:.1}"),
                format!("{:.0}%", 100.0 * gflop_s / m.kiln_gemm_gflop_s),
                format!("{gb_s:.1}"),
                format!("{read:.1}"),
                format!("{:.0}%", 100.0 * gb_s / read),
            ]);
        }
        format!(
            "{}\nGEMM peak: this chapter's GEMM on x [384, 1024] · Wᵀ [1024, 1024], **{:.1} GFLOP/s** \
             ({} threads; matrixmultiply on one thread: {:.1}). Read bandwidth **{:.1} GB/s** \
             (read GB/s: this, but for decode's rows, which have the read probe taken around \
             each decode, as in the speed table). \
             FLOPs count the projections and the output head (for the last position only); \
             attention's are left out. The ridge point, where a step stops being memory-bound, \
             is at {:.1} FLOP per byte.\n\n{}\n",
            table.to_markdown(),
            m.kiln_gemm_gflop_s,
            self.threads,
            m.reference_gemm_gflop_s,
            m.read_gb_s,
            m.kiln_gemm_gflop_s / m.read_gb_s,
            self.caption()
        )
    }

    fn roofline_plot(&self, measured: &Measured) -> String {
        let m = &measured.machine;
        let ridge = m.kiln_gemm_gflop_s / m.read_gb_s;
        let roof = [
            (0.1, 0.1 * m.read_gb_s),
            (ridge, m.kiln_gemm_gflop_s),
            (1000.0, m.kiln_gemm_gflop_s),
        ];
        let mut plot = LinePlot::new(format!(
            "Roofline, {}, {} threads",
            self.model_name, self.threads
        ))
        .x_label("FLOP per byte of weights")
        .y_label("GFLOP/s")
        .log_x()
        .log_y()
        .reference("roof: min(GEMM peak, bandwidth × intensity)", &roof);
        for (label, gflop_s, intensity, _) in self.roofline_points(measured) {
            plot = plot.series(label, &[(intensity, gflop_s)]);
        }
        plot.to_svg()
    }

    fn latency_table(&self, rows: &[LatencyRow]) -> String {
        let mut table = Table::new([
            "context T",
            "recompute, dense (ch. 1) ms",
            "recompute, fast kernels ms",
            "cached decode (ch. 2) ms",
            "cache speed-up",
        ]);
        for r in rows {
            table.row([
                r.len.to_string(),
                format!("{:.2}", ms(r.recompute_dense)),
                format!("{:.2}", ms(r.recompute_fast)),
                format!("{:.2}", ms(r.cached)),
                format!("{:.0}×", ms(r.recompute_fast) / ms(r.cached)),
            ]);
        }
        format!(
            "{}\nThe cost of producing the token after a context of T tokens. Recompute: chapter \
             1's `forward` over all T tokens, with chapter 1's dense projections and with this \
             chapter's kernels; cached: one decode step against T − 1 cached positions (median of \
             the five steps around T). Cache speed-up = recompute on the same kernels ÷ cached.\n\n{}\n",
            table.to_markdown(),
            self.caption()
        )
    }

    fn latency_plot(&self, rows: &[LatencyRow]) -> String {
        let series = |f: &dyn Fn(&LatencyRow) -> f64| -> Vec<(f64, f64)> {
            rows.iter().map(|r| (r.len as f64, f(r))).collect()
        };
        LinePlot::new(format!("Per-token latency, {}", self.model_name))
            .x_label("context length T")
            .y_label("ms per token")
            .log_x()
            .log_y()
            .series(
                "recompute, dense (ch. 1)",
                &series(&|r| ms(r.recompute_dense)),
            )
            .series(
                "recompute, fast kernels",
                &series(&|r| ms(r.recompute_fast)),
            )
            .series("cached decode (ch. 2)", &series(&|r| ms(r.cached)))
            .to_svg()
    }
}

/// `1 thread`, `2 threads`.
pub fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}
