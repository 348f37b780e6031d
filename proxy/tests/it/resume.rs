//! `resume`: a streamed text answer cut after output (a reset, a stall past the idle timeout,
//! a clean end without its terminal event) is continued through the same upstream's stack and
//! spliced into the client's one stream (the failover benchmark's faults S08, S09 and S14).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use serde_json::{json, Value};
use tower_llm_retry::continuation::RESUME_PROMPT;
use tower_llm_retry::mock::{sse, Reply, Script, SseFrame};
use tower_llm_retry_proxy::ResumeMode;

use crate::common::*;

/// The canonical answer's 60 words, as the chunks the upstream streams.
fn words() -> Vec<String> {
    (1..=60)
        .map(|i| {
            if i == 1 {
                "word1".to_owned()
            } else {
                format!(" word{i}")
            }
        })
        .collect()
}

fn canonical() -> String {
    words().concat()
}

/// The first 40 words.
fn partial() -> String {
    words()[..40].concat()
}

fn refs(w: &[String]) -> Vec<&str> {
    w.iter().map(String::as_str).collect()
}

/// An Anthropic stream of the first 40 words, no end: message_start, content_block_start,
/// 40 deltas.
fn anthropic_cut() -> Vec<SseFrame> {
    let w = words();
    let mut e = sse::anthropic_message(&refs(&w[..40]));
    e.truncate(42);
    e
}

/// The whole Anthropic stream of the last 20 words.
fn anthropic_rest() -> Vec<SseFrame> {
    let w = words();
    sse::anthropic_message(&refs(&w[40..]))
}

/// An OpenAI chat stream of the first 40 words, no end: the role chunk, 40 content chunks.
fn chat_cut() -> Vec<SseFrame> {
    let w = words();
    let mut e = sse::openai_chat(&refs(&w[..40]));
    e.truncate(41);
    e
}

/// The whole OpenAI chat stream of the last 20 words, under an id of its own.
fn chat_rest() -> Vec<SseFrame> {
    let w = words();
    sse::openai_chat(&refs(&w[40..]))
        .into_iter()
        .map(|f| {
            let text = String::from_utf8(f.bytes().to_vec()).unwrap();
            SseFrame::raw(text.replace("chatcmpl-mock", "chatcmpl-next"))
        })
        .collect()
}

/// Every event the client received: (name, data).
fn events(stream: &[u8]) -> Vec<(Option<String>, Value)> {
    let text = std::str::from_utf8(stream).unwrap();
    assert!(text.ends_with("\n\n"), "{text:?}");
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut name = None;
            let mut data = String::new();
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_owned());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            let data = if data == "[DONE]" {
                Value::from("[DONE]")
            } else {
                serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"))
            };
            (name, data)
        })
        .collect()
}

/// The text and final usage of an Anthropic stream, checked to be one well-formed message:
/// one `message_start`, blocks started once, in order, before their deltas, each stopped,
/// then `message_delta` and `message_stop` last, no error.
fn anthropic_answer(stream: &[u8]) -> (String, Value) {
    let ev = events(stream);
    let kinds: Vec<&str> = ev
        .iter()
        .map(|(_, d)| d["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds.iter().filter(|k| **k == "message_start").count(), 1);
    assert_eq!(kinds.first(), Some(&"message_start"));
    assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
    let (mut text, mut open, mut next) = (String::new(), None, 0);
    for (name, data) in &ev {
        assert_eq!(name.as_deref(), data["type"].as_str());
        match data["type"].as_str().unwrap() {
            "content_block_start" => {
                assert_eq!((open, data["index"].as_u64()), (None, Some(next)));
                open = Some(next);
                next += 1;
            }
            "content_block_delta" => {
                assert_eq!(data["index"].as_u64(), open);
                text.push_str(data["delta"]["text"].as_str().unwrap());
            }
            "content_block_stop" => {
                assert_eq!(data["index"].as_u64(), open);
                open = None;
            }
            "message_start" | "message_delta" | "message_stop" | "ping" => {}
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(open, None);
    (text, ev[ev.len() - 2].1["usage"].clone())
}

/// The text of an OpenAI chat stream, checked to be one completion: every chunk under the
/// first one's id, the role once, one finish reason, `[DONE]` last.
fn chat_answer(stream: &[u8]) -> String {
    let ev = events(stream);
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let (mut text, mut roles, mut finishes) = (String::new(), 0, 0);
    for (_, data) in &ev[..ev.len() - 1] {
        assert_eq!(data["id"], "chatcmpl-mock");
        let choice = &data["choices"][0];
        if choice["delta"].get("role").is_some() {
            roles += 1;
        }
        if !choice["finish_reason"].is_null() {
            finishes += 1;
        }
        if let Some(t) = choice["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!((roles, finishes), (1, 1));
    text
}

/// `original` with `(role, content)` turns appended to its `messages`, as the proxy must send
/// it: every byte of `original` kept, each turn `{"role":…,"content":…}`.
fn with_turns(original: &str, turns: &[(&str, &str)]) -> Vec<u8> {
    let close = original.rfind("]}").unwrap();
    let mut out = original[..close].to_owned();
    for (role, content) in turns {
        out.push_str(&format!(
            r#",{{"role":"{role}","content":{}}}"#,
            serde_json::to_string(content).unwrap()
        ));
    }
    out.push_str(&original[close..]);
    out.into_bytes()
}

fn prefill_body(original: &str) -> Vec<u8> {
    with_turns(original, &[("assistant", &partial())])
}

fn instruction_body(original: &str) -> Vec<u8> {
    with_turns(
        original,
        &[("assistant", &partial()), ("user", RESUME_PROMPT)],
    )
}

async fn stream(h: &Harness, path: &str, body: &'static str) -> (Bytes, Result<(), hyper::Error>) {
    let req = h.post(path, body).body(Full::from(body)).unwrap();
    let res = h.send(req).await;
    assert_eq!(res.status(), 200);
    let (frames, end) = frames(res).await;
    (joined(&frames), end)
}

fn resumes(h: &Harness, upstream: &str, outcome: &str) -> u64 {
    let m = h.proxy.metrics().render();
    let key =
        format!("llm_retry_proxy_resumes_total{{upstream=\"{upstream}\",outcome=\"{outcome}\"}} ");
    m.lines()
        .find_map(|l| l.strip_prefix(&key))
        .map_or(0, |n| n.parse().unwrap())
}

fn resume_all(mode: ResumeMode) -> impl FnOnce(&mut tower_llm_retry_proxy::Config) {
    move |c| {
        for up in &mut c.upstream {
            up.resume = mode;
        }
    }
}

/// The failover benchmark's fault S08, Anthropic: 40 of 60 words, then a reset.
#[tokio::test(start_paused = true)]
async fn an_anthropic_stream_reset_after_40_of_60_words_is_resumed_with_a_prefill() {
    let script = Script::new()
        .then(Reply::sse_then_reset(anthropic_cut()))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    assert!(end.is_ok(), "a whole answer ends cleanly");
    // The cut stream's bytes reached the client as they were sent.
    assert!(got.starts_with(&concat(&anthropic_cut())));
    let (text, usage) = anthropic_answer(&got);
    assert_eq!(text, canonical());
    // Both message_starts' 10 input tokens and 1 output token, the continuation's 20.
    assert_eq!(usage, json!({"input_tokens":20,"output_tokens":21}));
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].body, MESSAGES_STREAM.as_bytes());
    assert_eq!(seen[1].body, prefill_body(MESSAGES_STREAM));
    assert_eq!(
        sha256(&seen[1].body),
        sha256(&prefill_body(MESSAGES_STREAM))
    );
    assert_eq!(seen[1].headers.get("x-api-key").unwrap(), "sk-client");
    assert_eq!(
        seen[1].headers.get("anthropic-version").unwrap(),
        "2023-06-01"
    );
    assert_eq!(
        seen[1].headers.get("content-length").unwrap(),
        &seen[1].body.len().to_string()
    );
    assert_eq!(
        (
            resumes(&h, "anthropic", "resumed"),
            resumes(&h, "anthropic", "failed")
        ),
        (1, 0)
    );
}

/// The failover benchmark's fault S08, OpenAI: there is no prefill in Chat Completions, so
/// the continuation is an instruction.
#[tokio::test(start_paused = true)]
async fn an_openai_stream_reset_after_40_of_60_words_is_resumed_with_an_instruction() {
    let script = Script::new()
        .then(Reply::sse_then_reset(chat_cut()))
        .then(Reply::sse(chat_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/chat/completions", CHAT_STREAM).await;
    assert!(end.is_ok());
    assert!(got.starts_with(&concat(&chat_cut())));
    assert_eq!(chat_answer(&got), canonical());
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, instruction_body(CHAT_STREAM));
    assert_eq!(resumes(&h, "openai", "resumed"), 1);
}

/// The failover benchmark's fault S14: the target refuses a prefill with 400; the same text
/// as an instruction is accepted.
#[tokio::test(start_paused = true)]
async fn a_prefill_answered_with_400_is_sent_again_as_an_instruction() {
    let script = Script::new()
        .then(Reply::sse_then_reset(anthropic_cut()))
        .then(Reply::anthropic_error(
            400,
            "invalid_request_error",
            "This model does not support assistant message prefill.",
        ))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    assert!(end.is_ok());
    assert_eq!(anthropic_answer(&got).0, canonical());
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[1].body, prefill_body(MESSAGES_STREAM));
    assert_eq!(seen[2].body, instruction_body(MESSAGES_STREAM));
    assert_eq!(resumes(&h, "anthropic", "resumed"), 1);
}

/// The failover benchmark's fault S09: the stream goes silent after output; at the idle
/// timeout the continuation is sent.
#[tokio::test(start_paused = true)]
async fn a_stall_past_the_idle_timeout_is_resumed() {
    let script = Script::new()
        .then(Reply::sse_then_stall(anthropic_cut()))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, |c| {
        c.upstream[0].resume = ResumeMode::Instruction;
        c.upstream[0].idle_timeout_secs = Some(30);
    })
    .await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    assert!(end.is_ok());
    assert_eq!(anthropic_answer(&got).0, canonical());
    let seen = h.mock.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].body, instruction_body(MESSAGES_STREAM));
    let waited = seen[1].received_at - seen[0].received_at;
    assert!(
        waited >= Duration::from_secs(30) && waited < Duration::from_millis(30_100),
        "{waited:?}"
    );
}

/// The failover benchmark's fault S08 as a clean cut: the body ends without `finish_reason`
/// or `[DONE]`.
#[tokio::test(start_paused = true)]
async fn a_clean_end_without_the_terminal_event_is_resumed() {
    let script = Script::new()
        .then(Reply::sse(chat_cut()))
        .then(Reply::sse(chat_rest()));
    let h = start_with(script, resume_all(ResumeMode::Instruction)).await;
    let (got, end) = stream(&h, "/v1/chat/completions", CHAT_STREAM).await;
    assert!(end.is_ok());
    assert_eq!(chat_answer(&got), canonical());
    assert_eq!(h.mock.requests()[1].body, instruction_body(CHAT_STREAM));
}

/// The error event the client got after `prefix`: (event name, data).
fn tail_event(all: &Bytes, prefix: &Bytes) -> (Option<String>, Value) {
    assert!(
        all.starts_with(prefix),
        "the client did not get the upstream's bytes first"
    );
    let tail = &all[prefix.len()..];
    let mut ev = events(tail);
    assert_eq!(ev.len(), 1, "{:?}", String::from_utf8_lossy(tail));
    ev.pop().unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_stream_with_a_tool_use_block_open_is_not_resumed() {
    let mut cut = anthropic_cut();
    cut.push(SseFrame::new(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    ));
    cut.push(SseFrame::new(
        "content_block_start",
        r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use","id":"toolu_1","name":"pay","input":{}}}"#,
    ));
    cut.push(SseFrame::new(
        "content_block_delta",
        r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"amount\": 1"}}"#,
    ));
    let script = Script::new()
        .then(Reply::sse_then_reset(cut.clone()))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    let (event, data) = tail_event(&got, &concat(&cut));
    assert_eq!(event.as_deref(), Some("error"));
    assert_eq!(data["error"]["type"], "api_error");
    assert!(end.is_err(), "the connection was not aborted");
    assert_eq!(h.mock.request_count(), 1);
    assert_eq!(resumes(&h, "anthropic", "failed"), 0);
}

/// A continuation that fails too (a prefill refused, then the instruction refused): the
/// client gets the cut's own error event, as without `resume`, never the follow-up's 400.
#[tokio::test(start_paused = true)]
async fn a_failing_continuation_ends_with_the_protocols_error_event_and_an_abort() {
    let refused =
        || Reply::anthropic_error(400, "invalid_request_error", "prefill is not supported");
    let script = Script::new()
        .then(Reply::sse_then_reset(anthropic_cut()))
        .then(refused())
        .then(refused());
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    let (event, data) = tail_event(&got, &concat(&anthropic_cut()));
    assert_eq!(event.as_deref(), Some("error"));
    assert_eq!(data["error"]["type"], "api_error");
    let message = data["error"]["message"].as_str().unwrap();
    assert!(message.contains("response_body"), "{message}");
    assert!(!message.contains("prefill"), "{message}");
    assert!(
        end.is_err(),
        "a failed resume must not look like a whole answer"
    );
    assert_eq!(h.mock.request_count(), 3);
    assert_eq!(
        (
            resumes(&h, "anthropic", "resumed"),
            resumes(&h, "anthropic", "failed")
        ),
        (0, 1)
    );

    // OpenAI: the continuation is cut as well, after its own output.
    let w = words();
    let mut rest_cut = sse::openai_chat(&refs(&w[40..]));
    rest_cut.truncate(5);
    let script = Script::new()
        .then(Reply::sse_then_reset(chat_cut()))
        .then(Reply::sse_then_reset(rest_cut));
    let h = start_with(script, resume_all(ResumeMode::Instruction)).await;
    let (got, end) = stream(&h, "/v1/chat/completions", CHAT_STREAM).await;
    assert!(got.starts_with(&concat(&chat_cut())));
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains(r#""content":" word44""#), "{text}");
    let (_, last) = events(&got).pop().unwrap();
    assert_eq!(last["error"]["type"], "server_error");
    assert!(!text.contains("[DONE]"));
    assert!(end.is_err());
    assert_eq!(h.mock.request_count(), 2);
    assert_eq!(resumes(&h, "openai", "failed"), 1);
}

#[tokio::test(start_paused = true)]
async fn resume_off_by_default_keeps_the_error_event() {
    let script = Script::new()
        .then(Reply::sse_then_reset(anthropic_cut()))
        .then(Reply::sse(anthropic_rest()));
    let h = start(script).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    let (event, _) = tail_event(&got, &concat(&anthropic_cut()));
    assert_eq!(event.as_deref(), Some("error"));
    assert!(end.is_err());
    assert_eq!(h.mock.request_count(), 1);
}

/// A cut in the middle of an event: the half event never reaches the client, and its text is
/// not part of the partial text; the continuation supplies it.
#[tokio::test(start_paused = true)]
async fn a_cut_mid_event_is_resumed_from_the_last_whole_event() {
    let mut cut = anthropic_cut();
    cut.push(SseFrame::raw(Bytes::from_static(
        b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_de",
    )));
    let script = Script::new()
        .then(Reply::sse_then_reset(cut))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let (got, end) = stream(&h, "/v1/messages", MESSAGES_STREAM).await;
    assert!(end.is_ok());
    // 40 deltas of the cut stream, 20 of the continuation: the half event is not among them.
    let deltas = String::from_utf8_lossy(&got)
        .matches("event: content_block_delta\n")
        .count();
    assert_eq!(deltas, 60);
    assert_eq!(anthropic_answer(&got).0, canonical());
    assert_eq!(h.mock.requests()[1].body, prefill_body(MESSAGES_STREAM));
}

/// `x-llm-retry: off` asks for the upstream's answer as it is: no continuation.
#[tokio::test(start_paused = true)]
async fn a_request_with_retries_off_is_not_resumed() {
    let script = Script::new()
        .then(Reply::sse_then_reset(anthropic_cut()))
        .then(Reply::sse(anthropic_rest()));
    let h = start_with(script, resume_all(ResumeMode::Prefill)).await;
    let req = h
        .post("/v1/messages", MESSAGES_STREAM)
        .header("x-llm-retry", "off")
        .body(Full::from(MESSAGES_STREAM))
        .unwrap();
    let res = h.send(req).await;
    let (frames, end) = frames(res).await;
    let (event, _) = tail_event(&joined(&frames), &concat(&anthropic_cut()));
    assert_eq!(event.as_deref(), Some("error"));
    assert!(end.is_err());
    assert_eq!(h.mock.request_count(), 1);
}
