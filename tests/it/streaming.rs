//! Streaming safety over real sockets: the SSE first-event gate, head and idle timeouts, the
//! commit point, truncated envelopes and the output-limit marker.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use http_body::Body as _;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script, SseFrame};
use tower_llm_retry::retry::{GiveUpReason, Jitter};
use tower_llm_retry::stream::{CommitReason, OutputTruncated, StreamCommitted};
use tower_llm_retry::{ErrorKind, RetryBody, RetryLayer, RetryPolicy, RetryTrail};

fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .jitter(Jitter::none())
        .head_timeout(Some(Duration::from_secs(30)))
        .idle_timeout(Some(Duration::from_secs(20)))
}

fn layer(recorder: &Recorder) -> RetryLayer {
    RetryLayer::new()
        .policy(policy())
        .observer(recorder.clone())
}

async fn send(
    layer: RetryLayer,
    server: &MockServer,
    path: &str,
) -> http::Response<RetryBody<hyper::body::Incoming>> {
    let svc = ServiceBuilder::new().layer(layer).service(http_client());
    svc.oneshot(anthropic_request(&server.url(path), BODY))
        .await
        .expect("a response")
}

#[tokio::test(start_paused = true)]
async fn overloaded_before_the_head_then_a_clean_stream() {
    let good = sse::anthropic_message(&["Hel", "lo"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    let commit = *res.extensions().get::<StreamCommitted>().unwrap();
    assert_eq!(commit.reason, CommitReason::FirstOutput);
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    assert_eq!(bytes, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn in_band_overload_before_output_is_retried_transparently() {
    let recorder = Recorder::default();
    let bad = vec![
        sse::anthropic_message(&[])[0].clone(), // message_start
        SseFrame::new("ping", r#"{"type": "ping"}"#),
        sse::anthropic_error("overloaded_error"),
    ];
    let good = sse::anthropic_message(&["The ", "answer ", "is 42."]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse_then_stall(bad))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = send(layer(&recorder), &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.attempts()[0].class, FailureClass::Overloaded);
    assert_eq!(trail.attempts()[0].status, Some(StatusCode::OK));
    assert!(matches!(
        recorder.seen()[0],
        Seen::Retry {
            class: FailureClass::Overloaded,
            ..
        }
    ));
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    assert_eq!(
        bytes,
        concat(&good),
        "the caller sees exactly the successful attempt's stream"
    );
    // The server saw identical bodies both times.
    let reqs = server.requests();
    assert_eq!(sha256(&reqs[0].body), sha256(&reqs[1].body));
}

#[tokio::test(start_paused = true)]
async fn in_band_overloads_count_as_consecutive_overloads() {
    let bad = || {
        vec![
            sse::anthropic_message(&[])[0].clone(),
            sse::anthropic_error("overloaded_error"),
        ]
    };
    let server = MockServer::start(Script::always(Reply::sse(bad())))
        .await
        .unwrap();
    let l = RetryLayer::new().policy(policy().max_consecutive_overloads(Some(3)));
    let res = send(l, &server, "/v1/messages").await;
    assert_eq!(server.request_count(), 3);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxConsecutiveOverloads));
    let commit = *res.extensions().get::<StreamCommitted>().unwrap();
    assert_eq!(commit.reason, CommitReason::Error);
    // Given up: the caller gets the last stream, error event included, byte for byte.
    let (bytes, _) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&bad()));
}

#[tokio::test(start_paused = true)]
async fn error_after_output_is_never_replayed() {
    let mut events = sse::anthropic_message(&["one", "two"]);
    events.truncate(4); // message_start, content_block_start, two deltas
    events.push(sse::anthropic_error("overloaded_error"));
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(events.clone()))
            .then(Reply::sse(sse::anthropic_message(&["never"]))),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<RetryTrail>().is_none());
    assert_eq!(
        res.extensions().get::<StreamCommitted>().unwrap().reason,
        CommitReason::FirstOutput
    );
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    // Every content event exactly once, then the error event, as sent.
    assert_eq!(bytes, concat(&events));
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn stall_before_the_head_is_retried_after_the_head_timeout() {
    let good = sse::anthropic_message(&["ok"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::stall())
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    // 30 s head timeout, then the 0.5 s backoff.
    assert_eq!(reqs[1].received_at - start, Duration::from_millis(30_500));
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::Transport);
    assert!(trail.attempts()[0]
        .error
        .as_deref()
        .unwrap()
        .contains("no response head within 30s"));
    assert_eq!(drain(res.into_body()).await.0, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn stall_during_the_peek_is_retried_after_the_idle_timeout() {
    let good = sse::anthropic_message(&["ok"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse_then_stall(vec![
                sse::anthropic_message(&[])[0].clone()
            ]))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1].received_at - start, Duration::from_millis(20_500));
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::Transport);
    assert!(trail.attempts()[0]
        .error
        .as_deref()
        .unwrap()
        .contains("idle"));
    assert_eq!(drain(res.into_body()).await.0, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn reset_during_the_peek_is_retried() {
    let good = sse::anthropic_message(&["ok"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse_then_reset(vec![
                sse::anthropic_message(&[])[0].clone()
            ]))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    assert_eq!(server.request_count(), 2);
    assert_eq!(drain(res.into_body()).await.0, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn stall_after_output_is_an_idle_timeout_from_the_body() {
    let mut events = sse::anthropic_message(&["partial"]);
    events.truncate(3); // message_start, content_block_start, one delta
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse_then_stall(events.clone()))
            .then(Reply::sse(sse::anthropic_message(&["never"]))),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    let start = Instant::now();
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&events));
    let err = err.expect("the body fails");
    assert_eq!(err.kind(), ErrorKind::IdleTimeout);
    assert_eq!(start.elapsed(), Duration::from_secs(20));
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn reset_after_output_is_a_typed_body_error() {
    let mut events = sse::anthropic_message(&["partial"]);
    events.truncate(3);
    let server = MockServer::start(Script::new().then(Reply::sse_then_reset(events.clone())))
        .await
        .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&events));
    assert_eq!(err.expect("the body fails").kind(), ErrorKind::ResponseBody);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn openai_stream_error_before_output_is_retried() {
    let good = sse::openai_chat(&["Hi", " there"]);
    let role_chunk = good[0].clone();
    let bad = vec![
        role_chunk,
        SseFrame::data(
            r#"{"error":{"message":"The server is overloaded","type":"server_error","param":null,"code":null}}"#,
        ),
    ];
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(bad))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/chat/completions").await;
    assert_eq!(server.request_count(), 2);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.attempts()[0].class, FailureClass::Server);
    assert_eq!(drain(res.into_body()).await.0, concat(&good));
}

#[tokio::test(start_paused = true)]
async fn openai_stream_stalls() {
    // During the peek (only the role chunk came): retried.
    let good = sse::openai_chat(&["Hi"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse_then_stall(vec![good[0].clone()]))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/chat/completions").await;
    assert_eq!(server.request_count(), 2);
    assert_eq!(drain(res.into_body()).await.0, concat(&good));

    // After a content chunk: the body times out, nothing is re-sent.
    let partial = sse::openai_chat(&["Hi"])[..2].to_vec();
    let server = MockServer::start(Script::new().then(Reply::sse_then_stall(partial.clone())))
        .await
        .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/chat/completions").await;
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(bytes, concat(&partial));
    assert_eq!(err.unwrap().kind(), ErrorKind::IdleTimeout);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn long_preamble_ends_the_peek_without_losing_bytes() {
    // 80 KiB of pings and comments before the first output.
    let mut events = vec![sse::anthropic_message(&[])[0].clone()];
    for i in 0..2000 {
        events.push(SseFrame::raw(format!(
            ": keep-alive comment number {i:05}\n\n"
        )));
    }
    events.extend(sse::anthropic_message(&["late"])[1..].iter().cloned());
    let total = concat(&events);
    assert!(total.len() > 64 * 1024);
    let server = MockServer::start(Script::new().then(Reply::sse(events)))
        .await
        .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    let commit = *res.extensions().get::<StreamCommitted>().unwrap();
    assert_eq!(commit.reason, CommitReason::PeekLimit);
    assert!(commit.peeked_bytes >= 64 * 1024);
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    assert_eq!(sha256(&bytes), sha256(&total));
}

#[tokio::test(start_paused = true)]
async fn gate_off_hands_in_band_errors_straight_up() {
    let bad = vec![sse::anthropic_error("overloaded_error")];
    let server = MockServer::start(Script::new().then(Reply::sse(bad.clone())))
        .await
        .unwrap();
    let res = send(
        layer(&Recorder::default()).sse_gate(false),
        &server,
        "/v1/messages",
    )
    .await;
    assert!(res.extensions().get::<StreamCommitted>().is_none());
    assert_eq!(drain(res.into_body()).await.0, concat(&bad));
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn truncated_envelope_is_retried_when_buffering() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::reset_mid_body(200, r#"{"id":"msg_1","type":"mess"#))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let l = layer(&Recorder::default()).buffer_responses(Some(1 << 20));
    let res = send(l, &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.attempts()[0].class, FailureClass::TruncatedEnvelope);
    assert!(
        res.body().size_hint().exact().is_some(),
        "the caller gets a whole body"
    );
    let (bytes, err) = drain(res.into_body()).await;
    assert!(err.is_none());
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["type"], "message");
}

#[tokio::test(start_paused = true)]
async fn truncated_envelope_surfaces_when_not_buffering() {
    let partial = r#"{"id":"msg_1","type":"mess"#;
    let server = MockServer::start(
        Script::new()
            .then(Reply::reset_mid_body(200, partial))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let res = send(layer(&Recorder::default()), &server, "/v1/messages").await;
    let (bytes, err) = drain(res.into_body()).await;
    assert_eq!(&bytes[..], partial.as_bytes());
    assert_eq!(err.unwrap().kind(), ErrorKind::ResponseBody);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn stall_mid_envelope_is_retried_when_buffering() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::stall_mid_body(200, r#"{"id":"msg_1""#))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let start = Instant::now();
    let l = layer(&Recorder::default()).buffer_responses(Some(1 << 20));
    let res = send(l, &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::OK);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1].received_at - start, Duration::from_millis(20_500));
}

#[tokio::test(start_paused = true)]
async fn output_limit_marker_on_buffered_json() {
    let body = r#"{"id":"msg_1","type":"message","role":"assistant","content":[{"type":"text","text":"cut"}],"stop_reason":"max_tokens","usage":{"input_tokens":5,"output_tokens":16}}"#;
    let server = MockServer::start(
        Script::new().then(
            Reply::status(200)
                .header("content-type", "application/json")
                .body(body),
        ),
    )
    .await
    .unwrap();
    let l = layer(&Recorder::default()).buffer_responses(Some(1 << 20));
    let res = send(l, &server, "/v1/messages").await;
    assert!(res.extensions().get::<OutputTruncated>().is_some());
    assert_eq!(drain(res.into_body()).await.0, body.as_bytes());
    tokio::time::sleep(Duration::from_secs(300)).await;
    assert_eq!(server.request_count(), 1);

    let server = MockServer::start(Script::new()).await.unwrap();
    let l = layer(&Recorder::default()).buffer_responses(Some(1 << 20));
    let res = send(l, &server, "/v1/messages").await;
    assert!(res.extensions().get::<OutputTruncated>().is_none());
}

#[tokio::test(start_paused = true)]
async fn deadline_cuts_retries_short() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let l = RetryLayer::new().policy(policy().deadline(Some(Duration::from_secs(5))));
    let start = Instant::now();
    let res = send(l, &server, "/v1/messages").await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    // Sleeps 0.5, 1, 2 end at 3.5 s; the next (4 s) would end past 5 s.
    assert_eq!(server.request_count(), 4);
    assert_eq!(start.elapsed(), Duration::from_millis(3500));
    assert_eq!(
        res.extensions().get::<RetryTrail>().unwrap().gave_up(),
        Some(GiveUpReason::Deadline)
    );
}

#[tokio::test(start_paused = true)]
async fn a_head_timeout_cut_short_by_the_deadline_reports_the_time_it_waited() {
    // No head timeout of its own; the 5 s deadline is what ends the wait for a server that
    // never answers, and the error says 5 s, not the absent head timeout.
    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let l = RetryLayer::new().policy(
        policy()
            .head_timeout(None)
            .deadline(Some(Duration::from_secs(5))),
    );
    let svc = ServiceBuilder::new().layer(l).service(http_client());
    let start = Instant::now();
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::from_secs(5));
    let mut source = std::error::Error::source(&err);
    let mut timed_out = None;
    while let Some(e) = source {
        if let Some(t) = e.downcast_ref::<tower_llm_retry::retry::TimedOut>() {
            timed_out = Some((t.kind(), t.after()));
        }
        source = e.source();
    }
    assert_eq!(
        timed_out,
        Some((
            tower_llm_retry::retry::TimeoutKind::Head,
            Duration::from_secs(5)
        )),
        "{err}"
    );
}
