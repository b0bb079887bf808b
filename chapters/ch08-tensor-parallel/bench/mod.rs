//! `kiln bench ch08-tp`: tensor parallelism on this machine, and a cost model beyond it.
//!
//! 1. All-reduce latency and bandwidth of the thread communicator by message size (of the MPI
//!    communicator with `--communicator mpi`, under mpirun: that run measures only this).
//! 2. TP = 2 against TP = 1 with the same total threads: prefill and decode steps of the
//!    tensor-parallel executor, beside the cost model's prediction from (1) and the TP = 1 time.
//! 3. The cost model on Llama-8B and -70B shapes on an 8-GPU NVLink box: predictions, with their
//!    assumptions in the caption.
//! 4. The pipeline sketch's bubble against `(p − 1) / (m + p − 1)`.
//!
//! `--only PART` runs one of them (`--only pp-bubble`), writing its figure alone.

mod cost;

use std::time::Instant;

use ch04::{Executor, ScheduledSeq, SchedulerOutput};
use ch08tp::{Communicator, KvBlocks, TensorParallelExecutor, thread_group};

use super::svg::LinePlot;
use super::table::Table;
use super::{Output, RunFacts, bench_tokens, model_name, write_figures};
use crate::commands::ModelArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// The tensor-parallel sizes to compare with TP = 1 (each must split the model).
    #[arg(
        long = "tensor-parallel-size",
        value_delimiter = ',',
        default_value = "2"
    )]
    pub tensor_parallel_sizes: Vec<usize>,
    /// threads: the whole benchmark. mpi: only the all-reduce, over the processes mpirun
    /// started (a kiln built with `--features mpi`; rank 0 writes `tp-allreduce-mpi`):
    /// `mpirun -n 2 kiln bench ch08-tp --communicator mpi`.
    #[arg(long, value_enum, default_value = "threads")]
    pub communicator: CommKind,
    /// Run one part only, and write its figure alone (the others' files are left as they are).
    #[arg(long, value_enum, value_name = "PART")]
    pub only: Option<Part>,
}

/// The benchmark's parts, each named for the figure it writes.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// tp-allreduce: the thread communicator's all-reduce by message size.
    #[value(name = "tp-allreduce")]
    Allreduce,
    /// tp-speed: TP = N against TP = 1, measured and predicted.
    #[value(name = "tp-speed")]
    Speed,
    /// tp-cost-model: the cost model on Llama shapes (predictions only).
    #[value(name = "tp-cost-model")]
    CostModel,
    /// pp-bubble: the pipeline sketch's bubble.
    #[value(name = "pp-bubble")]
    Bubble,
}

/// Which communicator the all-reduce part measures.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommKind {
    Threads,
    Mpi,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let reps = args.output.reps(15)?;
    let out = args.output.dir("ch08");

    // 1. All-reduce by message size.
    let sizes = message_sizes(args.output.quick);
    if args.communicator == CommKind::Mpi {
        return mpi_all_reduce(&sizes, reps, &out, &facts);
    }
    let wants = |part: Part| args.only.is_none_or(|only| only == part);
    let mut figures: Vec<(&str, String, String)> = Vec::new();
    if wants(Part::Allreduce) {
        let (md, svg) = all_reduce_figure(&sizes, reps, &facts)?;
        figures.push(("tp-allreduce", md, svg));
    }
    // 2. TP = N against TP = 1, the same total threads.
    if wants(Part::Speed) {
        let (md, svg) = tp_speed_figure(&args, &facts, reps)?;
        figures.push(("tp-speed", md, svg));
    }
    // 3. The cost model on real shapes.
    if wants(Part::CostModel) {
        let (md, svg) = cost::figures(&facts);
        figures.push(("tp-cost-model", md, svg));
    }
    // 4. The pipeline sketch's bubble.
    if wants(Part::Bubble) {
        let (md, svg) = pipeline_bubble(&args, &facts, reps.min(5))?;
        figures.push(("pp-bubble", md, svg));
    }
    let figures: Vec<(&str, Option<&str>, &str)> = figures
        .iter()
        .map(|(stem, md, svg)| (*stem, Some(md.as_str()), svg.as_str()))
        .collect();
    write_figures(&out, &figures)
}

/// Part 1: the thread communicator's all-reduce latency and bandwidth by message size (for
/// 2 and 4 ranks): its table and plot.
fn all_reduce_figure(
    sizes: &[usize],
    reps: usize,
    facts: &RunFacts,
) -> anyhow::Result<(String, String)> {
    let worlds = [2usize, 4];
    let mut latency = Vec::new(); // per world: (floats, seconds)
    for &world in &worlds {
        let points: Vec<(usize, f64)> = sizes
            .iter()
            .map(|&n| Ok((n, all_reduce_seconds(world, n, reps)?)))
            .collect::<anyhow::Result<_>>()?;
        latency.push(points);
    }
    let mut table = Table::new([
        "message",
        "2 ranks: µs",
        "2 ranks: GB/s",
        "4 ranks: µs",
        "4 ranks: GB/s",
    ]);
    for (i, &n) in sizes.iter().enumerate() {
        let bytes = (n * 4) as f64;
        let cell = |w: usize| {
            let t = latency[w][i].1;
            [format!("{:.1}", t * 1e6), format!("{:.2}", bytes / t / 1e9)]
        };
        let [a, b] = cell(0);
        let [c, d] = cell(1);
        table.row([human_bytes(n * 4), a, b, c, d]);
    }
    let allreduce_md = format!(
        "{}\nAll-reduce (sum) of f32 messages through `ThreadComm` (ranks as threads, shared slots \
         and a barrier): median of {reps} timings of 20 back-to-back all-reduces each. GB/s = \
         message bytes / time. {}, {} CPUs, {}. `{}`\n",
        table.to_markdown(),
        facts.cpu.as_deref().unwrap_or("unknown CPU"),
        facts.nproc,
        facts.date,
        facts.command
    );
    let mut plot = LinePlot::new("All-reduce latency, thread communicator")
        .x_label("message bytes")
        .y_label("µs")
        .log_x()
        .log_y();
    for (w, points) in worlds.iter().zip(&latency) {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|&(n, t)| ((n * 4) as f64, t * 1e6))
            .collect();
        plot = plot.series(format!("{w} ranks"), &pts);
    }
    let allreduce_svg = plot.to_svg();
    Ok((allreduce_md, allreduce_svg))
}

/// Part 2: TP = N against TP = 1 with the same total threads, measured and predicted: its
/// table and plot.
fn tp_speed_figure(args: &Args, facts: &RunFacts, reps: usize) -> anyhow::Result<(String, String)> {
    let threads = rayon::current_num_threads();
    let name = model_name(&args.model.model);
    let loader = args.model.loader()?;
    let config = ch01::LlamaConfig::from_dir(&args.model.model)?;
    let batches: &[usize] = if args.output.quick {
        &[1, 4]
    } else {
        &[1, 4, 16, 64]
    };
    let context: usize = 64;
    let mut sizes_tp = vec![1];
    sizes_tp.extend(
        args.tensor_parallel_sizes
            .iter()
            .copied()
            .filter(|&n| n > 1),
    );
    let mut steps = Vec::new(); // per size: (prefill s, decode s per batch)
    for &world in &sizes_tp {
        let shards = ch08tp::load_shards(&args.model.model, &*loader, world)?;
        let per_rank = (threads / world).max(1);
        let blocks =
            KvBlocks::Count(batches.iter().max().unwrap_or(&1) * (context + 1).div_ceil(16));
        let mut executor = TensorParallelExecutor::new(shards, 16, blocks, per_rank)?;
        let prefill = step_seconds(&mut executor, &config, 4, context, false, reps)?;
        let decode: Vec<f64> = batches
            .iter()
            .map(|&b| step_seconds(&mut executor, &config, b, context, true, reps))
            .collect::<anyhow::Result<_>>()?;
        eprintln!(
            "  TP={world} ({per_rank} threads/rank): prefill {:.2} ms, decode {:?} ms",
            prefill * 1e3,
            decode
                .iter()
                .map(|t| (t * 1e4).round() / 10.0)
                .collect::<Vec<_>>()
        );
        steps.push((world, per_rank, prefill, decode));
    }
    let one = &steps[0];
    let mut table = Table::new(["step", "TP=1 ms"].into_iter().map(String::from).chain(
        steps[1..].iter().flat_map(|(w, ..)| {
            [
                format!("TP={w} ms"),
                format!("TP={w} speed-up"),
                format!("TP={w} predicted ms"),
            ]
        }),
    ));
    let hidden = config.hidden_size;
    let ar_time = |world: usize, floats: usize| all_reduce_seconds(world, floats, reps);
    let mut rows: Vec<(String, f64, Vec<f64>, usize)> = vec![(
        format!("prefill 4 × {context}"),
        one.2,
        steps[1..].iter().map(|s| s.2).collect(),
        4 * context,
    )];
    for (i, &b) in batches.iter().enumerate() {
        rows.push((
            format!("decode batch {b}"),
            one.3[i],
            steps[1..].iter().map(|s| s.3[i]).collect(),
            b,
        ));
    }
    let mut measured_pts: Vec<Vec<(f64, f64)>> = vec![Vec::new(); steps.len()];
    let mut predicted_pts: Vec<Vec<(f64, f64)>> = vec![Vec::new(); steps.len() - 1];
    for (label, t1, tn, tokens) in &rows {
        let mut cells = vec![label.clone(), format!("{:.2}", t1 * 1e3)];
        for (j, &t) in tn.iter().enumerate() {
            let world = steps[j + 1].0;
            // The model on a fixed set of cores: the same arithmetic on the same threads takes
            // the same time however it is split (the TP=1 time), and each layer adds two
            // all-reduces of the step's [tokens, hidden], the embedding one more (measured
            // above for this exact size).
            let comm = (2 * config.num_hidden_layers + 1) as f64 * ar_time(world, tokens * hidden)?;
            let predicted = t1 + comm;
            cells.extend([
                format!("{:.2}", t * 1e3),
                format!("{:.2}x", t1 / t),
                format!("{:.2}", predicted * 1e3),
            ]);
            if label.starts_with("decode") {
                predicted_pts[j].push((*tokens as f64, predicted * 1e3));
            }
        }
        table.row(cells);
        if label.starts_with("decode") {
            measured_pts[0].push((*tokens as f64, t1 * 1e3));
            for (j, &t) in tn.iter().enumerate() {
                measured_pts[j + 1].push((*tokens as f64, t * 1e3));
            }
        }
    }
    let tp_md = format!(
        "{}\n{name}, {threads} threads in all (TP=N: N ranks × {} threads each), f32 weights and KV, \
         context {context}: median of {reps} steps. Predicted = TP=1 time (the same threads do \
         the same arithmetic) + (2 · layers + 1) all-reduces of [tokens, hidden] f32 at the \
         latency measured for that size (the logits' all-gather left out). {}, {} CPUs, {}. `{}`\n",
        table.to_markdown(),
        steps.get(1).map_or(threads, |s| s.1),
        facts.cpu.as_deref().unwrap_or("unknown CPU"),
        facts.nproc,
        facts.date,
        facts.command
    );
    let mut plot = LinePlot::new(format!("Decode step time, {name}"))
        .x_label("batch (sequences)")
        .y_label("ms per step")
        .log_x()
        .log_y();
    for (j, pts) in measured_pts.iter().enumerate() {
        plot = plot.series(format!("TP={} measured", steps[j].0), pts);
    }
    for (j, pts) in predicted_pts.iter().enumerate() {
        plot = plot.reference(format!("TP={} predicted", steps[j + 1].0), pts);
    }
    let tp_svg = plot.to_svg();
    Ok((tp_md, tp_svg))
}

/// The measured bubble of the pipeline sketch on 2 stages against `(p − 1) / (m + p − 1)`.
fn pipeline_bubble(args: &Args, facts: &RunFacts, reps: usize) -> anyhow::Result<(String, String)> {
    use ch08tp::pipeline::{ideal_bubble, run_pipeline};
    let stages = 2;
    let model = args.model.load_with(&ch01::linear::DenseLoader)?.model;
    let counts: &[usize] = if args.output.quick {
        &[1, 4]
    } else {
        &[1, 2, 4, 8, 16]
    };
    let prompt = bench_tokens(64, model.config.vocab_size, None);
    let mut table = Table::new([
        "micro-batches m",
        "measured bubble",
        "(p − 1) / (m + p − 1)",
        "makespan ms",
    ]);
    let (mut measured, mut ideal) = (Vec::new(), Vec::new());
    for &m in counts {
        let batches = vec![prompt.clone(); m];
        let runs: Vec<_> = (0..reps)
            .map(|_| run_pipeline(&model, stages, &batches))
            .collect::<Result<_, _>>()?;
        let bubble = median(runs.iter().map(|r| r.bubble_fraction()).collect());
        let makespan = median(runs.iter().map(|r| r.makespan.as_secs_f64()).collect());
        table.row([
            m.to_string(),
            format!("{bubble:.3}"),
            format!("{:.3}", ideal_bubble(stages, m)),
            format!("{:.1}", makespan * 1e3),
        ]);
        measured.push((m as f64, bubble));
        ideal.push((m as f64, ideal_bubble(stages, m)));
    }
    let markdown = format!(
        "{}\nThe pipeline sketch: {} split into {stages} stages (layers {:?} and {:?}; the last \
         stage also runs the final norm and the head), one thread each, micro-batches of one \
         64-token prompt each, chapter 1's forward. Bubble = 1 − Σ stage busy time / (stages × \
         makespan), the makespan from the first stage's start to the last stage's end; median \
         of {reps} runs. {}, {} CPUs, {}. `{}`\n",
        table.to_markdown(),
        model_name(&args.model.model),
        ch08tp::pipeline::stage_layers(0, stages, model.layers.len()),
        ch08tp::pipeline::stage_layers(1, stages, model.layers.len()),
        facts.cpu.as_deref().unwrap_or("unknown CPU"),
        facts.nproc,
        facts.date,
        facts.command
    );
    let svg = LinePlot::new(format!("Pipeline bubble, {stages} stages"))
        .x_label("micro-batches m")
        .y_label("idle share")
        .log_x()
        .series("measured", &measured)
        .reference("(p − 1) / (m + p − 1)", &ideal)
        .to_svg();
    Ok((markdown, svg))
}

/// The all-reduce's message sizes, in floats: 64 to 4 Mi (16 Ki with --quick), by fours.
fn message_sizes(quick: bool) -> Vec<usize> {
    let max_pow = if quick { 14 } else { 22 };
    (6..=max_pow).step_by(2).map(|p| 1usize << p).collect()
}

/// `reps` timings of one all-reduce of `floats` f32 on `comm`'s rank (each the mean of 20
/// back-to-back all-reduces, after one warm-up); every rank of the group calls it together.
fn time_all_reduce(
    comm: &mut dyn Communicator,
    floats: usize,
    reps: usize,
) -> Result<Vec<f64>, ch08tp::CommError> {
    const BACK_TO_BACK: usize = 20;
    let mut buf = vec![1.0f32; floats];
    comm.all_reduce_sum(&mut buf)?; // warm-up: the buffers grow here
    (0..reps)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..BACK_TO_BACK {
                comm.all_reduce_sum(&mut buf)?;
            }
            Ok(start.elapsed().as_secs_f64() / BACK_TO_BACK as f64)
        })
        .collect()
}

/// Median seconds of one all-reduce of `floats` f32 among `world` thread ranks.
fn all_reduce_seconds(world: usize, floats: usize, reps: usize) -> anyhow::Result<f64> {
    let comms = thread_group(world)?;
    let times = std::thread::scope(|s| -> anyhow::Result<Vec<f64>> {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| s.spawn(move || time_all_reduce(&mut comm, floats, reps)))
            .collect();
        let mut all: Vec<Vec<f64>> = Vec::new();
        for h in handles {
            all.push(h.join().map_err(|_| anyhow::anyhow!("a rank panicked"))??);
        }
        Ok(all.swap_remove(0))
    })?;
    Ok(median(times))
}

/// The all-reduce part over MPI's processes: every rank measures, rank 0 writes
/// `tp-allreduce-mpi` (its own timings: the collective ends on every rank together).
#[cfg(feature = "mpi")]
fn mpi_all_reduce(
    sizes: &[usize],
    reps: usize,
    out: &std::path::Path,
    facts: &RunFacts,
) -> anyhow::Result<()> {
    let mut comm = ch08tp::comm::MpiComm::init()?;
    let world = comm.world();
    let mut points = Vec::new(); // (floats, seconds)
    for &n in sizes {
        points.push((n, median(time_all_reduce(&mut comm, n, reps)?)));
    }
    comm.finish(); // every rank's last collective is behind it: MPI may finalize
    if comm.rank() != 0 {
        return Ok(());
    }
    let mut table = Table::new(["message", "µs", "GB/s"]);
    for &(n, t) in &points {
        let bytes = (n * 4) as f64;
        table.row([
            human_bytes(n * 4),
            format!("{:.1}", t * 1e6),
            format!("{:.2}", bytes / t / 1e9),
        ]);
    }
    let markdown = format!(
        "{}\nAll-reduce (sum) of f32 messages through `MpiComm` ({world} processes under mpirun on \
         this machine, each bound to a core by mpirun; an all-gather, then the sum in rank order \
         on every rank): median of {reps} timings of 20 back-to-back all-reduces each, rank 0's. \
         GB/s = message bytes / time. {}, {}. Run as `mpirun -n {world} kiln ...` by a kiln built \
         with `--features mpi`: `{}`\n",
        table.to_markdown(),
        facts.cpu.as_deref().unwrap_or("unknown CPU"),
        facts.date,
        facts.command
    );
    let pts: Vec<(f64, f64)> = points
        .iter()
        .map(|&(n, t)| ((n * 4) as f64, t * 1e6))
        .collect();
    let svg = LinePlot::new("All-reduce latency, MPI communicator")
        .x_label("message bytes")
        .y_label("µs")
        .log_x()
        .log_y()
        .series(format!("{world} processes"), &pts)
        .to_svg();
    write_figures(out, &[("tp-allreduce-mpi", Some(&markdown), &svg)])
}

#[cfg(not(feature = "mpi"))]
fn mpi_all_reduce(_: &[usize], _: usize, _: &std::path::Path, _: &RunFacts) -> anyhow::Result<()> {
    anyhow::bail!("--communicator mpi needs a kiln built with --features mpi, started by mpirun")
}

/// Median seconds of a step of `batch` sequences after `context` positions: a decode step
/// (one token each) or, with `decode` false, a prefill of `context` tokens each.
fn step_seconds(
    executor: &mut TensorParallelExecutor,
    config: &ch01::LlamaConfig,
    batch: usize,
    context: usize,
    decode: bool,
    reps: usize,
) -> anyhow::Result<f64> {
    let tokens = bench_tokens(context + 1, config.vocab_size, None);
    let per_seq = (context + 1).div_ceil(16);
    let seq = |i: usize, tokens: Vec<u32>, start_pos| ScheduledSeq {
        id: i as u64,
        tokens,
        start_pos,
        block_table: ((i * per_seq) as u32..((i + 1) * per_seq) as u32).collect(),
        logit_rows: 1,
    };
    let prefill = SchedulerOutput {
        seqs: (0..batch)
            .map(|i| seq(i, tokens[..context].to_vec(), 0))
            .collect(),
        ..Default::default()
    };
    let step = if decode {
        executor.execute(&prefill).map_err(anyhow::Error::msg)?; // the context's K/V, untimed
        SchedulerOutput {
            seqs: (0..batch)
                .map(|i| seq(i, vec![tokens[context]], context))
                .collect(),
            ..Default::default()
        }
    } else {
        prefill
    };
    executor.execute(&step).map_err(anyhow::Error::msg)?; // warm-up
    let times: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            executor.execute(&step).map_err(anyhow::Error::msg)?;
            Ok(start.elapsed().as_secs_f64())
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(median(times))
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn human_bytes(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
