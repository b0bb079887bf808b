//! What chapter 2's several-token kernels buy speculative decoding: a verification step runs
//! k + 1 tokens through every projection, which on a CPU with AVX-512F take its 16-lane
//! several-token matvec up to six tokens (`kernels::set_tokens_matvec_512`), and otherwise the
//! AVX2 one for two and three tokens and the GEMM micro-kernel beyond. Greedy decoding of one
//! request with n-gram drafts (k = 2 and 4: steps of 3 and 5 tokens), the two ways alternating
//! within one process (medians of tokens/s after the first token); the tokens are the same
//! either way (the kernels compute the same bits).
//!
//! `cargo run --release -p ch06-speculative-decoding --example verify_step_kernels -- MODEL_DIR`

use std::time::Instant;

use ch02::kernels::set_tokens_matvec_512;
use ch02::{WeightDtype, load_fast};
use ch03::KvPool;
use ch04::{CpuExecutor, Engine, EngineConfig, Request};
use ch06_speculative_decoding::{NgramDrafter, SpecConfig, SpeculativeDecoding};

const ROUNDS: usize = 5;
const OUTPUT: usize = 96;
const BLOCK: usize = 16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .ok_or("usage: verify_step_kernels MODEL_DIR")?;
    // On a worker of the pool, as `kiln` runs every command.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    println!(
        "| weights | k | tokens per step | AVX-512 several-token matvec (tokens/s) | without (tokens/s) |"
    );
    println!("|---|---:|---:|---:|---:|");
    for dtype in [WeightDtype::Bf16, WeightDtype::F32] {
        let model = load_fast(dir.as_ref(), dtype)?;
        let vocab = model.config.vocab_size as u32;
        // A passage said three times: the n-gram drafter finds its continuations in the prompt.
        let passage: Vec<u32> = (0..40u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let prompt = passage.repeat(3);
        for k in [2, 4] {
            let mut rates = [Vec::new(), Vec::new()];
            let mut outputs: [Option<Vec<u32>>; 2] = [None, None];
            let mut steps = 0.0;
            for round in 0..=ROUNDS {
                for way in [round % 2, 1 - round % 2] {
                    set_tokens_matvec_512(way == 0);
                    let (rate, tokens, per_step) = pool
                        .install(|| run(&model, &prompt, k))
                        .map_err(|e| e as Box<dyn std::error::Error>)?;
                    if round > 0 {
                        rates[way].push(rate);
                    }
                    steps = per_step;
                    match &outputs[way] {
                        Some(seen) if *seen != tokens => return Err("the outputs differ".into()),
                        _ => outputs[way] = Some(tokens),
                    }
                }
            }
            if outputs[0] != outputs[1] {
                return Err("the two ways produced different tokens".into());
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "| {dtype:?} | {k} | {steps:.2} | {:.1} | {:.1} |",
                median(&mut rates[0]),
                median(&mut rates[1])
            );
        }
    }
    set_tokens_matvec_512(true);
    Ok(())
}

/// One greedy request with n-gram drafts of up to `k` tokens: decode tokens/s after the first
/// token, the tokens, and the mean tokens a verification step yielded.
fn run(
    model: &ch01::Llama,
    prompt: &[u32],
    k: usize,
) -> Result<(f64, Vec<u32>, f64), Box<dyn std::error::Error + Send + Sync>> {
    let blocks = (prompt.len() + OUTPUT + k + 1).div_ceil(BLOCK) + 2;
    let kv = KvPool::<f32>::new(&model.config, BLOCK, blocks)?;
    let config = EngineConfig {
        max_num_seqs: 1,
        ..EngineConfig::default()
    };
    let drafter = NgramDrafter::new(1, 4)?;
    let spec = SpecConfig {
        num_speculative_tokens: k,
        disable_by_batch_size: None,
    };
    let mut engine = Engine::new(CpuExecutor::new(model, kv), config)?
        .with_speculator(Box::new(SpeculativeDecoding::new(drafter, spec)));
    let mut request = Request::greedy(prompt.to_vec(), OUTPUT);
    request.ignore_eos = true;
    let id = engine.add_request(request)?;
    let mut first = None;
    while engine.has_unfinished() {
        let outputs = engine.step_or_stall()?;
        if first.is_none() && outputs.iter().any(|o| !o.new_tokens.is_empty()) {
            first = Some(Instant::now());
        }
    }
    let seconds = first.map_or(0.0, |t| t.elapsed().as_secs_f64());
    let c = engine.scheduler().counters();
    let per_step = (c.spec_decode_num_accepted_tokens + c.spec_decode_num_drafts) as f64
        / c.spec_decode_num_drafts.max(1) as f64;
    let tokens = engine.take(id).ok_or("a finished request")?.tokens;
    Ok(((tokens.len() - 1) as f64 / seconds, tokens, per_step))
}
