//! The prompts of `kiln bench ch06`: windows of Hamlet for the Shakespeare models, and
//! input-grounded requests for an instruction-tuned model: "repeat this passage", the kind of
//! work (editing, quoting, summarising with citations) where n-gram lookup finds its drafts.

use ch01::{SamplingParams, Tokenizer};
use ch04::Request;

/// `n` prompts of `len` tokens (BOS first, when the tokenizer has one) cut from `corpus` at
/// evenly spaced offsets.
pub fn corpus_prompts(corpus: &[u32], bos: Option<u32>, n: usize, len: usize) -> Vec<Vec<u32>> {
    let body = len - usize::from(bos.is_some());
    let span = corpus.len().saturating_sub(body).max(1);
    (0..n)
        .map(|i| {
            let start = span * i / n.max(1);
            bos.into_iter()
                .chain(
                    corpus[start..(start + body).min(corpus.len())]
                        .iter()
                        .copied(),
                )
                .collect()
        })
        .collect()
}

/// `n` passages of the text (about 400 characters, whole lines, starting at a paragraph),
/// each in a request to repeat it whose answer starts with the passage's first paragraph (the
/// model continues a quotation it has begun): in the model's chat format when its tokenizer
/// has one (SmolLM2's `<|im_start|>`), else as plain text.
pub fn grounded_prompts(
    tokenizer: &Tokenizer,
    text: &str,
    n: usize,
) -> anyhow::Result<Vec<Vec<u32>>> {
    let chat = tokenizer.encode("<|im_start|>", false)?.len() == 1;
    let mut prompts = Vec::with_capacity(n);
    for i in 0..n {
        let from = text.len() * (i + 1) / (n + 2);
        let start = text[from..].find("\n\n").map_or(from, |p| from + p + 2);
        let mut passage = String::new();
        for line in text[start..].lines() {
            if passage.len() > 400 {
                break;
            }
            passage.push_str(line);
            passage.push('\n');
        }
        let first = passage.split("\n\n").next().unwrap_or_default();
        let ask = format!(
            "Repeat the following passage from Hamlet exactly, word for word.\n\n{passage}"
        );
        let prompt = if chat {
            format!(
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
                 Hugging Face<|im_end|>\n<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n\
                 {first}\n\n"
            )
        } else {
            format!("{ask}\n{first}\n\n")
        };
        prompts.push(tokenizer.encode(&prompt, true)?);
    }
    Ok(prompts)
}

/// One request per prompt: `max_tokens` each, at `temperature` (0: greedy; else seeded by the
/// prompt's index), stopping at `eos`.
pub fn requests(
    prompts: &[Vec<u32>],
    max_tokens: usize,
    temperature: f32,
    eos: &[u32],
) -> Vec<Request> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let mut request = Request::greedy(prompt.clone(), max_tokens);
            request.params = SamplingParams {
                temperature,
                seed: i as u64,
                ..SamplingParams::default()
            };
            request.stop_token_ids = eos.to_vec();
            request
        })
        .collect()
}
