//! From an OpenAI request to the engine's [`Request`]s: every accepted parameter is checked
//! and mapped, or the request is refused with the parameter's name.

use std::sync::Arc;

use ch01::SamplingParams;
use ch04::{LogitsProcessor, Request};

use crate::error::ApiError;
use crate::protocol::Sampling;
use crate::structured::{Compiled, Constraint, EndedEarly, RequestProcessor, TokenRules};

/// The most alternatives `logprobs` / `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// The most choices one request may ask for (`n`).
pub const MAX_N: u32 = 16;
/// The most prompts one completions request may list (each is `n` engine sequences).
pub const DEFAULT_MAX_PROMPTS: usize = 64;
/// The most token entries one response may carry: every choice's max_tokens, times one plus
/// its logprobs alternatives, and every choice's echo at [`ECHO_BYTES_PER_ENTRY`]. At a few
/// dozen bytes an entry, a response stays under ~100 MB.
pub const MAX_RESPONSE_ENTRIES: usize = 1 << 21;
/// Bytes of echoed prompt text counted as one response entry: each choice carries its own copy
/// of its prompt's text, so `echo` with `n` 16 writes every prompt 16 times.
pub const ECHO_BYTES_PER_ENTRY: usize = 32;

/// The parts of a request that apply to each of its choices, checked.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Choice `p × n + i` is seeded `params.seed + p × n + i`, or `params.seed + i` when
    /// `seeded` (see [`Generation::requests`]).
    pub params: SamplingParams,
    /// Whether the client gave the `seed`.
    pub seeded: bool,
    /// How many completions per prompt.
    pub n: usize,
    pub max_tokens: Option<usize>,
    /// The field the client gave `max_tokens` in (`max_tokens` or `max_completion_tokens`),
    /// named in the errors about it.
    pub max_tokens_param: &'static str,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    /// Keep the text of the stop token that ended a choice (its stop strings are refused).
    pub include_stop_str_in_output: bool,
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's logprob and its `k` best alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// What the output must match, and the request field that asked (see [`constraint`]).
    pub constraint: Option<(Constraint, &'static str)>,
    /// The constraint compiled (by the route, off the runtime), one matcher per choice.
    pub grammar: Option<Arc<Compiled>>,
    /// logit_bias, allowed_token_ids, min_tokens; bad_words once the route tokenized them.
    pub rules: TokenRules,
    /// `bad_words` as sent, for the route to tokenize.
    pub bad_words: Vec<String>,
    /// Lower runs first.
    pub priority: i32,
    /// Keep only the prompt's last this many tokens.
    pub truncate_prompt_tokens: Option<usize>,
    /// The tokenizer the choices' tokens are decoded with, when not the server's: an `auto`
    /// tool request's where the tool-call tags are special tokens ([`crate::tools::tag_decoder`]).
    pub decoder: Option<Decoder>,
}

/// A tokenizer for [`Generation::decoder`].
#[derive(Clone)]
pub struct Decoder(pub Arc<ch01::Tokenizer>);

impl std::fmt::Debug for Decoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Decoder(..)")
    }
}

/// The most entries `logit_bias`, `stop_token_ids` or `bad_words` may have
/// (`allowed_token_ids`: the vocabulary, each id once).
pub const MAX_TOKEN_RULES: usize = 1024;

/// The most choices (n × prompts) of one request with structured output: each holds its own
/// grammar state, whose lexer grows with what it generates, up to its 25,000 states. A pattern
/// made to grow it (`^(.*a.{30}|.*b.{31}|.*c.{32}|.*d.{33})$`) filled them within 16 tokens:
/// 64 choices took the process from 55 MB to 642 MB, about 9 MB a choice; 16 hold some 150 MB.
pub const MAX_CONSTRAINED_CHOICES: usize = 16;

/// The most bytes one `stop` string or one `bad_words` entry may have: every choice holds its
/// own copy, and each word is tokenized (twice) before the request is admitted.
pub const MAX_RULE_TEXT_BYTES: usize = 1024;

/// The most bytes all of a request's `bad_words` may have together: each is tokenized twice
/// (alone and after a space) before the request is admitted, on a blocking thread. 1,024 words
/// of 1 KiB took 1.1 s there; 64 words of 1 KiB add 20-30 ms to a one-token completion, as do
/// 1,024 words of 64 bytes (SmolLM2's tokenizer, 2026-12-07).
pub const MAX_BAD_WORDS_BYTES: usize = 64 * 1024;

/// Server-wide values a request is checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
    /// Most prompts per completions request.
    pub max_prompts: usize,
    /// Most bytes of input text one token can stand for (see [`max_token_bytes`]).
    pub max_token_bytes: usize,
    /// Whether requests may ask for a `priority` (`--scheduling-policy priority`): off, a
    /// priority other than 0 is refused, since any client could otherwise jump every queue.
    pub priority_scheduling: bool,
}

// ANCHOR: max_token_bytes
/// The most bytes of input text any one token of `tokenizer` can stand for: its longest token
/// as written in the vocabulary, times 4. A token's written form is never shorter than the
/// text it covers (byte-level tokens write each byte as one or two bytes, SentencePiece writes
/// a space as three, byte fallback writes a byte as six), except where a normalizer shrinks the
/// text first, and a Unicode normalization turns one character of at most 4 bytes into at least
/// one byte: hence the factor. So a text of `b` bytes is at least `⌈b / max_token_bytes⌉`
/// tokens, which is known before tokenizing it. (A normalizer that deletes characters outright
/// would break the bound; the Llama-family tokenizers kiln loads have none.)
pub fn max_token_bytes(tokenizer: &ch01::Tokenizer) -> usize {
    let inner = tokenizer.inner();
    let longest = (0..inner.get_vocab_size(true) as u32)
        .filter_map(|id| inner.id_to_token(id))
        .map(|token| token.len())
        .max()
        .unwrap_or(1);
    4 * longest.max(1)
}
// ANCHOR_END: max_token_bytes

// ANCHOR: fits_by_bytes
/// Refuses a text of `bytes` bytes that cannot fit the context, before it is tokenized: it is
/// at least `⌈bytes / max_token_bytes⌉` tokens, and needs room for `max_tokens` (at least one)
/// more. Tokenizing 8 MB takes seconds and a gigabyte; this takes nothing. (A request with
/// `truncate_prompt_tokens` skips it: only the suffix its kept tokens need is tokenized,
/// `prompt_pieces::last_tokens`.) `max_tokens` comes with the field the client gave it in, which the error
/// names when the completion alone fills the context; otherwise it names `param`, the text's.
pub fn fits_by_bytes(
    bytes: usize,
    max_tokens: Option<(u32, &str)>,
    param: &str,
    limits: &Limits,
) -> Result<(), ApiError> {
    let at_least = bytes.div_ceil(limits.max_token_bytes);
    let completion = max_tokens.map_or(1, |(m, _)| m.max(1) as usize);
    if at_least.saturating_add(completion) > limits.max_model_len {
        let at_fault = match max_tokens {
            Some((_, field)) if completion >= limits.max_model_len => field,
            _ => param,
        };
        return Err(ApiError::bad_param(
            at_fault,
            format!(
                "This model's maximum context length is {} tokens. However, your {param} is \
                 {bytes} bytes of text, at least {at_least} tokens (no token covers more than \
                 {} bytes), and the completion needs {completion}. Please reduce the length \
                 of the {at_fault}.",
                limits.max_model_len, limits.max_token_bytes
            ),
        ));
    }
    Ok(())
}
// ANCHOR_END: fits_by_bytes

// ANCHOR: reject_unsupported
/// Rejects every OpenAI or vLLM field kiln parses but does not implement, unless it asks for
/// the default behaviour.
fn reject_unsupported(s: &Sampling) -> Result<(), ApiError> {
    // ANCHOR: task_8_1
    let unsupported = |param: &str, what: &str| {
        Err(ApiError::bad_param(
            param,
            format!("{param} is not supported by kiln ({what})"),
        ))
    };
    if s.best_of.is_some_and(|b| Some(b) != s.n && b != 1) {
        return unsupported("best_of", "use n");
    }
    if s.suffix.as_ref().is_some_and(|x| !x.is_empty()) {
        return unsupported("suffix", "no fill-in-the-middle");
    }
    if s.prompt_logprobs.is_some() {
        return unsupported(
            "prompt_logprobs",
            "the engine computes logits for the last prompt position only",
        );
    }
    if s.skip_special_tokens == Some(false) {
        return unsupported(
            "skip_special_tokens",
            "special tokens are never written into the text",
        );
    }
    if s.spaces_between_special_tokens == Some(false) {
        return unsupported(
            "spaces_between_special_tokens",
            "special tokens are never written into the text",
        );
    }
    if s.include_stop_str_in_output && s.stop.is_some() {
        return unsupported(
            "include_stop_str_in_output",
            "a stop string is always cut from the text (a stop token's text is kept)",
        );
    }
    Ok(())
    // ANCHOR_END: task_8_1
}
// ANCHOR_END: reject_unsupported

/// Checks and maps the shared fields. `max_tokens` and `logprobs` come from the endpoint's own
/// fields; `request_seed` is the seed a request without `seed` gets (from the server's seed).
pub fn generation(
    s: &Sampling,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    request_seed: u64,
    limits: &Limits,
) -> Result<Generation, ApiError> {
    generation_as(s, max_tokens, "max_tokens", logprobs, request_seed, limits)
}

/// [`generation`] for a `max_tokens` the client gave in the field `max_tokens_param` (chat's
/// `max_completion_tokens`), which its errors name.
pub fn generation_as(
    s: &Sampling,
    max_tokens: Option<u32>,
    max_tokens_param: &'static str,
    logprobs: Option<u32>,
    request_seed: u64,
    limits: &Limits,
) -> Result<Generation, ApiError> {
    reject_unsupported(s)?;
    let n = s.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ApiError::bad_param(
            "n",
            format!("n must be in 1..={MAX_N}, got {n}"),
        ));
    }
    if s.best_of.is_some_and(|b| b != n && b != 1) {
        return Err(ApiError::bad_param("best_of", "best_of must equal n"));
    }
    let priority = s.priority.unwrap_or(0);
    if priority != 0 && !limits.priority_scheduling {
        return Err(ApiError::bad_param(
            "priority",
            "priority scheduling is off on this server (kiln serve --scheduling-policy priority)",
        ));
    }
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ApiError::bad_param(
                max_tokens_param,
                format!("{max_tokens_param} must be at least 1"),
            ));
        }
        Some(m) => Some(m as usize),
        None => None,
    };
    if let Some(k) = logprobs
        && k > MAX_TOP_LOGPROBS
    {
        return Err(ApiError::bad_param(
            "logprobs",
            format!("at most {MAX_TOP_LOGPROBS} logprobs, got {k}"),
        ));
    }
    let top_k = match s.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::bad_param(
                "top_k",
                format!("top_k must be -1 (off) or positive, got {k}"),
            ));
        }
    };
    let seed = match s.seed {
        None => request_seed,
        Some(seed) => seed as u64, // negative seeds wrap: still one distinct seed each
    };
    let params = SamplingParams {
        // OpenAI's default temperature is 1.
        temperature: s.temperature.unwrap_or(1.0),
        top_k,
        top_p: s.top_p.unwrap_or(1.0),
        min_p: s.min_p.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        seed,
    };
    if let Err(ch01::sampler::SamplingError::InvalidParameter {
        name,
        value,
        expected,
    }) = params.validate()
    {
        return Err(ApiError::bad_param(
            name,
            format!("{name} = {value} is invalid: expected {expected}"),
        ));
    }
    let stop = s.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > 4 {
        return Err(ApiError::bad_param("stop", "at most 4 stop sequences"));
    }
    if stop.iter().any(|s| s.len() > MAX_RULE_TEXT_BYTES) {
        return Err(ApiError::bad_param(
            "stop",
            format!("a stop sequence has at most {MAX_RULE_TEXT_BYTES} bytes"),
        ));
    }
    let stop_token_ids = s.stop_token_ids.clone().unwrap_or_default();
    if stop_token_ids.len() > MAX_TOKEN_RULES {
        return Err(ApiError::bad_param(
            "stop_token_ids",
            format!("at most {MAX_TOKEN_RULES} stop_token_ids"),
        ));
    }
    if let Some(&bad) = stop_token_ids
        .iter()
        .find(|&&t| t as usize >= limits.vocab_size)
    {
        return Err(ApiError::bad_param(
            "stop_token_ids",
            format!(
                "token id {bad} is outside the vocabulary of {}",
                limits.vocab_size
            ),
        ));
    }
    if s.stream_options.is_some() && !s.stream {
        return Err(ApiError::bad_param(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    let rules = token_rules(s, limits, &stop_token_ids)?;
    let bad_words = s.bad_words.clone().unwrap_or_default();
    if bad_words.len() > MAX_TOKEN_RULES
        || bad_words.iter().any(|w| w.len() > MAX_RULE_TEXT_BYTES)
        || bad_words.iter().map(String::len).sum::<usize>() > MAX_BAD_WORDS_BYTES
    {
        return Err(ApiError::bad_param(
            "bad_words",
            format!(
                "at most {MAX_TOKEN_RULES} bad_words, each of at most {MAX_RULE_TEXT_BYTES} \
                 bytes and {MAX_BAD_WORDS_BYTES} bytes in all"
            ),
        ));
    }
    let truncate_prompt_tokens = match s.truncate_prompt_tokens {
        None | Some(-1) => None,
        Some(k) if k >= 1 => Some(k as usize),
        Some(k) => {
            return Err(ApiError::bad_param(
                "truncate_prompt_tokens",
                format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
            ));
        }
    };
    Ok(Generation {
        params,
        seeded: s.seed.is_some(),
        n: n as usize,
        max_tokens,
        max_tokens_param,
        stop,
        stop_token_ids,
        include_stop_str_in_output: s.include_stop_str_in_output,
        ignore_eos: s.ignore_eos,
        logprobs: logprobs.map(|k| k as usize),
        stream: s.stream,
        include_usage: s.stream_options.is_some_and(|o| o.include_usage),
        constraint: constraint(s)?,
        grammar: None,
        rules,
        bad_words,
        priority,
        truncate_prompt_tokens,
        decoder: None,
    })
}

// ANCHOR: constraint
/// What the output must match: at most one of `response_format` (`json_object`,
/// `json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
/// `guided_grammar`, or its `structured_outputs` object. With it, the field that asked.
pub fn constraint(s: &Sampling) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let mut found: Vec<(Constraint, &'static str)> = Vec::new();
    if let Some(format) = &s.response_format {
        let kind = format.get("type").and_then(|t| t.as_str());
        match kind {
            Some("text") => {}
            Some("json_object") => found.push((Constraint::JsonObject, "response_format")),
            Some("json_schema") => {
                let schema = format
                    .get("json_schema")
                    .and_then(|j| j.get("schema"))
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "response_format",
                            "a json_schema response_format needs json_schema.schema",
                        )
                    })?;
                found.push((Constraint::JsonSchema(schema.clone()), "response_format"));
            }
            _ => {
                return Err(ApiError::bad_param(
                    "response_format",
                    "response_format.type must be text, json_object or json_schema",
                ));
            }
        }
    }
    let json = |value: &serde_json::Value, param: &'static str| match value {
        // A schema may come as its JSON text.
        serde_json::Value::String(text) => serde_json::from_str(text)
            .map(Constraint::JsonSchema)
            .map_err(|e| ApiError::bad_param(param, format!("{param} is not JSON: {e}"))),
        schema => Ok(Constraint::JsonSchema(schema.clone())),
    };
    if let Some(schema) = &s.guided_json {
        found.push((json(schema, "guided_json")?, "guided_json"));
    }
    if let Some(regex) = &s.guided_regex {
        found.push((Constraint::Regex(regex.clone()), "guided_regex"));
    }
    if let Some(choice) = &s.guided_choice {
        found.push((Constraint::Choice(choice.clone()), "guided_choice"));
    }
    if let Some(grammar) = &s.guided_grammar {
        found.push((Constraint::Lark(grammar.clone()), "guided_grammar"));
    }
    if let Some(so) = &s.structured_outputs {
        let param = "structured_outputs";
        if let Some(schema) = &so.json {
            found.push((json(schema, param)?, param));
        }
        if let Some(regex) = &so.regex {
            found.push((Constraint::Regex(regex.clone()), param));
        }
        if let Some(choice) = &so.choice {
            found.push((Constraint::Choice(choice.clone()), param));
        }
        if let Some(grammar) = &so.grammar {
            found.push((Constraint::Lark(grammar.clone()), param));
        }
        if so.json_object {
            found.push((Constraint::JsonObject, param));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
        return Err(ApiError::bad_param(
            found[1].1,
            format!(
                "give at most one structured output constraint, got {}",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}
// ANCHOR_END: constraint

/// `logit_bias`, `allowed_token_ids` and `min_tokens`, checked against the vocabulary.
fn token_rules(
    s: &Sampling,
    limits: &Limits,
    stop_token_ids: &[u32],
) -> Result<TokenRules, ApiError> {
    let in_vocab = |param: &str, id: u32| {
        if (id as usize) < limits.vocab_size {
            Ok(id)
        } else {
            Err(ApiError::bad_param(
                param,
                format!(
                    "token id {id} is outside the vocabulary of {}",
                    limits.vocab_size
                ),
            ))
        }
    };
    let mut logit_bias = Vec::new();
    if let Some(bias) = &s.logit_bias {
        if bias.len() > MAX_TOKEN_RULES {
            return Err(ApiError::bad_param(
                "logit_bias",
                format!("at most {MAX_TOKEN_RULES} logit_bias entries"),
            ));
        }
        for (key, value) in bias {
            let id = key.parse::<u32>().map_err(|_| {
                ApiError::bad_param(
                    "logit_bias",
                    format!("logit_bias keys are token ids, got {key:?}"),
                )
            })?;
            let bias = value
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "logit_bias",
                        format!("logit_bias values are numbers in [-100, 100], got {value}"),
                    )
                })?;
            logit_bias.push((in_vocab("logit_bias", id)?, bias as f32));
        }
    }
    let allowed_token_ids = match &s.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() || ids.len() > limits.vocab_size => {
            return Err(ApiError::bad_param(
                "allowed_token_ids",
                "allowed_token_ids must list at least one token, and none twice",
            ));
        }
        Some(ids) => {
            let mut ids = ids
                .iter()
                .map(|&id| in_vocab("allowed_token_ids", id))
                .collect::<Result<Vec<_>, _>>()?;
            ids.sort_unstable();
            ids.dedup();
            Some(ids)
        }
    };
    let mut stops = limits.eos_token_ids.clone();
    stops.extend(stop_token_ids);
    Ok(TokenRules {
        logit_bias,
        allowed_token_ids,
        bad_words: Vec::new(),
        min_tokens: s.min_tokens.unwrap_or(0) as usize,
        stop_token_ids: stops,
    })
}

/// Refuses a request of more than [`Limits::max_prompts`] prompts, or of none.
pub fn check_prompt_count(prompts: usize, limits: &Limits) -> Result<(), ApiError> {
    if prompts == 0 {
        return Err(ApiError::bad_param("prompt", "the prompt list is empty"));
    }
    if prompts > limits.max_prompts {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "at most {} prompts per request, got {prompts} (each is n engine sequences)",
                limits.max_prompts
            ),
        ));
    }
    Ok(())
}

/// Every engine request of one HTTP request, built and checked once, before admission.
pub struct Planned {
    /// Choice `p × n + i` is prompt `p`'s `i`-th.
    pub requests: Vec<Request>,
    /// Each request's logits processor (its grammar and token rules), if it has any.
    pub processors: Vec<Option<Box<dyn LogitsProcessor>>>,
    /// Where each request's processor says why it ended the request early, if it does.
    pub ended_early: Vec<EndedEarly>,
    /// The prompts' tokens, each prompt counted once (however many choices share it).
    pub prompt_tokens: usize,
}

impl std::fmt::Debug for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Planned")
            .field("requests", &self.requests)
            .field("prompt_tokens", &self.prompt_tokens)
            .finish_non_exhaustive()
    }
}

impl Planned {
    /// Tokens the request may use: every prompt once, and every choice's max_tokens (what
    /// the key's tokens per minute are charged).
    pub fn budget(&self) -> u64 {
        (self.prompt_tokens + self.requests.iter().map(|r| r.max_tokens).sum::<usize>()) as u64
    }

    /// The prompt tokens the server holds for the request's sequences: every choice's prompt
    /// (each choice holds its own copy, and waits with it). What a running choice generates is
    /// bounded by the engine's `max_num_seqs` and context instead.
    pub fn held_tokens(&self) -> u64 {
        (self.requests.iter()).fold(0, |held, r| held.saturating_add(r.prompt.len() as u64))
    }

    /// Lowers the choices' max_tokens so that the [`budget`](Planned::budget) is at most
    /// `tokens`, each choice keeping an equal share (at least 1). For a request that gave no
    /// `max_tokens` (each choice may use the rest of the context) under a limit of `tokens` a
    /// minute, which a larger budget could never fit: it is served, each choice ending with
    /// `length` at its share, and is charged what it may use, as any other request.
    pub fn hold_to(&mut self, tokens: u64) {
        if self.budget() <= tokens || self.requests.is_empty() {
            return;
        }
        let left = tokens.saturating_sub(self.prompt_tokens as u64);
        let share = (left / self.requests.len() as u64).max(1);
        let share = usize::try_from(share).unwrap_or(usize::MAX);
        for request in &mut self.requests {
            request.max_tokens = request.max_tokens.min(share);
        }
    }
}

impl Generation {
    /// The engine requests for `prompts`, `n` per prompt (see [`Generation::requests`]).
    /// `prompt_param` names the prompt in errors (`prompt` or `messages`). Refuses more than
    /// [`Limits::max_prompts`] prompts, and a response that could carry more than
    /// [`MAX_RESPONSE_ENTRIES`] token entries.
    pub fn plan(
        &self,
        prompts: Vec<Vec<u32>>,
        prompt_param: &str,
        limits: &Limits,
    ) -> Result<Planned, ApiError> {
        check_prompt_count(prompts.len(), limits)?;
        let choices = prompts.len().saturating_mul(self.n);
        if self.grammar.is_some() && choices > MAX_CONSTRAINED_CHOICES {
            return Err(ApiError::bad_param(
                "n",
                format!(
                    "with structured output a request runs at most {MAX_CONSTRAINED_CHOICES} \
                     choices (n × prompts), each with its own grammar state: {choices} asked"
                ),
            ));
        }
        let kept = self.truncate_prompt_tokens.unwrap_or(usize::MAX);
        let prompt_tokens = prompts.iter().map(|p| p.len().min(kept)).sum();
        let mut requests = Vec::with_capacity(prompts.len() * self.n);
        for (index, prompt) in prompts.into_iter().enumerate() {
            requests.extend(self.requests(prompt, index, prompt_param, limits)?);
        }
        self.check_response_size(&requests, 0)?;
        // One copy of the token rules, shared by every choice's processor.
        let rules = Arc::new(self.rules.clone());
        let ended_early: Vec<EndedEarly> = requests.iter().map(|_| EndedEarly::default()).collect();
        let processors = (ended_early.iter())
            .map(|error| self.processor_with(&rules, error))
            .collect();
        Ok(Planned {
            requests,
            processors,
            ended_early,
            prompt_tokens,
        })
    }

    /// Refuses a plan whose response could carry more than [`MAX_RESPONSE_ENTRIES`] entries
    /// when each choice also carries its prompt's text of `echo` (as `echo: true` sends it).
    pub fn check_echo(&self, planned: &Planned, echo: &[String]) -> Result<(), ApiError> {
        let bytes = echo
            .iter()
            .map(String::len)
            .fold(0usize, usize::saturating_add);
        self.check_response_size(&planned.requests, bytes.saturating_mul(self.n))
    }

    /// The response's entries: every choice's max_tokens, one plus its logprobs alternatives
    /// a token, and `echo_bytes` of echoed text (all choices'), at most
    /// [`MAX_RESPONSE_ENTRIES`].
    fn check_response_size(&self, requests: &[Request], echo_bytes: usize) -> Result<(), ApiError> {
        let per_token = 1 + self.logprobs.unwrap_or(0);
        let tokens: usize = requests.iter().map(|r| r.max_tokens * per_token).sum();
        let echoed = echo_bytes.div_ceil(ECHO_BYTES_PER_ENTRY);
        let entries = tokens.saturating_add(echoed);
        if entries <= MAX_RESPONSE_ENTRIES {
            return Ok(());
        }
        let param = if echoed > 0 && tokens <= MAX_RESPONSE_ENTRIES {
            "echo" // the tokens alone fit: the echo is at fault
        } else if self.logprobs.is_some() {
            "logprobs"
        } else {
            "n"
        };
        let echo = match echoed {
            0 => String::new(),
            _ => format!(", {echo_bytes} bytes of echo at {ECHO_BYTES_PER_ENTRY} an entry"),
        };
        Err(ApiError::bad_param(
            param,
            format!(
                "the response could carry {entries} token entries ({} sequences, their \
                 max_tokens, {per_token} entries a token with logprobs{echo}), more than \
                 {MAX_RESPONSE_ENTRIES}: lower n, max_tokens, logprobs or the prompts",
                requests.len()
            ),
        ))
    }

    /// One choice's logits processor: its grammar from the start, and `rules`, this request's
    /// token rules, shared by its choices. `None` when the request has neither.
    fn processor_with(
        &self,
        rules: &Arc<TokenRules>,
        error: &EndedEarly,
    ) -> Option<Box<dyn LogitsProcessor>> {
        if self.grammar.is_none() && rules.is_empty() {
            return None;
        }
        Some(Box::new(RequestProcessor::new(
            Arc::clone(rules),
            self.grammar.as_ref().map(|g| g.start(error.clone())),
            rules.stop_token_ids.clone(),
            error.clone(),
        )))
    }

    /// The engine requests for prompt `index` of a request: `n` of them, so that the choices
    /// differ and each is reproducible. With the client's `seed`, choice `i` is seeded
    /// `seed + i`, whatever the prompt (vLLM's rule: equal prompts answer the same); without,
    /// choice `index × n + i` of the request is seeded `seed + index × n + i`, so that every
    /// choice of a prompt list samples its own stream. Refuses a prompt that, with
    /// `max_tokens`, does not fit the context; without `max_tokens` a request may use the
    /// rest of it.
    pub fn requests(
        &self,
        prompt: Vec<u32>,
        index: usize,
        prompt_param: &str,
        limits: &Limits,
    ) -> Result<Vec<Request>, ApiError> {
        let mut prompt = prompt;
        if let Some(keep) = self.truncate_prompt_tokens
            && prompt.len() > keep
        {
            prompt.drain(..prompt.len() - keep);
        }
        let len = prompt.len();
        if len == 0 {
            return Err(ApiError::bad_param(prompt_param, "the prompt is empty"));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
            return Err(ApiError::bad_param(
                prompt_param,
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    limits.vocab_size
                ),
            ));
        }
        let room = limits.max_model_len.saturating_sub(len);
        let max_tokens = match self.max_tokens {
            Some(m) if len + m > limits.max_model_len => {
                // The prompt alone fills the context: the prompt is at fault, else max_tokens.
                let param = if room == 0 {
                    prompt_param
                } else {
                    self.max_tokens_param
                };
                return Err(ApiError::bad_param(
                    param,
                    format!(
                        "This model's maximum context length is {} tokens. However, you \
                         requested {} tokens ({len} in the messages, {m} in the completion). \
                         Please reduce the length of the messages or completion.",
                        limits.max_model_len,
                        len + m
                    ),
                ));
            }
            Some(m) => m,
            None if room == 0 => {
                return Err(ApiError::bad_param(
                    prompt_param,
                    format!(
                        "the prompt's {len} tokens fill the model's context of {} tokens",
                        limits.max_model_len
                    ),
                ));
            }
            None => room,
        };
        // `ignore_eos` drops the model's EOS ids, never the client's own `stop_token_ids`:
        // the engine's `ignore_eos` would drop both, so it stays off here.
        let mut stop_token_ids = if self.ignore_eos {
            Vec::new()
        } else {
            limits.eos_token_ids.clone()
        };
        stop_token_ids.extend(&self.stop_token_ids);
        let first = if self.seeded { 0 } else { index * self.n };
        Ok((0..self.n)
            .map(|i| Request {
                prompt: prompt.clone(),
                params: SamplingParams {
                    seed: self.params.seed.wrapping_add((first + i) as u64),
                    ..self.params.clone()
                },
                max_tokens,
                stop_token_ids: stop_token_ids.clone(),
                ignore_eos: false,
                priority: self.priority,
                logprobs: self.logprobs,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_model_len: 64,
            eos_token_ids: vec![1],
            vocab_size: 100,
            max_prompts: 4,
            max_token_bytes: 8,
            priority_scheduling: false,
        }
    }

    fn sampling(json: &str) -> Sampling {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn defaults_follow_openai() {
        let g = generation(&sampling("{}"), None, None, 7, &limits()).unwrap();
        assert_eq!(g.params.temperature, 1.0);
        assert_eq!(g.params.seed, 7);
        assert_eq!(g.n, 1);
        let requests = g.requests(vec![5; 10], 0, "prompt", &limits()).unwrap();
        assert_eq!(requests[0].max_tokens, 54, "the rest of the context");
        assert_eq!(requests[0].stop_token_ids, vec![1]);
    }

    /// Every field `reject_unsupported` refuses, each named in its error, and each at its
    /// default (or a value that asks for the default) accepted.
    #[test]
    fn unsupported_fields_are_refused_by_name_and_defaults_pass() {
        for (json, param) in [
            (r#"{"best_of": 3}"#, "best_of"),
            (r#"{"best_of": 3, "n": 2}"#, "best_of"),
            (r#"{"suffix": "end"}"#, "suffix"),
            (r#"{"prompt_logprobs": 1}"#, "prompt_logprobs"),
            (r#"{"skip_special_tokens": false}"#, "skip_special_tokens"),
            (
                r#"{"spaces_between_special_tokens": false}"#,
                "spaces_between_special_tokens",
            ),
            (
                r#"{"include_stop_str_in_output": true, "stop": ["x"]}"#,
                "include_stop_str_in_output",
            ),
        ] {
            let error = reject_unsupported(&sampling(json)).expect_err(json);
            assert_eq!(error.param.as_deref(), Some(param), "{json}");
        }
        for json in [
            r#"{}"#,
            r#"{"best_of": 1}"#,
            r#"{"best_of": 2, "n": 2}"#,
            r#"{"suffix": ""}"#,
            r#"{"skip_special_tokens": true, "spaces_between_special_tokens": true}"#,
            r#"{"include_stop_str_in_output": true}"#,
            r#"{"include_stop_str_in_output": false, "stop": ["x"]}"#,
        ] {
            assert!(reject_unsupported(&sampling(json)).is_ok(), "{json}");
        }
    }

    /// A priority other than 0 needs a server that schedules by priority: otherwise any
    /// client could put itself ahead of every other.
    #[test]
    fn a_priority_needs_priority_scheduling() {
        let asks = sampling(r#"{"priority": -5}"#);
        let err = generation(&asks, None, None, 7, &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("priority"));
        assert!(generation(&sampling(r#"{"priority": 0}"#), None, None, 7, &limits()).is_ok());
        let on = Limits {
            priority_scheduling: true,
            ..limits()
        };
        assert_eq!(generation(&asks, None, None, 7, &on).unwrap().priority, -5);
    }

    /// `ignore_eos` ignores the model's EOS (id 1 here), not the client's stop tokens.
    #[test]
    fn ignore_eos_keeps_the_clients_stop_token_ids() {
        let g = generation(
            &sampling(r#"{"ignore_eos": true, "stop_token_ids": [9]}"#),
            None,
            None,
            7,
            &limits(),
        )
        .unwrap();
        let requests = g.requests(vec![5; 10], 0, "prompt", &limits()).unwrap();
        assert_eq!(requests[0].stop_token_ids, vec![9]);
        assert!(!requests[0].ignore_eos);
    }

    #[test]
    fn out_of_range_values_name_their_parameter() {
        let param = |json: &str, max: Option<u32>, logprobs: Option<u32>| {
            generation(&sampling(json), max, logprobs, 0, &limits())
                .unwrap_err()
                .param
                .unwrap()
        };
        assert_eq!(param(r#"{"temperature": -1}"#, None, None), "temperature");
        assert_eq!(param(r#"{"top_p": 0}"#, None, None), "top_p");
        assert_eq!(param(r#"{"top_k": -3}"#, None, None), "top_k");
        assert_eq!(
            param(r#"{"presence_penalty": 3}"#, None, None),
            "presence_penalty"
        );
        assert_eq!(param(r#"{"n": 0}"#, None, None), "n");
        assert_eq!(param("{}", Some(0), None), "max_tokens");
        assert_eq!(param("{}", None, Some(21)), "logprobs");
        assert_eq!(
            param(r#"{"logit_bias": {"3": 101}}"#, None, None),
            "logit_bias"
        );
        assert_eq!(
            param(r#"{"logit_bias": {"100": 1}}"#, None, None),
            "logit_bias"
        );
        assert_eq!(param(r#"{"best_of": 3}"#, None, None), "best_of");
        assert_eq!(
            param(r#"{"prompt_logprobs": 1}"#, None, None),
            "prompt_logprobs"
        );
        assert_eq!(
            param(r#"{"skip_special_tokens": false}"#, None, None),
            "skip_special_tokens"
        );
        assert_eq!(
            param(r#"{"response_format": {"type": "xml"}}"#, None, None),
            "response_format"
        );
        assert_eq!(
            param(
                r#"{"guided_regex": "a", "guided_choice": ["b"]}"#,
                None,
                None
            ),
            "guided_choice"
        );
        assert_eq!(
            param(r#"{"allowed_token_ids": []}"#, None, None),
            "allowed_token_ids"
        );
        assert_eq!(
            param(r#"{"truncate_prompt_tokens": 0}"#, None, None),
            "truncate_prompt_tokens"
        );
        assert_eq!(
            param(r#"{"stop": ["a","b","c","d","e"]}"#, None, None),
            "stop"
        );
        assert_eq!(
            param(r#"{"stream_options": {"include_usage": true}}"#, None, None),
            "stream_options"
        );
    }

    #[test]
    fn prompt_plus_max_tokens_must_fit_the_context_and_n_seeds_differ() {
        let g = generation(
            &sampling(r#"{"n": 3, "seed": 10}"#),
            Some(20),
            None,
            0,
            &limits(),
        )
        .unwrap();
        let err = g.requests(vec![5; 50], 0, "prompt", &limits()).unwrap_err();
        assert!(
            err.message.contains("maximum context length is 64"),
            "{}",
            err.message
        );
        let requests = g.requests(vec![5; 44], 0, "prompt", &limits()).unwrap();
        let seeds: Vec<u64> = requests.iter().map(|r| r.params.seed).collect();
        assert_eq!(seeds, [10, 11, 12]);
        assert!(g.requests(vec![], 0, "prompt", &limits()).is_err());
        assert!(g.requests(vec![100], 0, "prompt", &limits()).is_err());
    }

    #[test]
    fn a_prompt_that_fills_the_context_names_the_prompt_param() {
        let g = generation(&sampling("{}"), Some(10), None, 0, &limits()).unwrap();
        let err = g
            .requests(vec![5; 64], 0, "messages", &limits())
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
        // The prompt fits, the completion does not: max_tokens is at fault.
        let err = g
            .requests(vec![5; 60], 0, "messages", &limits())
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
        let open = generation(&sampling("{}"), None, None, 0, &limits()).unwrap();
        let err = open
            .requests(vec![5; 64], 0, "messages", &limits())
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
    }

    #[test]
    fn prompt_lists_and_responses_are_capped() {
        let g = generation(&sampling(r#"{"n": 2}"#), Some(4), None, 0, &limits()).unwrap();
        assert_eq!(
            g.plan(vec![vec![5]; 4], "prompt", &limits())
                .unwrap()
                .requests
                .len(),
            8
        );
        let err = g.plan(vec![vec![5]; 5], "prompt", &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("prompt"));
        assert!(err.message.contains("at most 4 prompts"), "{}", err.message);
        assert!(g.plan(vec![], "prompt", &limits()).is_err());
        // 16 choices x 60 tokens x (1 + 20) entries fit; a context of 8192 would not.
        let wide = Limits {
            max_model_len: 8192,
            max_prompts: 64,
            ..limits()
        };
        let g = generation(&sampling(r#"{"n": 16}"#), Some(8000), Some(20), 0, &wide).unwrap();
        let err = g.plan(vec![vec![5]], "prompt", &wide).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("logprobs"));
        let g = generation(&sampling(r#"{"n": 16}"#), Some(60), Some(20), 0, &wide).unwrap();
        assert!(g.plan(vec![vec![5]], "prompt", &wide).is_ok());
    }

    /// Without a client seed, every choice of a prompt list has its own seed (two equal
    /// prompts would otherwise answer the same); with one, each prompt's choice `i` is
    /// `seed + i`, as vLLM seeds them.
    #[test]
    fn unseeded_choices_of_a_prompt_list_never_share_a_seed() {
        let seeds = |json: &str| -> Vec<u64> {
            let g = generation(&sampling(json), Some(4), None, 7, &limits()).unwrap();
            let planned = g.plan(vec![vec![5; 3]; 3], "prompt", &limits()).unwrap();
            planned.requests.iter().map(|r| r.params.seed).collect()
        };
        assert_eq!(seeds(r#"{"n": 2}"#), [7, 8, 9, 10, 11, 12]);
        assert_eq!(seeds(r#"{"n": 2, "seed": 10}"#), [10, 11, 10, 11, 10, 11]);
        assert_eq!(seeds(r#"{"seed": 10}"#), [10, 10, 10]);
        assert_eq!(seeds("{}"), [7, 8, 9]);
    }

    /// Errors about the completion's length name the field the client sent it in.
    #[test]
    fn max_tokens_errors_name_the_field_the_client_used() {
        let s = sampling("{}");
        let param = |max: u32| {
            generation_as(&s, Some(max), "max_completion_tokens", None, 0, &limits())
                .and_then(|g| g.requests(vec![5; 10], 0, "messages", &limits()))
                .unwrap_err()
                .param
        };
        assert_eq!(param(0).as_deref(), Some("max_completion_tokens"));
        assert_eq!(param(60).as_deref(), Some("max_completion_tokens"));
    }

    /// A request without max_tokens is held to the tokens a minute allows, an equal share a
    /// choice, instead of a budget no minute could ever pay.
    #[test]
    fn hold_to_shares_the_limit_between_the_choices() {
        let g = generation(&sampling(r#"{"n": 4}"#), None, None, 0, &limits()).unwrap();
        let mut planned = g.plan(vec![vec![5; 10]], "prompt", &limits()).unwrap();
        assert_eq!(planned.budget(), 10 + 4 * 54);
        planned.hold_to(1000);
        assert_eq!(planned.budget(), 10 + 4 * 54, "what fits is left alone");
        planned.hold_to(50);
        let max: Vec<usize> = planned.requests.iter().map(|r| r.max_tokens).collect();
        assert_eq!(max, [10; 4]);
        assert_eq!(planned.budget(), 50);
        planned.hold_to(3);
        assert!(planned.requests.iter().all(|r| r.max_tokens == 1));
    }

    /// Every choice carries its prompt's echo: `n` copies count against the response size.
    #[test]
    fn echo_counts_once_per_choice_against_the_response_size() {
        let g = generation(&sampling(r#"{"n": 16}"#), Some(4), None, 0, &limits()).unwrap();
        let planned = g.plan(vec![vec![5]; 4], "prompt", &limits()).unwrap();
        // 256 token entries; each byte of the 4 prompts is half an entry (16 copies, 32 bytes
        // an entry).
        let fits = MAX_RESPONSE_ENTRIES * ECHO_BYTES_PER_ENTRY / 16 / 4 - 128;
        assert!(g.check_echo(&planned, &vec!["x".repeat(fits); 4]).is_ok());
        let err = g
            .check_echo(&planned, &vec!["x".repeat(fits + 64); 4])
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("echo"));
    }

    #[test]
    fn text_that_cannot_fit_is_refused_by_its_bytes() {
        // 8 bytes a token at most: 63 x 8 bytes is at least 63 tokens, + 1 to generate = 64.
        assert!(fits_by_bytes(63 * 8, None, "prompt", &limits()).is_ok());
        let err = fits_by_bytes(63 * 8 + 1, None, "prompt", &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("prompt"));
        let max = |m: u32| Some((m, "max_completion_tokens"));
        assert!(fits_by_bytes(60 * 8, max(4), "messages", &limits()).is_ok());
        let err = fits_by_bytes(60 * 8, max(5), "messages", &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages"));
        // A completion that fills the context alone is at fault, named as the client sent it.
        let err = fits_by_bytes(1, max(64), "messages", &limits()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("max_completion_tokens"));
        assert!(fits_by_bytes(usize::MAX, max(u32::MAX), "prompt", &limits()).is_err());
    }
}
