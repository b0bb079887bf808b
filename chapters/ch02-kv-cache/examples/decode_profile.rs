//! Where one decoded token's time goes, op by op, on one sequence (chapter 2's cached session):
//! prefill `PROMPT` tokens, then decode `STEPS` tokens with the profile on; prints ms per token
//! for each op and for the whole step.
//!
//! `cargo run --release -p ch02-kv-cache --example decode_profile -- MODEL_DIR [f32|bf16]`

use std::time::Instant;

use ch01::sampler::argmax;
use ch02_kv_cache::awake::awake;
use ch02_kv_cache::profile;
use ch02_kv_cache::{CachedSession, ContiguousKvCache, WeightDtype, load_fast};

const PROMPT: usize = 128;
const STEPS: usize = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // On a worker of the pool, as `kiln` runs every command: parallel loops queue on the
    // worker's own deque instead of waking the pool from outside.
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    pool.install(profile_decode)
        .map_err(|e| e as Box<dyn std::error::Error>)
}

fn profile_decode() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .ok_or("usage: decode_profile MODEL_DIR [f32|bf16]")?;
    let dtype: WeightDtype = args.next().unwrap_or_else(|| "f32".into()).parse()?;
    let model = load_fast(dir.as_ref(), dtype)?;
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    for round in 0..2 {
        let mut cache = ContiguousKvCache::new(&model.config, PROMPT + STEPS + 1);
        cache.populate(); // as the benchmark does before its clock
        let mut session = CachedSession::new(&model, cache);
        session.prefill(&prompt)?;
        profile::set_enabled(round == 1);
        profile::take();
        let start = Instant::now();
        // As `kiln`'s engine runs its steps: the pool's other thread spinning (`awake`).
        awake(|| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            let mut token = 1;
            for _ in 0..STEPS {
                let logits = session.decode(token)?;
                token = argmax(logits.as_slice().expect("one contiguous row")).unwrap_or(0); // greedy
            }
            Ok(())
        })?;
        let ms = start.elapsed().as_secs_f64() * 1e3 / STEPS as f64;
        if round == 1 {
            let ops = profile::take();
            let mut sum = 0.0;
            for (op, t) in ops {
                let t = t.as_secs_f64() * 1e3 / STEPS as f64;
                sum += t;
                println!("{:12} {t:7.3} ms", op.name());
            }
            println!("{:12} {:7.3} ms", "other", ms - sum);
            println!("{:12} {ms:7.3} ms ({:.1} tok/s)", "step", 1e3 / ms);
        }
    }
    Ok(())
}
