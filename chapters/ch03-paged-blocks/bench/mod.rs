//! `kiln bench ch03`: what paging buys and what it costs.
//!
//! ```text
//! memory    share of allocated KV memory holding tokens, contiguous vs paged, on chapter 2's
//!           workload; how many of its requests fit at once in one budget
//! sharing   blocks held by n = 4 parallel samples (forked vs independent) and by 100 requests
//!           sharing a 256-token system prompt (prefix cache on vs off); time to first token
//!           with a prefix hit vs cold
//! speed     decode tokens/s, paged (block 16) vs contiguous, side by side
//! ```

mod measure;

use anyhow::bail;
use ch02::workload::{ContiguousUtilisation, LogNormalLengths, Reservation, bytes_per_token};
use ch03::utilisation::{PagedUtilisation, requests_that_fit};

use super::bars::BarChart;
use super::svg::LinePlot;
use super::table::{Align, Table};
use super::{Output, RunFacts, bench_tokens, model_name, ms, write_figures};
use crate::commands::{ModelArgs, parse_bytes};

const REQUESTS: usize = 1000;
const SEED: u64 = 0;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: Output,
    /// Positions per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// The KV budget both caches get in the "requests that fit" comparison.
    #[arg(long, default_value = "4GiB", value_parser = parse_bytes)]
    pub kv_cache_memory: u64,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let facts = RunFacts::collect();
    let reps = args.output.reps(5)?;
    if args.block_size == 0 {
        bail!("--block-size must be at least 1");
    }
    let out = args.output.dir("ch03");
    let loaded = args.model.load()?;
    let model = &loaded.model;
    let config = &model.config;
    let name = model_name(&args.model.model);
    let bs = args.block_size;
    let caption = format!(
        "_{name}, block size {bs}, {}, medians of {reps} runs. Command: `{}`._",
        facts.machine(rayon::current_num_threads()),
        facts.command
    );

    eprintln!("== memory: chapter 2's workload, contiguous vs paged");
    let max_len = config.max_position_embeddings;
    let workload = LogNormalLengths::sharegpt_like(max_len)?.sample(REQUESTS, SEED);
    let contiguous = ContiguousUtilisation::measure(&workload, Reservation::Fixed(max_len))?;
    let paged = PagedUtilisation::measure(&workload, bs)?;
    let token_bytes = bytes_per_token(config, 4);
    let capacity = (args.kv_cache_memory / token_bytes) as usize;
    let fit_contiguous = requests_that_fit(&workload, capacity, None, max_len);
    let fit_paged = requests_that_fit(&workload, capacity, Some(bs), max_len);
    let mut memory = Table::new([
        "KV cache",
        "holds a token (lifetime)",
        "holds a token (time-weighted)",
        "requests that fit at once",
    ])
    .align(0, Align::Left);
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    memory.row([
        format!("contiguous, {max_len} positions reserved per request"),
        pct(contiguous.utilisation()),
        pct(contiguous.time_weighted_utilisation()),
        fit_contiguous.to_string(),
    ]);
    memory.row([
        format!("paged, blocks of {bs}"),
        pct(paged.utilisation()),
        pct(paged.time_weighted_utilisation()),
        fit_paged.to_string(),
    ]);
    let memory_md = format!(
        "{}\nChapter 2's workload ({REQUESTS} requests, seed {SEED}, log-normal prompt and output \
         lengths). Requests that fit: taken in order at their final length into {:.1} GiB \
         ({capacity} positions of {token_bytes} bytes). The PagedAttention paper reports \
         20.4–38.2% for contiguous systems and about 96% for paged.\n\n_Command: `{}`._\n",
        memory.to_markdown(),
        args.kv_cache_memory as f64 / (1u64 << 30) as f64,
        facts.command
    );
    let sizes: Vec<usize> = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        .into_iter()
        .filter(|&b| b <= max_len)
        .collect();
    let sweep: Vec<(f64, f64)> = sizes
        .iter()
        .map(|&b| {
            Ok((
                b as f64,
                100.0 * PagedUtilisation::measure(&workload, b)?.time_weighted_utilisation(),
            ))
        })
        .collect::<Result<_, ch02::workload::WorkloadError>>()?;
    let flat = |v: f64| {
        vec![
            (sizes[0] as f64, 100.0 * v),
            (*sizes.last().unwrap() as f64, 100.0 * v),
        ]
    };
    let memory_svg = LinePlot::new("Share of allocated KV memory holding tokens (time-weighted)")
        .x_label("block size (positions)")
        .y_label("% of allocated KV memory")
        .log_x()
        .series("paged", &sweep)
        .reference(
            format!("contiguous, {max_len} per request"),
            &flat(contiguous.time_weighted_utilisation()),
        )
        .to_svg();

    eprintln!("== sharing: forks and a shared system prompt");
    let (system, user, n_requests) = if args.output.quick {
        (32, 8, 10)
    } else {
        (256, 32, 100)
    };
    let (forked, independent) = measure::parallel_sampling_blocks(bs, 250, 128, 4);
    let cache_on = measure::shared_prefix_blocks(bs, system, user, n_requests, true);
    let cache_off = measure::shared_prefix_blocks(bs, system, user, n_requests, false);
    let block_mib = ch03::KvPool::<f32>::bytes_per_block(config, bs) as f64 / (1u64 << 20) as f64;
    let tokens = bench_tokens(
        (system + 2 * user).max(512).min(max_len),
        config.vocab_size,
        loaded.tokenizer.bos_token_id(),
    );
    let (cold, hit) = measure::ttft(model, &tokens, system, user, bs, reps);
    let mut sharing =
        Table::new(["case", "without sharing", "with sharing", "saved"]).align(0, Align::Left);
    let saved = |a: usize, b: usize| format!("{:.0}%", 100.0 * (1.0 - b as f64 / a as f64));
    let blocks = |b: usize| format!("{b} blocks ({:.1} MiB)", b as f64 * block_mib);
    sharing.row([
        "n = 4 samples of a 250-token prompt, 128 tokens each (fork)".to_string(),
        blocks(independent),
        blocks(forked),
        saved(independent, forked),
    ]);
    sharing.row([
        format!("{n_requests} requests, {system}-token system prompt + {user} own (prefix cache)"),
        blocks(cache_off),
        blocks(cache_on),
        saved(cache_off, cache_on),
    ]);
    sharing.row([
        format!("time to first token, {system} + {user} tokens"),
        format!("{:.1} ms (cold)", ms(cold)),
        format!("{:.1} ms (prefix hit)", ms(hit)),
        format!("{:.1}× faster", ms(cold) / ms(hit)),
    ]);
    let sharing_md = format!(
        "{}\nBlock counts come from the block manager (forks share every block and copy the \
         partial last one on first write; the prefix cache hands a new prompt the cached blocks \
         of its longest cached prefix). A block of {bs} positions holds {block_mib:.2} MiB of \
         f32 K/V for this model.\n\n{caption}\n",
        sharing.to_markdown()
    );
    let sharing_svg = BarChart::new(format!("KV blocks held, {name}"))
        .x_label("blocks")
        .group(
            "n = 4 parallel samples",
            &[
                ("no sharing", independent as f64),
                ("sharing", forked as f64),
            ],
        )
        .group(
            format!("{n_requests} requests, shared system prompt"),
            &[
                ("no sharing", cache_off as f64),
                ("sharing", cache_on as f64),
            ],
        )
        .to_svg();

    eprintln!("== speed: decode paged vs contiguous");
    let (prompt, decode) = if args.output.quick {
        (16, 8)
    } else {
        (128, 64)
    };
    let (contiguous_tok_s, paged_tok_s) =
        measure::decode_speed(model, &tokens, prompt, decode, bs, reps);
    let mut speed = Table::new(["KV cache", "decode tok/s", "relative"]).align(0, Align::Left);
    speed.row([
        "contiguous (chapter 2)".to_string(),
        format!("{contiguous_tok_s:.1}"),
        "1.00".to_string(),
    ]);
    speed.row([
        format!("paged, blocks of {bs}"),
        format!("{paged_tok_s:.1}"),
        format!("{:.2}", paged_tok_s / contiguous_tok_s),
    ]);
    let speed_md = format!(
        "{}\nBatch 1, f32 weights, {decode} decode steps after a {prompt}-token prompt, the two \
         caches measured one after the other in each round.\n\n{caption}\n",
        speed.to_markdown()
    );
    let speed_svg = BarChart::new(format!("Decode, {name}, batch 1"))
        .x_label("tokens/s")
        .group(
            "KV cache",
            &[("contiguous", contiguous_tok_s), ("paged", paged_tok_s)],
        )
        .to_svg();

    write_figures(
        &out,
        &[
            ("memory", Some(&memory_md), &memory_svg),
            ("sharing", Some(&sharing_md), &sharing_svg),
            ("speed", Some(&speed_md), &speed_svg),
        ],
    )?;
    Ok(())
}
