//! Stop strings over streamed text.
//!
//! A stop string can arrive split across tokens ("\n\n" as "\n" + "\n"), so text that might
//! be the start of a stop string is held back until the next token decides. The text before a
//! stop string is emitted; the stop string itself never is (OpenAI's behaviour).

/// Accumulates generated text and decides what may be released.
/// Invariant: `emitted <= text.len()` and `text[..emitted]` contains no stop string.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
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
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
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

    /// Length of the longest suffix of the unreleased text that is a proper prefix of a stop string.
    fn held_back_len(&self) -> usize {
        let pending = &self.text[self.emitted..];
        self.stops
            .iter()
            .flat_map(|stop| {
                (1..stop.len().min(pending.len() + 1))
                    .filter(|&n| stop.is_char_boundary(n) && pending.ends_with(&stop[..n]))
            })
            .max()
            .unwrap_or(0)
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
}
