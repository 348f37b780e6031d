//! The classification table of DESIGN section 2, row by row, against a real HTTP server.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter};
use tower_llm_retry::{ErrorKind, RetryLayer, RetryPolicy, RetryTrail};

fn layer(recorder: &Recorder) -> RetryLayer {
    RetryLayer::new()
        .policy(RetryPolicy::default().jitter(Jitter::none()))
        .observer(recorder.clone())
}

/// Sends one request through the retry layer to a server that plays `script`.
async fn run(
    script: Script,
) -> (
    MockServer,
    Recorder,
    http::Response<bytes::Bytes>,
    Option<RetryTrail>,
) {
    let server = MockServer::start(script).await.unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(layer(&recorder))
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .expect("a response");
    let trail = res.extensions().get::<RetryTrail>().cloned();
    let (parts, body) = res.into_parts();
    let bytes = http_body_util::BodyExt::collect(body)
        .await
        .unwrap()
        .to_bytes();
    (
        server,
        recorder,
        http::Response::from_parts(parts, bytes),
        trail,
    )
}

#[tokio::test(start_paused = true)]
async fn retryable_statuses_are_retried_with_their_class() {
    let cases = [
        (408, FailureClass::Timeout),
        (409, FailureClass::Conflict),
        (429, FailureClass::RateLimited),
        (500, FailureClass::Server),
        (502, FailureClass::Server),
        (503, FailureClass::Server),
        (504, FailureClass::Server),
        (529, FailureClass::Overloaded),
    ];
    for (status, class) in cases {
        let (server, recorder, res, trail) = run(Script::new()
            .then(Reply::status(status))
            .then(Reply::success()))
        .await;
        assert_eq!(res.status(), StatusCode::OK, "status {status}");
        assert_eq!(server.request_count(), 2, "status {status}");
        let trail = trail.expect("trail on a recovered response");
        assert_eq!(trail.total_attempts(), 2);
        assert_eq!(trail.gave_up(), None);
        assert_eq!(trail.attempts().len(), 1);
        assert_eq!(trail.attempts()[0].class, class, "status {status}");
        assert_eq!(trail.attempts()[0].status.map(|s| s.as_u16()), Some(status));
        assert_eq!(recorder.seen().last(), Some(&Seen::Recovered(2)));
    }
}

#[tokio::test(start_paused = true)]
async fn non_retryable_statuses_are_returned_as_is() {
    for (status, class) in [
        (400, FailureClass::Client),
        (401, FailureClass::Unauthorized),
        (403, FailureClass::Client),
        (404, FailureClass::Client),
        (422, FailureClass::Client),
    ] {
        let (server, recorder, res, trail) = run(Script::always(Reply::anthropic_error(
            status,
            "some_error",
            "no",
        )))
        .await;
        assert_eq!(res.status().as_u16(), status);
        assert_eq!(server.request_count(), 1, "status {status}");
        let trail = trail.expect("failed attempts are recorded");
        assert_eq!(trail.attempts()[0].class, class);
        assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
        // A plain "no" is not a give-up worth reporting.
        assert!(recorder.seen().is_empty(), "status {status}");
    }
}

#[tokio::test(start_paused = true)]
async fn should_retry_false_stops_a_503() {
    let (server, _, res, trail) = run(Script::new()
        .then(Reply::status(503).header("x-should-retry", "false"))
        .then(Reply::success()))
    .await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 1);
    assert_eq!(trail.unwrap().gave_up(), Some(GiveUpReason::NotRetryable));
}

#[tokio::test(start_paused = true)]
async fn should_retry_true_retries_a_400() {
    let (server, _, res, trail) = run(Script::new()
        .then(
            Reply::anthropic_error(400, "invalid_request_error", "flaky")
                .header("x-should-retry", "true"),
        )
        .then(Reply::success()))
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    assert_eq!(trail.unwrap().attempts()[0].class, FailureClass::Client);
}

/// A number of seconds too large for a `Duration` is still a wait above the ceiling, not no
/// wait at all: the response is returned, as for any other.
#[tokio::test(start_paused = true)]
async fn a_retry_after_too_large_to_hold_is_above_the_ceiling() {
    for value in ["99999999999999999999", "99999999999999999999999999999999"] {
        let (server, _recorder, res, trail) = run(Script::new()
            .then(Reply::rate_limited(value))
            .then(Reply::success()))
        .await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS, "{value}");
        assert_eq!(server.request_count(), 1, "{value}");
        let trail = trail.unwrap();
        assert_eq!(trail.gave_up(), Some(GiveUpReason::RetryAfterTooLong));
        assert_eq!(trail.attempts()[0].retry_after, Some(Duration::MAX));
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_above_the_ceiling_returns_the_response() {
    let (server, recorder, res, trail) = run(Script::new()
        .then(Reply::rate_limited("61"))
        .then(Reply::success()))
    .await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(server.request_count(), 1);
    let trail = trail.unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::RetryAfterTooLong));
    assert_eq!(
        trail.attempts()[0].retry_after,
        Some(Duration::from_secs(61))
    );
    assert!(matches!(recorder.seen()[..], [Seen::GaveUp(_)]));
}

#[tokio::test(start_paused = true)]
async fn exhausted_quota_is_not_retried() {
    for (reply, path) in [
        (
            Reply::openai_error(429, "insufficient_quota", "You exceeded your current quota"),
            "/v1/chat/completions",
        ),
        (
            Reply::openai_error(429, "enforced_spend_limit_reached", "Spend limit reached"),
            "/v1/messages",
        ),
    ] {
        let server = MockServer::start(Script::new().then(reply).then(Reply::success()))
            .await
            .unwrap();
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new())
            .service(http_client());
        let res = svc
            .oneshot(anthropic_request(&server.url(path), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
        assert_eq!(trail.attempts()[0].class, FailureClass::QuotaExhausted);
        assert_eq!(server.request_count(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn overloaded_error_body_is_class_overloaded() {
    let (server, recorder, res, _) = run(Script::new()
        .then(Reply::anthropic_error(
            500,
            "overloaded_error",
            "Overloaded",
        ))
        .then(Reply::overloaded())
        .then(Reply::success()))
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 3);
    let classes: Vec<_> = recorder
        .seen()
        .into_iter()
        .filter_map(|s| match s {
            Seen::Retry { class, .. } => Some(class),
            _ => None,
        })
        .collect();
    assert_eq!(
        classes,
        [FailureClass::Overloaded, FailureClass::Overloaded]
    );
}

#[tokio::test(start_paused = true)]
async fn context_overflow_400_is_returned_once() {
    let msg = "input length and `max_tokens` exceed context limit: 197000 + 21333 > 200000, decrease input length or `max_tokens` and try again";
    let (server, _, res, trail) = run(Script::always(Reply::anthropic_error(
        400,
        "invalid_request_error",
        msg,
    )))
    .await;
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(server.request_count(), 1);
    assert_eq!(
        trail.unwrap().attempts()[0].class,
        FailureClass::ContextOverflow
    );
    // The caller still gets the whole error body.
    assert!(std::str::from_utf8(res.body()).unwrap().contains(msg));
}

#[tokio::test(start_paused = true)]
async fn transport_errors_before_a_head_are_retried() {
    let (server, recorder, res, trail) =
        run(Script::new().then(Reply::reset()).then(Reply::success())).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    let trail = trail.unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::Transport);
    assert!(trail.attempts()[0].error.is_some());
    assert!(matches!(
        recorder.seen()[0],
        Seen::Retry {
            class: FailureClass::Transport,
            status: None,
            ..
        }
    ));
}

#[tokio::test(start_paused = true)]
async fn transport_errors_exhaust_into_a_typed_error() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().max_retries(2)))
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    let trail = err.trail().unwrap();
    assert_eq!(trail.total_attempts(), 3);
    assert_eq!(trail.attempts().len(), 3);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    assert!(std::error::Error::source(&err).is_some());
    assert_eq!(server.request_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn error_body_beyond_the_peek_limit_reaches_the_caller_intact() {
    // 200 KiB of JSON: the classifier sees 64 KiB, the caller all of it.
    let filler = "x".repeat(200 * 1024);
    let body =
        format!(r#"{{"type":"error","error":{{"type":"not_found_error","message":"{filler}"}}}}"#);
    let (server, _, res, _) = run(Script::always(
        Reply::status(404)
            .header("content-type", "application/json")
            .body(body.clone()),
    ))
    .await;
    assert_eq!(res.status(), StatusCode::NOT_FOUND);
    assert_eq!(server.request_count(), 1);
    assert_eq!(sha256(res.body()), sha256(body.as_bytes()));
}

#[tokio::test(start_paused = true)]
async fn retries_stop_at_max_and_return_the_last_response() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().max_retries(3).jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 4);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 4);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    let seen = recorder.seen();
    assert_eq!(seen.len(), 4);
    assert!(matches!(&seen[3], Seen::GaveUp(t) if t == trail));
}
