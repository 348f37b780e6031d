//! The first-output timeout: from an event stream's head to its first output, per attempt,
//! against the mock under paused time. A stream with no output in time is a timeout before the
//! commit point (retried, and counted by the fallback's timeout trigger); a stream that has
//! shown output is never cut by it.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::fallback::ModelUsed;
use tower_llm_retry::mock::{sse, MockServer, RecordedRequest, Reply, Script, SseFrame};
use tower_llm_retry::retry::{GiveUpReason, TimedOut, TimeoutKind};
use tower_llm_retry::{ErrorKind, ModelFallbackLayer, RetryLayer, RetryPolicy, RetryTrail};

const PRIMARY: &str = "claude-opus-4-1";
const FALLBACK: &str = "claude-sonnet-4-5";
const REQUEST: &str = r#"{"model":"claude-opus-4-1","max_tokens":1024,"stream":true,"messages":[{"role":"user","content":"Name a car."}]}"#;

type Response = http::Response<tower_llm_retry::RetryBody<hyper::body::Incoming>>;

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

fn model_of(r: &RecordedRequest) -> String {
    r.json().unwrap()["model"].as_str().unwrap().to_owned()
}

/// The models the server saw, each with its arrival after `start`.
fn seen(server: &MockServer, start: Instant) -> Vec<(String, Duration)> {
    server
        .requests()
        .iter()
        .map(|r| (model_of(r), r.received_at - start))
        .collect()
}

/// The failover benchmark's fault S07: the head at once, keep-alive pings every 4 s, and the
/// first token only after 20 s; then the rest of the answer.
fn late_first_token() -> Vec<SseFrame> {
    let mut events = sse::anthropic_message(&["Slow ", "answer."]);
    let ping = || SseFrame::new("ping", r#"{"type":"ping"}"#).after(secs(4));
    events.splice(1..1, [ping(), ping(), ping()]);
    // message_start, three pings (4, 8, 12 s), then content_block_start at 20 s.
    events[4] = events[4].clone().after(secs(8));
    events
}

/// A policy without jitter or backoff: a retry starts the instant its attempt failed.
fn policy() -> RetryPolicy {
    exact_policy().initial_backoff(Duration::ZERO)
}

async fn send(
    server: &MockServer,
    policy: RetryPolicy,
) -> Result<Response, tower_llm_retry::Error> {
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .service(http_client())
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
}

fn timed_out(err: &(dyn std::error::Error + 'static)) -> Option<(TimeoutKind, Duration)> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(t) = e.downcast_ref::<TimedOut>() {
            return Some((t.kind(), t.after()));
        }
        next = e.source();
    }
    None
}

#[tokio::test(start_paused = true)]
async fn no_first_output_within_the_timeout_falls_over_at_exactly_15_s() {
    let slow = late_first_token();
    let good = sse::anthropic_message(&["A ", "Saab."]);
    let server = MockServer::start(Script::new().when({
        let (slow, good) = (slow.clone(), good.clone());
        move |req| {
            Some(match model_of(req).as_str() {
                PRIMARY => Reply::sse(slow.clone()),
                _ => Reply::sse(good.clone()),
            })
        }
    }))
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy().first_output_timeout(Some(secs(15)))))
        .layer(
            ModelFallbackLayer::new([PRIMARY, FALLBACK])
                .unwrap()
                .after_timeouts(1)
                .unwrap(),
        )
        .service(http_client());
    let start = Instant::now();
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), REQUEST))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        seen(&server, start),
        [
            (PRIMARY.to_owned(), secs(0)),
            (FALLBACK.to_owned(), secs(15))
        ]
    );
    let requests = server.requests();
    assert_eq!(sha256(&requests[0].body), sha256(REQUEST.as_bytes()));
    assert_only_value_changed(
        REQUEST.as_bytes(),
        &requests[1].body,
        "model",
        "\"claude-sonnet-4-5\"",
    );
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.attempts().len(), 1);
    assert_eq!(trail.attempts()[0].class, FailureClass::Timeout);
    assert_eq!(trail.attempts()[0].elapsed, secs(15));
    assert!(
        trail.attempts()[0]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("no output in the event stream within 15s")),
        "{:?}",
        trail.attempts()[0].error
    );
    assert_eq!(res.extensions().get::<ModelUsed>().unwrap().model, FALLBACK);
    // The fallback's answer reaches the caller whole, the instant it was sent.
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&good));
    assert_eq!(start.elapsed(), secs(15));
}

#[tokio::test(start_paused = true)]
async fn the_policy_retries_a_first_output_timeout_on_the_same_model() {
    let slow = late_first_token();
    let good = sse::anthropic_message(&["A ", "Saab."]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(slow))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let res = send(&server, policy().first_output_timeout(Some(secs(15))))
        .await
        .unwrap();
    assert_eq!(
        seen(&server, start).iter().map(|s| s.1).collect::<Vec<_>>(),
        [secs(0), secs(15)]
    );
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn without_the_setting_the_late_first_token_is_waited_for() {
    let slow = late_first_token();
    let server = MockServer::start(Script::always(Reply::sse(slow.clone())))
        .await
        .unwrap();
    let start = Instant::now();
    let res = send(&server, policy()).await.unwrap();
    // The head came at once; the loop held it back until the first output, at 20 s.
    assert_eq!(start.elapsed(), secs(20));
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&slow));
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_showed_output_is_ruled_by_the_idle_timeout_alone() {
    // Output at once, then 20 s of silence before the next delta.
    let mut events = sse::anthropic_message(&["Quick ", "then slow."]);
    events[3] = events[3].clone().after(secs(20));
    let server = MockServer::start(Script::always(Reply::sse(events.clone())))
        .await
        .unwrap();
    let start = Instant::now();
    let res = send(
        &server,
        policy()
            .first_output_timeout(Some(secs(15)))
            .idle_timeout(Some(secs(30))),
    )
    .await
    .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(bytes, concat(&events));
    assert_eq!(start.elapsed(), secs(20));
    assert_eq!(server.request_count(), 1);

    // An idle timeout shorter than the gap cuts the stream after output as it always did:
    // an idle timeout, nothing re-sent.
    let server = MockServer::start(Script::always(Reply::sse(events.clone())))
        .await
        .unwrap();
    let start = Instant::now();
    let res = send(
        &server,
        policy()
            .first_output_timeout(Some(secs(15)))
            .idle_timeout(Some(secs(18))),
    )
    .await
    .unwrap();
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&events[..3]));
    let err = err.expect("the stall after output");
    assert_eq!(err.kind(), ErrorKind::IdleTimeout);
    assert_eq!(timed_out(&err), Some((TimeoutKind::Idle, secs(18))));
    assert_eq!(start.elapsed(), secs(18));
    tokio::time::sleep(secs(600)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_deadline_bounds_the_wait_for_first_output() {
    let server = MockServer::start(Script::always(Reply::sse(late_first_token())))
        .await
        .unwrap();
    let start = Instant::now();
    let err = send(
        &server,
        policy()
            .first_output_timeout(Some(secs(15)))
            .deadline(Some(secs(10))),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(start.elapsed(), secs(10));
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn with_no_retry_left_the_caller_reads_the_preamble_then_the_timeout() {
    let slow = late_first_token();
    let server = MockServer::start(Script::always(Reply::sse(slow.clone())))
        .await
        .unwrap();
    let start = Instant::now();
    let res = send(
        &server,
        policy().max_retries(1).first_output_timeout(Some(secs(15))),
    )
    .await
    .unwrap();
    assert_eq!(start.elapsed(), secs(30));
    assert_eq!(server.request_count(), 2);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    assert_eq!(
        trail.attempts().iter().map(|a| a.class).collect::<Vec<_>>(),
        [FailureClass::Timeout; 2]
    );
    let (bytes, err) = drain(res.into_body()).await;
    // message_start and the three pings came before the timeout; nothing after it.
    assert_eq!(bytes, concat(&slow[..4]));
    let err = err.expect("the timeout");
    assert_eq!(err.kind(), ErrorKind::IdleTimeout);
    assert_eq!(timed_out(&err), Some((TimeoutKind::FirstOutput, secs(15))));
}
