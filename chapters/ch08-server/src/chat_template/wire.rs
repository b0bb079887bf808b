//! What a server and a chat template's render process ([`super::worker`]) say to each other,
//! over the worker's stdin and stdout. Each message is a frame: a `u32` length, little-endian,
//! then that many bytes of JSON.
//!
//! ```text
//! server (ChatTemplate::isolated)                worker (kiln chat-template-worker)
//!   Handshake { source, bos_token, eos_token } ──▶  compiles it (ChatTemplate::from_source)
//!                                              ◀──  Ready::Compiled | Compile | Thread
//!   Request { messages, add_generation_prompt,
//!             extra }                          ──▶  renders it, on its big stack
//!                                              ◀──  Reply::Prompt | Render | Thread
//!   ... one request at a time; the server closing stdin ends the worker
//! ```

use std::borrow::Cow;
use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use super::{ChatMessage, TEMPLATE_OUTPUT_LIMIT};

/// The largest frame either side sends or reads (512 MiB). A prompt is at most
/// [`TEMPLATE_OUTPUT_LIMIT`] bytes, which JSON writes in at most six times as many (`\u0001`),
/// and a request's JSON is about as large as the HTTP body it came in (8 MiB by default). A
/// larger length is a broken peer: refused before anything is allocated for it.
pub(super) const MAX_FRAME_BYTES: usize = 8 * TEMPLATE_OUTPUT_LIMIT;

/// The first frame to a worker: the template to compile, and its special tokens.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Handshake<'a> {
    pub source: Cow<'a, str>,
    pub bos_token: Option<Cow<'a, str>>,
    pub eos_token: Option<Cow<'a, str>>,
}

/// The worker's answer to the handshake: compiled, or the error
/// [`ChatTemplate::from_source`](super::ChatTemplate::from_source) gave (a
/// [`TemplateError::Compile`](super::TemplateError::Compile) message, or a thread that could
/// not start), after which it exits.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Ready {
    Compiled,
    Compile(String),
    Thread(String),
}

/// One render: [`ChatTemplate::render_with`](super::ChatTemplate::render_with)'s arguments.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Request<'a> {
    pub messages: Cow<'a, [ChatMessage]>,
    pub add_generation_prompt: bool,
    pub extra: Cow<'a, [(String, Json)]>,
}

/// A render's outcome: the prompt, or the message of its
/// [`TemplateError::Render`](super::TemplateError::Render) or
/// [`TemplateError::Thread`](super::TemplateError::Thread).
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Reply {
    Prompt(String),
    Render(String),
    Thread(String),
}

/// `message` as a frame, ready to write: `InvalidInput` if its JSON is longer than
/// [`MAX_FRAME_BYTES`].
pub(super) fn encode(message: &impl Serialize) -> io::Result<Vec<u8>> {
    let mut frame = vec![0; 4];
    serde_json::to_writer(&mut frame, message)?;
    let len = frame.len() - 4;
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{len} bytes of JSON, more than a frame's {MAX_FRAME_BYTES}"),
        ));
    }
    frame[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(frame)
}

/// Writes a frame [`encode`] made, and flushes it.
pub(super) fn write_frame(output: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    output.write_all(frame)?;
    output.flush()
}

/// The next frame's JSON; `None` when `input` ends before one starts (the peer is done). A
/// frame cut short is `UnexpectedEof`; a length past [`MAX_FRAME_BYTES`], `InvalidData`.
pub(super) fn read_frame(input: &mut impl Read) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0; 4];
    let mut got = 0;
    while got < len.len() {
        match input.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes, more than {MAX_FRAME_BYTES}"),
        ));
    }
    // Read as it comes, not allocated up front from the length.
    let mut json = Vec::new();
    input.take(len as u64).read_to_end(&mut json)?;
    if json.len() < len {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(Some(json))
}

/// A frame's message.
pub(super) fn decode<T: DeserializeOwned>(json: &[u8]) -> io::Result<T> {
    Ok(serde_json::from_slice(json)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_end_cleanly_only_between_frames() {
        let messages = [ChatMessage::new("user", "Hi\n\u{1}é")];
        let request = Request {
            messages: Cow::Borrowed(&messages),
            add_generation_prompt: true,
            extra: Cow::Owned(vec![("tools".into(), serde_json::json!([{"a": 1}]))]),
        };
        let mut stream = encode(&request).unwrap();
        stream.extend(encode(&Reply::Prompt("p".into())).unwrap());
        let mut input = &stream[..];
        let back: Request = decode(&read_frame(&mut input).unwrap().unwrap()).unwrap();
        assert_eq!(back.messages.as_ref(), &messages);
        assert!(back.add_generation_prompt);
        assert_eq!(back.extra.as_ref(), request.extra.as_ref());
        let reply: Reply = decode(&read_frame(&mut input).unwrap().unwrap()).unwrap();
        assert!(matches!(reply, Reply::Prompt(p) if p == "p"));
        assert!(
            read_frame(&mut input).unwrap().is_none(),
            "the end, between frames"
        );

        // A frame cut inside its length, or inside its JSON: an error, not the end.
        let first = encode(&request).unwrap();
        for cut in [2, first.len() - 1] {
            let err = read_frame(&mut &first[..cut]).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "cut at {cut}");
        }
    }

    #[test]
    fn a_length_past_the_limit_is_refused_before_reading() {
        let len = (MAX_FRAME_BYTES as u32 + 1).to_le_bytes();
        let err = read_frame(&mut &len[..]).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }
}
