//! A chat template's render process: the worker that [`ChatTemplate::isolated`] sends each
//! render to, so that a template that crashes whatever renders it (the module doc of
//! [`super`] says which) ends this process and fails one request, not the server's process and
//! every request in it.
//!
//! A binary serves it as a subcommand that calls [`main`] (`kiln chat-template-worker`):
//! frames on stdin and stdout (`chat_template/wire.rs`), a handshake with the template, then
//! one render per request, each as [`ChatTemplate::render_with`] does it in process, on a
//! [`RENDER_STACK_BYTES`] stack, until stdin closes.

use std::borrow::Cow;
use std::io::{self, Read, Write};

use super::wire::{self, Handshake, Ready, Reply, Request};
use super::{ChatTemplate, RENDER_STACK_BYTES, TemplateError};

/// The address space a worker may use (3 GiB on 64-bit): the render's stack
/// ([`RENDER_STACK_BYTES`], reserved whole when its thread starts) and 2 GiB more, several times
/// what fuel lets a render build (a few hundred megabytes). An allocation past it fails at once
/// and aborts the worker, where without a limit `(['x' * 1000000] * 1000000) ~ ''` would first
/// take gigabytes of the host's memory.
pub const WORKER_ADDRESS_SPACE: u64 = RENDER_STACK_BYTES as u64 + (2 << 30);

/// The worker's whole life: limits this process ([`WORKER_ADDRESS_SPACE`] of address space, no
/// core files), then serves stdin and stdout with [`run`]. Nothing else may write to stdout.
pub fn main() -> io::Result<()> {
    limit_this_process(WORKER_ADDRESS_SPACE)?;
    run(io::stdin().lock(), io::stdout().lock())
}

/// Answers the frames on `input` with frames on `output`: the handshake, then each request in
/// turn, until `input` ends. A template's errors are replies; an error here means a broken
/// pipe or a malformed frame, and ends the worker.
pub fn run(mut input: impl Read, mut output: impl Write) -> io::Result<()> {
    let Some(frame) = wire::read_frame(&mut input)? else {
        return Ok(());
    };
    let handshake: Handshake = wire::decode(&frame)?;
    let compiled = ChatTemplate::from_source(
        &handshake.source,
        handshake.bos_token.map(Cow::into_owned),
        handshake.eos_token.map(Cow::into_owned),
    );
    let (template, ready) = match compiled {
        Ok(template) => (Some(template), Ready::Compiled),
        Err(TemplateError::Thread(e)) => (None, Ready::Thread(e.to_string())),
        Err(TemplateError::Compile { message, .. }) => (None, Ready::Compile(message)),
        Err(e) => (None, Ready::Compile(e.to_string())),
    };
    wire::write_frame(&mut output, &wire::encode(&ready)?)?;
    let Some(template) = template else {
        return Ok(());
    };
    while let Some(frame) = wire::read_frame(&mut input)? {
        // A whole frame that does not decode (JSON nested past serde_json's depth limit, which
        // the HTTP body passed a level or two shallower) fails this request, not the worker.
        let rendered = match wire::decode::<Request>(&frame) {
            Ok(request) => template.render_with(
                &request.messages,
                request.add_generation_prompt,
                &request.extra,
            ),
            Err(e) => Err(TemplateError::Render {
                message: format!("the request could not be read: {e}"),
            }),
        };
        let reply = match rendered {
            Ok(prompt) => Reply::Prompt(prompt),
            Err(TemplateError::Thread(e)) => Reply::Thread(e.to_string()),
            Err(TemplateError::Render { message }) => Reply::Render(message),
            Err(e) => Reply::Render(e.to_string()),
        };
        // A prompt within TEMPLATE_OUTPUT_LIMIT always fits a frame.
        wire::write_frame(&mut output, &wire::encode(&reply)?)?;
    }
    Ok(())
}

/// Lowers this process's limits, soft and hard (so that nothing it runs can raise them again):
/// its address space to `address_space` bytes, where it is higher, and core files to none (a
/// template that crashes a worker on every request would otherwise write one each time).
#[cfg(target_os = "linux")]
fn limit_this_process(address_space: u64) -> io::Result<()> {
    let lower = |resource, bytes: libc::rlim_t| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one `rlimit` through the pointer, which is valid and not
        // aliased for the call.
        if unsafe { libc::getrlimit(resource, &mut limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        limit.rlim_cur = limit.rlim_cur.min(bytes);
        limit.rlim_max = limit.rlim_max.min(bytes);
        // SAFETY: setrlimit reads one `rlimit` through the pointer, valid for the call, and
        // changes only this process's own limits.
        if unsafe { libc::setrlimit(resource, &limit) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    };
    // A limit past what `rlim_t` holds (a 32-bit one) is no limit.
    let address_space = libc::rlim_t::try_from(address_space).unwrap_or(libc::RLIM_INFINITY);
    lower(libc::RLIMIT_AS, address_space)?;
    lower(libc::RLIMIT_CORE, 0)
}

/// Elsewhere than Linux the worker runs unlimited: a crash still ends only the worker.
#[cfg(not(target_os = "linux"))]
fn limit_this_process(_address_space: u64) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_template::ChatMessage;

    /// `frames` in, the worker's frames out, decoded as `Ready` then `Reply`s.
    fn serve(frames: &[Vec<u8>]) -> (Ready, Vec<Reply>) {
        let input = frames.concat();
        let mut output = Vec::new();
        run(&input[..], &mut output).unwrap();
        let mut output = &output[..];
        let ready = wire::decode(&wire::read_frame(&mut output).unwrap().unwrap()).unwrap();
        let mut replies = Vec::new();
        while let Some(frame) = wire::read_frame(&mut output).unwrap() {
            replies.push(wire::decode(&frame).unwrap());
        }
        (ready, replies)
    }

    fn handshake(source: &str) -> Vec<u8> {
        wire::encode(&Handshake {
            source: source.into(),
            bos_token: Some("<s>".into()),
            eos_token: None,
        })
        .unwrap()
    }

    fn request(content: &str) -> Vec<u8> {
        let messages = [ChatMessage::new("user", content)];
        wire::encode(&Request {
            messages: Cow::Borrowed(&messages),
            add_generation_prompt: false,
            extra: Cow::Owned(vec![("x".into(), serde_json::json!(7))]),
        })
        .unwrap()
    }

    #[test]
    fn renders_each_request_in_turn_and_replies_with_the_templates_errors() {
        let source = "{% if messages[0].content == 'fail' %}{{ raise_exception('no: ' ~ x) }}\
                      {% endif %}{{ bos_token }}{{ messages[0].content }}{% if eos_token is defined %}!{% endif %}";
        let (ready, replies) = serve(&[
            handshake(source),
            request("one"),
            request("fail"),
            request("two"),
        ]);
        assert!(matches!(ready, Ready::Compiled), "{ready:?}");
        let replies: Vec<String> = replies.iter().map(|r| format!("{r:?}")).collect();
        assert_eq!(
            replies,
            [
                r#"Prompt("<s>one")"#,
                r#"Render("no: 7")"#,
                r#"Prompt("<s>two")"#,
            ]
        );
    }

    #[test]
    fn a_template_that_does_not_compile_is_answered_and_ends_the_worker() {
        let (ready, replies) = serve(&[handshake("{% if %}"), request("ignored")]);
        assert!(
            matches!(&ready, Ready::Compile(message) if message.contains("syntax error")),
            "{ready:?}"
        );
        assert!(replies.is_empty());
        // No handshake at all: nothing to do.
        let mut output = Vec::new();
        run(&[][..], &mut output).unwrap();
        assert!(output.is_empty());
    }

    #[test]
    fn a_request_that_does_not_decode_fails_alone() {
        let garbage = [&3u32.to_le_bytes()[..], b"{{{"].concat();
        let (ready, replies) = serve(&[
            handshake("{{ messages[0].content }}"),
            garbage,
            request("after"),
        ]);
        assert!(matches!(ready, Ready::Compiled), "{ready:?}");
        assert!(
            matches!(&replies[0], Reply::Render(m) if m.starts_with("the request could not be read")),
            "{replies:?}"
        );
        assert!(
            matches!(&replies[1], Reply::Prompt(p) if p == "after"),
            "{replies:?}"
        );
    }

    #[test]
    fn a_malformed_frame_ends_the_worker_with_an_error() {
        let mut output = Vec::new();
        let garbage = [&3u32.to_le_bytes()[..], b"{{{"].concat();
        assert!(run(&garbage[..], &mut output).is_err());
    }
}
