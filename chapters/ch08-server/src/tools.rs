//! Tool calls: `tools` and `tool_choice` in, `tool_calls` out.
//!
//! | tool_choice        | what the model may write                      | how it is read back        |
//! |--------------------|-----------------------------------------------|----------------------------|
//! | `none`             | text; the template is not shown the tools     | content                    |
//! | `auto` (default)   | text, with calls as `<tool_call>{"name", "arguments"}</tool_call>` (the Hermes format many templates teach) | calls parsed out, the rest is content |
//! | `required`         | constrained: `[{"name": ..., "parameters": {...}}, ...]` | every item is a call |
//! | `{"type": "function", "function": {"name": f}}` | constrained: `f`'s parameters object | one call of `f` |
//!
//! `required` and a named function go through the grammar engine ([`crate::structured`]), so
//! their output always parses: the JSON schema of the calls is the constraint.
//!
//! Some tokenizers make the `auto` tags special tokens, which decoded text leaves out, so the
//! parser would never see a call: an `auto` choice is then decoded by [`tag_decoder`]'s copy of
//! the tokenizer, which writes the tags and still leaves out every other special token, and the
//! tags never reach the content ([`without_tags`]).

use std::path::PathBuf;
use std::str::FromStr;

use ch01::Tokenizer;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::protocol::{FunctionCall, ToolCall};
use crate::structured::Constraint;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// Its parameters' JSON schema (`{"type": "object"}` when the tool gives none).
    pub parameters: Value,
}

/// What `tool_choice` asks.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolMode {
    None,
    Auto,
    Required,
    Named(String),
}

/// The request's tools, checked: each `{"type": "function", "function": {"name", ...}}`.
pub fn parse_tools(tools: &[Value]) -> Result<Vec<Tool>, ApiError> {
    let bad = |message: String| ApiError::bad_param("tools", message);
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            if tool.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(format!("tools[{i}].type must be \"function\"")));
            }
            let function = tool
                .get("function")
                .ok_or_else(|| bad(format!("tools[{i}] needs a function")))?;
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| bad(format!("tools[{i}].function needs a name")))?;
            let parameters = function
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            if !parameters.is_object() {
                return Err(bad(format!(
                    "tools[{i}].function.parameters must be a JSON schema object"
                )));
            }
            Ok(Tool {
                name: name.to_string(),
                parameters,
            })
        })
        .collect()
}

/// `tool_choice`, given the tools: `auto` when there are tools and no choice, `none` without
/// tools. Naming a function that is not among the tools, or requiring a call with no tools,
/// is a 400.
pub fn tool_mode(choice: Option<&Value>, tools: &[Tool]) -> Result<ToolMode, ApiError> {
    let bad = |message: &str| ApiError::bad_param("tool_choice", message);
    let mode = match choice {
        None if tools.is_empty() => ToolMode::None,
        None => ToolMode::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolMode::None,
            "auto" => ToolMode::Auto,
            "required" => ToolMode::Required,
            _ => {
                return Err(bad(
                    "tool_choice must be none, auto, required or a function",
                ));
            }
        },
        Some(named) => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| named.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
                })?;
            ToolMode::Named(name.to_string())
        }
    };
    match &mode {
        ToolMode::Required | ToolMode::Auto if tools.is_empty() => {
            Err(bad("tool_choice needs tools"))
        }
        ToolMode::Named(name) if !tools.iter().any(|t| &t.name == name) => Err(bad(&format!(
            "tool_choice names {name:?}, which is not among the tools"
        ))),
        _ => Ok(mode),
    }
}

// ANCHOR: tool_constraint
/// The constraint that makes a `required` or named call parse. `parallel`: `required` may
/// list more than one call.
pub fn constraint(mode: &ToolMode, tools: &[Tool], parallel: bool) -> Option<Constraint> {
    match mode {
        ToolMode::None | ToolMode::Auto => None,
        ToolMode::Named(name) => tools
            .iter()
            .find(|t| &t.name == name)
            .map(|t| Constraint::JsonSchema(t.parameters.clone())),
        ToolMode::Required => {
            // Each tool's schema sits under the root's `$defs`, its own `#...` references
            // rebased there: a reference resolves from the document's root, which is now the
            // array of calls.
            let mut defs = serde_json::Map::new();
            let calls: Vec<Value> = tools
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let base = format!("#/$defs/kiln_tool_{i}");
                    let mut parameters = t.parameters.clone();
                    rebase_refs(&mut parameters, &base);
                    defs.insert(format!("kiln_tool_{i}"), parameters);
                    json!({
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "enum": [t.name]},
                            "parameters": {"$ref": base},
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": false,
                    })
                })
                .collect();
            let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                    "$defs": defs});
            if !parallel {
                schema["maxItems"] = json!(1);
            }
            Some(Constraint::JsonSchema(schema))
        }
    }
}
// ANCHOR_END: tool_constraint

/// Every local reference in `schema` (`"$ref": "#..."`) made relative to `base`, where the
/// schema will sit: `#` becomes `base`, `#/$defs/x` becomes `base/$defs/x`.
fn rebase_refs(schema: &mut Value, base: &str) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match value {
                    Value::String(target) if key == "$ref" => {
                        if let Some(rest) = target.strip_prefix('#') {
                            *target = format!("{base}{rest}");
                        }
                    }
                    _ => rebase_refs(value, base),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

/// The tags around each `auto` call.
pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

// ANCHOR: tag_decoder
/// The tokenizer that decodes `auto` choices when `tokenizer` makes the tags special tokens:
/// a copy in which the tags alone are ordinary added tokens, so that decoded text keeps them
/// (for [`parse`] to find) and still leaves out every other special token (BOS, an end-of-turn
/// token), as `skip_special_tokens` asks. `None` when the tags are not special tokens: the
/// text has them already.
pub fn tag_decoder(tokenizer: &Tokenizer) -> Result<Option<Tokenizer>, String> {
    let inner = tokenizer.inner();
    let added = inner.get_added_vocabulary();
    if !added.is_special_token(OPEN) && !added.is_special_token(CLOSE) {
        return Ok(None);
    }
    // `tokenizers` cannot unmark a special token in place: unmark the tags in its saved form
    // and load that.
    let saved = inner.to_string(false).map_err(|e| e.to_string())?;
    let mut saved: Value = serde_json::from_str(&saved).map_err(|e| e.to_string())?;
    for token in (saved.get_mut("added_tokens").and_then(Value::as_array_mut))
        .into_iter()
        .flatten()
    {
        if matches!(
            token.get("content").and_then(Value::as_str),
            Some(OPEN | CLOSE)
        ) {
            token["special"] = Value::Bool(false);
        }
    }
    let copy = tokenizers::Tokenizer::from_str(&saved.to_string()).map_err(|e| e.to_string())?;
    let copy = Tokenizer::from_parts(
        copy,
        PathBuf::from("tokenizer.json (tool-call tags kept)"),
        tokenizer.bos_token_id(),
        tokenizer.eos_token_id(),
    );
    // It only decodes today; were it to encode, it would encode as the original does.
    Ok(Some(match tokenizer.encoder() {
        Some(encoder) => copy.with_encoder(encoder.clone()),
        None => copy,
    }))
}
// ANCHOR_END: tag_decoder

/// `text` without the tags: what a choice decoded by [`tag_decoder`] shows as content, where
/// the tags are special tokens that the client never sees.
pub fn without_tags(text: &str) -> String {
    text.replace(OPEN, "").replace(CLOSE, "")
}

/// A call as a response carries it; `id` from the response's id and the call's place.
pub fn call(id: String, name: &str, arguments: String) -> ToolCall {
    ToolCall {
        index: None,
        id: Some(id),
        kind: Some("function".into()),
        function: FunctionCall {
            name: Some(name.to_string()),
            arguments: Some(arguments),
        },
    }
}

/// What a choice's text says: its content (if any text is left) and its calls.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub content: Option<String>,
    /// (name, arguments as JSON text).
    pub calls: Vec<(String, String)>,
}

// ANCHOR: parse_calls
/// Reads the calls back from a choice's whole text. `required`: a JSON array of
/// `{"name", "parameters"}`; named: the text is the arguments; `auto`: every
/// `<tool_call>{"name", "arguments"}</tool_call>` block is a call, the rest is content. Text
/// that does not parse (a `length` cut) stays content. Without `parallel`
/// (`parallel_tool_calls: false`) only the first call is kept, as OpenAI answers.
pub fn parse(mode: &ToolMode, text: &str, parallel: bool) -> Parsed {
    let mut parsed = parse_all(mode, text);
    if !parallel {
        parsed.calls.truncate(1);
    }
    parsed
}

fn parse_all(mode: &ToolMode, text: &str) -> Parsed {
    let content = |text: &str| Parsed {
        content: Some(text.to_string()),
        calls: Vec::new(),
    };
    match mode {
        ToolMode::None => content(text),
        ToolMode::Named(name) => match serde_json::from_str::<Value>(text) {
            Ok(arguments) => Parsed {
                content: None,
                calls: vec![(name.clone(), arguments.to_string())],
            },
            Err(_) => content(text),
        },
        ToolMode::Required => {
            let calls: Option<Vec<(String, String)>> = serde_json::from_str::<Vec<Value>>(text)
                .ok()
                .and_then(|items| {
                    items
                        .iter()
                        .map(|item| {
                            let name = item.get("name")?.as_str()?.to_string();
                            Some((name, item.get("parameters")?.to_string()))
                        })
                        .collect()
                });
            match calls {
                Some(calls) if !calls.is_empty() => Parsed {
                    content: None,
                    calls,
                },
                _ => content(text),
            }
        }
        ToolMode::Auto => {
            let mut rest = text;
            let mut outside = String::new();
            let mut calls = Vec::new();
            while let Some(start) = rest.find(OPEN) {
                let after = &rest[start + OPEN.len()..];
                let Some(end) = after.find(CLOSE) else {
                    break;
                };
                let call = serde_json::from_str::<Value>(after[..end].trim())
                    .ok()
                    .and_then(|v| {
                        let name = v.get("name")?.as_str()?.to_string();
                        let arguments = v.get("arguments").or_else(|| v.get("parameters"))?;
                        Some((name, arguments.to_string()))
                    });
                match call {
                    Some(call) => {
                        outside.push_str(&rest[..start]);
                        calls.push(call);
                    }
                    None => outside.push_str(&rest[..start + OPEN.len() + end + CLOSE.len()]),
                }
                rest = &after[end + CLOSE.len()..];
            }
            outside.push_str(rest);
            if calls.is_empty() {
                return content(text);
            }
            let outside = outside.trim();
            Parsed {
                content: (!outside.is_empty()).then(|| outside.to_string()),
                calls,
            }
        }
    }
}
// ANCHOR_END: parse_calls

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(&[
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}),
        ])
        .unwrap()
    }

    #[test]
    fn tool_choice_is_checked_against_the_tools() {
        let t = tools();
        assert_eq!(tool_mode(None, &t).unwrap(), ToolMode::Auto);
        assert_eq!(tool_mode(None, &[]).unwrap(), ToolMode::None);
        assert_eq!(
            tool_mode(Some(&json!("required")), &t).unwrap(),
            ToolMode::Required
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        assert_eq!(
            tool_mode(Some(&named), &t).unwrap(),
            ToolMode::Named("get_weather".into())
        );
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert!(tool_mode(Some(&other), &t).is_err());
        assert!(tool_mode(Some(&json!("required")), &[]).is_err());
        assert!(tool_mode(Some(&json!("sometimes")), &t).is_err());
        assert!(parse_tools(&[json!({"type": "function"})]).is_err());
    }

    /// A `required` choice nests each tool's schema in one document: its references, written
    /// against its own root, must still resolve (Pydantic writes `$defs`; a tree refers to `#`).
    #[test]
    fn required_calls_keep_each_tools_references() {
        let tools = parse_tools(&[
            json!({"type": "function", "function": {"name": "locate", "parameters": {
                "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}}},
                "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}}}}),
            json!({"type": "function", "function": {"name": "tree", "parameters": {
                "type": "object", "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#"}}}}}}),
        ])
        .unwrap();
        let Some(Constraint::JsonSchema(schema)) = constraint(&ToolMode::Required, &tools, true)
        else {
            panic!("a JSON schema");
        };
        let defs = &schema["$defs"];
        assert_eq!(
            defs["kiln_tool_0"]["properties"]["loc"]["$ref"],
            "#/$defs/kiln_tool_0/$defs/Loc"
        );
        assert_eq!(
            defs["kiln_tool_1"]["properties"]["children"]["items"]["$ref"],
            "#/$defs/kiln_tool_1"
        );
        let any_of = &schema["items"]["anyOf"];
        assert_eq!(
            any_of[1]["properties"]["parameters"]["$ref"],
            "#/$defs/kiln_tool_1"
        );
        // And the grammar engine resolves them.
        let dir = ch01::fixtures_dir().join("tokenizer");
        let tokenizer = std::sync::Arc::new(ch01::Tokenizer::from_dir(&dir).unwrap());
        let vocab = tokenizer.vocab_size();
        let grammars = crate::structured::Grammars::new(tokenizer, vocab, &[1]).unwrap();
        grammars
            .compile(&Constraint::JsonSchema(schema), "tool_choice")
            .unwrap();
    }

    /// Where the tags are special tokens, the decoder writes them, at the same ids, and still
    /// leaves out the other special tokens; where they are not, the server's tokenizer serves.
    #[test]
    fn the_tag_decoder_writes_the_tags_alone() {
        let dir = ch01::fixtures_dir().join("tokenizer");
        let plain = ch01::Tokenizer::from_dir(&dir).unwrap();
        assert!(tag_decoder(&plain).unwrap().is_none());
        let mut inner = plain.inner().clone();
        let tags = [OPEN, CLOSE].map(|t| tokenizers::AddedToken::from(t, true));
        inner.add_special_tokens(&tags);
        let tagged = Tokenizer::from_parts(inner, dir, plain.bos_token_id(), None);
        let mut ids = tagged
            .encode("<s>Hi<tool_call>{}</tool_call>", false)
            .unwrap();
        ids.push(1); // </s>
        assert_eq!(tagged.decode(&ids).unwrap(), "Hi{}");
        let decoder = tag_decoder(&tagged).unwrap().expect("the tags are special");
        assert_eq!(decoder.decode(&ids).unwrap(), "Hi<tool_call>{}</tool_call>");
        for id in 0..tagged.vocab_size() as u32 {
            assert_eq!(
                decoder.inner().id_to_token(id),
                tagged.inner().id_to_token(id)
            );
        }
        let open = tagged.inner().token_to_id(OPEN).unwrap();
        assert!(tagged.token_bytes(open).unwrap().is_empty());
        assert_eq!(decoder.token_bytes(open).unwrap(), OPEN.as_bytes());
        assert_eq!(without_tags("a<tool_call>{}</tool_call>b"), "a{}b");
    }

    #[test]
    fn calls_are_read_back_in_each_mode() {
        let required = parse(
            &ToolMode::Required,
            r#"[{"name": "get_weather", "parameters": {"city": "Paris"}}]"#,
            true,
        );
        assert_eq!(required.content, None);
        assert_eq!(
            required.calls,
            vec![("get_weather".into(), r#"{"city":"Paris"}"#.into())]
        );
        let named = parse(&ToolMode::Named("f".into()), r#"{"a": 1}"#, true);
        assert_eq!(named.calls, vec![("f".into(), r#"{"a":1}"#.into())]);
        let auto = parse(
            &ToolMode::Auto,
            "Let me look.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 2}}\n</tool_call>",
            true,
        );
        assert_eq!(auto.content.as_deref(), Some("Let me look."));
        assert_eq!(auto.calls, vec![("f".into(), r#"{"x":2}"#.into())]);
        let cut = parse(&ToolMode::Required, r#"[{"name": "get_wea"#, true);
        assert_eq!(cut.calls, Vec::new());
        assert_eq!(cut.content.as_deref(), Some(r#"[{"name": "get_wea"#));
        // Two calls; without parallel calls, the first alone.
        let two = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\
                   <tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        assert_eq!(parse(&ToolMode::Auto, two, true).calls.len(), 2);
        let first = parse(&ToolMode::Auto, two, false);
        assert_eq!(first.calls, vec![("f".into(), "{}".into())]);
        assert_eq!(first.content, None);
    }
}
