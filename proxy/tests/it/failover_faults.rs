//! The failover benchmark's sixteen faults (S01–S16), each in both dialects (OpenAI chat
//! completions and Anthropic messages, streaming), with the benchmark's budget: the
//! `sdk_compatible` policy (2 retries), 30 s head and idle timeouts, one fallback target on a
//! second upstream. Two mocks on 127.0.0.1 (the primary and the fallback), paused time, one
//! configuration for every test ([`fault_config`]).
//!
//! Each test injects the fault with the mock's script, sends one streaming request through
//! the proxy with a plain hyper client, reads the whole response, and asserts the attempts
//! each upstream saw, the virtual time taken, and what the client received; then it grades
//! the result as the benchmark does ([`grade`]): `pass` is the complete canonical answer (the
//! text put together from the stream's deltas equal, byte for byte, to [`CANONICAL`]) with
//! every check of the fault clean, or for S13 a clean error. Every test asserts `pass`.
//!
//! The upstreams answer like a model that knows only [`CANONICAL`]: a request that carries a
//! prefix of it (as an assistant prefill or quoted in an instruction) gets the rest, and
//! every other request gets all of it, one word a delta; `model` echoes the request's.
//! Backoffs are the `sdk_compatible` policy's: 0.5 s, then 1 s, each less up to 25 %; a move
//! to the fallback sleeps the backoff too, so "at once" below means after 0.375–0.5 s.
//!
//! | fault | injected | asserted (both dialects) |
//! |---|---|---|
//! | S01 | primary: `429` with `Retry-After: 2`, then healthy | 2 primary attempts exactly 2 s apart, none at the fallback, done at 2 s |
//! | S02 | primary: `429` without `Retry-After` on every attempt | ≤ 4 attempts in 3 s, ≤ 6 at the primary; 1 primary attempt, the fallback serves at once |
//! | S03 | primary: `500` once, then healthy | 2 primary attempts one backoff apart, none at the fallback |
//! | S04 | primary: overloaded on every attempt (OpenAI `503` `overloaded`, Anthropic `529`) | 1 primary attempt, the fallback serves at once, its body the request's with only the model changed |
//! | S05 | primary: connection reset before the head once, then healthy | 2 primary attempts, none at the fallback, done within one backoff |
//! | S06 | primary: accepts and never answers (closes after 120 s) | 1 primary attempt; the fallback serves after the 30 s head timeout and a backoff (≤ 100 s) |
//! | S07 | primary: head at once, first token after 20 s | left at the 10 s first-output timeout, the fallback serves at once (≤ 15 s) |
//! | S08 | primary: stream cut after 40 of 60 tokens, no terminal event | one continuation carrying exactly the 40 words; one message, the whole answer |
//! | S09 | primary: 20 tokens, then 30 s of silence, then cut | resumed from exactly the 20 words at the idle timeout; ≤ 45 s; a healthy call after |
//! | S10 | primary: the tenth SSE event is invalid JSON | 1 attempt, the upstream's bytes as sent, done at once; a healthy call after |
//! | S11 | primary: complete stream without `data: [DONE]` (Anthropic: without `message_stop`) | 1 attempt, the whole answer at once (≤ 8 s), usage present |
//! | S12 | primary: `400` context length exceeded for its model | 1 attempt of that model, the same body re-sent at once to the larger-context model, which serves |
//! | S13 | primary: `400` content policy violation | 1 attempt, none at the fallback, the upstream's `400` as sent (a clean error) |
//! | S14 | primary: cut after 40 tokens, overloaded after; fallback: rejects an assistant prefill | the fallback continues from exactly the 40 words; never the prefill `400` as the end |
//! | S15 | primary: overloaded for the first 60 s; 20 requests, one every 4 s, 30 s each | every request of the outage served by the fallback; the primary serves again within 30 s of its recovery; ≤ 1 primary attempt a request during the outage |
//! | S16 | primary: overloaded on every attempt; the fallback answers | the response's `model` and `x-llm-retry-model` name the fallback, usage present, `x-llm-retry-upstream` is `fallback` |
//!
//! Every one of the 32 passes. Before the proxy had failover in its config, resume, the
//! first-output timeout and Anthropic completeness by content, 11 of them did: S01, S03, S05,
//! S10 and S13 in both dialects, and S11 in OpenAI's.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use serde_json::{json, Value};
use tokio::time::Instant;
use tower_llm_retry::mock::{MockServer, RecordedRequest, Reply, Script, SseFrame};
use tower_llm_retry_proxy::Config;

use crate::common::*;

/// The one answer every upstream gives: sixty words, ASCII, no quote or backslash, so it
/// reads the same in a JSON string.
const CANONICAL: &str = "Resilience shows only on bad days. When a provider throttles, \
    stalls or drops a stream halfway, the caller should still receive one complete answer, \
    delivered once, with no repeated words and no silent gaps. Good middleware waits when it \
    is asked to, moves elsewhere when waiting cannot help, and says plainly what happened \
    whenever nothing could be saved at all.";

const PROMPT: &str = "Explain in sixty words what retry middleware is for.";

const PRIMARY_MODEL: &str = "primary-model";
const FALLBACK_MODEL: &str = "fallback-model";
const LARGER_MODEL: &str = "larger-model";
/// A model every upstream always answers: the benchmark's healthy call after a fault.
const HEALTHY_MODEL: &str = "healthy-model";

/// The backoff before the first retry (or the move to the fallback): 0.5 s less up to 25 %.
const FIRST_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(375), Duration::from_millis(500));

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dialect {
    OpenAi,
    Anthropic,
}

impl Dialect {
    fn kind(self) -> &'static str {
        match self {
            Dialect::OpenAi => "openai",
            Dialect::Anthropic => "anthropic",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Dialect::OpenAi => "/v1/chat/completions",
            Dialect::Anthropic => "/v1/messages",
        }
    }

    /// A streaming request for `model`, as the benchmark's client sends it (OpenAI: with
    /// usage asked for).
    fn request(self, model: &str) -> String {
        let body = match self {
            Dialect::OpenAi => json!({
                "model": model,
                "stream": true,
                "stream_options": {"include_usage": true},
                "messages": [{"role": "user", "content": PROMPT}],
            }),
            Dialect::Anthropic => json!({
                "model": model,
                "max_tokens": 1024,
                "stream": true,
                "messages": [{"role": "user", "content": PROMPT}],
            }),
        };
        body.to_string()
    }

    /// The overload this dialect's provider answers with.
    fn overloaded(self) -> Reply {
        match self {
            Dialect::OpenAi => openai_error(
                503,
                "server_error",
                "overloaded",
                "The engine is currently overloaded. Please try again later.",
            ),
            Dialect::Anthropic => Reply::overloaded(),
        }
    }
}

/// An OpenAI error body with its `type` and `code` apart (the mock's helper makes them one).
fn openai_error(status: u16, kind: &str, code: &str, message: &str) -> Reply {
    Reply::status(status).json(json!({
        "error": {"message": message, "type": kind, "param": null, "code": code}
    }))
}

// ---------------------------------------------------------------------------------------
// The configuration
// ---------------------------------------------------------------------------------------

/// The configuration of every test: the agreed failover shape, the benchmark's budget, the
/// two mocks' URLs.
///
/// The first-output timeout is 10 s, not 15: a move to the fallback sleeps a backoff
/// (up to 0.5 s), so a 15 s limit could not end S07 within the benchmark's 15 s.
fn fault_config(primary: &MockServer, fallback: &MockServer, dialect: Dialect) -> Config {
    let (primary, fallback) = (base_url(primary), base_url(fallback));
    let config = Config::from_toml(&fault_toml(&primary, &fallback, dialect)).unwrap();
    config.validate().unwrap();
    config
}

/// The TOML of [`fault_config`].
fn fault_toml(primary: &str, fallback: &str, dialect: Dialect) -> String {
    let kind = dialect.kind();
    format!(
        r#"listen = "127.0.0.1:0"

[[upstream]]
name = "primary"
kind = "{kind}"
url = "{primary}"
policy = "sdk_compatible"
head_timeout_secs = 30
idle_timeout_secs = 30
first_output_timeout_secs = 10
context_window_fallback = "{LARGER_MODEL}"
resume = "prefill"
fallback = ["{PRIMARY_MODEL}", {{ model = "{FALLBACK_MODEL}", upstream = "fallback", resume = "prefill" }}]
fallback_threshold = 1
fallback_after_failures = 2
fallback_after_timeouts = 1
fallback_on_unwaitable_rate_limit = true

[upstream.circuit]
failures = 2
window_secs = 30
cooldown_secs = 10
max_cooldown_secs = 20

[[upstream]]
name = "fallback"
kind = "{kind}"
url = "{fallback}"
policy = "sdk_compatible"
head_timeout_secs = 30
idle_timeout_secs = 30
"#
    )
}

#[test]
fn the_fault_config_is_the_agreed_shape() {
    for dialect in [Dialect::OpenAi, Dialect::Anthropic] {
        let toml = fault_toml("http://127.0.0.1:1", "http://127.0.0.1:2", dialect);
        let config = Config::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        config.validate().unwrap();
        assert_eq!(config.upstream.len(), 2);
    }
}

// ---------------------------------------------------------------------------------------
// The upstreams: a model that knows one answer
// ---------------------------------------------------------------------------------------

/// The answer as the model streams it: one word a delta, every word after the first with
/// its leading space.
fn tokens() -> Vec<String> {
    CANONICAL
        .split(' ')
        .enumerate()
        .map(|(i, w)| {
            if i == 0 {
                w.to_owned()
            } else {
                format!(" {w}")
            }
        })
        .collect()
}

fn model_of(req: &RecordedRequest) -> String {
    req.json()
        .ok()
        .and_then(|v| v.get("model")?.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// How many words of the answer the request carries already: the longest prefix of it
/// found in the body (an assistant prefill, or the text an instruction quotes); 0 for a
/// first request.
fn carried_words(req: &RecordedRequest) -> usize {
    let body = String::from_utf8_lossy(&req.body);
    let tokens = tokens();
    (1..=tokens.len())
        .rev()
        .find(|&k| body.contains(&tokens[..k].concat()))
        .unwrap_or(0)
}

fn is_prefill(req: &RecordedRequest) -> bool {
    req.json().ok().is_some_and(|v| {
        v["messages"]
            .as_array()
            .and_then(|m| m.last())
            .is_some_and(|m| m["role"] == "assistant")
    })
}

fn include_usage(req: &RecordedRequest) -> bool {
    req.json()
        .ok()
        .is_some_and(|v| v["stream_options"]["include_usage"] == true)
}

/// The stream's events before the first word: how many of [`stream`]'s frames come first.
fn prelude(dialect: Dialect) -> usize {
    match dialect {
        Dialect::OpenAi => 1,
        Dialect::Anthropic => 2,
    }
}

/// A complete stream of `words` from `model`, in the provider's shapes: the prelude
/// ([`prelude`] frames), one frame a word, then the terminal events (OpenAI: the
/// `finish_reason` chunk, the usage chunk when asked for, `[DONE]`; Anthropic:
/// `content_block_stop`, `message_delta` with the usage, `message_stop`).
///
/// A continuation's stream has ids of its own (`chatcmpl-resumed`, `msg_resumed`), as a
/// provider's second answer does: one message spliced from two shows one id only.
fn stream(
    dialect: Dialect,
    model: &str,
    words: &[String],
    usage: bool,
    continuation: bool,
) -> Vec<SseFrame> {
    let n = words.len();
    let (chunk_id, message_id) = match continuation {
        false => ("chatcmpl-fault", "msg_fault"),
        true => ("chatcmpl-resumed", "msg_resumed"),
    };
    let mut frames = Vec::with_capacity(n + 6);
    match dialect {
        Dialect::OpenAi => {
            let chunk = |delta: Value, finish: Value| {
                let c = json!({
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": 1_700_000_000,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                });
                SseFrame::data(&c.to_string())
            };
            frames.push(chunk(
                json!({"role": "assistant", "content": ""}),
                Value::Null,
            ));
            for w in words {
                frames.push(chunk(json!({"content": w}), Value::Null));
            }
            frames.push(chunk(json!({}), json!("stop")));
            if usage {
                let c = json!({
                    "id": chunk_id,
                    "object": "chat.completion.chunk",
                    "created": 1_700_000_000,
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 14, "completion_tokens": n, "total_tokens": 14 + n},
                });
                frames.push(SseFrame::data(&c.to_string()));
            }
            frames.push(SseFrame::data("[DONE]"));
        }
        Dialect::Anthropic => {
            let event = |name: &str, data: Value| SseFrame::new(name, &data.to_string());
            frames.push(event(
                "message_start",
                json!({"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": 14, "output_tokens": 1},
                }}),
            ));
            frames.push(event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ));
            for w in words {
                frames.push(event(
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": w}}),
                ));
            }
            frames.push(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ));
            frames.push(event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": n}}),
            ));
            frames.push(event("message_stop", json!({"type": "message_stop"})));
        }
    }
    frames
}

/// The whole answer for a first request, the rest of it for a continuation.
fn answer(dialect: Dialect, req: &RecordedRequest) -> Reply {
    let words = tokens();
    let from = carried_words(req);
    Reply::sse(stream(
        dialect,
        &model_of(req),
        &words[from..],
        include_usage(req),
        from > 0,
    ))
}

/// The first request's stream up to and including word `k`, without its terminal events.
fn first_words(dialect: Dialect, k: usize) -> Vec<SseFrame> {
    let mut frames = stream(dialect, PRIMARY_MODEL, &tokens(), true, false);
    frames.truncate(prelude(dialect) + k);
    frames
}

/// The primary: `fault(n, request)` may answer the `n`-th request for [`PRIMARY_MODEL`]
/// (from 0, continuations included); everything else gets [`answer`].
fn primary(
    dialect: Dialect,
    fault: impl Fn(usize, &RecordedRequest) -> Option<Reply> + Send + Sync + 'static,
) -> Script {
    let seen = Arc::new(AtomicUsize::new(0));
    Script::new().when(move |req| {
        if model_of(req) == PRIMARY_MODEL {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            if let Some(reply) = fault(n, req) {
                return Some(reply);
            }
        }
        Some(answer(dialect, req))
    })
}

/// The fallback: a healthy upstream.
fn healthy(dialect: Dialect) -> Script {
    Script::new().when(move |req| Some(answer(dialect, req)))
}

fn count(mock: &MockServer, model: &str) -> usize {
    mock.requests()
        .iter()
        .filter(|r| model_of(r) == model)
        .count()
}

fn models(mock: &MockServer) -> Vec<String> {
    mock.requests().iter().map(model_of).collect()
}

// ---------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------

/// What the client received, read as the benchmark's client reads a stream.
#[derive(Debug)]
struct Outcome {
    status: u16,
    headers: http::HeaderMap,
    /// From sending the request to the end of the response body.
    elapsed: Duration,
    /// No end within the fault's wall-clock limit.
    hang: bool,
    /// The body ended cleanly, without an error (an error event, an aborted body, a status
    /// other than 200).
    success: bool,
    /// The text of every delta, in order.
    text: String,
    /// What the error said, when there was one.
    error: Option<String>,
    /// The last `model` the stream named.
    model: Option<String>,
    usage: Option<Value>,
    /// Events whose data was not JSON, skipped as a lenient client does.
    skipped: usize,
    raw: Bytes,
    /// Anthropic: `message_start`, `content_block_start`, `message_stop` events.
    message_starts: usize,
    block_starts: usize,
    message_stops: usize,
    /// Anthropic: the indices of the text deltas.
    indices: BTreeSet<u64>,
    /// OpenAI: the chunk ids, the chunks with a `finish_reason`, the `[DONE]` sentinels.
    ids: BTreeSet<String>,
    finishes: usize,
    dones: usize,
}

impl Outcome {
    /// Nothing read yet of a response with `status` and body `raw`.
    fn new(status: u16, raw: Bytes) -> Outcome {
        Outcome {
            status,
            headers: http::HeaderMap::new(),
            elapsed: Duration::ZERO,
            hang: false,
            success: false,
            text: String::new(),
            error: None,
            model: None,
            usage: None,
            skipped: 0,
            raw,
            message_starts: 0,
            block_starts: 0,
            message_stops: 0,
            indices: BTreeSet::new(),
            ids: BTreeSet::new(),
            finishes: 0,
            dones: 0,
        }
    }

    fn complete(&self) -> bool {
        self.success && self.text == CANONICAL
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends `body` to the dialect's path and reads the whole answer, giving up (a hang) after
/// `max_wall`.
async fn call(h: &Harness, dialect: Dialect, body: String, max_wall: Duration) -> Outcome {
    let req = h
        .post(dialect.path(), "")
        .header("authorization", "Bearer sk-client")
        .body(Full::from(body))
        .unwrap();
    let t0 = Instant::now();
    let read = async {
        let res = h.send(req).await;
        let status = res.status().as_u16();
        let headers = res.headers().clone();
        let (frames, end) = frames(res).await;
        (status, headers, joined(&frames), end.is_ok())
    };
    let Ok((status, headers, raw, clean)) = tokio::time::timeout(max_wall, read).await else {
        let mut o = Outcome::new(0, Bytes::new());
        o.elapsed = t0.elapsed();
        o.hang = true;
        o.error = Some(format!("hang: no end within {max_wall:?}"));
        return o;
    };
    let mut o = Outcome::new(status, raw.clone());
    o.headers = headers;
    o.elapsed = t0.elapsed();
    if status != 200 {
        o.error = Some(format!("{status}: {}", String::from_utf8_lossy(&raw)));
        return o;
    }
    read_events(&mut o, &raw);
    if !clean && o.error.is_none() {
        o.error = Some("the body was aborted".to_owned());
    }
    o.success = clean && o.error.is_none();
    o
}

/// A `200` stream of `raw`, read.
fn read_stream(raw: Bytes) -> Outcome {
    let mut o = Outcome::new(200, raw.clone());
    read_events(&mut o, &raw);
    o
}

/// Reads the SSE events of `raw` into `o`.
fn read_events(o: &mut Outcome, raw: &[u8]) {
    let text = String::from_utf8_lossy(raw).replace("\r\n", "\n");
    for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut name = None;
        let mut data = Vec::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = Some(v.trim().to_owned());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        let data = data.join("\n");
        if data == "[DONE]" {
            o.dones += 1;
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(&data) else {
            o.skipped += 1;
            continue;
        };
        if name.as_deref() == Some("error") || v.get("error").is_some_and(|e| !e.is_null()) {
            o.error.get_or_insert_with(|| data.clone());
            continue;
        }
        if let Some(m) = v["model"].as_str().or(v["message"]["model"].as_str()) {
            o.model = Some(m.to_owned());
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            o.usage = Some(u.clone());
        }
        match v["type"].as_str() {
            Some("message_start") => o.message_starts += 1,
            Some("content_block_start") => o.block_starts += 1,
            Some("message_stop") => o.message_stops += 1,
            Some("content_block_delta") => {
                if let Some(t) = v["delta"]["text"].as_str() {
                    o.text.push_str(t);
                }
                if let Some(i) = v["index"].as_u64() {
                    o.indices.insert(i);
                }
            }
            _ => {}
        }
        if let Some(id) = v["id"].as_str() {
            o.ids.insert(id.to_owned());
        }
        if let Some(choice) = v["choices"].get(0) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                o.text.push_str(t);
            }
            if !choice["finish_reason"].is_null() {
                o.finishes += 1;
            }
        }
    }
}

/// One message as the protocol shapes it, however many upstream streams made it.
fn assert_one_message(o: &Outcome, dialect: Dialect) {
    match dialect {
        Dialect::OpenAi => {
            assert_eq!(o.ids.len(), 1, "chunk ids {:?}", o.ids);
            assert_eq!(o.finishes, 1, "finish_reason chunks");
            assert!(o.dones <= 1, "{} [DONE]", o.dones);
        }
        Dialect::Anthropic => {
            assert_eq!(o.message_starts, 1, "message_start events");
            assert_eq!(o.block_starts, 1, "content_block_start events");
            assert_eq!(o.indices, BTreeSet::from([0]), "content block indices");
            assert!(o.message_stops <= 1, "{} message_stop", o.message_stops);
        }
    }
}

fn within(elapsed: Duration, (low, high): (Duration, Duration)) {
    assert!(
        low <= elapsed && elapsed <= high,
        "{elapsed:?} not within {low:?}..={high:?}"
    );
}

// ---------------------------------------------------------------------------------------
// The grading
// ---------------------------------------------------------------------------------------

/// The benchmark's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Rescued (the ideal outcome), every check clean.
    Pass,
    /// Rescued, an advisory check failed; or, where a clean error is ideal, answered anyway.
    Partial,
    /// Not rescued, but a bounded clean error and every required check clean.
    Safe,
    /// A required check failed, a hang, or a truncated answer presented as a success.
    Fail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Severity {
    Required,
    Advisory,
    /// Recorded, never counted.
    Informational,
}

#[derive(Debug)]
struct Check {
    id: &'static str,
    severity: Severity,
    ok: bool,
    detail: String,
}

fn required(id: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        id,
        severity: Severity::Required,
        ok,
        detail: detail.into(),
    }
}

fn advisory(id: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        id,
        severity: Severity::Advisory,
        ok,
        detail: detail.into(),
    }
}

fn informational(id: &'static str, ok: bool, detail: impl Into<String>) -> Check {
    Check {
        id,
        severity: Severity::Informational,
        ok,
        detail: detail.into(),
    }
}

/// What the fault's caller should end with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ideal {
    /// The complete canonical answer.
    Answer,
    /// A clean error (S13).
    Error,
}

#[derive(Debug)]
struct Graded {
    verdict: Verdict,
    reason: String,
    /// Every check that failed, with what it saw.
    failing: Vec<String>,
}

/// Grades `o` with the fault's `checks`, as the benchmark does.
fn grade(ideal: Ideal, o: &Outcome, checks: &[Check]) -> Graded {
    let failing: Vec<String> = checks
        .iter()
        .filter(|c| !c.ok && c.severity != Severity::Informational)
        .map(|c| format!("{} ({:?}): {}", c.id, c.severity, c.detail))
        .collect();
    let done = |verdict, reason: String| Graded {
        verdict,
        reason,
        failing: failing.clone(),
    };
    if o.hang {
        return done(Verdict::Fail, "hang".into());
    }
    if ideal == Ideal::Answer && o.success && !o.complete() {
        return done(
            Verdict::Fail,
            format!(
                "truncated answer presented as success ({} of 60 words)",
                o.text.split_whitespace().count()
            ),
        );
    }
    let failed = |severity| {
        checks
            .iter()
            .filter(|c| !c.ok && c.severity == severity)
            .map(|c| c.id)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let required_failed = failed(Severity::Required);
    if !required_failed.is_empty() {
        return done(Verdict::Fail, format!("failed: {required_failed}"));
    }
    let advisory_failed = failed(Severity::Advisory);
    let rescued = match ideal {
        Ideal::Answer => o.complete(),
        Ideal::Error if o.success => {
            return done(
                Verdict::Partial,
                "answered by routing around the rejection".into(),
            )
        }
        Ideal::Error => true,
    };
    match (rescued, advisory_failed.is_empty()) {
        (true, true) => done(Verdict::Pass, "rescued".into()),
        (true, false) => done(
            Verdict::Partial,
            format!("rescued; advisory: {advisory_failed}"),
        ),
        (false, _) => done(
            Verdict::Safe,
            format!("not rescued, a clean error: {:?}", o.error),
        ),
    }
}

fn assert_pass(ideal: Ideal, o: &Outcome, checks: &[Check]) {
    let g = grade(ideal, o, checks);
    assert_eq!(
        g.verdict,
        Verdict::Pass,
        "{} ; failing: {:?} ; error: {:?} ; text: {:?}",
        g.reason,
        g.failing,
        o.error,
        o.text
    );
}

// The benchmark's checks, by kind.

fn no_hang(o: &Outcome) -> Check {
    required("no_hang", !o.hang, format!("ended in {:?}", o.elapsed))
}

fn wall_max(id: &'static str, o: &Outcome, max: Duration, advisory_only: bool) -> Check {
    let ok = !o.hang && o.elapsed <= max;
    let detail = format!("{:?} (at most {max:?})", o.elapsed);
    if advisory_only {
        advisory(id, ok, detail)
    } else {
        required(id, ok, detail)
    }
}

fn no_truncated_success(id: &'static str, o: &Outcome) -> Check {
    let bad = o.success && !o.complete();
    required(
        id,
        !bad,
        format!("success: {}, text: {:?}", o.success, o.text),
    )
}

/// Attempts at the primary model inside the first `window` after the first.
fn max_attempts_within(primary: &MockServer, window: Duration, max: usize) -> Check {
    let times: Vec<Instant> = primary
        .requests()
        .iter()
        .filter(|r| model_of(r) == PRIMARY_MODEL)
        .map(|r| r.received_at)
        .collect();
    let n = times.first().map_or(0, |&first| {
        times.iter().filter(|t| **t - first < window).count()
    });
    required(
        "no_hammer",
        n <= max,
        format!("{n} attempts in the first {window:?}"),
    )
}

fn attempts_primary_max(primary: &MockServer, max: usize) -> Check {
    let n = count(primary, PRIMARY_MODEL);
    required(
        "bounded_attempts",
        n <= max,
        format!("{n} primary attempts"),
    )
}

fn attempts_primary_eq(primary: &MockServer, n: usize) -> Check {
    let seen = count(primary, PRIMARY_MODEL);
    required(
        "no_same_model_retry",
        seen == n,
        format!("{seen} primary attempts"),
    )
}

fn usage_present(o: &Outcome) -> Check {
    advisory(
        "usage_present",
        o.usage.is_some(),
        format!("usage: {:?}", o.usage),
    )
}

/// The benchmark's healthy call after a fault: a model every upstream answers, through the
/// same proxy.
async fn alive_after(h: &Harness, dialect: Dialect) -> Check {
    let o = call(
        h,
        dialect,
        dialect.request(HEALTHY_MODEL),
        Duration::from_secs(10),
    )
    .await;
    required(
        "alive_after",
        o.complete(),
        format!("healthy call: {:?}", o.error),
    )
}

// ---------------------------------------------------------------------------------------
// The faults
// ---------------------------------------------------------------------------------------

async fn run(
    dialect: Dialect,
    primary_script: Script,
    fallback_script: Script,
    max_wall: Duration,
) -> (Harness, MockServer, Outcome) {
    let (h, fallback) = start_pair(primary_script, fallback_script, |p, f| {
        fault_config(p, f, dialect)
    })
    .await;
    let o = call(&h, dialect, dialect.request(PRIMARY_MODEL), max_wall).await;
    (h, fallback, o)
}

/// S01: a `429` with `Retry-After: 2`, then healthy. Honoured exactly, on the primary.
async fn s01(dialect: Dialect) {
    let limited = match dialect {
        Dialect::OpenAi => openai_error(
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            "Rate limit reached. Please retry after 2 seconds.",
        )
        .header("retry-after", "2"),
        Dialect::Anthropic => Reply::rate_limited("2"),
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| (n == 0).then(|| limited.clone())),
        healthy(dialect),
        Duration::from_secs(20),
    )
    .await;
    let seen = h.mock.requests();
    assert_eq!(models(&h.mock), [PRIMARY_MODEL, PRIMARY_MODEL]);
    assert_eq!(
        seen[1].received_at - seen[0].received_at,
        Duration::from_secs(2)
    );
    assert_eq!(fallback.request_count(), 0);
    assert_eq!(o.elapsed, Duration::from_secs(2));
    assert_one_message(&o, dialect);
    let gap = seen[1].received_at - seen[0].received_at;
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            advisory(
                "retried",
                seen.len() >= 2,
                format!("{} primary attempts", seen.len()),
            ),
            advisory(
                "retry_after_honoured",
                gap >= Duration::from_millis(1800),
                format!("gap {gap:?}"),
            ),
            max_attempts_within(&h.mock, Duration::from_millis(1500), 2),
        ],
    );
}

/// S02: a `429` without `Retry-After` on every attempt: nowhere to wait, so the fallback.
async fn s02(dialect: Dialect) {
    let limited = match dialect {
        Dialect::OpenAi => openai_error(
            429,
            "rate_limit_error",
            "rate_limit_exceeded",
            "Rate limit reached.",
        ),
        Dialect::Anthropic => Reply::anthropic_error(
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit.",
        ),
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(limited.clone())),
        healthy(dialect),
        Duration::from_secs(40),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(models(&fallback), [FALLBACK_MODEL]);
    within(o.elapsed, FIRST_BACKOFF);
    assert_one_message(&o, dialect);
    assert_eq!(o.model.as_deref(), Some(FALLBACK_MODEL));
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            max_attempts_within(&h.mock, Duration::from_secs(3), 4),
            attempts_primary_max(&h.mock, 6),
            no_hang(&o),
        ],
    );
}

/// S03: a `500` once, then healthy: retried on the primary.
async fn s03(dialect: Dialect) {
    let error = match dialect {
        Dialect::OpenAi => openai_error(
            500,
            "server_error",
            "server_error",
            "The server had an error while processing your request.",
        ),
        Dialect::Anthropic => Reply::anthropic_error(500, "api_error", "Internal server error"),
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| (n == 0).then(|| error.clone())),
        healthy(dialect),
        Duration::from_secs(20),
    )
    .await;
    let seen = h.mock.requests();
    assert_eq!(models(&h.mock), [PRIMARY_MODEL, PRIMARY_MODEL]);
    assert_eq!(sha256(&seen[0].body), sha256(&seen[1].body));
    within(seen[1].received_at - seen[0].received_at, FIRST_BACKOFF);
    assert_eq!(fallback.request_count(), 0);
    within(o.elapsed, FIRST_BACKOFF);
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            no_hang(&o),
            advisory(
                "same_provider_retry",
                seen.len() >= 2,
                format!("{} primary attempts", seen.len()),
            ),
        ],
    );
}

/// Every primary attempt overloaded; the fallback answers. S04 and S16 share it.
async fn overloaded_primary(dialect: Dialect) -> (Harness, MockServer, Outcome) {
    let overloaded = dialect.overloaded();
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(overloaded.clone())),
        healthy(dialect),
        Duration::from_secs(40),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(models(&fallback), [FALLBACK_MODEL]);
    // Only the model's value changed, every other byte as sent.
    let expected = dialect
        .request(PRIMARY_MODEL)
        .replace(PRIMARY_MODEL, FALLBACK_MODEL);
    assert_eq!(
        sha256(&fallback.requests()[0].body),
        sha256(expected.as_bytes())
    );
    within(o.elapsed, FIRST_BACKOFF);
    assert_one_message(&o, dialect);
    (h, fallback, o)
}

/// S04: overloaded on every attempt: the fallback within the retry budget.
async fn s04(dialect: Dialect) {
    let (h, _fallback, o) = overloaded_primary(dialect).await;
    assert_pass(
        Ideal::Answer,
        &o,
        &[attempts_primary_max(&h.mock, 6), no_hang(&o)],
    );
}

/// S05: the connection reset before the head once, then healthy.
async fn s05(dialect: Dialect) {
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, |n, _| (n == 0).then(Reply::reset)),
        healthy(dialect),
        Duration::from_secs(20),
    )
    .await;
    let seen = h.mock.requests();
    assert_eq!(models(&h.mock), [PRIMARY_MODEL, PRIMARY_MODEL]);
    assert_eq!(sha256(&seen[0].body), sha256(&seen[1].body));
    assert_eq!(fallback.request_count(), 0);
    within(o.elapsed, (Duration::ZERO, FIRST_BACKOFF.1));
    assert_one_message(&o, dialect);
    assert_pass(Ideal::Answer, &o, &[no_hang(&o)]);
}

/// S06: the primary accepts and never answers (it closes after 120 s): left after its first
/// head timeout.
async fn s06(dialect: Dialect) {
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, |_, _| {
            Some(Reply::reset().delay(Duration::from_secs(120)))
        }),
        healthy(dialect),
        Duration::from_secs(130),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(models(&fallback), [FALLBACK_MODEL]);
    let head = Duration::from_secs(30);
    within(o.elapsed, (head + FIRST_BACKOFF.0, head + FIRST_BACKOFF.1));
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            wall_max("within_budget", &o, Duration::from_secs(100), false),
            no_hang(&o),
            {
                let n = count(&h.mock, PRIMARY_MODEL);
                advisory(
                    "silent_route_not_retried",
                    n <= 1,
                    format!("{n} primary attempts"),
                )
            },
        ],
    );
}

/// S07: the head at once, the first word after 20 s: left at the first-output timeout.
async fn s07(dialect: Dialect) {
    let slow = {
        let mut frames = stream(dialect, PRIMARY_MODEL, &tokens(), true, false);
        // The first event that shows output: OpenAI's first content chunk (the role chunk
        // before it shows none), Anthropic's `content_block_start`.
        frames[1] = frames[1].clone().after(Duration::from_secs(20));
        Reply::sse(frames)
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(slow.clone())),
        healthy(dialect),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(models(&fallback), [FALLBACK_MODEL]);
    let limit = Duration::from_secs(10);
    within(
        o.elapsed,
        (limit + FIRST_BACKOFF.0, limit + FIRST_BACKOFF.1),
    );
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            no_hang(&o),
            wall_max("ttft_limit", &o, Duration::from_secs(15), true),
        ],
    );
}

/// The continuations both upstreams saw: the number of words each carried, and whether it
/// came as a prefill.
fn continuations(mocks: &[&MockServer]) -> Vec<(usize, bool)> {
    mocks
        .iter()
        .flat_map(|m| m.requests())
        .map(|r| (carried_words(&r), is_prefill(&r)))
        .filter(|(k, _)| *k > 0)
        .collect()
}

/// S08: the stream dies after 40 of 60 words, with no terminal event: resumed.
async fn s08(dialect: Dialect) {
    let cut = Reply::sse_then_reset(first_words(dialect, 40));
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| (n == 0).then(|| cut.clone())),
        healthy(dialect),
        Duration::from_secs(40),
    )
    .await;
    // The first request, and one continuation (at the primary or the fallback) carrying
    // exactly the 40 words the client had.
    assert_eq!(count(&h.mock, PRIMARY_MODEL) + fallback.request_count(), 2);
    let resumed = continuations(&[&h.mock, &fallback]);
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0].0, 40);
    within(o.elapsed, (Duration::ZERO, FIRST_BACKOFF.1));
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            no_truncated_success("no_truncated_success", &o),
            no_hang(&o),
        ],
    );
}

/// S09: 20 words, then 30 s of silence, then the connection closes: resumed at the idle
/// timeout.
async fn s09(dialect: Dialect) {
    let stall = {
        let mut frames = first_words(dialect, 20);
        frames.push(SseFrame::silence(Duration::from_secs(30)));
        Reply::sse_then_reset(frames)
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| (n == 0).then(|| stall.clone())),
        healthy(dialect),
        Duration::from_secs(70),
    )
    .await;
    assert_eq!(count(&h.mock, PRIMARY_MODEL) + fallback.request_count(), 2);
    let resumed = continuations(&[&h.mock, &fallback]);
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    assert_eq!(resumed[0].0, 20);
    let idle = Duration::from_secs(30);
    within(o.elapsed, (idle, idle + FIRST_BACKOFF.1));
    assert_one_message(&o, dialect);
    let alive = alive_after(&h, dialect).await;
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            wall_max("bounded", &o, Duration::from_secs(45), false),
            no_truncated_success("no_truncated_success", &o),
            alive,
            no_hang(&o),
        ],
    );
}

/// S10: the tenth event of the stream is invalid JSON; the stream otherwise completes.
async fn s10(dialect: Dialect) {
    let mut frames = stream(dialect, PRIMARY_MODEL, &tokens(), true, false);
    let malformed = match dialect {
        Dialect::OpenAi => SseFrame::raw(
            &b"data: {\"id\": \"chatcmpl-fault\", \"object\": \"chat.completion.chunk\", \"choices\": [{\"delta\": {\"content\": \n\n"[..],
        ),
        Dialect::Anthropic => SseFrame::raw(
            &b"event: content_block_delta\ndata: {\"type\": \"content_block_delta\", \"index\": 0, \"delta\": {\"type\": \"text_delta\", \"text\": \n\n"[..],
        ),
    };
    frames.insert(9, malformed);
    let sent = concat(&frames);
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| {
            (n == 0).then(|| Reply::sse(frames.clone()))
        }),
        healthy(dialect),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(fallback.request_count(), 0);
    assert_eq!(o.elapsed, Duration::ZERO);
    // Forwarded as the upstream sent it; the client skipped the one event.
    assert_eq!(sha256(&o.raw), sha256(&sent));
    assert_eq!(o.skipped, 1);
    assert_one_message(&o, dialect);
    let alive = alive_after(&h, dialect).await;
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            alive,
            no_truncated_success("no_garbage", &o),
            no_hang(&o),
            advisory("recovered_in_place", o.complete(), format!("{:?}", o.text)),
        ],
    );
}

/// S11: a complete stream without its last sentinel (OpenAI: `data: [DONE]`; Anthropic:
/// `message_stop`, after the `message_delta` with the stop reason and the usage).
async fn s11(dialect: Dialect) {
    let mut frames = stream(dialect, PRIMARY_MODEL, &tokens(), true, false);
    frames.pop();
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(Reply::sse(frames.clone()))),
        healthy(dialect),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(fallback.request_count(), 0);
    assert_eq!(o.elapsed, Duration::ZERO);
    assert_one_message(&o, dialect);
    assert_eq!(o.dones, 0, "no [DONE] was made up");
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            wall_max("prompt_finalise", &o, Duration::from_secs(8), false),
            usage_present(&o),
        ],
    );
}

/// S12: `400` context length exceeded for the primary's model: the same request, at once,
/// to the larger-context model.
async fn s12(dialect: Dialect) {
    let overflow = match dialect {
        Dialect::OpenAi => Reply::status(400).json(json!({"error": {
            "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9631 tokens. Please reduce the length of the messages.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }})),
        Dialect::Anthropic => Reply::prompt_too_long(9631, 8192),
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(overflow.clone())),
        healthy(dialect),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL, LARGER_MODEL]);
    let expected = dialect
        .request(PRIMARY_MODEL)
        .replace(PRIMARY_MODEL, LARGER_MODEL);
    assert_eq!(
        sha256(&h.mock.requests()[1].body),
        sha256(expected.as_bytes())
    );
    assert_eq!(fallback.request_count(), 0);
    assert_eq!(o.elapsed, Duration::ZERO);
    assert_eq!(o.model.as_deref(), Some(LARGER_MODEL));
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[attempts_primary_eq(&h.mock, 1), no_hang(&o)],
    );
}

/// S13: `400` content policy violation: one attempt, the provider's error as it was.
async fn s13(dialect: Dialect) {
    let rejected = match dialect {
        Dialect::OpenAi => openai_error(
            400,
            "invalid_request_error",
            "content_policy_violation",
            "Your request was rejected as a result of our safety system.",
        ),
        Dialect::Anthropic => Reply::anthropic_error(
            400,
            "invalid_request_error",
            "Output blocked by content filtering policy",
        ),
    };
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |_, _| Some(rejected.clone())),
        healthy(dialect),
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(models(&h.mock), [PRIMARY_MODEL]);
    assert_eq!(fallback.request_count(), 0);
    assert_eq!(o.elapsed, Duration::ZERO);
    assert_eq!(o.status, 400);
    let body: Value = serde_json::from_slice(&o.raw).unwrap();
    match dialect {
        Dialect::OpenAi => assert_eq!(body["error"]["code"], "content_policy_violation"),
        Dialect::Anthropic => assert_eq!(
            body["error"]["message"],
            "Output blocked by content filtering policy"
        ),
    }
    let n = fallback.request_count();
    assert_pass(
        Ideal::Error,
        &o,
        &[
            attempts_primary_eq(&h.mock, 1),
            no_hang(&o),
            informational(
                "fallback_attempted",
                n >= 1,
                format!("{n} fallback attempts"),
            ),
        ],
    );
}

/// S14: the primary's stream dies after 40 words and the primary is overloaded after that;
/// the fallback rejects a request whose last message is an assistant prefill. The
/// continuation must reach the fallback as an instruction, and its `400` must never be the
/// end.
async fn s14(dialect: Dialect) {
    let cut = Reply::sse_then_reset(first_words(dialect, 40));
    let overloaded = dialect.overloaded();
    let (h, fallback, o) = run(
        dialect,
        primary(dialect, move |n, _| {
            Some(if n == 0 {
                cut.clone()
            } else {
                overloaded.clone()
            })
        }),
        // Rules run in the order they were added: the rejection first.
        Script::new()
            .reject_prefill()
            .when(move |req| Some(answer(dialect, req))),
        Duration::from_secs(40),
    )
    .await;
    let at_fallback: Vec<(usize, bool)> = fallback
        .requests()
        .iter()
        .map(|r| (carried_words(r), is_prefill(r)))
        .collect();
    let prefill_rejections = at_fallback.iter().filter(|(_, p)| *p).count();
    // The fallback ended it with a continuation from exactly the 40 words, not a prefill.
    assert_eq!(at_fallback.last(), Some(&(40, false)), "{at_fallback:?}");
    assert!(count(&h.mock, PRIMARY_MODEL) <= 2, "{:?}", models(&h.mock));
    within(o.elapsed, (Duration::ZERO, Duration::from_secs(2)));
    assert_one_message(&o, dialect);
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            required(
                "no_prefill_masking",
                !(o.error.is_some() && prefill_rejections > 0),
                format!(
                    "{prefill_rejections} prefill rejections; error {:?}",
                    o.error
                ),
            ),
            no_truncated_success("no_truncated_success", &o),
        ],
    );
}

/// S15: the primary overloaded for the first 60 s, then healthy; twenty requests, one every
/// 4 s, each allowed 30 s.
async fn s15(dialect: Dialect) {
    let down = Duration::from_secs(60);
    let t0 = Instant::now();
    let overloaded = dialect.overloaded();
    let (h, fallback) = start_pair(
        primary(dialect, move |_, req| {
            (req.received_at - t0 < down).then(|| overloaded.clone())
        }),
        healthy(dialect),
        |p, f| fault_config(p, f, dialect),
    )
    .await;
    let mut items = Vec::new();
    for i in 0..20u32 {
        tokio::time::sleep_until(t0 + Duration::from_secs(4) * i).await;
        let sent = t0.elapsed();
        let o = call(
            &h,
            dialect,
            dialect.request(PRIMARY_MODEL),
            Duration::from_secs(30),
        )
        .await;
        items.push((sent, o));
    }
    let during: Vec<_> = items.iter().filter(|(sent, _)| *sent < down).collect();
    assert_eq!(during.len(), 15);
    let served = during.iter().filter(|(_, o)| o.complete()).count();
    let primary_times: Vec<Duration> = h
        .mock
        .requests()
        .iter()
        .filter(|r| model_of(r) == PRIMARY_MODEL)
        .map(|r| r.received_at - t0)
        .collect();
    let attempts_during = primary_times.iter().filter(|t| **t < down).count();
    let recovered = primary_times
        .iter()
        .find(|t| **t >= down)
        .map(|t| *t - down);
    // Every request of the outage served by the fallback, every one after by the primary
    // once it answered again.
    for (sent, o) in &items {
        assert!(o.complete(), "at {sent:?}: {:?}", o.error);
        assert_one_message(o, dialect);
        if *sent < down {
            assert_eq!(o.model.as_deref(), Some(FALLBACK_MODEL), "at {sent:?}");
        }
        if let Some(r) = recovered {
            if *sent > down + r {
                assert_eq!(o.model.as_deref(), Some(PRIMARY_MODEL), "at {sent:?}");
            }
        }
    }
    assert!(fallback.request_count() >= 15);
    // The sequence as the benchmark grades it: the last request's outcome, the sequence's
    // checks.
    let (_, last) = items.last().unwrap();
    let hangs = items.iter().filter(|(_, o)| o.hang).count();
    assert_pass(
        Ideal::Answer,
        last,
        &[
            required(
                "no_hang",
                hangs == 0,
                format!("{hangs} hung requests of 20"),
            ),
            required(
                "served_during_outage",
                served == during.len(),
                format!(
                    "{served}/{} answered while the primary was down",
                    during.len()
                ),
            ),
            required(
                "recovered",
                recovered.is_some_and(|r| r <= Duration::from_secs(30)),
                format!("the primary answered again {recovered:?} after its recovery"),
            ),
            informational(
                "probe_discipline",
                attempts_during <= during.len(),
                format!(
                    "{attempts_during} primary attempts for {} requests during the outage",
                    during.len()
                ),
            ),
        ],
    );
    // The circuit kept the dead primary's share to the probes.
    assert!(
        attempts_during <= during.len(),
        "{attempts_during} primary attempts during the outage: {primary_times:?}"
    );
}

/// S16: every primary attempt overloaded; the fallback answers: the caller sees the
/// fallback's model and usage.
async fn s16(dialect: Dialect) {
    let (h, _fallback, o) = overloaded_primary(dialect).await;
    assert_eq!(o.header("x-llm-retry-model"), Some(FALLBACK_MODEL));
    assert_eq!(o.header("x-llm-retry-upstream"), Some("fallback"));
    assert_eq!(o.header("x-llm-retry-fallback"), Some("true"));
    let reported = o.model.clone().unwrap_or_default();
    assert_pass(
        Ideal::Answer,
        &o,
        &[
            required(
                "reports_fallback_model",
                reported.contains(FALLBACK_MODEL),
                format!("response model {reported:?}"),
            ),
            usage_present(&o),
            attempts_primary_max(&h.mock, 6),
        ],
    );
}

// ---------------------------------------------------------------------------------------
// Sixteen faults × two dialects
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn s01_rate_limit_with_retry_after_openai() {
    s01(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s01_rate_limit_with_retry_after_anthropic() {
    s01(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s02_persistent_rate_limit_without_retry_after_openai() {
    s02(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s02_persistent_rate_limit_without_retry_after_anthropic() {
    s02(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s03_server_error_once_openai() {
    s03(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s03_server_error_once_anthropic() {
    s03(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s04_persistent_overload_openai() {
    s04(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s04_persistent_overload_anthropic() {
    s04(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s05_reset_before_the_head_once_openai() {
    s05(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s05_reset_before_the_head_once_anthropic() {
    s05(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s06_no_response_at_all_openai() {
    s06(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s06_no_response_at_all_anthropic() {
    s06(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s07_slow_first_token_openai() {
    s07(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s07_slow_first_token_anthropic() {
    s07(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s08_stream_cut_mid_answer_openai() {
    s08(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s08_stream_cut_mid_answer_anthropic() {
    s08(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s09_stream_stalls_then_closes_openai() {
    s09(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s09_stream_stalls_then_closes_anthropic() {
    s09(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s10_malformed_event_openai() {
    s10(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s10_malformed_event_anthropic() {
    s10(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s11_no_final_sentinel_openai() {
    s11(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s11_no_final_sentinel_anthropic() {
    s11(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s12_context_length_exceeded_openai() {
    s12(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s12_context_length_exceeded_anthropic() {
    s12(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s13_content_policy_rejection_openai() {
    s13(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s13_content_policy_rejection_anthropic() {
    s13(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s14_fallback_rejects_prefill_openai() {
    s14(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s14_fallback_rejects_prefill_anthropic() {
    s14(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s15_primary_flaps_openai() {
    s15(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s15_primary_flaps_anthropic() {
    s15(Dialect::Anthropic).await;
}

#[tokio::test(start_paused = true)]
async fn s16_failover_accounting_openai() {
    s16(Dialect::OpenAi).await;
}

#[tokio::test(start_paused = true)]
async fn s16_failover_accounting_anthropic() {
    s16(Dialect::Anthropic).await;
}

// ---------------------------------------------------------------------------------------
// The harness itself
// ---------------------------------------------------------------------------------------

#[test]
fn the_canonical_answer_is_sixty_words_that_read_the_same_in_json() {
    assert_eq!(CANONICAL.split(' ').count(), 60);
    assert_eq!(tokens().concat(), CANONICAL);
    assert!(CANONICAL.is_ascii() && !CANONICAL.contains(['"', '\\']));
    assert!(!PROMPT.contains(CANONICAL.split(' ').next().unwrap()));
}

/// What the ignored tests rely on from the upstreams, checked without the proxy: a
/// continuation, as a prefill or as an instruction, gets exactly the rest of the answer,
/// and the S14 fallback refuses the prefill only.
#[tokio::test(start_paused = true)]
async fn the_upstreams_continue_from_the_text_a_request_carries() {
    for dialect in [Dialect::OpenAi, Dialect::Anthropic] {
        let plain = MockServer::start(healthy(dialect)).await.unwrap();
        let strict = MockServer::start(
            Script::new()
                .reject_prefill()
                .when(move |req| Some(answer(dialect, req))),
        )
        .await
        .unwrap();
        let partial = tokens()[..40].concat();
        let mut prefill: Value = serde_json::from_str(&dialect.request(PRIMARY_MODEL)).unwrap();
        prefill["messages"]
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "assistant", "content": partial}));
        let mut instruction: Value =
            serde_json::from_str(&dialect.request(FALLBACK_MODEL)).unwrap();
        instruction["messages"].as_array_mut().unwrap().push(json!({
            "role": "user",
            "content": format!("Continue exactly where this text stops: {partial}"),
        }));
        let client = client();
        let send = |mock: &MockServer, body: &Value| {
            let req = http::Request::post(mock.url(dialect.path()))
                .header("content-type", "application/json")
                .body(Full::from(body.to_string()))
                .unwrap();
            client.request(req)
        };
        for (mock, body) in [(&plain, &prefill), (&strict, &instruction)] {
            let res = send(mock, body).await.unwrap();
            assert_eq!(res.status(), 200, "{dialect:?}");
            let (frames, end) = frames(res).await;
            end.unwrap();
            let rest = read_stream(joined(&frames));
            assert_eq!(partial.clone() + &rest.text, CANONICAL);
            if dialect == Dialect::OpenAi {
                assert_eq!(rest.ids, BTreeSet::from(["chatcmpl-resumed".to_owned()]));
            }
        }
        let res = send(&strict, &prefill).await.unwrap();
        assert_eq!(res.status(), 400, "{dialect:?}");
        // A first request gets the whole answer, and names the model it asked for.
        let res = send(
            &plain,
            &serde_json::from_str(&dialect.request(HEALTHY_MODEL)).unwrap(),
        )
        .await
        .unwrap();
        let (frames, _) = frames(res).await;
        let o = read_stream(joined(&frames));
        assert_eq!(o.text, CANONICAL);
        assert_eq!(o.model.as_deref(), Some(HEALTHY_MODEL));
        // The request asked for it (OpenAI); Anthropic's `message_delta` always has it.
        assert!(o.usage.is_some());
    }
}

#[test]
fn the_grader_tells_the_verdicts_apart() {
    let ok = |text: &str, success: bool| {
        let mut o = Outcome::new(200, Bytes::new());
        o.success = success;
        o.text = text.to_owned();
        o.error = (!success).then(|| "cut".to_owned());
        o
    };
    let whole = ok(CANONICAL, true);
    let short = ok("Resilience shows", true);
    let error = ok("", false);
    let clean = [required("a", true, "")];
    let advice = [advisory("b", false, "")];
    let broken = [required("c", false, "")];
    let v = |ideal, o: &Outcome, c: &[Check]| grade(ideal, o, c).verdict;
    assert_eq!(v(Ideal::Answer, &whole, &clean), Verdict::Pass);
    assert_eq!(v(Ideal::Answer, &whole, &advice), Verdict::Partial);
    assert_eq!(v(Ideal::Answer, &whole, &broken), Verdict::Fail);
    assert_eq!(v(Ideal::Answer, &short, &clean), Verdict::Fail);
    assert_eq!(v(Ideal::Answer, &error, &clean), Verdict::Safe);
    assert_eq!(v(Ideal::Error, &error, &clean), Verdict::Pass);
    assert_eq!(v(Ideal::Error, &whole, &clean), Verdict::Partial);
    assert_eq!(
        v(Ideal::Answer, &whole, &[informational("d", false, "")]),
        Verdict::Pass
    );
    let mut hung = ok("", false);
    hung.hang = true;
    assert_eq!(v(Ideal::Error, &hung, &clean), Verdict::Fail);
    // A single space off is not the answer.
    let spaced = ok(&CANONICAL.replacen(' ', "  ", 1), true);
    assert_eq!(v(Ideal::Answer, &spaced, &clean), Verdict::Fail);
}
