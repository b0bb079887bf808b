//! From an OpenAI request to the engine's [`Request`]s: every accepted parameter is checked
//! and mapped, or the request is refused with the parameter's name.

use ch01::SamplingParams;
use ch04::Request;

use crate::error::ApiError;
use crate::protocol::Sampling;

/// The most alternatives `logprobs` / `top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// The most choices one request may ask for (`n`).
pub const MAX_N: u32 = 16;

/// The parts of a request that apply to each of its choices, checked.
#[derive(Debug, Clone)]
pub struct Generation {
    pub params: SamplingParams,
    /// How many completions per prompt.
    pub n: usize,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(k)`: report each token's logprob and its `k` best alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
}

/// Server-wide values a request is checked against.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_model_len: usize,
    pub eos_token_ids: Vec<u32>,
    pub vocab_size: usize,
}

// ANCHOR: reject_unsupported
/// Rejects every OpenAI field kiln parses but does not implement, unless it asks for the
/// default behaviour.
fn reject_unsupported(s: &Sampling) -> Result<(), ApiError> {
    // ANCHOR: task_8_1
    let unsupported = |param: &str, what: &str| {
        Err(ApiError::bad_param(
            param,
            format!("{param} is not supported by kiln ({what})"),
        ))
    };
    if s.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
        return unsupported("logit_bias", "send no logit_bias");
    }
    if s.best_of.is_some_and(|b| Some(b) != s.n && b != 1) {
        return unsupported("best_of", "use n");
    }
    if s.suffix.as_ref().is_some_and(|x| !x.is_empty()) {
        return unsupported("suffix", "no fill-in-the-middle");
    }
    if let Some(format) = &s.response_format
        && format.get("type").and_then(|t| t.as_str()) != Some("text")
    {
        return unsupported("response_format", "only {\"type\": \"text\"}");
    }
    if s.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return unsupported("tools", "no tool calling");
    }
    if s.tool_choice.as_ref().is_some_and(|c| c != "none") {
        return unsupported("tool_choice", "no tool calling");
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
    let max_tokens = match max_tokens {
        Some(0) => {
            return Err(ApiError::bad_param(
                "max_tokens",
                "max_tokens must be at least 1",
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
    let stop_token_ids = s.stop_token_ids.clone().unwrap_or_default();
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
    Ok(Generation {
        params,
        n: n as usize,
        max_tokens,
        stop,
        stop_token_ids,
        ignore_eos: s.ignore_eos,
        logprobs: logprobs.map(|k| k as usize),
        stream: s.stream,
        include_usage: s.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// Every engine request of one HTTP request, built and checked once, before admission.
#[derive(Debug, Clone)]
pub struct Planned {
    /// Choice `p × n + i` is prompt `p`'s `i`-th.
    pub requests: Vec<Request>,
    /// The prompts' tokens, each prompt counted once (however many choices share it).
    pub prompt_tokens: usize,
}

impl Planned {
    /// Tokens the request may use: every prompt once, and every choice's max_tokens (what
    /// the key's tokens per minute are charged).
    pub fn budget(&self) -> u64 {
        (self.prompt_tokens + self.requests.iter().map(|r| r.max_tokens).sum::<usize>()) as u64
    }
}

impl Generation {
    /// The engine requests for `prompts`, `n` per prompt (see [`Generation::requests`]).
    pub fn plan(&self, prompts: Vec<Vec<u32>>, limits: &Limits) -> Result<Planned, ApiError> {
        let prompt_tokens = prompts.iter().map(Vec::len).sum();
        let mut requests = Vec::with_capacity(prompts.len() * self.n);
        for prompt in prompts {
            requests.extend(self.requests(prompt, limits)?);
        }
        Ok(Planned {
            requests,
            prompt_tokens,
        })
    }

    /// The engine requests for one prompt: `n` of them, choice `i` seeded `seed + i` so that
    /// the choices differ and each is reproducible. Refuses a prompt that, with `max_tokens`,
    /// does not fit the context; without `max_tokens` a request may use the rest of it.
    pub fn requests(&self, prompt: Vec<u32>, limits: &Limits) -> Result<Vec<Request>, ApiError> {
        let len = prompt.len();
        if len == 0 {
            return Err(ApiError::bad_param("prompt", "the prompt is empty"));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
            return Err(ApiError::bad_param(
                "prompt",
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    limits.vocab_size
                ),
            ));
        }
        let room = limits.max_model_len.saturating_sub(len);
        let max_tokens = match self.max_tokens {
            Some(m) if len + m > limits.max_model_len => {
                return Err(ApiError::bad_param(
                    "max_tokens",
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
                    "prompt",
                    format!(
                        "the prompt's {len} tokens fill the model's context of {} tokens",
                        limits.max_model_len
                    ),
                ));
            }
            None => room,
        };
        let mut stop_token_ids = limits.eos_token_ids.clone();
        stop_token_ids.extend(&self.stop_token_ids);
        Ok((0..self.n)
            .map(|i| Request {
                prompt: prompt.clone(),
                params: SamplingParams {
                    seed: self.params.seed.wrapping_add(i as u64),
                    ..self.params.clone()
                },
                max_tokens,
                stop_token_ids: stop_token_ids.clone(),
                ignore_eos: self.ignore_eos,
                priority: 0,
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
        let requests = g.requests(vec![5; 10], &limits()).unwrap();
        assert_eq!(requests[0].max_tokens, 54, "the rest of the context");
        assert_eq!(requests[0].stop_token_ids, vec![1]);
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
            param(r#"{"logit_bias": {"3": 1}}"#, None, None),
            "logit_bias"
        );
        assert_eq!(param(r#"{"tools": [{}]}"#, None, None), "tools");
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
        let err = g.requests(vec![5; 50], &limits()).unwrap_err();
        assert!(
            err.message.contains("maximum context length is 64"),
            "{}",
            err.message
        );
        let requests = g.requests(vec![5; 44], &limits()).unwrap();
        let seeds: Vec<u64> = requests.iter().map(|r| r.params.seed).collect();
        assert_eq!(seeds, [10, 11, 12]);
        assert!(g.requests(vec![], &limits()).is_err());
        assert!(g.requests(vec![100], &limits()).is_err());
    }
}
