//! `--demo`: the proxy in front of the crate's fault-injecting mock, so it can be tried with
//! `curl` or an SDK and no account.
//!
//! The mock answers like Anthropic (`/v1/messages`) and OpenAI (`/v1/chat/completions`),
//! streaming when the body says `"stream": true`. Without instructions, every third request
//! it receives is first answered with an overload. A client can script the faults per request
//! with two headers, which the proxy forwards as it forwards any header:
//!
//! - `x-mock-id`: any string naming the logical request; the mock counts the attempts it saw
//!   for it, readable at `GET {mock}/_mock/attempts/{id}` (`{"attempts": n}`).
//! - `x-mock-scenario`: what to do, by attempt number `n` (1 for the first the mock sees):
//!
//! | scenario | reply |
//! |---|---|
//! | `ok` | success |
//! | `overloaded:K` | `n ≤ K`: overloaded (`529` Anthropic, `500` OpenAI); then success |
//! | `rate_limited:K` | `n ≤ K`: `429` with `retry-after-ms: 50`; then success |
//! | `sse_error_first` | `n = 1`: a stream whose first event is an overload error; then success |
//! | `reset_first` | `n = 1`: the connection closed before a response; then success |
//! | `cut_after_output` | always: a stream with output, then the connection reset |
//! | `clean_cut_after_output` | always: a stream with output that ends cleanly, without its terminal event |
//! | `cut_then_rest` | `n = 1`: a stream with output, then the connection reset; then a whole stream of the rest of the answer (for the upstreams that resume) |
//! | `always_overloaded` | always overloaded |
//! | `slow_unavailable:MS` | always `503` (a plain server error, no overload), answered after `MS` milliseconds |
//! | `overloaded_model` | overloaded while the body's model is `claude-primary`; success for any other model |

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::json;
use tower_llm_retry::mock::{sse, MockServer, RecordedRequest, Reply, Script, SseFrame};

use crate::config::{Config, Kind, ResumeMode, Upstream};

/// The retries the demo's upstreams allow (short, so a give-up is quick to see).
pub const DEMO_MAX_RETRIES: u32 = 3;

/// The fallback chain the demo's Anthropic upstream uses.
pub const DEMO_FALLBACK: &str = "claude-fallback";

/// The mock's script: scenarios per request, attempt counts per `x-mock-id`.
pub fn script() -> Script {
    let counts: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let global = AtomicU64::new(0);
    Script::new().when(move |req| {
        let path = req.uri.path();
        if let Some(id) = path.strip_prefix("/_mock/attempts/") {
            let n = counts
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(id)
                .copied()
                .unwrap_or(0);
            return Some(Reply::status(200).json(json!({ "attempts": n })));
        }
        let header = |n: &str| req.headers.get(n).and_then(|v| v.to_str().ok());
        let n = match header("x-mock-id") {
            Some(id) => {
                let mut c = counts.lock().unwrap_or_else(PoisonError::into_inner);
                let e = c.entry(id.to_owned()).or_insert(0);
                *e += 1;
                *e
            }
            None => 0,
        };
        let openai = !path.ends_with("/messages");
        let scenario = header("x-mock-scenario").unwrap_or("demo");
        let (name, k) = match scenario.split_once(':') {
            Some((name, k)) => (name, k.parse::<u64>().unwrap_or(1)),
            None => (scenario, 0),
        };
        Some(match name {
            "overloaded" if n <= k => overloaded(openai),
            "rate_limited" if n <= k => rate_limited(openai),
            "sse_error_first" if n == 1 => {
                let mut events = success_events(openai);
                events.truncate(1);
                events.push(if openai {
                    SseFrame::data(r#"{"error":{"message":"Overloaded","type":"server_error","code":"overloaded_error"}}"#)
                } else {
                    sse::anthropic_error("overloaded_error")
                });
                Reply::sse(events)
            }
            "reset_first" if n == 1 => Reply::reset(),
            "cut_after_output" => Reply::sse_then_reset(partial_events(openai)),
            "clean_cut_after_output" => Reply::sse(partial_events(openai)),
            "cut_then_rest" if n == 1 => Reply::sse_then_reset(partial_events(openai)),
            "cut_then_rest" => Reply::sse(rest_events(openai)),
            "always_overloaded" => overloaded(openai),
            "slow_unavailable" => unavailable(openai).delay(Duration::from_millis(k)),
            "overloaded_model" if model(req).as_deref() == Some("claude-primary") => {
                overloaded(openai)
            }
            "demo" if global.fetch_add(1, Ordering::Relaxed).is_multiple_of(3) => overloaded(openai),
            _ => success(req, openai),
        })
    })
}

fn model(req: &RecordedRequest) -> Option<String> {
    Some(req.json().ok()?.get("model")?.as_str()?.to_owned())
}

fn streaming(req: &RecordedRequest) -> bool {
    req.json()
        .ok()
        .and_then(|v| v.get("stream").and_then(|s| s.as_bool()))
        .unwrap_or(false)
}

fn overloaded(openai: bool) -> Reply {
    if openai {
        Reply::openai_error(
            500,
            "server_error",
            "The server had an error while processing your request.",
        )
    } else {
        Reply::overloaded()
    }
}

fn unavailable(openai: bool) -> Reply {
    if openai {
        Reply::openai_error(
            503,
            "service_unavailable",
            "Service temporarily unavailable.",
        )
    } else {
        Reply::anthropic_error(503, "api_error", "Service temporarily unavailable.")
    }
}

fn rate_limited(openai: bool) -> Reply {
    let r = if openai {
        Reply::openai_error(
            429,
            "rate_limit_exceeded",
            "Rate limit reached for requests",
        )
    } else {
        Reply::anthropic_error(
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit.",
        )
    };
    r.header("retry-after-ms", "50").header("retry-after", "1")
}

fn success_events(openai: bool) -> Vec<SseFrame> {
    let words = ["Retried ", "through ", "the ", "proxy."];
    if openai {
        sse::openai_chat(&words)
    } else {
        sse::anthropic_message(&words)
    }
}

/// Output, but no terminal event: Anthropic's stops before `message_delta`, OpenAI's before
/// the chunk with a `finish_reason`.
fn partial_events(openai: bool) -> Vec<SseFrame> {
    let mut events = success_events(openai);
    let keep = if openai { 3 } else { 4 };
    events.truncate(keep);
    events
}

/// The rest of the answer after [`partial_events`], as a whole stream of its own.
fn rest_events(openai: bool) -> Vec<SseFrame> {
    let words = ["the ", "proxy."];
    if openai {
        sse::openai_chat(&words)
    } else {
        sse::anthropic_message(&words)
    }
}

fn success(req: &RecordedRequest, openai: bool) -> Reply {
    if streaming(req) {
        Reply::sse(success_events(openai))
    } else {
        Reply::success()
    }
}

/// Starts the mock on `127.0.0.1` (ephemeral port).
pub async fn start_mock() -> std::io::Result<MockServer> {
    MockServer::start(script()).await
}

/// The demo's configuration: both upstreams at the mock, 3 retries from 100 ms, and the
/// fallback chain `claude-primary` → `claude-fallback` on the Anthropic one; and the same two
/// again, resuming cut streams, under `/anthropic-resume` (`resume = "prefill"`) and
/// `/openai-resume` (`resume = "instruction"`).
pub fn config(mock: &MockServer, mut base: Config) -> Config {
    let url = mock.url("");
    let url = url.trim_end_matches('/');
    let mut anthropic = Upstream::new("anthropic", Kind::Anthropic, url);
    anthropic.initial_backoff_ms = Some(100);
    anthropic.max_retries = Some(DEMO_MAX_RETRIES);
    anthropic.fallback = vec!["claude-primary".into(), DEMO_FALLBACK.into()];
    let mut openai = Upstream::new("openai", Kind::OpenAi, url);
    openai.initial_backoff_ms = Some(100);
    openai.max_retries = Some(DEMO_MAX_RETRIES);
    let mut anthropic_resume = anthropic.clone();
    anthropic_resume.name = "anthropic-resume".into();
    anthropic_resume.resume = ResumeMode::Prefill;
    let mut openai_resume = openai.clone();
    openai_resume.name = "openai-resume".into();
    openai_resume.resume = ResumeMode::Instruction;
    base.upstream = vec![anthropic, openai, anthropic_resume, openai_resume];
    base
}
