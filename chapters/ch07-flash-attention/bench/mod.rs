//! `kiln bench ch07`: flash attention against naive attention, on the CPU.
//!
//! ```text
//! memory    peak heap bytes of one attention call over T = 1k … 32k positions (one head of 64):
//!           chapter 1's naive attention (its [T, T] scores) vs flash; counted by the binary's
//!           counting allocator; naive runs up to 16k, beyond it its score matrix is computed
//! traffic   the IO model (ch07::traffic): bytes moved between slow and fast memory by the
//!           naive and the tiled algorithm, against M and against the query tile, beside the
//!           paper's Θ(N²d²/M)
//! prefill   attention time of one T-token prompt, T = 128 … 16k: chapter 4's batch_attention
//!           vs flash (SmolLM2-135M's attention shape, random K/V in a paged pool)
//! decode    one query at context 256 … 32k: batch_attention, flash on one partition, flash
//!           split-K
//! ```
//! Writes `memory`, `traffic`, `prefill`, `decode` (`.md` + `.svg`; also `traffic-tiles.svg`)
//! into `book/src/ch07/` (or `--out`).
//!
//! `--device cuda` runs the GPU part instead ([`gpu`]): the model end to end on the GPU beside
//! transformers, written to `gpu-e2e` (the attention kernels' GPU timings are
//! `just gpu-check`'s).

mod gpu;
mod measure;

use ch07::traffic;

use super::svg::LinePlot;
use super::table::Table;
use super::{Output, RunFacts, ms, write_figures};
use measure::{MEMORY_SHAPE, SHAPE};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub output: Output,
    /// Run only these parts, comma-separated [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Part>,
    /// Prompt lengths of the prefill part, comma-separated [default: 128 … 16384].
    #[arg(long, value_delimiter = ',', value_name = "T,..")]
    pub prefill_lengths: Vec<usize>,
    /// Contexts of the decode part, comma-separated [default: 256 … 32768].
    #[arg(long, value_delimiter = ',', value_name = "T,..")]
    pub decode_lengths: Vec<usize>,
    /// `cuda` or `cuda:N`: run the model end to end on that GPU (batch-1 decode, continuous
    /// batching at 32 and 64) beside transformers, instead of the CPU parts.
    #[arg(long, value_parser = crate::commands::parse_device)]
    pub device: Option<ch07::cuda::DeviceSpec>,
    /// The GPU part's Hugging Face checkpoint [default: target/llama-1b-random, a Llama-1B-shaped
    /// random bf16 checkpoint, written when missing].
    #[arg(long, value_name = "DIR", requires = "device")]
    pub model: Option<std::path::PathBuf>,
}

/// A part of the benchmark.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Memory,
    Traffic,
    Prefill,
    Decode,
}

/// Every size of the benchmark, full or --quick.
struct Plan {
    memory: Vec<usize>,
    /// The longest T at which naive attention runs (beyond: its score matrix's size).
    naive_memory_max: usize,
    traffic_n: usize,
    prefill: Vec<usize>,
    decode: Vec<usize>,
}

impl Plan {
    fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                memory: vec![256, 512],
                naive_memory_max: 512,
                traffic_n: 128,
                prefill: vec![64, 256],
                decode: vec![256, 1024],
            }
        } else {
            Plan {
                memory: vec![1024, 2048, 4096, 8192, 16384, 32768],
                naive_memory_max: 16384,
                traffic_n: 1024,
                prefill: vec![128, 256, 512, 1024, 2048, 4096, 8192, 16384],
                decode: vec![256, 1024, 4096, 8192, 16384, 32768],
            }
        }
    }
}

const MIB: f64 = (1u64 << 20) as f64;
const D: usize = 64; // the traffic model's head dim

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let reps = args.output.reps(3)?;
    let out = args.output.dir("ch07");
    let mut plan = Plan::new(args.output.quick);
    if !args.prefill_lengths.is_empty() {
        plan.prefill = args.prefill_lengths.clone();
    }
    if !args.decode_lengths.is_empty() {
        plan.decode = args.decode_lengths.clone();
    }
    anyhow::ensure!(
        plan.prefill.iter().chain(&plan.decode).all(|&t| t >= 1),
        "lengths must be at least 1"
    );
    if let Some(device) = args.device.filter(|d| *d != ch07::cuda::DeviceSpec::Cpu) {
        let (markdown, svg) = gpu::run(device, args.model, args.output.quick, reps, &facts, &out)?;
        return write_figures(&out, &[("gpu-e2e", Some(&markdown), &svg)]);
    }
    let threads = rayon::current_num_threads();
    let caption = format!(
        "_{}. Command: `{}`._",
        facts.machine(threads),
        facts.command
    );

    let wants = |part: Part| args.only.is_empty() || args.only.contains(&part);
    // (stem, table, plot) of every figure made.
    let mut figures: Vec<(&str, Option<String>, String)> = Vec::new();

    if wants(Part::Memory) {
        eprintln!("== memory: peak heap bytes of one call, naive vs flash");
        let mut memory = Table::new([
            "T",
            "naive: peak MiB",
            "flash: peak MiB",
            "naive / flash",
            "[T, T] scores MiB",
        ]);
        let (mut naive_pts, mut flash_pts) = (Vec::new(), Vec::new());
        for &t in &plan.memory {
            let (naive, flash) = measure::memory(t, t <= plan.naive_memory_max)?;
            let scores = (t * t * 4) as f64 / MIB;
            let naive_mib = naive.map(|b| b as f64 / MIB);
            let flash_mib = flash as f64 / MIB;
            eprintln!("  T = {t:5}: naive {naive_mib:?} MiB, flash {flash_mib:.2} MiB");
            memory.row([
                t.to_string(),
                naive_mib.map_or(format!("({scores:.0}, not run)"), |m| format!("{m:.1}")),
                format!("{flash_mib:.2}"),
                naive_mib.map_or("-".into(), |m| format!("{:.0}×", m / flash_mib)),
                format!("{scores:.0}"),
            ]);
            if let Some(m) = naive_mib {
                naive_pts.push((t as f64, m));
            }
            flash_pts.push((t as f64, flash_mib));
        }
        let scores_pts: Vec<(f64, f64)> = plan
            .memory
            .iter()
            .map(|&t| (t as f64, (t * t * 4) as f64 / MIB))
            .collect();
        let memory_md = format!(
            "{}\nPeak heap bytes live during one causal attention call beyond those live before it \
         (the inputs Q, K, V [T, 64] excluded, the output [T, 64] included), one head of 64 \
         ({} query head, {} KV head): measured by the `kiln` binary's counting global \
         allocator. Naive is chapter 1's `causal_attention`, which materialises one head's \
         [T, T] scores at a time; it is run up to T = {}, and beyond that only the size of its \
         score matrix is given (running it would take that much memory and minutes). Flash is \
         `ch07::flash_attention` with the default tiles.\n\n{caption}\n",
            memory.to_markdown(),
            MEMORY_SHAPE.num_heads,
            MEMORY_SHAPE.num_kv_heads,
            plan.naive_memory_max,
        );
        let memory_svg = LinePlot::new("Peak memory of one attention call (one head of 64)")
            .x_label("sequence length T (tokens)")
            .y_label("MiB")
            .log_x()
            .log_y()
            .series("naive (chapter 1), measured", &naive_pts)
            .series("flash, measured", &flash_pts)
            .reference("[T, T] f32 scores (∝ T²)", &scores_pts)
            .to_svg();
        figures.push(("memory", Some(memory_md), memory_svg));
    }

    if wants(Part::Traffic) {
        eprintln!("== traffic: the IO model, N = {}, d = {D}", plan.traffic_n);
        let n = plan.traffic_n;
        let mut rng = ch02::workload::WorkloadRng::new(7);
        let mut input = || -> Vec<f32> {
            (0..n * D)
                .map(|_| rng.uniform_open0() as f32 * 2.0 - 1.0)
                .collect()
        };
        let (q, k, v) = (input(), input(), input());
        let mut traffic_table = Table::new([
            "M (KiB)",
            "tiles Br = Bc",
            "naive MiB moved",
            "tiled MiB moved",
            "naive / tiled",
            "N²d²/M (MiB)",
        ]);
        let (mut naive_t, mut tiled_t, mut bound_t) = (Vec::new(), Vec::new(), Vec::new());
        for kib in [8usize, 16, 32, 64, 128, 256, 512] {
            let m = kib << 10;
            let Some(b) = traffic::largest_tiles(D, m) else {
                continue;
            };
            let (_, naive) = traffic::naive(&q, &k, &v, n, D, false, m)?;
            let (_, tiled) = traffic::tiled(&q, &k, &v, n, D, false, m, (b, b))?;
            let bound = traffic::paper_bound_bytes(n, D, m);
            let mib = |b: u64| b as f64 / MIB;
            traffic_table.row([
                kib.to_string(),
                b.to_string(),
                format!("{:.1}", mib(naive.total())),
                format!("{:.2}", mib(tiled.total())),
                format!("{:.1}", naive.total() as f64 / tiled.total() as f64),
                format!("{:.2}", bound / MIB),
            ]);
            naive_t.push((kib as f64, mib(naive.total())));
            tiled_t.push((kib as f64, mib(tiled.total())));
            bound_t.push((kib as f64, bound / MIB));
        }
        // Against the query tile Br at M = 128 KiB, Bc as large as fits.
        let m = 128 << 10;
        let (_, naive_at_m) = traffic::naive(&q, &k, &v, n, D, false, m)?;
        let mut tiles_t = Vec::new();
        let mut tiles_table = Table::new(["Br", "Bc", "tiled MiB moved (M = 128 KiB)"]);
        for br in [1usize, 2, 4, 8, 16, 32, 64, 96] {
            let bc = (1..)
                .take_while(|&bc| traffic::tiled_footprint(D, br, bc) * 4 <= m)
                .last();
            let Some(bc) = bc else { continue };
            let (_, t) = traffic::tiled(&q, &k, &v, n, D, false, m, (br, bc))?;
            tiles_table.row([
                br.to_string(),
                bc.to_string(),
                format!("{:.2}", t.total() as f64 / MIB),
            ]);
            tiles_t.push((br as f64, t.total() as f64 / MIB));
        }
        let flat = |y: f64| vec![(tiles_t[0].0, y), (tiles_t[tiles_t.len() - 1].0, y)];
        let traffic_md = format!(
            "{}\n{}\nBytes moved between slow and fast memory by one head of non-causal attention, \
         N = {n}, d = {D}, f32, counted by the instrumented model `ch07::traffic`, which \
         computes the attention (checked against chapter 1's in the tests) and refuses any step \
         that holds more than M bytes of fast memory. Naive: S = QKᵀ in the largest square \
         blocks that fit, S and P [N, N] written out and read back. Tiled: FlashAttention-2's \
         loop with the largest square tiles that fit (first table), or query tiles Br with the \
         largest Bc that fits in M = 128 KiB (second table). N²d²/M is the FlashAttention \
         paper's Θ bound on the tiled loop (M in elements, times 4 bytes), drawn with \
         constant 1. These are counts of a model, not timings. Command: `{}`.\n",
            traffic_table.to_markdown(),
            tiles_table.to_markdown(),
            facts.command,
        );
        let traffic_svg = LinePlot::new(format!("Bytes moved by attention, N = {n}, d = {D}"))
            .x_label("fast memory M (KiB)")
            .y_label("MiB moved (slow ↔ fast)")
            .log_x()
            .log_y()
            .series("naive", &naive_t)
            .series("tiled (largest tiles that fit)", &tiled_t)
            .reference("N²d²/M (paper's bound)", &bound_t)
            .to_svg();
        let tiles_svg = LinePlot::new(format!(
            "Tiled traffic against the query tile, M = 128 KiB, N = {n}"
        ))
        .x_label("query tile Br (rows)")
        .y_label("MiB moved (slow ↔ fast)")
        .log_x()
        .log_y()
        .series("tiled", &tiles_t)
        .reference("naive", &flat(naive_at_m.total() as f64 / MIB))
        .to_svg();
        figures.push(("traffic", Some(traffic_md), traffic_svg));
        figures.push(("traffic-tiles", None, tiles_svg));
    }

    if wants(Part::Prefill) {
        eprintln!("== prefill: one prompt's attention, batch_attention vs flash");
        let mut prefill_table = Table::new(["T", "batch_attention (ms)", "flash (ms)", "speed-up"]);
        let (mut naive_p, mut flash_p) = (Vec::new(), Vec::new());
        for &t in &plan.prefill {
            let reps = if t >= 8192 { reps.min(1) } else { reps };
            let (naive, flash) = measure::prefill(t, reps)?;
            eprintln!(
                "  T = {t:5}: naive {:.1} ms, flash {:.1} ms",
                ms(naive),
                ms(flash)
            );
            prefill_table.row([
                t.to_string(),
                format!("{:.1}", ms(naive)),
                format!("{:.1}", ms(flash)),
                format!("{:.2}×", ms(naive) / ms(flash)),
            ]);
            naive_p.push((t as f64, ms(naive)));
            flash_p.push((t as f64, ms(flash)));
        }
        let shape_text = shape_text();
        let _ = format!(
            "{} query heads sharing {} KV heads of {} (SmolLM2-135M's attention), random K/V in \
         an f32 paged pool of blocks of {} in scattered order, one layer",
            SHAPE.num_heads,
            SHAPE.num_kv_heads,
            SHAPE.head_dim,
            measure::BLOCK_SIZE
        );
        let prefill_md = format!(
            "{}\nCausal attention of one T-token prompt (every row attends to the positions up to \
         its own), {shape_text}: chapter 4's `batch_attention` (one task per query row, every \
         score of the row at once) against `FlashAttention` (query tiles of 32 × KV tiles of \
         64, tasks = query tile × KV head). Median of {reps} timed runs after one untimed run \
         (1 timed run from T = 8192).\n\n{caption}\n",
            prefill_table.to_markdown()
        );
        let prefill_svg = LinePlot::new("Prefill attention, one sequence")
            .x_label("prompt length T (tokens)")
            .y_label("ms")
            .log_x()
            .log_y()
            .series("batch_attention (chapter 4)", &naive_p)
            .series("flash", &flash_p)
            .to_svg();
        figures.push(("prefill", Some(prefill_md), prefill_svg));
    }

    if wants(Part::Decode) {
        let shape_text = shape_text();
        eprintln!("== decode: one query against a long context");
        let decode_reps = if args.output.quick { 1 } else { 20 };
        let mut decode_table = Table::new([
            "context",
            "batch_attention (ms)",
            "flash, 1 partition (ms)",
            "flash split-K (ms)",
            "partitions",
            "split-K vs 1 partition",
        ]);
        let (mut naive_d, mut one_d, mut split_d) = (Vec::new(), Vec::new(), Vec::new());
        for &t in &plan.decode {
            let (naive, one, split, parts) = measure::decode(t, decode_reps)?;
            eprintln!(
                "  context {t:5}: naive {:.3} ms, 1 partition {:.3} ms, split-K ({parts}) {:.3} ms",
                ms(naive),
                ms(one),
                ms(split)
            );
            decode_table.row([
                t.to_string(),
                format!("{:.3}", ms(naive)),
                format!("{:.3}", ms(one)),
                format!("{:.3}", ms(split)),
                parts.to_string(),
                format!("{:.2}×", ms(one) / ms(split)),
            ]);
            naive_d.push((t as f64, ms(naive)));
            one_d.push((t as f64, ms(one)));
            split_d.push((t as f64, ms(split)));
        }
        let decode_md = format!(
            "{}\nOne decode row (one query per head at the last position) against the whole \
         context, {shape_text}. Flash with one partition runs the row as one task (every \
         head, each K and V row read once); split-K cuts the context into the partitions \
         shown (`Partitions::Auto`: 4 tasks per thread, no partition under 256 keys), one task \
         each, merged by log-sum-exp. Median of {decode_reps} timed runs after one untimed \
         run.\n\n{caption}\n",
            decode_table.to_markdown(),
        );
        let decode_svg = LinePlot::new("Decode attention, one sequence")
            .x_label("context (tokens)")
            .y_label("ms per decode step (one layer)")
            .log_x()
            .log_y()
            .series("batch_attention (chapter 4)", &naive_d)
            .series("flash, 1 partition", &one_d)
            .series("flash split-K", &split_d)
            .to_svg();
        figures.push(("decode", Some(decode_md), decode_svg));
    }

    let figures: Vec<(&str, Option<&str>, &str)> = figures
        .iter()
        .map(|(stem, md, svg)| (*stem, md.as_deref(), svg.as_str()))
        .collect();
    write_figures(&out, &figures)?;
    Ok(())
}

/// The benchmarks' attention shape, for the captions.
fn shape_text() -> String {
    format!(
        "{} query heads sharing {} KV heads of {} (SmolLM2-135M's attention), random K/V in \
         an f32 paged pool of blocks of {} in scattered order, one layer",
        SHAPE.num_heads,
        SHAPE.num_kv_heads,
        SHAPE.head_dim,
        measure::BLOCK_SIZE
    )
}
