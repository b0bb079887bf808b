//! `kiln`: one binary over the chapter crates.
//!
//! ```text
//! kiln generate   --prompt TEXT            stream a completion, then timings on stderr
//! kiln generate   --prompts-file FILE      one prompt per line, through the engine
//! kiln forward    --prompt TEXT --out FILE logits of every position as safetensors
//! kiln perplexity --file TEXT --ctx 512    llama.cpp-style perplexity
//! kiln quantize   --type q4_0 --out F.gguf a Hugging Face checkpoint → GGUF (kiln and llama.cpp load it)
//! kiln random-model --out DIR              a Llama checkpoint with random weights (llama-1b, tiny-d64)
//! kiln serve     --port 8000              the OpenAI-compatible server (chapter 8)
//! kiln bench ch01 [--quick]                a chapter's benchmark: table + SVG plot for the book
//! kiln exercise new 1 | check 1 [k]        the learner's copy with chapter 1's tasks as todo!; its tests
//! kiln diagrams [--check]                  the book's figures of what the engine did (ch03 blocks, ch04 trace)
//! kiln figures                             check that every figure in the book names the command that wrote it
//! ```
//! `--model` defaults to the embedded shakespeare-small fixture.

mod bench;
mod commands;
mod diagrams;
mod exercise;
mod figures;

use clap::{Parser, Subcommand};

/// Counts heap bytes (live and peak) for the benchmarks' memory tables; forwards to the system
/// allocator.
#[global_allocator]
static ALLOCATOR: bench::alloc::Counting = bench::alloc::Counting;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "LLM inference serving, built chapter by chapter"
)]
struct Cli {
    /// Worker threads for the kernels [default: one per CPU].
    #[arg(long, short = 't', global = true, value_name = "N")]
    threads: Option<usize>,
    /// Keep the row-wise ops between the matrix products (norms, RoPE, residual adds, SiLU,
    /// sampling) on the calling thread, as before they were threaded; results are identical.
    /// For before/after measurements of any command.
    #[arg(long, global = true)]
    serial_elementwise: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout, or from a file of prompts at once.
    Generate(commands::generate::Args),
    /// Write the logits of every prompt position to a safetensors file (tensor `logits`, [T, vocab], f32).
    Forward(commands::forward::Args),
    /// Score a text file as llama.cpp's perplexity tool does.
    Perplexity(commands::perplexity::Args),
    /// Write a Hugging Face checkpoint as a GGUF file in one of llama.cpp's types (f32 ... q6_k).
    Quantize(commands::quantize::Args),
    /// Write a Hugging Face Llama checkpoint with random weights (Llama-3.2-1B's shape or a tiny
    /// head_dim-64 model), for benchmarks and tests.
    RandomModel(commands::random_model::Args),
    /// Serve the model over an OpenAI-compatible HTTP API (completions, chat, metrics).
    Serve(commands::serve::Args),
    /// Run a chapter's benchmark: print a markdown table, write it and an SVG plot for the book.
    Bench(bench::Args),
    /// The learner's path: a copy with a chapter's task bodies as todo!, and their tests.
    Exercise(exercise::Args),
    /// Rank 1.. of a tensor-parallel group of processes under mpirun (chapter 8; a kiln built
    /// with --features mpi): `mpirun -n 1 kiln generate --tensor-parallel-size N
    /// --tensor-parallel-backend mpi ... : -n N-1 kiln tp-worker --model DIR`.
    TpWorker(commands::tensor_parallel::WorkerArgs),
    /// Draw the book's figures of what the engine did (chapter 3's block tables, chapter 4's trace).
    Diagrams(diagrams::Args),
    /// Check that every figure the book shows names the command of this repository that wrote
    /// it, and that the command (still) writes it.
    Figures(figures::Args),
    /// `kiln serve`'s chat template renders: frames on stdin and stdout (ch08's
    /// chat_template/worker.rs), so that a template that crashes ends this process, not the
    /// server. Not for people: hidden from --help.
    #[command(name = commands::serve::CHAT_TEMPLATE_WORKER, hide = true)]
    ChatTemplateWorker,
}

/// The most `--threads` per CPU of the machine.
const MAX_THREADS_PER_CPU: usize = 8;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // More threads than a few per CPU only queue behind each other (thousands take seconds a
    // token): refused, not run.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(threads) = cli.threads
        && threads > MAX_THREADS_PER_CPU * cpus
    {
        anyhow::bail!(
            "--threads {threads}: this machine has {cpus} CPUs; at most {} threads",
            MAX_THREADS_PER_CPU * cpus
        );
    }
    if let Command::ChatTemplateWorker = cli.command {
        // Before the thread pool: the worker needs no threads but its render's, and limits its
        // own address space.
        return Ok(ch08::chat_template::worker::main()?);
    }
    ch02::elementwise::set_parallel_elementwise(!cli.serial_elementwise);
    // Every command runs on a worker of the kernels' thread pool: parallel loops started there
    // queue their jobs on the worker's own deque, so a decode step allocates nothing.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(cli.threads.unwrap_or(0)) // 0: one per CPU
        .build()?;
    let pool = std::sync::Arc::new(pool);
    if let Command::Serve(args) = cli.command {
        // The server runs its engine loop on the pool itself (and HTTP on tokio).
        return commands::serve::run(args, pool);
    }
    pool.install(|| match cli.command {
        Command::Serve(_) | Command::ChatTemplateWorker => unreachable!("handled above"),
        Command::Generate(args) => commands::generate::run(args),
        Command::Forward(args) => commands::forward::run(args),
        Command::Perplexity(args) => commands::perplexity::run(args),
        Command::Quantize(args) => commands::quantize::run(args),
        Command::RandomModel(args) => commands::random_model::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Exercise(args) => exercise::run(args),
        Command::TpWorker(args) => commands::tensor_parallel::run_worker(args),
        Command::Diagrams(args) => diagrams::run(args),
        Command::Figures(args) => figures::run(args),
    })
}
