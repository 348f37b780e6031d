//! ContinuationLayer against the mock server: answers stopped at the output limit are
//! continued append-only and stitched into one response; the bytes each follow-up carries are
//! the previous request's with two turns appended; truncated tool calls are never continued.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use hyper::body::Incoming;
use serde_json::{json, Value};
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::continuation::{
    ContinuationBody, Continued, TruncatedToolCall, DEFAULT_PROMPT,
};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::stream::OutputTruncated;
use tower_llm_retry::{ContinuationLayer, RetryBody, RetryLayer};

type Response = http::Response<ContinuationBody<RetryBody<Incoming>>>;

const ANTHROPIC: &str = r#"{"model":"claude-sonnet-4-5", "max_tokens": 16,
 "messages": [ {"role":"user","content":"Tell me about foxes"} ] , "temperature": 0}"#;

const OPENAI: &str = r#"{"model":"gpt-4o","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Foxes?"}],"max_tokens":16}"#;

fn message(text: &str, stop: &str, output_tokens: u64) -> Reply {
    Reply::success().json(json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop, "stop_sequence": null,
        "usage": {"input_tokens": 20, "cache_read_input_tokens": 5, "output_tokens": output_tokens}
    }))
}

fn completion(content: &str, finish: &str, completion_tokens: u64) -> Reply {
    Reply::success().json(json!({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content, "refusal": null},
                     "logprobs": null, "finish_reason": finish}],
        "usage": {"prompt_tokens": 30, "completion_tokens": completion_tokens,
                  "total_tokens": 30 + completion_tokens}
    }))
}

async fn run(
    script: Script,
    layer: ContinuationLayer,
    path: &str,
    body: &'static str,
) -> (MockServer, Response) {
    let server = MockServer::start(script).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url(path), body))
        .await
        .unwrap();
    (server, res)
}

/// `body` with `appended` inserted just before the `]` that closes its `messages` array.
fn with_appended(body: &[u8], appended: &str) -> Vec<u8> {
    let span = crate::common::json::value_span(body, "messages").unwrap();
    let close = span.end - 1;
    let mut out = body[..close].to_vec();
    out.extend_from_slice(appended.as_bytes());
    out.extend_from_slice(&body[close..]);
    out
}

/// The follow-up turns as the layer writes them: role first, then content.
fn appended(partials: &[&str]) -> String {
    partials
        .iter()
        .map(|p| {
            format!(
                r#",{{"role":"assistant","content":{}}},{{"role":"user","content":{}}}"#,
                Value::from(*p),
                Value::from(DEFAULT_PROMPT)
            )
        })
        .collect()
}

fn continued(res: &Response) -> Option<(u32, bool)> {
    res.extensions()
        .get::<Continued>()
        .map(|c| (c.rounds, c.complete))
}

fn tool_call(res: &Response) -> Option<(Option<&str>, Option<&str>)> {
    res.extensions()
        .get::<TruncatedToolCall>()
        .map(|c| (c.name.as_deref(), c.id.as_deref()))
}

async fn json_body(res: Response) -> (http::HeaderMap, Value, usize) {
    let headers = res.headers().clone();
    let bytes = body_bytes(res).await;
    (
        headers,
        serde_json::from_slice(&bytes).unwrap(),
        bytes.len(),
    )
}

#[tokio::test(start_paused = true)]
async fn a_three_round_anthropic_answer_is_stitched_into_one() {
    let script = Script::new()
        .then(message("The red fox ", "max_tokens", 16))
        .then(message("is a small ", "max_tokens", 16))
        .then(message("omnivore.", "end_turn", 4));
    let (server, res) = run(script, ContinuationLayer::new(), "/v1/messages", ANTHROPIC).await;

    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(continued(&res), Some((2, true)));
    assert!(res.extensions().get::<OutputTruncated>().is_none());
    let (headers, v, len) = json_body(res).await;
    assert_eq!(headers["content-length"], len.to_string().as_str());
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "The red fox is a small omnivore."}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(
        v["usage"],
        json!({"input_tokens": 60, "cache_read_input_tokens": 15, "output_tokens": 36})
    );
    assert_eq!(v["type"], "message");

    let seen = server.requests();
    assert_eq!(seen.len(), 3);
    assert_eq!(&seen[0].body[..], ANTHROPIC.as_bytes());
    // Each follow-up: the request before it, byte for byte, with two turns appended.
    let one = format!(
        r#"{{"model":"claude-sonnet-4-5", "max_tokens": 16,
 "messages": [ {{"role":"user","content":"Tell me about foxes"}} ,{{"role":"assistant","content":"The red fox "}},{{"role":"user","content":{}}}] , "temperature": 0}}"#,
        Value::from(DEFAULT_PROMPT)
    );
    assert_eq!(std::str::from_utf8(&seen[1].body).unwrap(), one);
    let two = with_appended(
        ANTHROPIC.as_bytes(),
        &appended(&["The red fox ", "is a small "]),
    );
    assert_eq!(&seen[2].body[..], &two[..]);
    // The headers went along; the length is the new body's.
    assert_eq!(seen[2].headers["anthropic-version"], "2023-06-01");
    assert_eq!(
        seen[2].headers["content-length"],
        two.len().to_string().as_str()
    );
    // At once: no sleep between rounds.
    assert_eq!(seen[2].received_at - seen[0].received_at, Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn an_openai_answer_cut_at_length_is_continued() {
    let script = Script::new()
        .then(completion("Foxes are ", "length", 16))
        .then(completion("canids.", "stop", 3));
    let (server, res) = run(
        script,
        ContinuationLayer::new(),
        "/v1/chat/completions",
        OPENAI,
    )
    .await;
    assert_eq!(continued(&res), Some((1, true)));
    let (headers, v, len) = json_body(res).await;
    assert_eq!(headers["content-length"], len.to_string().as_str());
    assert_eq!(v["choices"][0]["message"]["content"], "Foxes are canids.");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 60, "completion_tokens": 19, "total_tokens": 79})
    );
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(&seen[0].body[..], OPENAI.as_bytes());
    assert_eq!(
        &seen[1].body[..],
        &with_appended(OPENAI.as_bytes(), &appended(&["Foxes are "]))[..]
    );
}

#[tokio::test(start_paused = true)]
async fn a_truncated_tool_use_is_returned_marked_and_never_continued() {
    let answer = json!({
        "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "Deleting it now."},
                    {"type": "tool_use", "id": "toolu_1", "name": "delete_file", "input": {}}],
        "stop_reason": "max_tokens", "stop_sequence": null,
        "usage": {"input_tokens": 20, "output_tokens": 16}
    });
    let sent = answer.to_string();
    let (server, res) = run(
        Script::always(Reply::success().json(answer)),
        ContinuationLayer::new(),
        "/v1/messages",
        ANTHROPIC,
    )
    .await;
    assert_eq!(server.request_count(), 1);
    assert_eq!(
        tool_call(&res),
        Some((Some("delete_file"), Some("toolu_1")))
    );
    assert!(res.extensions().get::<OutputTruncated>().is_some());
    assert!(res.extensions().get::<Continued>().is_none());
    // The body is the server's, byte for byte.
    assert_eq!(&body_bytes(res).await[..], sent.as_bytes());
}

#[tokio::test(start_paused = true)]
async fn a_truncated_tool_calls_entry_is_returned_marked_and_never_continued() {
    let answer = json!({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "gpt-4o",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "transfer_funds", "arguments": "{\"amount\": 10"}}]},
            "finish_reason": "length"}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 16, "total_tokens": 46}
    });
    let sent = answer.to_string();
    let (server, res) = run(
        Script::always(Reply::success().json(answer)),
        ContinuationLayer::new(),
        "/v1/chat/completions",
        OPENAI,
    )
    .await;
    assert_eq!(server.request_count(), 1);
    let call = res.extensions().get::<TruncatedToolCall>().unwrap();
    assert_eq!(call.name.as_deref(), Some("transfer_funds"));
    assert_eq!(call.id.as_deref(), Some("call_1"));
    assert_eq!(&body_bytes(res).await[..], sent.as_bytes());
}

#[tokio::test(start_paused = true)]
async fn a_tool_use_cut_in_a_follow_up_ends_the_continuation_marked() {
    let cut = json!({
        "id": "msg_2", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "fox. Saving: "},
                    {"type": "tool_use", "id": "toolu_2", "name": "save", "input": {}}],
        "stop_reason": "max_tokens", "stop_sequence": null,
        "usage": {"input_tokens": 20, "output_tokens": 16}
    });
    let script = Script::new()
        .then(message("The red ", "max_tokens", 16))
        .then(Reply::success().json(cut))
        .then(message("never asked for", "end_turn", 1));
    let (server, res) = run(script, ContinuationLayer::new(), "/v1/messages", ANTHROPIC).await;
    assert_eq!(server.request_count(), 2);
    assert_eq!(continued(&res), Some((1, false)));
    assert_eq!(
        res.extensions()
            .get::<TruncatedToolCall>()
            .unwrap()
            .name
            .as_deref(),
        Some("save")
    );
    let (_, v, _) = json_body(res).await;
    assert_eq!(v["content"][0]["text"], "The red fox. Saving: ");
    assert_eq!(v["content"][1]["type"], "tool_use");
}

#[tokio::test(start_paused = true)]
async fn a_model_that_always_truncates_costs_exactly_n_plus_one_requests() {
    for (layer, n) in [
        (ContinuationLayer::new(), 3u32),
        (ContinuationLayer::new().max_rounds(1), 1),
        (ContinuationLayer::new().max_rounds(5), 5),
    ] {
        let (server, res) = run(
            Script::always(message("more ", "max_tokens", 16)),
            layer,
            "/v1/messages",
            ANTHROPIC,
        )
        .await;
        assert_eq!(server.request_count(), n as usize + 1);
        assert_eq!(continued(&res), Some((n, false)));
        assert!(res.extensions().get::<OutputTruncated>().is_some());
        let (_, v, _) = json_body(res).await;
        assert_eq!(v["content"][0]["text"], "more ".repeat(n as usize + 1));
        assert_eq!(v["stop_reason"], "max_tokens");
        assert_eq!(v["usage"]["output_tokens"], 16 * (u64::from(n) + 1));
    }
}

#[tokio::test(start_paused = true)]
async fn a_custom_prompt_is_the_user_turn() {
    let script = Script::new()
        .then(message("a", "max_tokens", 1))
        .then(message("b", "end_turn", 1));
    let layer = ContinuationLayer::new().prompt("go on");
    let (server, _) = run(script, layer, "/v1/messages", ANTHROPIC).await;
    let seen = server.requests();
    let want = with_appended(
        ANTHROPIC.as_bytes(),
        r#",{"role":"assistant","content":"a"},{"role":"user","content":"go on"}"#,
    );
    assert_eq!(&seen[1].body[..], &want[..]);
}

#[tokio::test(start_paused = true)]
async fn a_complete_answer_and_a_streaming_request_pass_through() {
    let (server, res) = run(
        Script::always(message("All of it.", "end_turn", 3)),
        ContinuationLayer::new(),
        "/v1/messages",
        ANTHROPIC,
    )
    .await;
    assert_eq!(server.request_count(), 1);
    assert!(res.extensions().get::<Continued>().is_none());
    assert!(res.extensions().get::<OutputTruncated>().is_none());

    const STREAM: &str = r#"{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;
    let (server, res) = run(
        Script::always(message("cut", "max_tokens", 16)),
        ContinuationLayer::new(),
        "/v1/messages",
        STREAM,
    )
    .await;
    assert_eq!(server.request_count(), 1);
    assert!(res.extensions().get::<Continued>().is_none());
}

#[tokio::test(start_paused = true)]
async fn a_failed_follow_up_keeps_what_was_answered() {
    let script = Script::new()
        .then(message("The red fox ", "max_tokens", 16))
        .then(Reply::anthropic_error(
            400,
            "invalid_request_error",
            "messages: roles must alternate",
        ));
    let (server, res) = run(script, ContinuationLayer::new(), "/v1/messages", ANTHROPIC).await;
    assert_eq!(server.request_count(), 2);
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(continued(&res), Some((0, false)));
    assert!(res.extensions().get::<OutputTruncated>().is_some());
    let (_, v, _) = json_body(res).await;
    assert_eq!(v["content"][0]["text"], "The red fox ");
}

#[tokio::test(start_paused = true)]
async fn a_follow_up_that_fails_in_transport_is_retried_as_its_own_request() {
    let script = Script::new()
        .then(message("The red fox ", "max_tokens", 16))
        .then(Reply::reset())
        .then(message("runs.", "end_turn", 2));
    let (server, res) = run(script, ContinuationLayer::new(), "/v1/messages", ANTHROPIC).await;
    let seen = server.requests();
    assert_eq!(seen.len(), 3);
    // The retry re-sent the follow-up, never the original request.
    assert_eq!(seen[1].body, seen[2].body);
    assert_ne!(&seen[2].body[..], ANTHROPIC.as_bytes());
    let (_, v, _) = json_body(res).await;
    assert_eq!(v["content"][0]["text"], "The red fox runs.");
}

const STREAM: &str = r#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Hi"}]}"#;

/// `ResumeBody` over a `RetryLayer` stack: a stream reset after output is continued through
/// the same stack with a prefill of the exact text, and read as one message.
#[tokio::test(start_paused = true)]
async fn a_stream_cut_after_output_is_resumed_through_the_stack() {
    use std::sync::{Arc, Mutex};

    use bytes::Bytes;
    use http_body_util::BodyExt;
    use tower_llm_retry::continuation::{ResumeBody, ResumeOutcome, ResumeWith};
    use tower_llm_retry::mock::sse;

    let mut cut = sse::anthropic_message(&["Hello", ", wor"]);
    cut.truncate(4);
    let script = Script::new()
        .then(Reply::sse_then_reset(cut.clone()))
        .then(Reply::sse(sse::anthropic_message(&["ld", "!"])));
    let server = MockServer::start(script).await.unwrap();
    let stack = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(http_client());
    let url = server.url("/v1/messages");
    let res = stack
        .clone()
        .oneshot(anthropic_request(&url, STREAM))
        .await
        .unwrap();
    let original = http::Request::post(&url)
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Bytes::from_static(STREAM.as_bytes()))
        .unwrap();
    let outcome = Arc::new(Mutex::new(None));
    let seen = outcome.clone();
    let body = ResumeBody::new(res.into_body(), stack, original, ResumeWith::Prefill)
        .on_outcome(move |o| *seen.lock().unwrap() = Some(o));
    let got = body.collect().await.unwrap().to_bytes();
    assert!(got.starts_with(&concat(&cut)));
    let text = std::str::from_utf8(&got).unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let answer: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| {
            assert_eq!(e["index"], 0);
            e["delta"]["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(answer, "Hello, world!");
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "message_start").count(), 1);
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "content_block_start")
            .count(),
        1
    );
    assert_eq!(kinds[kinds.len() - 2..], ["message_delta", "message_stop"]);
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(
        &requests[1].body[..],
        br#"{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello, wor"}]}"#
    );
    assert_eq!(*outcome.lock().unwrap(), Some(ResumeOutcome::Resumed));
}
