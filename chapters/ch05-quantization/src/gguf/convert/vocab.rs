//! A Hugging Face byte-level BPE tokenizer (`tokenizer.json`, `tokenizer_config.json`,
//! `config.json`, `generation_config.json`) → `tokenizer.ggml.*` metadata, as llama.cpp's
//! converter writes it (see `tokenizer.rs` for what each key means).
//!
//! ```text
//! key                        from
//! model                      "gpt2" (byte-level BPE is the only kind written)
//! pre                        the pre-tokenizer of tokenizer.json, recognised by its structure:
//!                            ByteLevel → gpt-2; Digits + ByteLevel → smollm;
//!                            Llama 3's / Qwen2's split regex + ByteLevel → llama-bpe / qwen2;
//!                            anything else is an error (a wrong guess would tokenize differently)
//! tokens, token_type         model.vocab and added_tokens, padded to config.json's vocab_size
//!                            with "[PADn]" (unused); added tokens that are special, or look
//!                            special (<|...|>), are control, other added tokens user-defined
//! merges                     model.merges ("a b"; a space inside a piece written as U+0120)
//! bos / eos / unknown /      tokenizer_config.json's bos_token, eos_token, unk_token, pad_token,
//!   padding_token_id         else config.json's *_token_id
//! eot_token_id               generation_config.json's first eos_token_id that is not eos
//! add_bos / add_eos_token    the post-processor (TemplateProcessing adding them), else
//!                            tokenizer_config.json's add_bos_token / add_eos_token, else false
//! tokenizer.chat_template    tokenizer_config.json's chat_template, else chat_template.jinja
//! ```
//!
//! Invariant of what [`HfVocab::read`] returns: `tokens` are unique, `tokens.len() ==
//! types.len() == vocab_size`, and every special id is below `vocab_size`.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::error::{ConvertError, ConvertResult};
use crate::gguf::error::GgufResult;
use crate::gguf::tokenizer::{LLAMA3_SPLIT, QWEN2_SPLIT, token_type};
use crate::gguf::value::GgufValue;
use crate::gguf::writer::GgufWriter;

/// The tokenizer metadata of one checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct HfVocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre`.
    pub pre: &'static str,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub unknown: Option<u32>,
    pub padding: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
    /// What was left out, for the user to read.
    pub warnings: Vec<String>,
}

/// `path` as JSON; `None` when the file does not exist; text that is not JSON is `invalid`'s
/// error for that file (the tokenizer's files are tokenizer errors, the model's config errors).
fn read_json(
    path: &Path,
    invalid: fn(&Path, String) -> ConvertError,
) -> ConvertResult<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| ch01::Error::Io {
        path: path.to_path_buf(),
        error: e,
    })?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| invalid(path, format!("not valid JSON: {e}")))
}

/// llama.cpp's converter treats these added tokens as control tokens even when the checkpoint
/// does not mark them special.
fn looks_special(token: &str) -> bool {
    (token.starts_with("<|") && token.ends_with("|>"))
        || (token.starts_with("<｜") && token.ends_with("｜>"))
        || (token.starts_with("<unused") && token.ends_with('>'))
        || matches!(token, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
}

/// `tokenizer.ggml.pre` for `tokenizer.json`'s `pre_tokenizer`, or why none fits.
fn detect_pre(pre: &Value) -> Result<&'static str, String> {
    let kind = |v: &Value| v["type"].as_str().unwrap_or_default().to_string();
    // ByteLevel without a prefix space; `use_regex` defaults to true.
    let byte_level = |v: &Value, regex: bool| {
        kind(v) == "ByteLevel"
            && !v["add_prefix_space"].as_bool().unwrap_or(false)
            && v["use_regex"].as_bool().unwrap_or(true) == regex
    };
    let split = |v: &Value, pattern: &str| {
        kind(v) == "Split"
            && v["pattern"]["Regex"].as_str() == Some(pattern)
            && v["behavior"].as_str() == Some("Isolated")
            && !v["invert"].as_bool().unwrap_or(false)
    };
    let digits = |v: &Value| kind(v) == "Digits" && v["individual_digits"].as_bool() == Some(true);
    let found = match kind(pre).as_str() {
        "ByteLevel" if byte_level(pre, true) => Some("gpt-2"),
        "Sequence" => match pre["pretokenizers"].as_array().map(Vec::as_slice) {
            Some([a, b]) if digits(a) && byte_level(b, true) => Some("smollm"),
            Some([a, b]) if split(a, LLAMA3_SPLIT) && byte_level(b, false) => Some("llama-bpe"),
            Some([a, b]) if split(a, QWEN2_SPLIT) && byte_level(b, false) => Some("qwen2"),
            _ => None,
        },
        _ => None,
    };
    found.ok_or_else(|| {
        let mut shown = pre.to_string();
        if shown.len() > 300 {
            let mut end = 300;
            while !shown.is_char_boundary(end) {
                end -= 1;
            }
            shown.truncate(end);
            shown.push('…');
        }
        format!(
            "pre-tokenizer {shown} is not one kiln recognises (ByteLevel → gpt-2, Digits + \
             ByteLevel → smollm, Llama 3's or Qwen2's split + ByteLevel → llama-bpe / qwen2)"
        )
    })
}

/// A merge as `"left right"`; spaces inside a piece become U+0120, as llama.cpp's converter
/// writes them.
fn merge_string(m: &Value) -> Option<String> {
    match m {
        Value::String(s) => Some(s.clone()),
        Value::Array(pair) => match pair.as_slice() {
            [Value::String(a), Value::String(b)] => {
                let escape = |s: &str| s.replace(' ', "\u{0120}");
                Some(format!("{} {}", escape(a), escape(b)))
            }
            _ => None,
        },
        _ => None,
    }
}

/// A `{key}` of tokenizer_config.json: a token string or `{"content": ...}`.
fn config_token<'v>(config: &'v Value, key: &str) -> Option<&'v str> {
    match &config[key] {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("content").and_then(Value::as_str),
        _ => None,
    }
}

/// The first id of an `eos_token_id`-style field (an integer or a list of them), and the rest.
fn ids(v: &Value) -> Vec<u32> {
    match v {
        Value::Number(n) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Value::Array(a) => a.iter().flat_map(ids).collect(),
        _ => Vec::new(),
    }
}

impl HfVocab {
    /// Reads the tokenizer of the checkpoint in `dir`, whose embedding has `vocab_size` rows.
    pub fn read(dir: &Path, vocab_size: usize) -> ConvertResult<HfVocab> {
        let path = dir.join("tokenizer.json");
        let json = read_json(&path, |p, m| ConvertError::tokenizer(p, m))?.ok_or_else(|| {
            ConvertError::tokenizer(&path, "missing (GGUF needs the tokenizer in its metadata)")
        })?;
        let bad = |message: String| ConvertError::tokenizer(&path, message);
        let model = &json["model"];
        match model["type"].as_str() {
            Some("BPE") => {}
            other => {
                return Err(bad(format!(
                    "model type {other:?} is not supported (only byte-level BPE)"
                )));
            }
        }
        if !json["normalizer"].is_null() {
            return Err(bad(format!(
                "normalizer {} is not supported for byte-level BPE",
                json["normalizer"]
            )));
        }
        let pre = detect_pre(&json["pre_tokenizer"]).map_err(bad)?;

        // tokens[id], from the vocabulary and the added tokens.
        let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
        let mut place = |token: &str, id: &Value| -> ConvertResult<usize> {
            let id = id
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| bad(format!("token {token:?} has id {id}, not an integer")))?;
            let slot = tokens.get_mut(id).ok_or_else(|| {
                bad(format!(
                    "token {token:?} has id {id}, outside config.json's vocab_size {vocab_size}"
                ))
            })?;
            match slot {
                Some(other) if other != token => {
                    Err(bad(format!("id {id} is both {other:?} and {token:?}")))
                }
                _ => {
                    *slot = Some(token.to_string());
                    Ok(id)
                }
            }
        };
        let vocab = model["vocab"]
            .as_object()
            .ok_or_else(|| bad("model.vocab is not an object".to_string()))?;
        for (token, id) in vocab {
            place(token, id)?;
        }
        let mut types = vec![token_type::NORMAL; vocab_size];
        let mut added_ids: HashMap<String, u32> = HashMap::new();
        for added in json["added_tokens"].as_array().into_iter().flatten() {
            let content = added["content"]
                .as_str()
                .ok_or_else(|| bad(format!("added token {added} has no content")))?;
            let id = place(content, &added["id"])?;
            types[id] = if added["special"].as_bool().unwrap_or(false) || looks_special(content) {
                token_type::CONTROL
            } else {
                token_type::USER_DEFINED
            };
            added_ids.insert(content.to_string(), id as u32);
        }
        let mut padded = 0;
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(id, t)| {
                t.unwrap_or_else(|| {
                    types[id] = token_type::UNUSED;
                    padded += 1;
                    format!("[PAD{id}]")
                })
            })
            .collect();
        let mut seen = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            if let Some(first) = seen.insert(t.as_str(), id) {
                return Err(bad(format!(
                    "token {t:?} appears twice (ids {first} and {id})"
                )));
            }
        }
        let merges = model["merges"]
            .as_array()
            .ok_or_else(|| bad("model.merges is not a list".to_string()))?
            .iter()
            .map(|m| merge_string(m).ok_or_else(|| bad(format!("merge {m} is not two pieces"))))
            .collect::<ConvertResult<Vec<_>>>()?;

        let config_path = dir.join("tokenizer_config.json");
        let tok_config =
            read_json(&config_path, |p, m| ConvertError::tokenizer(p, m))?.unwrap_or(Value::Null);
        let model_config =
            read_json(&dir.join("config.json"), ConvertError::config)?.unwrap_or(Value::Null);
        let generation = read_json(&dir.join("generation_config.json"), ConvertError::config)?
            .unwrap_or(Value::Null);
        let id_of = |token: &str| {
            added_ids
                .get(token)
                .copied()
                .or_else(|| seen.get(token).map(|&i| i as u32))
        };
        let mut warnings = Vec::new();
        let mut special = |typ: &str| -> ConvertResult<Option<u32>> {
            if let Some(token) = config_token(&tok_config, &format!("{typ}_token")) {
                return match id_of(token) {
                    Some(id) => Ok(Some(id)),
                    None => Err(ConvertError::tokenizer(
                        &config_path,
                        format!("{typ}_token {token:?} is not in the vocabulary"),
                    )),
                };
            }
            let from_config = ids(&model_config[format!("{typ}_token_id")]);
            match from_config.first() {
                Some(&id) if (id as usize) < vocab_size => Ok(Some(id)),
                Some(&id) => {
                    warnings.push(format!(
                        "config.json {typ}_token_id {id} is outside the vocabulary: left out"
                    ));
                    Ok(None)
                }
                None => Ok(None),
            }
        };
        let bos = special("bos")?;
        let mut eos = special("eos")?;
        let unknown = special("unk")?;
        let padding = special("pad")?;

        // Stop tokens beyond eos: generation_config.json's, which is what `generate` stops on.
        let gen_eos = ids(&generation["eos_token_id"]);
        if eos.is_none() {
            eos = gen_eos.first().copied();
        }
        let mut extra = gen_eos
            .into_iter()
            .filter(|&id| Some(id) != eos && (id as usize) < vocab_size);
        let eot = extra.next();
        let dropped: Vec<u32> = extra.collect();
        if !dropped.is_empty() {
            warnings.push(format!(
                "generation_config.json stop ids {dropped:?} left out: GGUF names only eos and eot"
            ));
        }

        // BOS / EOS added by the post-processor, else as tokenizer_config.json says.
        let name = |id: Option<u32>| id.map(|i| tokens[i as usize].as_str());
        let (mut add_bos, mut add_eos) = (None, None);
        let post = &json["post_processor"];
        let processors = match post["processors"].as_array() {
            Some(list) => list.iter().collect(),
            None if post.is_null() => Vec::new(),
            None => vec![post],
        };
        for p in processors {
            match p["type"].as_str() {
                Some("TemplateProcessing") => {
                    let single = p["single"]
                        .as_array()
                        .map(Vec::as_slice)
                        .unwrap_or_default();
                    fn special_at(item: Option<&Value>) -> Option<&str> {
                        item.and_then(|i| i["SpecialToken"]["id"].as_str())
                    }
                    add_bos = Some(
                        single.len() > 1
                            && special_at(single.first()).is_some_and(|t| Some(t) == name(bos)),
                    );
                    add_eos = Some(
                        single.len() > 1
                            && special_at(single.last()).is_some_and(|t| Some(t) == name(eos)),
                    );
                }
                Some("ByteLevel") => {}
                other => {
                    return Err(bad(format!(
                        "post-processor {other:?} is not supported (expected ByteLevel or TemplateProcessing)"
                    )));
                }
            }
        }
        let config_bool = |key: &str| tok_config[key].as_bool();
        let add_bos = add_bos.or(config_bool("add_bos_token")).unwrap_or(false);
        let add_eos = add_eos.or(config_bool("add_eos_token")).unwrap_or(false);

        let chat_template = match &tok_config["chat_template"] {
            Value::String(s) => Some(s.clone()),
            Value::Array(named) => {
                let default = named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str());
                if named.len() > 1 {
                    warnings.push("only the default of the named chat templates is kept".into());
                }
                default.map(str::to_string)
            }
            _ => {
                let jinja = dir.join("chat_template.jinja");
                if jinja.exists() {
                    Some(
                        std::fs::read_to_string(&jinja).map_err(|e| ch01::Error::Io {
                            path: jinja.clone(),
                            error: e,
                        })?,
                    )
                } else {
                    None
                }
            }
        };
        if padded > 0 {
            warnings.push(format!(
                "{padded} ids of the {vocab_size}-row embedding have no token: written as [PADn]"
            ));
        }
        Ok(HfVocab {
            tokens,
            types,
            merges,
            pre,
            bos,
            eos,
            eot,
            unknown,
            padding,
            add_bos,
            add_eos,
            chat_template,
            warnings,
        })
    }

    /// Adds `tokenizer.*` to `w`.
    pub fn add_to(&self, w: &mut GgufWriter<'_>) -> GgufResult<()> {
        w.add_metadata("tokenizer.ggml.model", "gpt2")?;
        w.add_metadata("tokenizer.ggml.pre", self.pre)?;
        w.add_metadata(
            "tokenizer.ggml.tokens",
            GgufValue::strings(self.tokens.clone()),
        )?;
        w.add_metadata(
            "tokenizer.ggml.token_type",
            GgufValue::array(self.types.clone()),
        )?;
        w.add_metadata(
            "tokenizer.ggml.merges",
            GgufValue::strings(self.merges.clone()),
        )?;
        for (key, id) in [
            ("bos_token_id", self.bos),
            ("eos_token_id", self.eos),
            ("eot_token_id", self.eot),
            ("unknown_token_id", self.unknown),
            ("padding_token_id", self.padding),
        ] {
            if let Some(id) = id {
                w.add_metadata(format!("tokenizer.ggml.{key}"), id)?;
            }
        }
        w.add_metadata("tokenizer.ggml.add_bos_token", self.add_bos)?;
        w.add_metadata("tokenizer.ggml.add_eos_token", self.add_eos)?;
        if let Some(t) = &self.chat_template {
            w.add_metadata("tokenizer.chat_template", t.as_str())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pre_tokenizers_are_recognised_by_structure() {
        let bl = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "use_regex": regex});
        assert_eq!(detect_pre(&bl(true)), Ok("gpt-2"));
        let smollm = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, bl(true)]});
        assert_eq!(detect_pre(&smollm), Ok("smollm"));
        let split = |p: &str| {
            json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false},
            bl(false)]})
        };
        assert_eq!(detect_pre(&split(LLAMA3_SPLIT)), Ok("llama-bpe"));
        assert_eq!(detect_pre(&split(QWEN2_SPLIT)), Ok("qwen2"));
        for bad in [
            split("\\s+"),
            bl(false),
            json!({"type": "Metaspace"}),
            Value::Null,
        ] {
            let e = detect_pre(&bad).unwrap_err();
            assert!(e.contains("not one kiln recognises"), "{e}");
        }
    }

    #[test]
    fn merges_escape_inner_spaces() {
        assert_eq!(merge_string(&json!("a b")).as_deref(), Some("a b"));
        assert_eq!(
            merge_string(&json!(["a b", "c"])).as_deref(),
            Some("a\u{0120}b c")
        );
        assert_eq!(merge_string(&json!(["a"])), None);
        assert!(looks_special("<|im_start|>") && !looks_special("<s>"));
    }
}
