//! A whole greedy decode, timed, as the decode examples share it.

use std::time::Instant;

use ch01::Llama;
use ch01::sampler::argmax;
use ch02_kv_cache::awake::awake;
use ch02_kv_cache::{CachedSession, ContiguousKvCache};

/// Prompt tokens before a timed decode.
const PROMPT: usize = 128;
/// Decode steps timed.
const STEPS: usize = 64;

/// ms per token of a greedy decode of `STEPS` tokens after a `PROMPT`-token prompt (the prompt
/// not timed), the loop inside [`awake`] as `kiln`'s engine runs its steps (its switch,
/// `awake::set_keep_awake`, decides whether the pool's other threads spin).
pub fn decode_ms(model: &Llama) -> f64 {
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let mut cache = ContiguousKvCache::new(&model.config, PROMPT + STEPS + 1);
    cache.populate();
    let mut session = CachedSession::new(model, cache);
    session
        .prefill(&prompt)
        .expect("the cache holds the prompt");
    let start = Instant::now();
    awake(|| {
        let mut token = 1;
        for _ in 0..STEPS {
            let logits = session.decode(token).expect("the cache holds every step");
            // Greedy, as `decode_profile` picks it (the first id if every logit is masked).
            token = argmax(logits.as_slice().expect("one contiguous row")).unwrap_or(0);
        }
    });
    start.elapsed().as_secs_f64() * 1e3 / STEPS as f64
}
