//! The tables and plots of `kiln bench ch05`, from its measurements.

use super::{Batching, Measured};
use crate::bench::RunFacts;
use crate::bench::bars::BarChart;
use crate::bench::svg::LinePlot;
use crate::bench::table::{Align, Table};

/// Everything one run measured.
pub struct Report<'a> {
    pub facts: &'a RunFacts,
    pub threads: usize,
    pub reps: usize,
    pub prompt: usize,
    pub decode: usize,
    pub ctx: usize,
    pub chunks: usize,
    pub quick: bool,
    pub rows: &'a [Measured],
    pub batching: Option<&'a Batching>,
}

const MIB: f64 = 1024.0 * 1024.0;

impl Report<'_> {
    /// (file stem, markdown, svg) for each part measured.
    pub fn files(&self) -> Vec<(&'static str, String, String)> {
        let mut files = Vec::new();
        if self.rows.iter().any(|r| r.kiln.is_some()) {
            files.push(("speed", self.speed_table(), self.speed_plot()));
        }
        if self.rows.iter().any(|r| r.kiln_ppl.is_some()) {
            files.push((
                "perplexity",
                self.perplexity_table(),
                self.perplexity_plot(),
            ));
        }
        if let Some(b) = self.batching {
            files.push(("batching", self.batching_table(b), self.batching_plot(b)));
        }
        files
    }

    fn model(&self) -> &'static str {
        if self.quick {
            "shakespeare-small quantized on load (--quick)"
        } else {
            "SmolLM2-135M-Instruct GGUF files"
        }
    }

    fn caption(&self, what: &str) -> String {
        format!(
            "_{}, {what}, {}, {}. Command: `{}`._",
            self.model(),
            self.facts.machine(self.threads),
            crate::bench::runs(self.reps),
            self.facts.command
        )
    }

    fn speed_table(&self) -> String {
        let mut table = Table::new([
            "format",
            "tensors",
            "file MiB",
            "read per token MiB",
            "kiln decode",
            "llama.cpp decode",
            "kiln / llama.cpp",
            "kiln prefill",
            "llama.cpp prefill",
            "kiln / llama.cpp",
        ]);
        table = table.align(0, Align::Left).align(1, Align::Left);
        for r in self.rows {
            let Some(kiln) = r.kiln else { continue };
            let reference = r.llama_cpp;
            let rate = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.1}"));
            let ratio = |a: f64, b: Option<f64>| b.map_or("—".to_string(), |b| ratio(a, b));
            table.row([
                r.label.to_string(),
                r.types.clone(),
                format!("{:.1}", r.file_bytes as f64 / MIB),
                format!("{:.1}", r.projection_bytes as f64 / MIB),
                format!("{:.1}", kiln.decode_tok_s),
                rate(reference.map(|s| s.decode_tok_s)),
                ratio(kiln.decode_tok_s, reference.map(|s| s.decode_tok_s)),
                format!("{:.1}", kiln.prefill_tok_s),
                rate(reference.map(|s| s.prefill_tok_s)),
                ratio(kiln.prefill_tok_s, reference.map(|s| s.prefill_tok_s)),
            ]);
        }
        format!(
            "{}\n{}\n",
            table.to_markdown(),
            self.caption(&format!(
                "tokens/s: decode of {} tokens after a {}-token prompt at batch 1, prefill of \
                 the {}-token prompt (llama-bench: `-n {} -d {}` and `-p {}`); the KV cache in \
                 f32 for kiln, F16 for llama.cpp (each one's default)",
                self.decode, self.prompt, self.prompt, self.decode, self.prompt, self.prompt
            ))
        )
    }

    fn speed_plot(&self) -> String {
        let mut chart = BarChart::new(format!(
            "Decode at batch 1, tokens/s ({}, {} threads)",
            self.model(),
            self.threads
        ))
        .x_label("tokens per second (longer is faster)");
        for r in self.rows {
            let Some(kiln) = r.kiln else { continue };
            let mut bars = vec![("kiln", kiln.decode_tok_s)];
            if let Some(reference) = r.llama_cpp {
                bars.push(("llama.cpp", reference.decode_tok_s));
            }
            chart = chart.group(
                format!("{} ({:.0} MiB)", r.label, r.file_bytes as f64 / MIB),
                &bars,
            );
        }
        chart.to_svg()
    }

    fn perplexity_table(&self) -> String {
        let mut table = Table::new([
            "format",
            "file MiB",
            "kiln PPL",
            "llama.cpp PPL",
            "kiln − llama.cpp",
            "vs F32 (kiln)",
        ]);
        table = table.align(0, Align::Left);
        let f32_ppl = self
            .rows
            .iter()
            .find(|r| r.label == "F32")
            .and_then(|r| r.kiln_ppl);
        for r in self.rows {
            let Some(ppl) = r.kiln_ppl else { continue };
            table.row([
                r.label.to_string(),
                format!("{:.1}", r.file_bytes as f64 / MIB),
                format!("{ppl:.4}"),
                r.llama_cpp_ppl
                    .map_or("—".to_string(), |p| format!("{p:.4}")),
                r.llama_cpp_ppl.map_or("—".to_string(), |p| {
                    format!("{:+.3}%", 100.0 * (ppl - p) / p)
                }),
                f32_ppl.map_or("—".to_string(), |f| {
                    format!("{:+.2}%", 100.0 * (ppl - f) / f)
                }),
            ]);
        }
        format!(
            "{}\n{}\n",
            table.to_markdown(),
            self.caption(&format!(
                "perplexity of fixtures/corpus/hamlet.txt, {} chunks of {} tokens, the second \
                 half of each scored (llama-perplexity `-c {} --chunks {} -ctk f32 -ctv f32 -fa \
                 off`: an f32 KV cache and exact attention, as kiln's; llama.cpp's default F16 \
                 cache alone raised Q4_0's perplexity by 0.2%)",
                self.chunks, self.ctx, self.ctx, self.chunks
            ))
        )
    }

    fn perplexity_plot(&self) -> String {
        let points = |ppl: fn(&Measured) -> Option<f64>| -> Vec<(f64, f64)> {
            let mut points: Vec<(f64, f64)> = self
                .rows
                .iter()
                .filter_map(|r| ppl(r).map(|p| (r.file_bytes as f64 / MIB, p)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            points
        };
        let mut plot = LinePlot::new(format!(
            "Size against perplexity ({}, Hamlet, {} × {} tokens)",
            self.model(),
            self.chunks,
            self.ctx
        ))
        .x_label("file size, MiB")
        .y_label("perplexity (lower is better)")
        .log_x()
        .series("kiln", &points(|r| r.kiln_ppl));
        let reference = points(|r| r.llama_cpp_ppl);
        if !reference.is_empty() {
            plot = plot.series("llama.cpp", &reference);
        }
        plot.to_svg()
    }

    fn batching_table(&self, b: &Batching) -> String {
        let mut table = Table::new([
            "weights",
            "one at a time, output tokens/s",
            "continuous batching, output tokens/s",
            "speed-up",
        ]);
        table = table.align(0, Align::Left);
        for &(label, sequential, continuous) in &b.rows {
            table.row([
                label.to_string(),
                format!("{sequential:.1}"),
                format!("{continuous:.1}"),
                ratio(continuous, sequential),
            ]);
        }
        format!(
            "{}\n{}\n",
            table.to_markdown(),
            self.caption(&format!(
                "chapter 4's workload: {} requests submitted at once, max_num_seqs 1 against {}",
                b.requests, b.requests
            ))
        )
    }

    fn batching_plot(&self, b: &Batching) -> String {
        let mut chart = BarChart::new(format!(
            "{} requests at once: output tokens/s ({})",
            b.requests,
            self.model()
        ))
        .x_label("output tokens per second (longer is faster)");
        for &(label, sequential, continuous) in &b.rows {
            chart = chart.group(
                label,
                &[("one at a time", sequential), ("continuous", continuous)],
            );
        }
        chart.to_svg()
    }
}

fn ratio(a: f64, b: f64) -> String {
    format!("{:.2}x", a / b)
}
