//! Stop strings over streamed text.
//!
//! A stop string can arrive split across tokens ("\n\n" as "\n" + "\n"), so text that might
//! be the start of a stop string is held back until the next token decides. The text before a
//! stop string is emitted; the stop string itself never is (OpenAI's behaviour).

/// Accumulates generated text and decides what may be released.
/// Invariant: `emitted <= text.len()` and `text[..emitted]` contains no stop string;
/// `borders[i]` is `borders(stops[i])`.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    borders: Vec<Vec<usize>>,
    text: String,
    emitted: usize,
}

/// What [`StopStrings::push`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum StopStatus {
    /// Text safe to emit now (may be empty); generation continues.
    Continue(String),
    /// A stop string was found: the last text to emit, then stop.
    Stopped(String),
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        StopStrings {
            borders: stops.iter().map(|s| borders(s.as_bytes())).collect(),
            stops,
            ..Default::default()
        }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, delta: &str) -> StopStatus {
        // A stop string may start up to (longest stop - 1) bytes before the new text.
        let search_from = self.emitted;
        self.text.push_str(delta);
        let earliest = self
            .stops
            .iter()
            .filter_map(|stop| {
                self.text[search_from..]
                    .find(stop.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(end) = earliest {
            let out = self.text[self.emitted..end].to_string();
            self.text.truncate(end);
            self.emitted = end;
            return StopStatus::Stopped(out);
        }
        let safe = self.text.len() - self.held_back_len();
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        StopStatus::Continue(out)
    }

    /// Releases whatever was held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }

    /// The text so far, up to (not including) a stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Length of the longest suffix of the unreleased text that is a proper prefix of a stop
    /// string: linear in their lengths (trying every prefix would be quadratic per token, and
    /// cubic over a generation that keeps matching a long stop string's start).
    fn held_back_len(&self) -> usize {
        let pending = &self.text.as_bytes()[self.emitted..];
        self.stops
            .iter()
            .zip(&self.borders)
            .map(|(stop, borders)| overlap(pending, stop.as_bytes(), borders))
            .max()
            .unwrap_or(0)
    }
}

/// `b[i]`: the length of the longest proper prefix of `pattern[..=i]` that is also its suffix
/// (Knuth–Morris–Pratt's failure function).
fn borders(pattern: &[u8]) -> Vec<usize> {
    let mut b = vec![0; pattern.len()];
    let mut k = 0;
    for i in 1..pattern.len() {
        while k > 0 && pattern[i] != pattern[k] {
            k = b[k - 1];
        }
        if pattern[i] == pattern[k] {
            k += 1;
        }
        b[i] = k;
    }
    b
}

/// The length of the longest proper prefix of `pattern` that `text` ends with (`borders`:
/// [`borders`] of `pattern`, non-empty). Bytes, not characters: `text` is whole UTF-8, so a
/// prefix it ends with never ends inside a character.
fn overlap(text: &[u8], pattern: &[u8], borders: &[usize]) -> usize {
    let mut matched = 0; // the longest prefix of `pattern` that the bytes read end with
    for &byte in text {
        while matched > 0 && (matched == pattern.len() || byte != pattern[matched]) {
            matched = borders[matched - 1];
        }
        if byte == pattern[matched] {
            matched += 1;
        }
    }
    if matched == pattern.len() {
        borders[matched - 1]
    } else {
        matched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns (emitted text, whether a stop string fired).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            match s.push(piece) {
                StopStatus::Continue(text) => out.push_str(&text),
                StopStatus::Stopped(text) => {
                    out.push_str(&text);
                    assert_eq!(out, s.text());
                    return (out, true);
                }
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_caught_and_not_emitted() {
        assert_eq!(
            run(&["\n\n"], &["Ham", "let.\n", "\nEnter"]),
            ("Hamlet.".to_string(), true)
        );
    }

    #[test]
    fn a_partial_match_is_held_back_then_released() {
        let mut s = StopStrings::new(vec!["END".into()]);
        assert_eq!(s.push("the EN"), StopStatus::Continue("the ".into()));
        assert_eq!(s.push("ding"), StopStatus::Continue("ENding".into()));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["lord", "my"], &["Good my lord"]),
            ("Good ".to_string(), true)
        );
    }

    #[test]
    fn without_stops_everything_is_emitted() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".to_string(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".to_string(), false));
    }

    #[test]
    fn held_back_text_is_released_at_finish() {
        assert_eq!(run(&["xyz"], &["abcx"]), ("abcx".to_string(), false));
    }

    #[test]
    fn multibyte_stop_strings_respect_char_boundaries() {
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".to_string(), true));
        assert_eq!(run(&["—x"], &["a—", "b"]), ("a—b".to_string(), false));
    }

    /// The linear overlap equals its definition: the longest proper prefix of the pattern
    /// that the text ends with, tried length by length.
    #[test]
    fn overlap_equals_trying_every_prefix() {
        use proptest::prelude::*;
        let case = ("[ab]{0,12}", "[ab]{1,6}");
        crate::testing::seeded_runner(512, 17)
            .run(&case, |(text, pattern)| {
                let naive = (1..pattern.len())
                    .filter(|&n| text.ends_with(&pattern[..n]))
                    .max()
                    .unwrap_or(0);
                let fast = overlap(
                    text.as_bytes(),
                    pattern.as_bytes(),
                    &borders(pattern.as_bytes()),
                );
                prop_assert_eq!(fast, naive, "{:?} {:?}", text, pattern);
                Ok(())
            })
            .unwrap();
    }
}
