//! Judging the events of a `text/event-stream` response before its commit point.

use std::borrow::Cow;

use serde::Deserialize;

use super::{Classification, FailureClass};
use crate::provider::error_body::says_server_overloaded;
use crate::stream::SseEvent;

/// What one SSE event means to the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SseVerdict {
    /// The event shows output to the caller: the stream is committed from here on.
    Output,
    /// Set-up or keep-alive (`message_start`, `ping`, a role-only chunk): keep reading.
    Preamble,
    /// An in-band error, judged like the HTTP response it stands for.
    Error(Classification),
}

/// The default judgement of one SSE event, used by
/// [`DefaultClassifier`](crate::classify::DefaultClassifier).
pub fn default_sse_verdict(event: &SseEvent<'_>) -> SseVerdict {
    let name = event.event.as_deref();
    match name {
        Some("content_block_start" | "content_block_delta") => return SseVerdict::Output,
        Some("error") => return SseVerdict::Error(error_twin(&event.data)),
        Some(n) if is_responses_output(n) => return SseVerdict::Output,
        Some("response.failed") => return SseVerdict::Error(error_twin(&event.data)),
        Some(
            "message_start" | "ping" | "content_block_stop" | "message_delta" | "message_stop",
        ) => return SseVerdict::Preamble,
        _ => {}
    }
    let data = event.data.trim();
    if data.is_empty() || data == "[DONE]" || !data.starts_with('{') {
        return SseVerdict::Preamble;
    }
    let Ok(chunk) = serde_json::from_str::<Chunk<'_>>(data) else {
        return SseVerdict::Preamble;
    };
    if chunk.error.is_some() {
        return SseVerdict::Error(error_twin(data));
    }
    if let Some(kind) = chunk.kind.as_deref() {
        if kind == "error" || kind == "response.failed" {
            return SseVerdict::Error(error_twin(data));
        }
        if kind == "content_block_start"
            || kind == "content_block_delta"
            || is_responses_output(kind)
        {
            return SseVerdict::Output;
        }
    }
    let shows = chunk.choices.iter().flatten().any(|c| {
        // Legacy Completions (`/v1/completions`, and the servers that speak it) stream
        // `choices[].text`.
        c.text.as_deref().is_some_and(|s| !s.is_empty())
            || c.delta.as_ref().is_some_and(|d| {
                d.content.as_ref().is_some_and(Content::shows)
                    || d.refusal.as_deref().is_some_and(|s| !s.is_empty())
                    || d.tool_calls.as_ref().is_some_and(|t| !t.is_empty())
                    || d.function_call.is_some()
            })
    });
    if shows {
        SseVerdict::Output
    } else {
        SseVerdict::Preamble
    }
}

fn is_responses_output(name: &str) -> bool {
    name == "response.output_item.added"
        || name == "response.content_part.added"
        || (name.starts_with("response.") && name.ends_with(".delta"))
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    // `null` where a server sends one (a usage-only chunk) reads as none.
    #[serde(borrow, default)]
    choices: Option<Vec<Choice<'a>>>,
}

#[derive(Deserialize, Default)]
struct Choice<'a> {
    #[serde(borrow, default)]
    delta: Option<Delta<'a>>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// A delta's `content`: a string, or (as some OpenAI-compatible servers send) a list of parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum Content<'a> {
    #[serde(borrow)]
    Text(Cow<'a, str>),
    Parts(Vec<serde::de::IgnoredAny>),
}

impl Content<'_> {
    fn shows(&self) -> bool {
        match self {
            Content::Text(s) => !s.is_empty(),
            Content::Parts(p) => !p.is_empty(),
        }
    }
}

#[derive(Deserialize, Default)]
struct Delta<'a> {
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Cow<'a, str>>,
    #[serde(default)]
    tool_calls: Option<Vec<serde::de::IgnoredAny>>,
    #[serde(default)]
    function_call: Option<serde::de::IgnoredAny>,
}

/// Maps an in-band error payload to the classification of its HTTP twin.
fn error_twin(data: &str) -> Classification {
    #[derive(Deserialize)]
    struct Outer<'a> {
        #[serde(borrow, default)]
        error: Option<Inner<'a>>,
        #[serde(borrow, default)]
        code: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        message: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        response: Option<Resp<'a>>,
    }
    #[derive(Deserialize)]
    struct Resp<'a> {
        #[serde(borrow, default)]
        error: Option<Inner<'a>>,
    }
    #[derive(Deserialize)]
    struct Inner<'a> {
        #[serde(borrow, default, rename = "type")]
        kind: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        code: Option<Cow<'a, str>>,
        #[serde(borrow, default)]
        message: Option<Cow<'a, str>>,
    }
    let mut names: Vec<String> = Vec::new();
    // OpenAI's overload, told by its code or its message (as in an error body).
    let mut server_overloaded = false;
    if let Ok(o) = serde_json::from_str::<Outer<'_>>(data) {
        let inners = o.error.into_iter().chain(o.response.and_then(|r| r.error));
        for i in inners {
            server_overloaded |= says_server_overloaded(
                i.kind.as_deref().unwrap_or(""),
                i.code.as_deref().unwrap_or(""),
                i.message.as_deref(),
            );
            names.extend(i.kind.map(Cow::into_owned));
            names.extend(i.code.map(Cow::into_owned));
        }
        server_overloaded |=
            says_server_overloaded("", o.code.as_deref().unwrap_or(""), o.message.as_deref());
        names.extend(o.code.map(Cow::into_owned));
    }
    let has = |n: &str| names.iter().any(|x| x == n);
    if has("overloaded_error") || server_overloaded {
        Classification::retry(FailureClass::Overloaded)
    } else if has("rate_limit_error") || has("rate_limit_exceeded") {
        Classification::retry(FailureClass::RateLimited)
    } else if has("api_error") || has("server_error") || has("internal_error") {
        Classification::retry(FailureClass::Server)
    } else if has("invalid_request_error") {
        Classification::fail(FailureClass::Client)
    } else {
        Classification::fail(FailureClass::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(event: Option<&str>, data: &str) -> SseVerdict {
        default_sse_verdict(&SseEvent {
            event: event.map(Cow::Borrowed),
            data: Cow::Borrowed(data),
        })
    }

    #[test]
    fn anthropic_events() {
        assert_eq!(
            verdict(Some("message_start"), r#"{"type":"message_start"}"#),
            SseVerdict::Preamble
        );
        assert_eq!(
            verdict(Some("ping"), r#"{"type": "ping"}"#),
            SseVerdict::Preamble
        );
        assert_eq!(
            verdict(Some("content_block_start"), "{}"),
            SseVerdict::Output
        );
        assert_eq!(
            verdict(Some("content_block_delta"), "{}"),
            SseVerdict::Output
        );
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            SseVerdict::Error(Classification::retry(FailureClass::Overloaded))
        );
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","error":{"type":"rate_limit_error"}}"#
            ),
            SseVerdict::Error(Classification::retry(FailureClass::RateLimited))
        );
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","error":{"type":"api_error"}}"#
            ),
            SseVerdict::Error(Classification::retry(FailureClass::Server))
        );
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","error":{"type":"invalid_request_error"}}"#
            ),
            SseVerdict::Error(Classification::fail(FailureClass::Client))
        );
    }

    #[test]
    fn openai_chat_chunks() {
        let role = r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#;
        assert_eq!(verdict(None, role), SseVerdict::Preamble);
        let text = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}]}"#;
        assert_eq!(verdict(None, text), SseVerdict::Output);
        let tool =
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1"}]}}]}"#;
        assert_eq!(verdict(None, tool), SseVerdict::Output);
        assert_eq!(verdict(None, "[DONE]"), SseVerdict::Preamble);
        let err = r#"{"error":{"message":"overloaded","type":"server_error","code":null}}"#;
        assert_eq!(
            verdict(None, err),
            SseVerdict::Error(Classification::retry(FailureClass::Server))
        );
        // OpenAI's overload, by its message or its code.
        let overloaded = SseVerdict::Error(Classification::retry(FailureClass::Overloaded));
        let err = r#"{"error":{"message":"The server is overloaded or not ready yet.","type":"server_error","code":null}}"#;
        assert_eq!(verdict(None, err), overloaded);
        let err = r#"{"error":{"message":"busy","type":"server_error","code":"overloaded"}}"#;
        assert_eq!(verdict(None, err), overloaded);
    }

    #[test]
    fn legacy_completions_and_compatible_servers_chunks() {
        // `/v1/completions` streams `choices[].text`.
        let text = r#"{"object":"text_completion","choices":[{"text":"Hello","index":0,"finish_reason":null}]}"#;
        assert_eq!(verdict(None, text), SseVerdict::Output);
        let empty = r#"{"object":"text_completion","choices":[{"text":"","index":0}]}"#;
        assert_eq!(verdict(None, empty), SseVerdict::Preamble);
        // Content as a list of parts, a `null` delta, `null` choices (a usage-only chunk).
        let parts =
            r#"{"choices":[{"index":0,"delta":{"content":[{"type":"text","text":"Hi"}]}}]}"#;
        assert_eq!(verdict(None, parts), SseVerdict::Output);
        let no_delta = r#"{"choices":[{"index":0,"delta":null,"finish_reason":"stop"}]}"#;
        assert_eq!(verdict(None, no_delta), SseVerdict::Preamble);
        let usage = r#"{"choices":null,"usage":{"total_tokens":3}}"#;
        assert_eq!(verdict(None, usage), SseVerdict::Preamble);
        // A `null` delta beside a choice with text still shows output.
        let mixed = r#"{"choices":[{"index":0,"delta":null},{"index":1,"delta":{"content":"x"}}]}"#;
        assert_eq!(verdict(None, mixed), SseVerdict::Output);
    }

    #[test]
    fn openai_responses_events() {
        assert_eq!(
            verdict(Some("response.created"), "{}"),
            SseVerdict::Preamble
        );
        assert_eq!(
            verdict(Some("response.output_text.delta"), "{}"),
            SseVerdict::Output
        );
        assert_eq!(
            verdict(Some("response.output_item.added"), "{}"),
            SseVerdict::Output
        );
        assert_eq!(
            verdict(None, r#"{"type":"response.output_text.delta","delta":"x"}"#),
            SseVerdict::Output
        );
        // The in-band overload, as an `error` event and inside `response.failed`.
        let overloaded = SseVerdict::Error(Classification::retry(FailureClass::Overloaded));
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","code":"server_is_overloaded","message":"The server is overloaded","param":null}"#
            ),
            overloaded
        );
        assert_eq!(
            verdict(
                Some("response.failed"),
                r#"{"type":"response.failed","response":{"status":"failed","error":{"code":"server_is_overloaded","message":"Try again later"}}}"#
            ),
            overloaded
        );
        assert_eq!(
            verdict(
                Some("error"),
                r#"{"type":"error","code":"server_error","message":"The server had an error"}"#
            ),
            SseVerdict::Error(Classification::retry(FailureClass::Server))
        );
    }
}
