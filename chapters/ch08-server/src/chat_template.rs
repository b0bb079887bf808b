//! The model's chat template: a Jinja program, shipped with the model, that turns a list of
//! messages into the one prompt string the model was fine-tuned on.
//!
//! `transformers` renders it with Jinja2 in a particular environment, and a prompt that is off
//! by one newline is a different prompt, so this module copies that environment in minijinja:
//!
//! | transformers (`apply_chat_template`)     | here                                            |
//! |------------------------------------------|-------------------------------------------------|
//! | `trim_blocks=True`, `lstrip_blocks=True` | the same                                        |
//! | `keep_trailing_newline` left `False`     | the same (one trailing newline is dropped)      |
//! | `raise_exception(msg)`                   | fails the render; [`TemplateError::Render`] holds `msg` |
//! | `tojson` (`json.dumps`, `ensure_ascii=False`) | Python's layout: `{"a": 1, "b": [1, 2]}`, `indent`, `sort_keys`, `ensure_ascii` |
//! | `strftime_now(fmt)`                      | the same specifiers, in UTC (not local time)    |
//! | Python string / dict methods             | `minijinja_contrib::pycompat` (`.strip()`, `.items()`, ...) |
//! | variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token` | the same; a token the model does not define is undefined, not `None` |
//!
//! minijinja's `loop_controls` feature is on (Jinja2's `{% break %}` / `{% continue %}`), and
//! its `preserve_order` (maps keep their keys in insertion order, as Python's dicts do, where
//! minijinja otherwise sorts them). Printed lists, dicts and tuples read as Python's `repr`
//! writes them (`{'a': None}`), as in Jinja2, and `//`, `%` and `round` round as Python does
//! (minijinja 2, which this module used until 2026-12-06, printed JSON and rounded otherwise).
//! Known differences: the bounds below, and `tojson(indent=n)` takes `n` up to 32, where Python
//! takes any.
//!
//! A template comes with the model file, so it is untrusted: a render must end in a prompt or
//! an error, never a crash. Its bounds: [`TEMPLATE_FUEL`] of minijinja's fuel;
//! [`TEMPLATE_OUTPUT_LIMIT`] bytes of output, checked as they are written; in `tojson`,
//! [`TOJSON_MAX_DEPTH`] levels of nesting (which also ends a namespace that contains itself),
//! an `indent` of at most [`TOJSON_MAX_INDENT`], and [`TEMPLATE_OUTPUT_LIMIT`] bytes written by
//! all its calls together; and in `str.format`, `str.join` and the `join` and `string` filters,
//! a result bounded by [`TEMPLATE_OUTPUT_LIMIT`] before it is built (and `str.format` fields at
//! most [`FORMAT_MAX_WIDTH`] wide or precise). A render runs on a stack of
//! [`RENDER_STACK_BYTES`], deep enough for minijinja's recursion through the most deeply nested
//! list the fuel lets a template build; compiling runs on such a stack too, for a source of at
//! most [`TEMPLATE_SOURCE_LIMIT`] bytes whose tags hold at most [`TEMPLATE_TAG_LIMIT`] each
//! (`crate::template_size` says why).
//!
//! Fuel counts work and sizes: a unit per instruction, and a unit per 64 bytes or so of what a
//! render writes, of the strings and lists it makes (their items count too), and of the text it
//! hands to filters. minijinja refuses to make a value larger than the fuel left, so fuel also
//! bounds the memory a render builds without writing it: a string doubled in a loop
//! (`{% set ns.s = ns.s ~ ns.s %}`), or many large strings kept in a list, stop at a few hundred
//! megabytes with an out-of-fuel error, where minijinja 2 joined strings of any size until an
//! allocation failed and aborted the process. A template that copies each message's text several
//! times may run out of fuel before its output reaches [`TEMPLATE_OUTPUT_LIMIT`].
//!
//! What a render cannot be kept from doing (minijinja 3.1 offers no limit to set, and
//! operators no hook):
//! - a list repeated by `*` is lazy and costs no fuel, and minijinja charges for turning it into
//!   one string only after building it: `(['x' * 1000000] * 1000000) ~ ''` fails an allocation
//!   of 4 GB and aborts the process. The `join` and `string` filters, `str.join` and
//!   `str.format` are checked here first (`check_joined`, `check_format`), which the `~`
//!   operator cannot be;
//! - minijinja's own printing of a value that contains itself: after `{% set ns.me = ns %}`,
//!   `{{ ns }}` (or anything else that turns `ns` into text) recurses without end, until the
//!   stack overflows, which aborts the process. Only `tojson`, which is ours, has a depth
//!   limit.
//!
//! Neither can be stopped inside the process that renders, so a server renders in another:
//! [`ChatTemplate::isolated`] sends each render to a worker process ([`worker`]; `kiln serve`
//! starts `kiln chat-template-worker`), which caps its own address space at
//! [`worker::WORKER_ADDRESS_SPACE`] (3 GiB, on Linux). Either template then ends its worker, not
//! the server. The render fails with [`TemplateError::Crashed`], which a chat request answers
//! with a 400 as it does any render error, and the next render starts a fresh worker. A worker
//! that cannot start, or ends before it has compiled the template, fails the render with
//! [`TemplateError::WorkerStart`] (the server's trouble, a 503). A worker that gives no answer
//! within [`WORKER_TIMEOUT`] is killed. A template that is not isolated, as `from_source` and
//! `from_model_dir` make it, renders in the calling process, where these two still abort it.

mod isolated;
mod wire;
pub mod worker;

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde_json::Value as Json;

pub use isolated::WORKER_TIMEOUT;

/// The name the template is registered under (it appears in minijinja's error messages).
const TEMPLATE_NAME: &str = "chat_template";
/// The most work one render may take, in minijinja's fuel: one unit per instruction, and about
/// one per 64 bytes written, made or filtered (so five million instructions, or some 320 MB).
pub const TEMPLATE_FUEL: u64 = 5_000_000;
/// The most bytes one render may write (64 MiB), and, separately, the most that all of its
/// `tojson` calls together may produce. Text averages about 4 bytes a token, so this is some 16
/// million tokens, more than any model's context; a render that goes past it fails at once.
pub const TEMPLATE_OUTPUT_LIMIT: usize = 64 << 20;
/// The stack a render (and a compile) runs on. minijinja prints, compares, sorts and drops a nested list
/// recursively, a few hundred bytes of stack per level, and fuel allows lists nested some
/// hundreds of thousands deep (`{% set ns.d = [ns.d] %}` in a loop): on a thread's usual 2 MiB
/// that overflowed the stack, which aborts the process. Only the pages a render touches are
/// ever made, so this is address space, not memory, for every render but such a one.
pub const RENDER_STACK_BYTES: usize = if cfg!(target_pointer_width = "64") {
    1 << 30
} else {
    64 << 20 // a 32-bit process has 4 GB of address space in all
};
pub use crate::template_size::{TEMPLATE_SOURCE_LIMIT, TEMPLATE_TAG_LIMIT};
/// The deepest nesting `tojson` writes, as serde_json reads: deeper (or a value that contains
/// itself) is an error, not a stack overflow.
pub const TOJSON_MAX_DEPTH: usize = 128;
/// The largest `tojson(indent=n)`; real templates use 2 or 4.
pub const TOJSON_MAX_INDENT: usize = 32;

/// One message of a conversation.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// A participant's name, for templates that write it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's calls: `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`, as OpenAI sends them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Json>>,
    /// A `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// Why a template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed JSON in {}: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// `chat_template` is there but not a string or a list of `{"name", "template"}` with a
    /// "default" entry.
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    /// The template is not valid Jinja (or uses something minijinja does not support).
    #[error("chat template{} does not compile: {message}", in_path(path.as_deref()))]
    Compile {
        path: Option<PathBuf>,
        message: String,
    },
    /// Rendering failed: the template called `raise_exception(message)` (then `message` is
    /// exactly its argument), or hit an error such as an undefined attribute, or went past one
    /// of the bounds in the module doc (fuel, output bytes, `tojson` depth or indent).
    #[error("{message}")]
    Render { message: String },
    /// The render's thread could not be started (no memory for its stack): the server's
    /// trouble, not the request's.
    #[error("could not start the chat template's thread: {0}")]
    Thread(std::io::Error),
    /// An isolated template's render process ([`ChatTemplate::isolated`]) ended instead of
    /// answering (a stack overflow, a failed allocation: see the module doc), answered garbage,
    /// or gave no answer within its timeout and was killed. `status` says which, with its exit
    /// status and the last lines it wrote. The request's fault, as `Render` is: the next render
    /// starts a fresh process.
    #[error("the chat template crashed its render process: {status}")]
    Crashed { status: String },
    /// An isolated template's render process could not be started: the server's trouble.
    #[error("could not start the chat template's render process: {0}")]
    Spawn(std::io::Error),
    /// An isolated template's render process started but ended, or failed, before it had
    /// compiled the template (which compiled in this process): the server's trouble too.
    #[error("the chat template's render process did not start: {status}")]
    WorkerStart { status: String },
}

fn in_path(path: Option<&Path>) -> String {
    path.map(|p| format!(" in {}", p.display()))
        .unwrap_or_default()
}

/// A compiled chat template and the special tokens it may refer to. `Send + Sync`: one per
/// server, shared by all handlers.
#[derive(Debug)]
pub struct ChatTemplate {
    /// Holds exactly one template, [`TEMPLATE_NAME`], which compiled.
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Where renders run: `None` in the calling process, else in worker processes.
    isolation: Option<isolated::Isolation>,
}

impl ChatTemplate {
    /// From a Hugging Face model folder: `chat_template.jinja` if present, else
    /// `tokenizer_config.json`'s "chat_template" (a string, or a list of {"name", "template"}
    /// where the one named "default" is used). Also reads bos_token / eos_token (strings, or
    /// objects with a "content" field) from tokenizer_config.json for the template's
    /// `bos_token` / `eos_token` variables. `Ok(None)` when the model has no template.
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let config =
            match read_optional(&config_path)? {
                Some(text) => Some(serde_json::from_str::<Json>(&text).map_err(|source| {
                    TemplateError::Json {
                        path: config_path.clone(),
                        source,
                    }
                })?),
                None => None,
            };
        let jinja_path = dir.join("chat_template.jinja");
        let (source, path) = match read_optional(&jinja_path)? {
            Some(source) => (source, jinja_path),
            None => match config.as_ref() {
                Some(config) => match template_from_config(config, &config_path)? {
                    Some(source) => (source, config_path),
                    None => return Ok(None),
                },
                None => return Ok(None),
            },
        };
        let token = |key| config.as_ref().and_then(|c| special_token(c, key));
        Self::build(source, token("bos_token"), token("eos_token"), Some(path)).map(Some)
    }

    /// From template source and the special tokens (`None`: the variable is undefined).
    pub fn from_source(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        Self::build(source.to_string(), bos_token, eos_token, None)
    }

    fn build(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
        path: Option<PathBuf>,
    ) -> Result<Self, TemplateError> {
        if let Err(message) = crate::template_size::check(&source) {
            return Err(TemplateError::Compile { path, message });
        }
        let mut env = Environment::new();
        // A template comes with the model file: a bound on its work per render, so that
        // nested loops in one cannot spin every chat request for minutes. Real templates take
        // a few hundred units a message.
        env.set_fuel(Some(TEMPLATE_FUEL));
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(python_method);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_filter("join", join);
        env.add_filter("string", string);
        let compiled = on_big_stack(|| env.add_template_owned(TEMPLATE_NAME, source))?;
        compiled.map_err(|e| TemplateError::Compile {
            path,
            message: e.to_string(),
        })?;
        Ok(ChatTemplate {
            env,
            bos_token,
            eos_token,
            isolation: None,
        })
    }

    /// Renders in worker processes from now on, each started as `program args` and serving
    /// [`worker::main`] (`kiln serve` starts `kiln chat-template-worker`), so that a template
    /// that crashes its render fails that render with [`TemplateError::Crashed`] instead of
    /// aborting this process. A worker that gives no answer within [`WORKER_TIMEOUT`] is
    /// killed. Workers start when a render needs one; at most two are kept waiting between renders.
    pub fn isolated(self, program: PathBuf, args: Vec<String>) -> Self {
        self.isolated_with_timeout(program, args, WORKER_TIMEOUT)
    }

    /// [`ChatTemplate::isolated`] with another timeout than [`WORKER_TIMEOUT`].
    pub fn isolated_with_timeout(
        mut self,
        program: PathBuf,
        args: Vec<String>,
        timeout: Duration,
    ) -> Self {
        self.isolation = Some(isolated::Isolation::new(program, args, timeout));
        self
    }

    /// Renders the conversation; `add_generation_prompt` as in transformers'
    /// `apply_chat_template` (append the header that starts the assistant's turn).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        self.render_with(messages, add_generation_prompt, &[])
    }

    /// [`ChatTemplate::render`] with more variables: `tools` (as transformers passes them) and
    /// a request's `chat_template_kwargs`. They cannot override `messages`,
    /// `add_generation_prompt` or the special tokens.
    ///
    /// It renders on a thread of its own with a [`RENDER_STACK_BYTES`] stack (see there): in
    /// this process, or, [`ChatTemplate::isolated`], in a worker process.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &[(String, Json)],
    ) -> Result<String, TemplateError> {
        let Some(isolation) = &self.isolation else {
            return on_big_stack(|| self.render_here(messages, add_generation_prompt, extra))?;
        };
        let source = self.env.get_template(TEMPLATE_NAME).map_err(render_error)?;
        let handshake = wire::Handshake {
            source: Cow::Borrowed(source.source()),
            bos_token: self.bos_token.as_deref().map(Cow::Borrowed),
            eos_token: self.eos_token.as_deref().map(Cow::Borrowed),
        };
        let request = wire::Request {
            messages: Cow::Borrowed(messages),
            add_generation_prompt,
            extra: Cow::Borrowed(extra),
        };
        isolation.render(&handshake, &request)
    }

    /// [`ChatTemplate::render_with`] on the calling thread.
    fn render_here(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: &[(String, Json)],
    ) -> Result<String, TemplateError> {
        let mut ctx: Vec<(&str, Value)> = extra
            .iter()
            .map(|(name, value)| (name.as_str(), Value::from(Serde(value))))
            .collect();
        ctx.push(("messages", Value::from(Serde(messages))));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        for (name, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ] {
            if let Some(token) = token {
                ctx.push((name, Value::from(token.as_str())));
            }
        }
        let ctx = Value::from_pairs(ctx);
        let mut out = LimitedWriter::new(TEMPLATE_OUTPUT_LIMIT);
        self.env
            .get_template(TEMPLATE_NAME)
            .and_then(|t| t.render_captured_to(ctx, &mut out))
            .map_err(render_error)?;
        String::from_utf8(out.bytes).map_err(|e| TemplateError::Render {
            message: format!("chat template wrote invalid UTF-8: {e}"),
        })
    }
}

/// The render's output: an `io::Write` that takes at most `limit` bytes in all and fails the
/// write that would go past it (taking none of it), which fails the render. Invariant:
/// `bytes.len() <= limit`.
struct LimitedWriter {
    bytes: Vec<u8>,
    limit: usize,
}

impl LimitedWriter {
    fn new(limit: usize) -> Self {
        LimitedWriter {
            bytes: Vec::new(),
            limit,
        }
    }
}

impl std::io::Write for LimitedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.limit - self.bytes.len() {
            return Err(std::io::Error::other(OutputTooLarge {
                what: "output",
                limit: self.limit,
            }));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A render, or its `tojson` calls together, wrote more than `limit` bytes.
#[derive(Debug, thiserror::Error)]
#[error("chat template {what} is larger than {limit} bytes")]
struct OutputTooLarge {
    what: &'static str,
    limit: usize,
}

/// The file's text, `None` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<String>, TemplateError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TemplateError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// `chat_template` from a tokenizer_config.json: a string, or the "default" of a named list.
fn template_from_config(config: &Json, path: &Path) -> Result<Option<String>, TemplateError> {
    let fail = |message: &str| TemplateError::Config {
        path: path.to_path_buf(),
        message: message.to_string(),
    };
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => Ok(Some(source.clone())),
        Some(Json::Array(named)) => {
            let default = named
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .ok_or_else(|| {
                    fail("chat_template lists several templates but none named \"default\"")
                })?;
            let source = default
                .get("template")
                .and_then(Json::as_str)
                .ok_or_else(|| fail("chat_template \"default\" has no \"template\" string"))?;
            Ok(Some(source.to_string()))
        }
        Some(_) => Err(fail(
            "chat_template must be a string or a list of {\"name\", \"template\"}",
        )),
    }
}

/// A special token from tokenizer_config.json: `"<s>"` or `{"content": "<s>", ...}`.
fn special_token(config: &Json, key: &str) -> Option<String> {
    match config.get(key)? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// The error of a `raise_exception` call, kept as the source of minijinja's error so that
/// [`render_error`] can give back the template author's message as is.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(
        minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
            .with_source(RaisedException(message)),
    )
}

/// Runs `work` on a thread of its own with a [`RENDER_STACK_BYTES`] stack and waits for it (a
/// panic in it goes on in the caller); an error only when the thread cannot start.
fn on_big_stack<T: Send>(work: impl FnOnce() -> T + Send) -> Result<T, TemplateError> {
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("chat-template".into())
            .stack_size(RENDER_STACK_BYTES)
            .spawn_scoped(scope, work)
            .map_err(TemplateError::Thread)?;
        Ok(thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
    })
}

fn render_error(err: minijinja::Error) -> TemplateError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cause {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return TemplateError::Render {
                message: raised.0.clone(),
            };
        }
        // The output limit: its message alone says what happened, minijinja's adds nothing.
        let too_large = e.downcast_ref::<OutputTooLarge>().or_else(|| {
            e.downcast_ref::<std::io::Error>()?
                .get_ref()?
                .downcast_ref()
        });
        if let Some(too_large) = too_large {
            return TemplateError::Render {
                message: too_large.to_string(),
            };
        }
        cause = e.source();
    }
    TemplateError::Render {
        message: err.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// tojson, as transformers defines it: json.dumps(x, ensure_ascii=False, indent=None,
// sort_keys=False), whose layout is Python's (", " and ": " separators; with indent, ","
// and a newline).
// ---------------------------------------------------------------------------------------------

/// The widest field a template's `str.format` may ask for, as width or precision (`'{:>N}'`,
/// `'{:.N}'`); see `check_format`.
pub const FORMAT_MAX_WIDTH: usize = 4096;

/// Python's string and dict methods (`minijinja_contrib::pycompat`), but a `str.format` is
/// checked first ([`check_format`]): pycompat builds its result, padding included, before any
/// fuel sees it, so `'{:>9999999999}'.format(x)` or `('{0}' * 1000000).format(s)` would fail an
/// allocation and abort the process.
fn python_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    if let Some(text) = value.as_str() {
        match (method, args) {
            ("format", _) => check_format(text, args)?,
            ("join", [items]) => check_joined(items, text.len())?,
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Fails unless `items` joined with a joiner of `joiner_len` bytes stays within
/// [`TEMPLATE_OUTPUT_LIMIT`], bounded by `items`' printed length (each item's text and more)
/// plus a joiner per item, before the string is built: a list repeated with `*` is lazy and
/// costs no fuel, so `(['x' * 1000000] * 1000000) | join` would otherwise allocate 1 TB.
fn check_joined(items: &Value, joiner_len: usize) -> Result<(), minijinja::Error> {
    let joiners = joiner_len.saturating_mul(items.len().unwrap_or(0));
    // The joiners alone first: counting the items' text of a long list takes a while.
    let too_large = |bytes: usize| bytes > TEMPLATE_OUTPUT_LIMIT;
    if too_large(joiners)
        || too_large(printed_len(items, TEMPLATE_OUTPUT_LIMIT - joiners).saturating_add(joiners))
    {
        return Err(too_large_result("join"));
    }
    Ok(())
}

/// The error of an operation `what` refused because its result could pass
/// [`TEMPLATE_OUTPUT_LIMIT`].
fn too_large_result(what: &str) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{what}: its result could be larger than {TEMPLATE_OUTPUT_LIMIT} bytes"),
    )
}

/// minijinja's `join` filter after [`check_joined`].
fn join(
    state: &mut State,
    value: &Value,
    joiner: Option<minijinja::value::StringInput<'_>>,
    attribute: Option<&str>,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    check_joined(value, joiner.as_ref().map_or(0, |j| j.as_str().len()))?;
    minijinja::filters::join(state, value, joiner, attribute, kwargs)
}

/// minijinja's `string` filter, after a check that the text stays within
/// [`TEMPLATE_OUTPUT_LIMIT`] (minijinja charges for it only after building it).
fn string(state: &State, value: &Value) -> Result<Value, minijinja::Error> {
    if printed_len(value, TEMPLATE_OUTPUT_LIMIT) > TEMPLATE_OUTPUT_LIMIT {
        return Err(too_large_result("string"));
    }
    minijinja::filters::string(state, value)
}

/// Fails unless every number in each replacement field's format spec of `format` is at most
/// [`FORMAT_MAX_WIDTH`], and a bound on what `format.format(*args)` writes, the format's length
/// plus, for each field, the widest number and every argument's printed length, is at most
/// [`TEMPLATE_OUTPUT_LIMIT`].
fn check_format(format: &str, args: &[Value]) -> Result<(), minijinja::Error> {
    let refuse = |why: String| Err(minijinja::Error::new(ErrorKind::InvalidOperation, why));
    let specs = format_specs(format);
    let mut widest = 0;
    for spec in &specs {
        for digits in spec.split(|c: char| !c.is_ascii_digit()) {
            match digits.trim_start_matches('0').parse::<usize>() {
                Ok(n) if n <= FORMAT_MAX_WIDTH => widest = widest.max(n),
                Err(_) if digits.trim_start_matches('0').is_empty() => {}
                _ => {
                    return refuse(format!(
                        "str.format: a field's width or precision is at most {FORMAT_MAX_WIDTH}"
                    ));
                }
            }
        }
    }
    let args_len = (args.iter()).fold(0usize, |sum, arg| {
        sum.saturating_add(printed_len(arg, TEMPLATE_OUTPUT_LIMIT))
    });
    let bound =
        (specs.len().saturating_mul(widest.saturating_add(args_len))).saturating_add(format.len());
    if bound > TEMPLATE_OUTPUT_LIMIT {
        return Err(too_large_result("str.format"));
    }
    Ok(())
}

/// The format spec of each replacement field of `format` (empty for a field without one), read
/// as minijinja reads them: `{{` is a literal brace, and a field name's `[key]` may hold any
/// character, `:` and `}` included, without ending the name.
fn format_specs(format: &str) -> Vec<&str> {
    let mut specs = Vec::new();
    let mut rest = format;
    while let Some(open) = rest.find('{') {
        rest = &rest[open + 1..];
        if let Some(after) = rest.strip_prefix('{') {
            rest = after; // `{{`
            continue;
        }
        let (mut spec, mut end) = ("", rest.len());
        let mut chars = rest.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '[' => {
                    let _ = chars.by_ref().find(|&(_, c)| c == ']');
                }
                ':' => {
                    end = rest[i..].find('}').map_or(rest.len(), |close| i + close);
                    spec = &rest[i + 1..end];
                    break;
                }
                '}' => {
                    end = i;
                    break;
                }
                _ => {}
            }
        }
        specs.push(spec);
        rest = &rest[end..];
    }
    specs
}

/// The bytes `value` prints as, counted up to `cap` and `cap + 1` past it: a lazily repeated
/// list is printed only as far as the cap to find out.
fn printed_len(value: &Value, cap: usize) -> usize {
    if let Some(s) = value.as_str() {
        return s.len().min(cap + 1);
    }
    struct Count {
        bytes: usize,
        cap: usize,
    }
    impl std::fmt::Write for Count {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.bytes = self.bytes.saturating_add(s.len());
            if self.bytes > self.cap {
                Err(std::fmt::Error)
            } else {
                Ok(())
            }
        }
    }
    let mut count = Count { bytes: 0, cap };
    let _ = std::fmt::Write::write_fmt(&mut count, format_args!("{value}"));
    count.bytes.min(cap + 1)
}

/// The bytes `tojson` has written so far in one render (a render-local extension of
/// minijinja's state).
#[derive(Debug, Default)]
struct TojsonWritten(usize);

fn tojson(state: &mut State, value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let indent = kwargs.get::<Option<usize>>("indent")?;
    if indent.is_some_and(|n| n > TOJSON_MAX_INDENT) {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: indent is at most {TOJSON_MAX_INDENT}"),
        ));
    }
    let written = state.get_or_insert_extension_with(TojsonWritten::default);
    let json = PyJson {
        indent,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        max_len: TEMPLATE_OUTPUT_LIMIT.saturating_sub(written.0),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    json.write(&value, 0, &mut out)?;
    json.check_len(&out)?;
    written.0 += out.len();
    Ok(Value::from_safe_string(out))
}

/// One `tojson` call. Invariants: the indentation is at most [`TOJSON_MAX_INDENT`], so one
/// line's is at most `TOJSON_MAX_INDENT * (TOJSON_MAX_DEPTH + 1)` bytes; the output is checked
/// against `max_len` before each value, item and character it writes, so it never holds more
/// than `max_len` plus one such piece.
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
    /// What this call may still write: [`TEMPLATE_OUTPUT_LIMIT`] less the render's earlier calls.
    max_len: usize,
}

impl PyJson {
    /// `value` at nesting `depth` (0: the top). Containers are iterated, not collected, so a
    /// huge lazy sequence (`[1] * 10**9`) stops at `max_len` without being built.
    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), minijinja::Error> {
        self.check_len(out)?;
        if depth > TOJSON_MAX_DEPTH {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "tojson: nested deeper than {TOJSON_MAX_DEPTH} levels (or contains itself)"
                ),
            ));
        }
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
            ValueKind::Number => out.push_str(&py_float(f64::try_from(value.clone())?)),
            ValueKind::String => self.write_str(value.as_str().unwrap_or_default(), out)?,
            ValueKind::Seq | ValueKind::Iterable => {
                self.write_items(('[', ']'), value.try_iter()?, depth, out, |item, out| {
                    self.write(&item, depth + 1, out)
                })?;
            }
            ValueKind::Map => {
                let keys: Box<dyn Iterator<Item = Value>> = if self.sort_keys {
                    // An entry takes at least 5 bytes (`"": 0`): more keys than that allows
                    // would not fit, so they are not collected either.
                    let most = self.max_len.saturating_sub(out.len()) / 5 + 1;
                    let mut keys = value
                        .try_iter()?
                        .take(most + 1)
                        .map(|key| Ok((key_text(&key)?, key)))
                        .collect::<Result<Vec<_>, minijinja::Error>>()?;
                    if keys.len() > most {
                        return Err(self.too_large());
                    }
                    keys.sort_by(|(a, _), (b, _)| a.cmp(b));
                    Box::new(keys.into_iter().map(|(_, key)| key))
                } else {
                    Box::new(value.try_iter()?)
                };
                self.write_items(('{', '}'), keys, depth, out, |key, out| {
                    self.write_str(&key_text(&key)?, out)?;
                    out.push_str(": ");
                    self.write(&value.get_item(&key)?, depth + 1, out)
                })?;
            }
            kind => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    /// `open items close`, items separated as Python does with and without `indent`.
    fn write_items(
        &self,
        (open, close): (char, char),
        items: impl Iterator<Item = Value>,
        depth: usize,
        out: &mut String,
        mut write_item: impl FnMut(Value, &mut String) -> Result<(), minijinja::Error>,
    ) -> Result<(), minijinja::Error> {
        out.push(open);
        let mut empty = true;
        for (i, item) in items.enumerate() {
            self.check_len(out)?;
            empty = false;
            match self.indent {
                Some(n) => {
                    out.push_str(if i == 0 { "\n" } else { ",\n" });
                    push_spaces(out, n * (depth + 1));
                }
                None if i > 0 => out.push_str(", "),
                None => {}
            }
            write_item(item, out)?;
        }
        if let (Some(n), false) = (self.indent, empty) {
            out.push('\n');
            push_spaces(out, n * depth);
        }
        out.push(close);
        Ok(())
    }

    fn write_str(&self, s: &str, out: &mut String) -> Result<(), minijinja::Error> {
        self.check_len(out)?;
        if s.len() > self.max_len.saturating_sub(out.len()) {
            return Err(self.too_large());
        }
        out.push('"');
        for c in s.chars() {
            // Escapes make the text up to 6 times longer: check as it grows.
            self.check_len(out)?;
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
        Ok(())
    }

    /// An error once `out` is longer than this call may write.
    fn check_len(&self, out: &str) -> Result<(), minijinja::Error> {
        if out.len() > self.max_len {
            return Err(self.too_large());
        }
        Ok(())
    }

    fn too_large(&self) -> minijinja::Error {
        let too_large = OutputTooLarge {
            what: "tojson output",
            limit: TEMPLATE_OUTPUT_LIMIT,
        };
        minijinja::Error::new(ErrorKind::InvalidOperation, too_large.to_string())
            .with_source(too_large)
    }
}

/// A map key's text as json.dumps writes it: a string as it is; a number, boolean or None as
/// its JSON text (`{1: 0}` → `{"1": 0}`); any other key is an error (Python's TypeError).
fn key_text(key: &Value) -> Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Undefined | ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(py_float(f64::try_from(key.clone())?)),
        kind => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be strings, numbers, booleans or none, not a {kind}"),
        )),
    }
}

/// `n` spaces (at most [`TOJSON_MAX_INDENT`] times [`TOJSON_MAX_DEPTH`] + 1: see [`PyJson`]).
fn push_spaces(out: &mut String, n: usize) {
    out.extend(std::iter::repeat_n(' ', n));
}

/// Python's `repr(float)` (what `json.dumps` writes): shortest round-trip digits, positional
/// for exponents -4..16, else `1e+16` style; `NaN` / `Infinity` as json.dumps allows.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') { s } else { s + ".0" }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

// ---------------------------------------------------------------------------------------------
// strftime_now: the current time (UTC) formatted with Python's strftime specifiers.
// ---------------------------------------------------------------------------------------------

fn strftime_now(format: String) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime_utc(&format, i64::try_from(now).unwrap_or(i64::MAX))
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// Formats a Unix time (UTC) with the strftime specifiers chat templates use: `%Y %y %m %d
/// %e %H %I %M %S %p %B %b %h %A %a %j %%`, and glibc's `%-d`-style unpadded forms. Other
/// specifiers are copied as is.
fn strftime_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let (year, month, day) = civil_from_days(days);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const BEFORE: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = BEFORE[month - 1] + day + i64::from(leap && month > 2);
    let weekday = WEEKDAYS[(days + 4).rem_euclid(7) as usize]; // 1970-01-01 was a Thursday
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = chars.next();
        let unpadded = spec == Some('-');
        if unpadded {
            spec = chars.next();
        }
        let num = |n: i64, width: usize| {
            if unpadded {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let text = match spec {
            Some('Y') => year.to_string(),
            Some('y') => num(year.rem_euclid(100), 2),
            Some('m') => num(month as i64, 2),
            Some('d') => num(day, 2),
            Some('e') => format!("{day:>2}"),
            Some('H') => num(hour, 2),
            Some('I') => num(hour12, 2),
            Some('M') => num(minute, 2),
            Some('S') => num(second, 2),
            Some('j') => num(yday, 3),
            Some('p') => if hour < 12 { "AM" } else { "PM" }.to_string(),
            Some('B') => MONTHS[month - 1].to_string(),
            Some('b' | 'h') => MONTHS[month - 1][..3].to_string(),
            Some('A') => weekday.to_string(),
            Some('a') => weekday[..3].to_string(),
            Some('%') => "%".to_string(),
            Some(other) => format!("%{}{other}", if unpadded { "-" } else { "" }),
            None => "%".to_string(),
        };
        out.push_str(&text);
    }
    out
}

/// (year, month 1..=12, day 1..=31) of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, usize, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the year from March 1
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month as usize, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's template, as in its tokenizer_config.json.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msgs(list: &[(&str, &str)]) -> Vec<ChatMessage> {
        list.iter().map(|(r, c)| ChatMessage::new(r, c)).collect()
    }

    fn render(source: &str, messages: &[(&str, &str)]) -> Result<String, TemplateError> {
        ChatTemplate::from_source(source, Some("<s>".into()), Some("</s>".into()))?
            .render(&msgs(messages), true)
    }

    #[test]
    fn smollm2_template_adds_default_system_prompt() {
        let t = ChatTemplate::from_source(SMOLLM2, None, None).unwrap();
        let conversation = msgs(&[("user", "Hi!"), ("assistant", "Hello."), ("user", "Why?")]);
        assert_eq!(
            t.render(&conversation, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
             Face<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.\
             <|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"
        );
        let with_system = msgs(&[("system", "Be brief."), ("user", "Hi!")]);
        assert_eq!(
            t.render(&with_system, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        );
    }

    /// A list nested about as deep as the fuel allows (some 500 000 levels; more runs out of
    /// fuel, and the partial list is dropped) is printed, measured, compared, sorted, turned
    /// into text and dropped on the render's stack. With 2 MiB of stack, 50 000 levels aborted
    /// the process; with 256 MiB all of these passed.
    #[test]
    fn lists_nested_as_deep_as_the_fuel_allows_do_not_overflow_the_stack() {
        let nest = |depth: usize, then: &str| {
            format!(
                "{{% set ns = namespace(d=[]) %}}{{% for i in range({}) %}}\
                 {{% for j in range(1000) %}}{{% set ns.d = [ns.d] %}}{{% endfor %}}\
                 {{% endfor %}}{then}",
                depth / 1000
            )
        };
        let out_of_fuel = "engine ran out of fuel (in chat_template:1)";
        let err = render(&nest(10_000_000, ""), &[]).unwrap_err();
        assert_eq!(err.to_string(), out_of_fuel);
        let depth = 500_000;
        let printed = render(&nest(depth, "{{ ns.d }}"), &[]).unwrap();
        assert_eq!(printed.len(), 2 * depth + 2, "[[[...]]]");
        for (then, expected) in [
            ("{{ ns.d | length }} {{ ns.d == ns.d }}", "1 True"),
            ("{{ [ns.d, ns.d] | sort | length }}", "2"),
            ("{{ (ns.d ~ '') | length }}", "1000002"),
            ("{{ ns.d | string | length }}", "1000002"),
        ] {
            assert_eq!(render(&nest(depth, then), &[]).unwrap(), expected, "{then}");
        }
        // Ours: refused at its depth limit before any recursion goes deep.
        let err = render(&nest(depth, "{{ ns.d | tojson }}"), &[]).unwrap_err();
        assert!(err.to_string().contains("nest"), "{err}");
    }

    /// A template that builds a huge string without writing it, by doubling one or by keeping
    /// many large ones, stops at its fuel with an error, long before memory runs out (with
    /// minijinja 2 the first aborted the process).
    #[test]
    fn building_huge_strings_runs_out_of_fuel() {
        let out_of_fuel = "engine ran out of fuel (in chat_template:1)";
        let doubled = "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
                       {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";
        assert_eq!(render(doubled, &[]).unwrap_err().to_string(), out_of_fuel);
        let added = "{% set ns = namespace(s='x') %}{% for i in range(64) %}\
                     {% set ns.s = ns.s + ns.s %}{% endfor %}";
        assert_eq!(render(added, &[]).unwrap_err().to_string(), out_of_fuel);
        // 1 MiB strings, each made and kept: no one of them is too large for the fuel left,
        // but together they use it up.
        let kept = "{% set ns = namespace(s='x', l=[]) %}{% for i in range(20) %}\
                    {% set ns.s = ns.s ~ ns.s %}{% endfor %}{% for i in range(400) %}\
                    {% set ns.l = ns.l + [ns.s ~ i] %}{% endfor %}{{ ns.l | length }}";
        assert_eq!(render(kept, &[]).unwrap_err().to_string(), out_of_fuel);
        let fewer = kept.replace("range(400)", "range(20)");
        assert_eq!(render(&fewer, &[]).unwrap(), "20");
        // A message as large as the server's default body limit (8 MiB) still renders.
        let large = "x".repeat(8 << 20);
        assert_eq!(
            render(SMOLLM2, &[("user", &large)]).unwrap().len(),
            large.len() + 148
        );
    }

    /// A `str.format` that asks for a huge field, or whose fields and arguments could write
    /// more than the output limit, fails the render before it is built; so does the `format`
    /// filter's huge field (minijinja's fuel); ordinary formats work.
    #[test]
    fn huge_formats_fail_the_render() {
        let too_wide = "invalid operation: str.format: a field's width or precision is at most \
                        4096 (in chat_template:1)";
        for source in [
            "{{ '{:>9999999999}'.format('x') }}",
            "{{ '{:>99999999999999999999999}'.format('x') }}",
            "{{ '{0:.99999}'.format(1.5) }}",
            "{{ 'a{{b}}{:05000}'.format(1) }}",
            "{{ '{0[}]:>99999999999}'.format({'}': 'x'}) }}",
            "{{ '{a[x:y]:>99999}'.format(a={'x:y': 1}) }}",
        ] {
            assert_eq!(
                render(source, &[]).unwrap_err().to_string(),
                too_wide,
                "{source}"
            );
        }
        let too_large = "invalid operation: str.format: its result could be larger than \
                         67108864 bytes (in chat_template:1)";
        for source in [
            "{{ ('{0}' * 1000000).format('x' * 1000000) }}",
            "{{ ('{0:>4096}' * 100000).format(1) }}",
            "{{ '{}'.format(['x' * 1000000] * 1000000) }}",
        ] {
            assert_eq!(
                render(source, &[]).unwrap_err().to_string(),
                too_large,
                "{source}"
            );
        }
        let out_of_fuel = "engine ran out of fuel (in chat_template:1)";
        let filter = "{{ '%9999999999s' | format('x') }}";
        assert_eq!(render(filter, &[]).unwrap_err().to_string(), out_of_fuel);
        let ok = "{{ '{:>5}|{:.2f}|{{x}}|{:0>4096}'.format('ab', 1.5, 7) | length }}";
        assert_eq!(render(ok, &[]).unwrap(), "4111");
        assert_eq!(
            render("{{ '{:>5}|{:.2f}|é{}'.format('ab', 1.5, 'ü') }}", &[]).unwrap(),
            "   ab|1.50|éü"
        );
    }

    /// A list repeated with `*` is lazy and costs no fuel; joining it or printing it with the
    /// `string` filter into more than the output limit fails before the string is built (it
    /// aborted the process), and ordinary joins still work.
    #[test]
    fn huge_lazy_lists_cannot_be_joined_or_printed() {
        let message = |what: &str| {
            format!(
                "invalid operation: {what}: its result could be larger than 67108864 bytes (in chat_template:1)"
            )
        };
        let huge = "(['x' * 1000000] * 1000000)";
        for (source, what) in [
            (format!("{{{{ {huge} | join }}}}"), "join"),
            (format!("{{{{ {huge} | join(', ') }}}}"), "join"),
            (format!("{{{{ ''.join({huge}) }}}}"), "join"),
            (
                "{{ (['x'] * 100000000) | join('y' * 100) }}".to_string(),
                "join",
            ),
            (format!("{{{{ {huge} | string }}}}"), "string"),
        ] {
            assert_eq!(
                render(&source, &[]).unwrap_err().to_string(),
                message(what),
                "{source}"
            );
        }
        assert_eq!(
            render("{{ ['a', 'b'] | join(', ') }}", &[]).unwrap(),
            "a, b"
        );
        assert_eq!(render("{{ '-'.join(['a', 'b']) }}", &[]).unwrap(), "a-b");
        assert_eq!(render("{{ [1, 'x'] | string }}", &[]).unwrap(), "[1, 'x']");
        let users = "{{ messages | join(', ', attribute='content') }}";
        assert_eq!(
            render(users, &[("user", "a"), ("user", "b")]).unwrap(),
            "a, b"
        );
    }

    /// Printed lists, dicts and tuples read as Python's `repr` writes them, as in Jinja2.
    #[test]
    fn containers_print_as_python_does() {
        assert_eq!(
            render("{{ {'a': 1, 'b': [1, 'x'], 'c': none, 'd': true} }}", &[]).unwrap(),
            "{'a': 1, 'b': [1, 'x'], 'c': None, 'd': True}"
        );
        assert_eq!(render("{{ (1, 'y') }}", &[]).unwrap(), "(1, 'y')");
    }

    /// A template whose loops would run 10^10 times stops at its fuel with an error, quickly;
    /// a conversation of 2,000 messages through SmolLM2's template stays well within it.
    #[test]
    fn a_runaway_template_runs_out_of_fuel_and_a_long_conversation_does_not() {
        let nested =
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}";
        let started = std::time::Instant::now();
        assert!(render(nested, &[("user", "hi")]).is_err());
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        let long: Vec<(&str, &str)> = (0..2000)
            .map(|i| {
                if i % 2 == 0 {
                    ("user", "a question")
                } else {
                    ("assistant", "an answer")
                }
            })
            .collect();
        assert!(render(SMOLLM2, &long).is_ok());
    }

    #[test]
    fn smollm2_from_the_downloaded_model() {
        let dir = ch01::fixtures_dir().join(".cache/SmolLM2-135M-Instruct");
        if !dir.join("tokenizer_config.json").exists() {
            eprintln!("skipped: {} not downloaded (just fixtures)", dir.display());
            return;
        }
        let t = ChatTemplate::from_model_dir(&dir)
            .unwrap()
            .expect("has a template");
        assert_eq!(t.bos_token.as_deref(), Some("<|im_start|>"));
        assert_eq!(t.eos_token.as_deref(), Some("<|im_end|>"));
        let out = t.render(&msgs(&[("user", "What is 2+2?")]), true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
             Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn shakespeare_small_speaks_in_play_script() {
        let dir = ch01::default_model_dir();
        let t = ChatTemplate::from_model_dir(&dir)
            .unwrap()
            .expect("has a template");
        let conversation = msgs(&[
            ("system", "A room in the castle."),
            ("user", "Who goes there?"),
            ("assistant", "Nay, answer me."),
            ("user", "Long live the king!"),
        ]);
        assert_eq!(
            t.render(&conversation, true).unwrap(),
            "<s>[A room in the castle.]\n\nUSER.\nWho goes there?\n\nASSISTANT.\nNay, answer \
             me.\n\nUSER.\nLong live the king!\n\nASSISTANT.\n"
        );
        assert_eq!(
            t.render(&conversation[1..2], false).unwrap(),
            "<s>USER.\nWho goes there?\n\n"
        );
        let err = t.render(&msgs(&[("tool", "{}")]), true).unwrap_err();
        assert!(err.to_string().contains("tool"), "{err}");
    }

    #[test]
    fn raise_exception_message_comes_back_as_is() {
        let source = "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}\
                      {{ raise_exception('Only user and assistant roles are supported!') }}\
                      {% endif %}{{ m.content }}{% endfor %}";
        assert_eq!(
            render(source, &[("user", "a"), ("assistant", "b")]).unwrap(),
            "ab"
        );
        let err = render(source, &[("user", "a"), ("system", "b")]).unwrap_err();
        assert!(matches!(&err, TemplateError::Render { .. }));
        assert_eq!(
            err.to_string(),
            "Only user and assistant roles are supported!"
        );
        // Raised inside a macro, the message still comes back unchanged.
        let in_macro = "{% macro check(m) %}{{ raise_exception('bad ' + m.role) }}{% endmacro %}\
                        {% for m in messages %}{{ check(m) }}{% endfor %}";
        let err = render(in_macro, &[("tool", "x")]).unwrap_err();
        assert_eq!(err.to_string(), "bad tool");
    }

    #[test]
    fn python_string_methods_work() {
        let source = "{% for m in messages %}[{{ m.content.strip() }}]\
                      {% if m.content.strip().startswith('Q') %}?{% endif %}\
                      {{ m.role.upper() }}{% endfor %}";
        assert_eq!(
            render(
                source,
                &[("user", "  Question \n"), ("assistant", " answer ")]
            )
            .unwrap(),
            "[Question]?USER[answer]ASSISTANT"
        );
    }

    #[test]
    fn whitespace_control_matches_transformers() {
        // trim_blocks drops the newline after a block tag; lstrip_blocks drops the indentation
        // before one; the template's single trailing newline is dropped.
        let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(source, &[("user", "a"), ("x", "b"), ("user", "c")]).unwrap(),
            "a\nc\n"
        );
    }

    #[test]
    fn special_tokens_are_variables_and_undefined_when_absent() {
        let source = "{{ bos_token }}|{{ eos_token }}|{{ bos_token is defined }}";
        assert_eq!(render(source, &[]).unwrap(), "<s>|</s>|True");
        let none = ChatTemplate::from_source(source, None, None).unwrap();
        assert_eq!(none.render(&[], false).unwrap(), "||False");
    }

    #[test]
    fn tojson_writes_like_python_json_dumps() {
        let t = |source: &str| render(source, &[]).unwrap();
        assert_eq!(
            t(r#"{{ {'a': [1, 2.5, 1e16, 0.00001, none, true], 'b': {}, 'c': []} | tojson }}"#),
            r#"{"a": [1, 2.5, 1e+16, 1e-05, null, true], "b": {}, "c": []}"#
        );
        assert_eq!(
            t(r#"{{ {'a': [1, {'z': none}], 'b': {}, 'c': [true]} | tojson(indent=2) }}"#),
            "{\n  \"a\": [\n    1,\n    {\n      \"z\": null\n    }\n  ],\n  \"b\": {},\n  \"c\": [\n    true\n  ]\n}"
        );
        // ensure_ascii=False by default: non-ASCII as is, control characters escaped, no
        // HTML escaping of < > & '.
        assert_eq!(
            t(r#"{{ "é<&'>\"\n\x01" | tojson }}"#),
            r#""é<&'>\"\n\u0001""#
        );
        assert_eq!(
            t(r#"{{ "é😀" | tojson(ensure_ascii=true) }}"#),
            r#""\u00e9\ud83d\ude00""#
        );
        assert_eq!(t("{{ messages | tojson }}"), "[]");
        assert!(render("{{ 1 | tojson(bogus=1) }}", &[]).is_err());
    }

    /// A namespace that contains itself, and a value nested past [`TOJSON_MAX_DEPTH`], are
    /// errors that name the depth; the stack would otherwise overflow, aborting the server.
    #[test]
    fn tojson_stops_at_its_depth_limit_and_on_a_value_that_contains_itself() {
        let cyclic = "{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}";
        let err = render(cyclic, &[]).unwrap_err();
        assert!(err.to_string().contains("deeper than 128"), "{err}");
        // Two references to itself: 2^128 paths, but the depth limit ends it at once.
        let twice = "{% set ns = namespace() %}{% set ns.a = ns %}{% set ns.b = ns %}\
                     {{ ns | tojson(sort_keys=true) }}";
        let started = std::time::Instant::now();
        assert!(render(twice, &[]).is_err());
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        let nested = |levels: usize| {
            format!(
                "{{% set ns = namespace(v=1) %}}{{% for i in range({levels}) %}}\
                 {{% set ns.v = [ns.v] %}}{{% endfor %}}{{{{ ns.v | tojson }}}}"
            )
        };
        let deepest = render(&nested(TOJSON_MAX_DEPTH), &[]).unwrap();
        assert_eq!(deepest.len(), 2 * TOJSON_MAX_DEPTH + 1);
        let err = render(&nested(TOJSON_MAX_DEPTH + 1), &[]).unwrap_err();
        assert!(err.to_string().contains("deeper than 128"), "{err}");
    }

    /// `indent` past [`TOJSON_MAX_INDENT`] is an error, where `" ".repeat(n * depth)` would
    /// abort on a failed allocation or overflow.
    #[test]
    fn tojson_refuses_an_indent_past_its_limit() {
        let indented = |n: usize| render(&format!("{{{{ [1] | tojson(indent={n}) }}}}"), &[]);
        assert_eq!(
            indented(TOJSON_MAX_INDENT).unwrap(),
            format!("[\n{}1\n]", " ".repeat(32))
        );
        for n in [TOJSON_MAX_INDENT + 1, 4_611_686_018_427_387_904, usize::MAX] {
            let err = indented(n).unwrap_err();
            assert!(
                err.to_string().contains("indent is at most 32"),
                "{n}: {err}"
            );
        }
        let err = render(
            "{{ messages | tojson(indent=4611686018427387904) }}",
            &[("user", "hi")],
        )
        .unwrap_err();
        assert!(err.to_string().contains("indent"), "{err}");
    }

    /// `tojson` writes at most [`TEMPLATE_OUTPUT_LIMIT`] bytes in a render, all its calls
    /// together, even when what it writes is kept rather than output; a huge lazy sequence is
    /// not built first.
    #[test]
    fn tojson_output_is_bounded_per_render() {
        let too_large = "chat template tojson output is larger than 67108864 bytes";
        let started = std::time::Instant::now();
        let one_call = "{% set s = 'x' * 40000000 %}{{ [s, s] | tojson }}";
        assert_eq!(render(one_call, &[]).unwrap_err().to_string(), too_large);
        let escaped = "{% set s = '\"' * 40000000 %}{% set j = s | tojson %}";
        assert_eq!(render(escaped, &[]).unwrap_err().to_string(), too_large);
        let kept = "{% set s = 'x' * 10000000 %}{% for i in range(100) %}\
                    {% set j = s | tojson %}{% endfor %}";
        assert_eq!(render(kept, &[]).unwrap_err().to_string(), too_large);
        // minijinja itself refuses to repeat a sequence that far (it once built it lazily).
        let lazy = "{% set j = ([1] * 1000000000) | tojson %}";
        let refused = "invalid operation: repeated sequence is too large (in chat_template:1)";
        assert_eq!(render(lazy, &[]).unwrap_err().to_string(), refused);
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        // Under the limit, many calls are fine.
        let many = "{% for i in range(1000) %}{{ messages | tojson }}{% endfor %}";
        assert_eq!(render(many, &[("user", "a")]).unwrap().len(), 1000 * 34);
    }

    #[test]
    fn tojson_map_keys_follow_python() {
        let t = |source: &str| render(source, &[]);
        // `true` and `1` are one key, as in Python (`True == 1`): the later value wins, in
        // the first key's place.
        assert_eq!(
            t("{{ {1: 'a', 'b': 2, true: 3, none: 4} | tojson }}").unwrap(),
            r#"{"1": 3, "b": 2, "null": 4}"#
        );
        assert_eq!(
            t("{{ {1.5: 'a', 'b': 2, false: 3, none: 4} | tojson }}").unwrap(),
            r#"{"1.5": "a", "b": 2, "false": 3, "null": 4}"#
        );
        assert_eq!(
            t("{{ {'b': 1, 'a': {'d': 2, 'c': 3}} | tojson(sort_keys=true) }}").unwrap(),
            r#"{"a": {"c": 3, "d": 2}, "b": 1}"#
        );
        assert!(t("{{ {[1]: 2} | tojson }}").is_err());
    }

    /// A render writes at most [`TEMPLATE_OUTPUT_LIMIT`] bytes: a template that would write
    /// terabytes fails at the first write past the limit, quickly.
    #[test]
    fn output_past_the_limit_fails_the_render() {
        let started = std::time::Instant::now();
        let huge = "{% set s = 'x' * 100000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}";
        let err = render(huge, &[]).unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }));
        assert_eq!(
            err.to_string(),
            "chat template output is larger than 67108864 bytes"
        );
        let many = "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}";
        assert!(render(many, &[]).is_err());
        assert!(started.elapsed() < std::time::Duration::from_secs(20));
        // Exactly the limit is fine.
        let exact = format!("{{{{ 'x' * {TEMPLATE_OUTPUT_LIMIT} }}}}");
        assert_eq!(render(&exact, &[]).unwrap().len(), TEMPLATE_OUTPUT_LIMIT);
    }

    #[test]
    fn strftime_matches_python() {
        // Expected strings from Python's datetime.strftime.
        let cases = [
            (
                1_721_743_509,
                "2024-07-23 14:05:09 24 02 PM July Jul Tuesday Tue 205 %|23 Jul 2024",
            ),
            (
                1_709_164_800,
                "2024-02-29 00:00:00 24 12 AM February Feb Thursday Thu 060 %|29 Feb 2024",
            ),
            (
                946_684_799,
                "1999-12-31 23:59:59 99 11 PM December Dec Friday Fri 365 %|31 Dec 1999",
            ),
            (
                0,
                "1970-01-01 00:00:00 70 12 AM January Jan Thursday Thu 001 %|01 Jan 1970",
            ),
        ];
        for (secs, expected) in cases {
            let format = "%Y-%m-%d %H:%M:%S %y %I %p %B %b %A %a %j %%|%d %b %Y";
            assert_eq!(strftime_utc(format, secs), expected);
        }
        assert_eq!(
            strftime_utc("%-d %B, %-H:%M", 1_709_164_800),
            "29 February, 0:00"
        );
        assert_eq!(strftime_utc("%e|%Q|%", 0), " 1|%Q|%");
        let year = render("{{ strftime_now('%Y') }}", &[]).unwrap();
        assert!(year.parse::<i32>().is_ok_and(|y| y >= 2024), "{year}");
    }

    #[test]
    fn py_float_matches_repr() {
        for (x, repr) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123456789012345.6, "123456789012345.6"),
            (1e16, "1e+16"),
            (2.5e300, "2.5e+300"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(py_float(x), repr);
        }
    }

    /// minijinja parses a run of unary operators by recursion, and compiles a chain of operators
    /// in work that grows with the square of its depth (`crate::template_size`): runs and
    /// chains as long as a tag may hold compile and render, ending in a constant or in a
    /// variable; a tag one byte longer is refused.
    #[test]
    fn operator_runs_as_long_as_a_tag_may_hold_compile() {
        let tag = |body: String| format!("{{{{{body}}}}}");
        let fits = |unit: &str, end: &str| {
            let run = unit.repeat((TEMPLATE_TAG_LIMIT - end.len()) / unit.len());
            tag(format!("{run}{end}"))
        };
        let extra = [("n".to_string(), serde_json::json!(1))];
        for source in [
            fits("-", "1"),
            fits("-", "n"),
            fits("not ", "n"),
            tag(format!("n{}", "-1".repeat((TEMPLATE_TAG_LIMIT - 1) / 2))),
        ] {
            let template = ChatTemplate::from_source(&source, None, None).unwrap();
            let out = template.render_with(&[], false, &extra).unwrap();
            // Minus signs render an integer, `not`s a bool.
            let printed = out.parse::<i64>().is_ok() || ["True", "False"].contains(&&*out);
            assert!(printed, "{out}");
        }
        let over = tag("-".repeat(TEMPLATE_TAG_LIMIT) + "n");
        let err = ChatTemplate::from_source(&over, None, None).unwrap_err();
        assert!(
            err.to_string().contains("kiln compiles tags of up to 2048"),
            "{err}"
        );
    }

    #[test]
    fn compile_errors_are_reported() {
        let err = ChatTemplate::from_source("{% for m in messages %}", None, None).unwrap_err();
        assert!(
            matches!(err, TemplateError::Compile { path: None, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("does not compile"), "{err}");
    }

    fn model_dir(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        dir
    }

    #[test]
    fn loads_string_template_and_object_tokens_from_a_folder() {
        let config = serde_json::json!({
            "bos_token": {"content": "<|begin|>", "lstrip": false},
            "eos_token": "<|end|>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}",
        });
        let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            t.render(&msgs(&[("user", "a"), ("assistant", "b")]), false)
                .unwrap(),
            "<|begin|>a<|end|>b<|end|>"
        );
    }

    #[test]
    fn loads_the_default_of_named_templates() {
        let config = serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT"},
            ],
        });
        let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "DEFAULT");

        let config = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        let dir = model_dir(&[("tokenizer_config.json", &config.to_string())]);
        let err = ChatTemplate::from_model_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TemplateError::Config { .. }), "{err}");
        assert!(err.to_string().contains("default"));
    }

    #[test]
    fn chat_template_jinja_wins_over_the_config() {
        let dir = model_dir(&[
            (
                "tokenizer_config.json",
                r#"{"bos_token": "<s>", "chat_template": "CONFIG"}"#,
            ),
            ("chat_template.jinja", "{{ bos_token }}FILE\n"),
        ]);
        let t = ChatTemplate::from_model_dir(dir.path()).unwrap().unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "<s>FILE");
    }

    #[test]
    fn folder_without_template_is_none_and_bad_files_are_errors() {
        let empty = model_dir(&[]);
        assert!(
            ChatTemplate::from_model_dir(empty.path())
                .unwrap()
                .is_none()
        );
        let no_template = model_dir(&[("tokenizer_config.json", r#"{"bos_token": "<s>"}"#)]);
        assert!(
            ChatTemplate::from_model_dir(no_template.path())
                .unwrap()
                .is_none()
        );

        let bad_json = model_dir(&[("tokenizer_config.json", "{not json")]);
        let err = ChatTemplate::from_model_dir(bad_json.path()).unwrap_err();
        assert!(
            matches!(&err, TemplateError::Json { path, .. } if path.ends_with("tokenizer_config.json"))
        );

        let wrong_type = model_dir(&[("tokenizer_config.json", r#"{"chat_template": 3}"#)]);
        let err = ChatTemplate::from_model_dir(wrong_type.path()).unwrap_err();
        assert!(matches!(err, TemplateError::Config { .. }), "{err}");

        let bad_jinja = model_dir(&[("chat_template.jinja", "{{ unclosed")]);
        let err = ChatTemplate::from_model_dir(bad_jinja.path()).unwrap_err();
        assert!(
            matches!(&err, TemplateError::Compile { path: Some(p), .. } if p.ends_with("chat_template.jinja"))
        );
        assert!(err.to_string().contains("chat_template.jinja"));
    }

    #[test]
    fn template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
