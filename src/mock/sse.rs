//! Ready-made event sequences in the shapes real providers stream.
//!
//! Combine them with [`Reply::sse`](super::Reply::sse) and friends; add
//! delays with [`SseFrame::after`].

use super::json::{array, object, Null, Raw};
use super::script::{ANTHROPIC_MODEL, CREATED, OPENAI_MODEL};
use super::SseFrame;

/// A complete Anthropic Messages stream producing one text block made of
/// `text_chunks`.
///
/// Events: `message_start`, `content_block_start`, one `content_block_delta`
/// per chunk, `content_block_stop`, `message_delta` and `message_stop`.
pub fn anthropic_message(text_chunks: &[&str]) -> Vec<SseFrame> {
    let mut events = Vec::with_capacity(text_chunks.len() + 5);
    events.push(anthropic_event(
        "message_start",
        object! {
            "type": "message_start",
            "message": object! {
                "id": "msg_mock",
                "type": "message",
                "role": "assistant",
                "model": ANTHROPIC_MODEL,
                "content": array![],
                "stop_reason": Null,
                "stop_sequence": Null,
                "usage": object! {"input_tokens": 10, "output_tokens": 1},
            },
        },
    ));
    events.push(anthropic_event(
        "content_block_start",
        object! {
            "type": "content_block_start",
            "index": 0,
            "content_block": object! {"type": "text", "text": ""},
        },
    ));
    for chunk in text_chunks {
        events.push(anthropic_event(
            "content_block_delta",
            object! {
                "type": "content_block_delta",
                "index": 0,
                "delta": object! {"type": "text_delta", "text": chunk},
            },
        ));
    }
    events.push(anthropic_event(
        "content_block_stop",
        object! {"type": "content_block_stop", "index": 0},
    ));
    events.push(anthropic_event(
        "message_delta",
        object! {
            "type": "message_delta",
            "delta": object! {"stop_reason": "end_turn", "stop_sequence": Null},
            "usage": object! {"output_tokens": text_chunks.len().max(1)},
        },
    ));
    events.push(anthropic_event(
        "message_stop",
        object! {"type": "message_stop"},
    ));
    events
}

/// An Anthropic in-stream `error` event, as sent when a stream fails after
/// it has started (for example `"overloaded_error"`).
pub fn anthropic_error(error_type: &str) -> SseFrame {
    let message = match error_type {
        "overloaded_error" => "Overloaded",
        "rate_limit_error" => "Rate limited",
        "api_error" => "Internal server error",
        _ => "Error",
    };
    SseFrame::new(
        "error",
        &super::script::anthropic_error_body(error_type, message),
    )
}

/// A complete OpenAI Chat Completions stream producing `text_chunks`.
///
/// Unnamed `data:` events: a chunk carrying the assistant role, one chunk per
/// text chunk in `choices[0].delta.content`, a chunk carrying
/// `finish_reason: "stop"`, then `data: [DONE]`.
pub fn openai_chat(text_chunks: &[&str]) -> Vec<SseFrame> {
    let chunk = |delta: Raw, finish_reason: Option<&str>| {
        let chunk = object! {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": OPENAI_MODEL,
            "choices": array![object! {
                "index": 0,
                "delta": delta,
                "logprobs": Null,
                "finish_reason": finish_reason,
            }],
        };
        SseFrame::data(&chunk.into_string())
    };
    let mut events = Vec::with_capacity(text_chunks.len() + 3);
    events.push(chunk(object! {"role": "assistant", "content": ""}, None));
    for text in text_chunks {
        events.push(chunk(object! {"content": text}, None));
    }
    events.push(chunk(object! {}, Some("stop")));
    events.push(SseFrame::data("[DONE]"));
    events
}

fn anthropic_event(name: &str, data: Raw) -> SseFrame {
    SseFrame::new(name, &data.into_string())
}
