//! [`NgramDrafter`]: prompt lookup. Text that quotes, repeats or edits its own input (code,
//! summaries, "repeat after me") often continues the way it went before, so the drafts come
//! from the sequence's own tokens, with no model at all:
//!
//! ```text
//! tokens: … the quick brown fox jumps over … the quick brown ▮
//! suffix of n = 3 tokens "the quick brown" occurred earlier, followed by "fox jumps over …"
//! drafts: fox jumps over (up to k tokens)
//! ```
//!
//! n runs from `max_n` down to `min_n`: the longest suffix that occurred before wins, and of
//! its occurrences the last (most recent) one. Cost per proposal: O(length × max_n) compares,
//! no allocation. The drafts are proposed with certainty (q is one-hot).

use ch04::{Draft, DraftSeq};

use crate::drafter::{DraftError, Drafter};

/// vLLM's `ngram` method, with its `prompt_lookup_min` / `prompt_lookup_max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramDrafter {
    /// Errors unless `1 <= min_n <= max_n`.
    pub fn new(min_n: usize, max_n: usize) -> Result<Self, DraftError> {
        if min_n == 0 || min_n > max_n {
            return Err(DraftError::Config(format!(
                "n-gram lengths need 1 <= min ({min_n}) <= max ({max_n})"
            )));
        }
        Ok(NgramDrafter { min_n, max_n })
    }
}

// ANCHOR: lookup
/// Up to `k` tokens that followed the last earlier occurrence of the longest suffix of
/// `tokens` of `min_n..=max_n` tokens; empty when none occurred before.
pub fn ngram_lookup(tokens: &[u32], min_n: usize, max_n: usize, k: usize) -> &[u32] {
    // ANCHOR: task_6_2
    let len = tokens.len();
    for n in (min_n..=max_n.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // Occurrences starting at `start < len - n`, latest first.
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return &tokens[from..(from + k).min(len)];
        }
    }
    &[]
    // ANCHOR_END: task_6_2
}
// ANCHOR_END: lookup

impl Drafter for NgramDrafter {
    fn propose(&mut self, seqs: &[DraftSeq], drafts: &mut [Draft]) -> Result<(), DraftError> {
        for (seq, draft) in seqs.iter().zip(drafts) {
            let found = ngram_lookup(seq.tokens, self.min_n, self.max_n, seq.max_drafts);
            draft.tokens.extend_from_slice(found);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_suffix_and_its_latest_occurrence_win() {
        //            0  1  2  3  4  5  6  7  8  9
        let tokens = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3];
        // "2 3" occurred at 1 (then 9) and at 5 (then 8): the latest wins.
        assert_eq!(ngram_lookup(&tokens, 1, 3, 2), &[8, 2]);
        // "1 2 3"-length suffixes: "8 2 3" never occurred; "2 3" did.
        assert_eq!(ngram_lookup(&tokens, 2, 3, 5), &[8, 2, 3]);
        // Nothing of length 3 alone.
        assert_eq!(ngram_lookup(&tokens, 3, 3, 5), &[] as &[u32]);
        // A run of one token proposes the run.
        assert_eq!(ngram_lookup(&[5, 5, 5], 1, 2, 4), &[5]);
        assert_eq!(ngram_lookup(&[5], 1, 2, 4), &[] as &[u32]);
    }

    #[test]
    fn lengths_are_checked() {
        assert!(NgramDrafter::new(0, 2).is_err());
        assert!(NgramDrafter::new(3, 2).is_err());
        assert!(NgramDrafter::new(1, 1).is_ok());
    }
}
