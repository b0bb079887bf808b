//! The prompts of `kiln bench serve`: windows of a held-out text, with lengths in words.
//!
//! ```text
//! random   every prompt --random-input-len words long, max_tokens --random-output-len
//! corpus   lengths from chapter 2's ShareGPT-like log-normals, scaled by --length-scale and
//!          clipped to --max-input-len / --max-output-len (as `kiln bench ch04` does in tokens)
//! ```
//!
//! The load generator does not tokenize: a prompt's length is counted in words of the corpus,
//! and the server's `usage` reports the real token counts. Each prompt is a slice of the
//! original text (line breaks kept) that starts at a word chosen by the seeded RNG.

use ch02::workload::{RequestLengths, WorkloadRng};

use crate::bench::ch04::workload::ScaledLengths;

/// One request to send: the prompt and how many tokens to ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    pub text: String,
    /// Words in `text`.
    pub words: usize,
    /// `max_tokens` of the request.
    pub max_tokens: usize,
}

/// A text split into words, remembering where each word starts and ends.
pub struct Corpus {
    text: String,
    /// Byte ranges of the words, in order.
    words: Vec<(usize, usize)>,
}

impl Corpus {
    pub fn new(text: String) -> Self {
        let mut words = Vec::new();
        let mut start = None;
        for (i, c) in text.char_indices() {
            match (c.is_whitespace(), start) {
                (false, None) => start = Some(i),
                (true, Some(s)) => {
                    words.push((s, i));
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            words.push((s, text.len()));
        }
        Corpus { text, words }
    }

    pub fn words(&self) -> usize {
        self.words.len()
    }

    /// `len` consecutive words starting at a seeded random word, as they stand in the text.
    /// Panics if `len` is 0 or longer than the corpus.
    pub fn window(&self, len: usize, rng: &mut WorkloadRng) -> &str {
        assert!(
            (1..=self.words.len()).contains(&len),
            "a prompt of {len} words from a corpus of {}",
            self.words.len()
        );
        let first = (rng.next_u64() % (self.words.len() - len + 1) as u64) as usize;
        &self.text[self.words[first].0..self.words[first + len - 1].1]
    }
}

/// `n` prompts of exactly `input_len` words, each asking for `output_len` tokens
/// (vLLM's `--dataset-name random`, with text instead of random token ids).
pub fn random(
    corpus: &Corpus,
    n: usize,
    input_len: usize,
    output_len: usize,
    seed: u64,
) -> anyhow::Result<Vec<Prompt>> {
    let lengths = vec![
        RequestLengths {
            prompt_len: input_len,
            output_len,
        };
        n
    ];
    prompts(corpus, &lengths, seed)
}

/// `n` prompts with chapter 2's long-tailed lengths (`lengths.sample(n, seed)`), in words.
pub fn sharegpt_like(
    corpus: &Corpus,
    n: usize,
    lengths: &ScaledLengths,
    seed: u64,
) -> anyhow::Result<Vec<Prompt>> {
    prompts(corpus, &lengths.sample(n, seed), seed)
}

fn prompts(corpus: &Corpus, lengths: &[RequestLengths], seed: u64) -> anyhow::Result<Vec<Prompt>> {
    let longest = lengths.iter().map(|l| l.prompt_len).max().unwrap_or(0);
    anyhow::ensure!(
        longest <= corpus.words(),
        "a prompt of {longest} words does not fit in the corpus ({} words)",
        corpus.words()
    );
    anyhow::ensure!(
        lengths
            .iter()
            .all(|l| l.prompt_len >= 1 && l.output_len >= 1),
        "prompt and output lengths must be at least 1"
    );
    let mut rng = WorkloadRng::new(seed ^ 0x5eed);
    Ok(lengths
        .iter()
        .map(|l| Prompt {
            text: corpus.window(l.prompt_len, &mut rng).to_string(),
            words: l.prompt_len,
            max_tokens: l.output_len,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(n: usize) -> Corpus {
        let text: Vec<String> = (0..n).map(|i| i.to_string()).collect();
        Corpus::new(format!("  {}\n", text.join(" \n ")))
    }

    #[test]
    fn corpus_words_keep_the_text_between_them() {
        let corpus = Corpus::new("HAMLET.\n  To be, or\tnot".to_string());
        assert_eq!(corpus.words(), 5);
        let mut rng = WorkloadRng::new(0);
        assert_eq!(corpus.window(5, &mut rng), "HAMLET.\n  To be, or\tnot");
        assert_eq!(Corpus::new("  \n ".to_string()).words(), 0);
    }

    #[test]
    fn random_prompts_have_the_asked_lengths_and_are_seeded() {
        let corpus = numbers(1000);
        let a = random(&corpus, 50, 20, 16, 3).unwrap();
        assert_eq!(a, random(&corpus, 50, 20, 16, 3).unwrap());
        assert_ne!(a, random(&corpus, 50, 20, 16, 4).unwrap());
        for p in &a {
            assert_eq!((p.words, p.max_tokens), (20, 16));
            let words: Vec<usize> = p
                .text
                .split_whitespace()
                .map(|w| w.parse().unwrap())
                .collect();
            assert_eq!(words.len(), 20);
            assert!(
                words.windows(2).all(|w| w[1] == w[0] + 1),
                "consecutive words"
            );
        }
        // Not all from the same place.
        assert!(a.iter().any(|p| p.text != a[0].text));
        // The whole corpus is one possible window; one word more is an error.
        assert_eq!(random(&corpus, 1, 1000, 1, 0).unwrap()[0].words, 1000);
        assert!(random(&corpus, 1, 1001, 1, 0).is_err());
        assert!(random(&corpus, 1, 0, 1, 0).is_err());
    }

    #[test]
    fn sharegpt_like_prompts_follow_the_scaled_lengths() {
        let corpus = numbers(1000);
        let lengths = ScaledLengths {
            scale: 0.25,
            max_prompt: 256,
            max_output: 128,
        };
        let prompts = sharegpt_like(&corpus, 200, &lengths, 0).unwrap();
        let expected = lengths.sample(200, 0);
        for (p, l) in prompts.iter().zip(&expected) {
            assert_eq!(p.words, l.prompt_len);
            assert_eq!(p.text.split_whitespace().count(), l.prompt_len);
            assert_eq!(p.max_tokens, l.output_len);
        }
        assert!(
            prompts.iter().any(|p| p.words != prompts[0].words),
            "lengths vary"
        );
    }
}
