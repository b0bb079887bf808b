//! Generated token ids → the text a caller sees, in one fold used by every path that streams
//! text: chapter 1's generation loop, `kiln generate --prompts-file` and chapter 8's server.
//!
//! ```text
//! token ─▶ TextStream (never half a character) ─▶ StopStrings (never a stop string) ─▶ text
//! ```

use crate::error::Result;
use crate::stop::{StopStatus, StopStrings};
use crate::tokenizer::{TextStream, Tokenizer};

/// What one token (or the end) released.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TextDelta {
    /// Text final now (may be empty).
    pub text: String,
    /// A stop string completed: the caller ends the generation, and this fold releases
    /// nothing more.
    pub stopped: bool,
}

/// One generation's text so far.
///
/// Invariant: once `stopped`, no text is released again.
pub struct OutputText<'t> {
    stream: TextStream<'t>,
    stops: StopStrings,
    stopped: bool,
}

impl<'t> OutputText<'t> {
    /// A fold that decodes with `tokenizer` and ends before any of `stops`.
    pub fn new(tokenizer: &'t Tokenizer, stops: Vec<String>) -> Self {
        Self::after(tokenizer, stops, &[])
    }

    /// The same for a text that continues `context` (the prompt's tokens): see
    /// [`TextStream::after`].
    pub fn after(tokenizer: &'t Tokenizer, stops: Vec<String>, context: &[u32]) -> Self {
        OutputText {
            stream: TextStream::after(tokenizer, context),
            stops: StopStrings::new(stops),
            stopped: false,
        }
    }

    // ANCHOR: push
    /// Adds a generated token; what it releases.
    pub fn push(&mut self, token: u32) -> Result<TextDelta> {
        if self.stopped {
            return Ok(self.delta(String::new()));
        }
        match self.stream.push(token)? {
            Some(piece) => Ok(self.fold(&piece)),
            None => Ok(TextDelta::default()),
        }
    }

    /// Generation ended for another reason (EOS, a length limit): releases what was held
    /// back. That text may still complete a stop string.
    pub fn finish(&mut self) -> Result<TextDelta> {
        if self.stopped {
            return Ok(self.delta(String::new()));
        }
        let mut delta = match self.stream.finish()? {
            Some(piece) => self.fold(&piece),
            None => TextDelta::default(),
        };
        if !delta.stopped {
            delta.text.push_str(&self.stops.finish());
        }
        Ok(delta)
    }
    // ANCHOR_END: push

    /// The text so far, up to (not including) a stop string.
    pub fn text(&self) -> &str {
        self.stops.text()
    }

    pub fn stopped(&self) -> bool {
        self.stopped
    }

    fn fold(&mut self, piece: &str) -> TextDelta {
        match self.stops.push(piece) {
            StopStatus::Continue(text) => self.delta(text),
            StopStatus::Stopped(text) => {
                self.stopped = true;
                self.delta(text)
            }
        }
    }

    fn delta(&self, text: String) -> TextDelta {
        TextDelta {
            text,
            stopped: self.stopped,
        }
    }
}
