//! Reading one round of a non-streaming answer, building the follow-up, and stitching the
//! rounds into one response body. Pure functions over bytes, so they are tested on their own.

use bytes::Bytes;
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::TruncatedToolCall;
use crate::json_edit;

/// One answer, as far as continuing it is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Round {
    /// The answer's text, all its text blocks joined.
    pub(crate) text: String,
    /// It stopped at the output limit (`max_tokens`, `length`).
    pub(crate) at_limit: bool,
    /// A tool call in an answer cut at the limit.
    pub(crate) tool_call: Option<TruncatedToolCall>,
    /// It can be continued with a text follow-up: cut at the limit inside text, one choice,
    /// no tool call, some text.
    pub(crate) continuable: bool,
}

const ANTHROPIC_TOOL_BLOCKS: [&str; 3] = ["tool_use", "server_tool_use", "mcp_tool_use"];

/// Reads an Anthropic Messages or OpenAI Chat Completions response body; `None` for any other.
pub(crate) fn read_round(body: &[u8]) -> Option<Round> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object()?;
    if let (Some(content), true) = (obj.get("content"), obj.contains_key("stop_reason")) {
        let blocks = content.as_array()?;
        let at_limit = obj.get("stop_reason").and_then(Value::as_str) == Some("max_tokens");
        let kind = |b: &Value| b.get("type").and_then(Value::as_str).map(str::to_owned);
        let text: String = blocks
            .iter()
            .filter(|b| kind(b).as_deref() == Some("text"))
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect();
        let tool = blocks
            .iter()
            .rev()
            .find(|b| kind(b).is_some_and(|k| ANTHROPIC_TOOL_BLOCKS.contains(&k.as_str())));
        // Cut inside a tool call only when the call is the last block: a complete one
        // followed by text cut at the limit is whole.
        let last_is_tool = blocks
            .last()
            .and_then(kind)
            .is_some_and(|k| ANTHROPIC_TOOL_BLOCKS.contains(&k.as_str()));
        let tool_call = tool
            .filter(|_| at_limit && last_is_tool)
            .map(|b| TruncatedToolCall {
                name: b.get("name").and_then(Value::as_str).map(str::to_owned),
                id: b.get("id").and_then(Value::as_str).map(str::to_owned),
            });
        let ends_in_text = blocks.last().and_then(kind).as_deref() == Some("text");
        let continuable = at_limit && tool.is_none() && ends_in_text && !text.is_empty();
        return Some(Round {
            text,
            at_limit,
            tool_call,
            continuable,
        });
    }
    let choices = obj.get("choices")?.as_array()?;
    let at_limit = choices
        .iter()
        .any(|c| c.get("finish_reason").and_then(Value::as_str) == Some("length"));
    let message = choices.first().and_then(|c| c.get("message"));
    let calls = message
        .and_then(|m| m.get("tool_calls"))
        .and_then(Value::as_array)
        .filter(|calls| !calls.is_empty());
    let function_call = message
        .and_then(|m| m.get("function_call"))
        .filter(|f| !f.is_null());
    let tool_call = if !at_limit {
        None
    } else if let Some(last) = calls.and_then(|c| c.last()) {
        Some(TruncatedToolCall {
            name: last
                .pointer("/function/name")
                .and_then(Value::as_str)
                .map(str::to_owned),
            id: last.get("id").and_then(Value::as_str).map(str::to_owned),
        })
    } else {
        function_call.map(|f| TruncatedToolCall {
            name: f.get("name").and_then(Value::as_str).map(str::to_owned),
            id: None,
        })
    };
    let text = message
        .and_then(|m| m.get("content"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let continuable = at_limit
        && choices.len() == 1
        && calls.is_none()
        && function_call.is_none()
        && !text.is_empty();
    Some(Round {
        text,
        at_limit,
        tool_call,
        continuable,
    })
}

/// Whether a request body can be continued by the layer: a JSON object with a `messages`
/// array, not asking for a stream.
pub(crate) fn request_is_continuable(body: &[u8]) -> bool {
    let messages = json_edit::value_span(body, "messages");
    let is_array = messages.is_some_and(|span| body[span].first() == Some(&b'['));
    is_array && json_edit::read_value::<bool>(body, "stream") != Some(true)
}

#[derive(Serialize)]
struct Turn<'a> {
    role: &'a str,
    content: &'a str,
}

/// `original` with two turns appended to its `messages` array, every other byte kept.
pub(crate) fn append_turns(original: &[u8], partial: &str, prompt: &str) -> Option<Bytes> {
    if partial.is_empty() || prompt.is_empty() {
        return None;
    }
    append(
        original,
        &[
            Turn {
                role: "assistant",
                content: partial,
            },
            Turn {
                role: "user",
                content: prompt,
            },
        ],
    )
}

/// `original` with one assistant turn appended to its `messages` array (a prefill), every
/// other byte kept.
pub(crate) fn append_prefill(original: &[u8], partial: &str) -> Option<Bytes> {
    if partial.is_empty() {
        return None;
    }
    append(
        original,
        &[Turn {
            role: "assistant",
            content: partial,
        }],
    )
}

fn append(original: &[u8], turns: &[Turn<'_>]) -> Option<Bytes> {
    let span = json_edit::value_span(original, "messages")?;
    let raw = &original[span.clone()];
    if raw.first() != Some(&b'[') || raw.last() != Some(&b']') {
        return None;
    }
    let close = span.end - 1;
    let mut empty = original[span.start + 1..close]
        .iter()
        .all(u8::is_ascii_whitespace);
    let mut out = Vec::with_capacity(original.len() + 64);
    out.extend_from_slice(&original[..close]);
    for turn in turns {
        if !empty {
            out.push(b',');
        }
        empty = false;
        out.extend_from_slice(&serde_json::to_vec(turn).ok()?);
    }
    out.extend_from_slice(&original[close..]);
    Some(Bytes::from(out))
}

/// One response body made of the rounds' bodies, oldest first: the last round's bytes with its
/// text preceded by every earlier round's, and `usage` summed. `None` when a body is not of the
/// shape [`read_round`] reads.
pub(crate) fn stitch(rounds: &[Bytes]) -> Option<Bytes> {
    let last = rounds.last()?;
    if rounds.len() == 1 {
        return Some(last.clone());
    }
    let mut out = if json_edit::value_span(last, "choices").is_some() {
        stitch_openai(rounds)?
    } else {
        stitch_anthropic(rounds)?
    };
    if json_edit::value_span(last, "usage").is_some() {
        let mut usage = Value::Null;
        for body in rounds {
            if let Some(u) = json_edit::read_value::<Value>(body, "usage") {
                add_usage(&mut usage, &u);
            }
        }
        out = json_edit::replace_value(&out, "usage", &usage)?;
    }
    Some(out)
}

/// Anthropic: every round's blocks in order, the text blocks merged into the first one (its
/// other fields kept as they were).
fn stitch_anthropic(rounds: &[Bytes]) -> Option<Bytes> {
    let mut blocks: Vec<Box<RawValue>> = Vec::new();
    let mut text = String::new();
    let mut first_text = None;
    for body in rounds {
        let content: Vec<Box<RawValue>> = json_edit::read_value(body, "content")?;
        for block in content {
            let bytes = block.get().as_bytes();
            if json_edit::read_value::<String>(bytes, "type").as_deref() == Some("text") {
                text.push_str(&json_edit::read_value::<String>(bytes, "text").unwrap_or_default());
                if first_text.is_some() {
                    continue;
                }
                first_text = Some(blocks.len());
            }
            blocks.push(block);
        }
    }
    if let Some(i) = first_text {
        let merged = json_edit::replace_value(blocks[i].get().as_bytes(), "text", &text)?;
        blocks[i] = RawValue::from_string(String::from_utf8(merged.to_vec()).ok()?).ok()?;
    }
    json_edit::replace_value(rounds.last()?, "content", &blocks)
}

/// OpenAI: the last round's choices, its message's `content` the text of every round.
fn stitch_openai(rounds: &[Bytes]) -> Option<Bytes> {
    let mut text = String::new();
    for body in rounds {
        let choices: Vec<Value> = json_edit::read_value(body, "choices")?;
        // A round that answered with a tool call or a refusal has `content: null`: no text of
        // its own, and the earlier rounds' text is still the answer's.
        match choices.first()?.pointer("/message/content") {
            Some(Value::String(content)) => text.push_str(content),
            Some(Value::Null) | None => {}
            Some(_) => return None,
        }
    }
    let last = rounds.last()?;
    if text.is_empty() {
        return Some(last.clone());
    }
    let mut choices: Vec<Box<RawValue>> = json_edit::read_value(last, "choices")?;
    let choice = choices.first_mut()?;
    let message: Box<RawValue> = json_edit::read_value(choice.get().as_bytes(), "message")?;
    let message = json_edit::replace_value(message.get().as_bytes(), "content", &text)?;
    let message = RawValue::from_string(String::from_utf8(message.to_vec()).ok()?).ok()?;
    let edited = json_edit::replace_value(choice.get().as_bytes(), "message", &message)?;
    *choice = RawValue::from_string(String::from_utf8(edited.to_vec()).ok()?).ok()?;
    json_edit::replace_value(last, "choices", &choices)
}

/// Adds `next` into `acc`: numbers summed, objects merged key by key, anything else (a
/// `service_tier` string, say) taken from `next`.
pub(crate) fn add_usage(acc: &mut Value, next: &Value) {
    match (acc, next) {
        (Value::Object(a), Value::Object(n)) => add_objects(a, n),
        (slot, Value::Number(n)) => {
            let sum = match slot.as_number() {
                Some(m) => match (m.as_u64(), n.as_u64()) {
                    (Some(x), Some(y)) => Value::from(x.saturating_add(y)),
                    _ => match (m.as_f64(), n.as_f64()) {
                        (Some(x), Some(y)) => Value::from(x + y),
                        _ => Value::Number(n.clone()),
                    },
                },
                None => Value::Number(n.clone()),
            };
            *slot = sum;
        }
        // A null (an unused counter) does not erase a count of an earlier round.
        (_, Value::Null) => {}
        (slot, other) => *slot = other.clone(),
    }
}

fn add_objects(acc: &mut Map<String, Value>, next: &Map<String, Value>) {
    for (key, value) in next {
        match acc.get_mut(key) {
            Some(slot) => add_usage(slot, value),
            None => {
                acc.insert(key.clone(), value.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn anthropic(text: &str, stop: &str, out: u64) -> Bytes {
        Bytes::from(
            json!({"id":"msg","type":"message","role":"assistant","model":"m",
                "content":[{"type":"text","text":text}],"stop_reason":stop,"stop_sequence":null,
                "usage":{"input_tokens":10,"output_tokens":out,"cache_read_input_tokens":null,
                         "service_tier":"standard"}})
            .to_string(),
        )
    }

    #[test]
    fn appends_after_the_last_message_byte_for_byte() {
        let body =
            br#"{"model":"m", "messages" : [ {"role":"user","content":"hi"} ] ,"max_tokens":5}"#;
        let out = append_turns(body, "Hel", "go on").unwrap();
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"model":"m", "messages" : [ {"role":"user","content":"hi"} ,{"role":"assistant","content":"Hel"},{"role":"user","content":"go on"}] ,"max_tokens":5}"#
        );
        let empty = append_turns(br#"{"messages":[ ]}"#, "a\"b", "c").unwrap();
        assert_eq!(
            &empty[..],
            br#"{"messages":[ {"role":"assistant","content":"a\"b"},{"role":"user","content":"c"}]}"#
        );
        assert_eq!(append_turns(br#"{"messages":{}}"#, "a", "b"), None);
        assert_eq!(append_turns(br#"{"input":[]}"#, "a", "b"), None);
        assert_eq!(append_turns(br#"{"messages":[]}"#, "", "b"), None);
    }

    #[test]
    fn only_non_streaming_message_requests_are_continued() {
        assert!(request_is_continuable(br#"{"messages":[]}"#));
        assert!(request_is_continuable(br#"{"messages":[],"stream":false}"#));
        assert!(!request_is_continuable(br#"{"messages":[],"stream":true}"#));
        assert!(!request_is_continuable(br#"{"input":"hi"}"#));
        assert!(!request_is_continuable(b"not json"));
    }

    #[test]
    fn reads_rounds() {
        let r = read_round(&anthropic("Hel", "max_tokens", 3)).unwrap();
        assert!(r.at_limit && r.continuable && r.tool_call.is_none());
        assert_eq!(r.text, "Hel");
        let r = read_round(&anthropic("Hello", "end_turn", 3)).unwrap();
        assert!(!r.at_limit && !r.continuable);
        let tool = json!({"content":[{"type":"text","text":"Let me"},
            {"type":"tool_use","id":"toolu_1","name":"rm","input":{}}],"stop_reason":"max_tokens"});
        let r = read_round(tool.to_string().as_bytes()).unwrap();
        assert!(!r.continuable);
        assert_eq!(
            r.tool_call,
            Some(TruncatedToolCall {
                name: Some("rm".into()),
                id: Some("toolu_1".into())
            })
        );
        // A whole tool call, then text cut at the limit: no tool call was cut, and with a
        // tool call in it the answer is not continued with text either.
        let after = json!({"content":[{"type":"tool_use","id":"toolu_1","name":"rm","input":{}},
            {"type":"text","text":"Done, and now"}],"stop_reason":"max_tokens"});
        let r = read_round(after.to_string().as_bytes()).unwrap();
        assert!(r.at_limit && !r.continuable && r.tool_call.is_none());
        let thinking =
            json!({"content":[{"type":"thinking","thinking":"hmm"}],"stop_reason":"max_tokens"});
        let r = read_round(thinking.to_string().as_bytes()).unwrap();
        assert!(r.at_limit && !r.continuable && r.tool_call.is_none());

        let openai = json!({"choices":[{"index":0,"message":{"role":"assistant","content":"Hel"},"finish_reason":"length"}]});
        let r = read_round(openai.to_string().as_bytes()).unwrap();
        assert!(r.continuable);
        let calls = json!({"choices":[{"index":0,"message":{"role":"assistant","content":null,
            "tool_calls":[{"id":"call_1","type":"function","function":{"name":"pay","arguments":"{\"amo"}}]},
            "finish_reason":"length"}]});
        let r = read_round(calls.to_string().as_bytes()).unwrap();
        assert!(!r.continuable);
        assert_eq!(r.tool_call.unwrap().name.as_deref(), Some("pay"));
        assert_eq!(read_round(br#"{"type":"error"}"#), None);
    }

    #[test]
    fn stitches_anthropic_rounds() {
        let rounds = [
            anthropic("Hel", "max_tokens", 3),
            anthropic("lo, wor", "max_tokens", 4),
            anthropic("ld!", "end_turn", 2),
        ];
        let out = stitch(&rounds).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(
            v["content"],
            json!([{"type":"text","text":"Hello, world!"}])
        );
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(
            v["usage"],
            json!({"input_tokens":30,"output_tokens":9,"cache_read_input_tokens":null,
                   "service_tier":"standard"})
        );
    }

    #[test]
    fn stitches_openai_rounds() {
        let round = |text: &str, fin: &str| {
            Bytes::from(
                json!({"id":"c","object":"chat.completion","choices":[{"index":0,
                "message":{"role":"assistant","content":text,"refusal":null},"finish_reason":fin}],
                "usage":{"prompt_tokens":10,"completion_tokens":2,"total_tokens":12,
                         "completion_tokens_details":{"reasoning_tokens":1}}})
                .to_string(),
            )
        };
        let out = stitch(&[round("a", "length"), round("b", "stop")]).unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], "ab");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert_eq!(v["usage"]["total_tokens"], 24);
        assert_eq!(
            v["usage"]["completion_tokens_details"]["reasoning_tokens"],
            2
        );
    }

    #[test]
    fn a_follow_up_with_null_content_keeps_the_earlier_text() {
        let first = Bytes::from(
            json!({"id":"c","object":"chat.completion","choices":[{"index":0,
                "message":{"role":"assistant","content":"Hello, wor"},"finish_reason":"length"}],
                "usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}})
            .to_string(),
        );
        let tool_call = Bytes::from(
            json!({"id":"c","object":"chat.completion","choices":[{"index":0,
                "message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1",
                "type":"function","function":{"name":"pay","arguments":"{}"}}]},
                "finish_reason":"tool_calls"}],
                "usage":{"prompt_tokens":20,"completion_tokens":5,"total_tokens":25}})
            .to_string(),
        );
        let out = stitch(&[first.clone(), tool_call.clone()]).expect("stitched");
        let v: Value = serde_json::from_slice(&out).unwrap();
        let message = &v["choices"][0]["message"];
        assert_eq!(message["content"], "Hello, wor");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "pay");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(v["usage"]["total_tokens"], 40);
        // No round with text: the last round as it is, its usage summed.
        let out = stitch(&[tool_call.clone(), tool_call]).expect("stitched");
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v["choices"][0]["message"]["content"].is_null());
        assert_eq!(v["usage"]["total_tokens"], 50);
    }
}
