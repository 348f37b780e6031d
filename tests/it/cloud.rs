//! The cloud dialects on the wire: Amazon Bedrock's AWS error codes and `x-amz-retry-after`,
//! Google's error envelope (`RESOURCE_EXHAUSTED`, `RetryInfo.retryDelay`, `UNAVAILABLE`, a
//! prompt too long on `413`), through `RetryLayer` under paused time: exact sleeps, attempt
//! counts, byte-identical bodies.

use std::time::Duration;

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter};
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

/// What one request through the default policy (no jitter) did.
struct Run {
    server: MockServer,
    recorder: Recorder,
    status: StatusCode,
    trail: Option<RetryTrail>,
    elapsed: Duration,
}

async fn run(script: Script) -> Run {
    let server = MockServer::start(script).await.unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client());
    let start = Instant::now();
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let status = res.status();
    let trail = res.extensions().get::<RetryTrail>().cloned();
    let _ = body_bytes(res).await;
    Run {
        server,
        recorder,
        status,
        trail,
        elapsed: start.elapsed(),
    }
}

/// Every request the server received carried the caller's body, byte for byte.
fn assert_identical_bodies(server: &MockServer) {
    let want = sha256(BODY.as_bytes());
    for r in server.requests() {
        assert_eq!(sha256(&r.body), want);
    }
}

/// The classes and sleeps of the retries the observer saw.
fn retries(recorder: &Recorder) -> Vec<(FailureClass, Option<Duration>, Duration)> {
    recorder
        .seen()
        .into_iter()
        .filter_map(|s| match s {
            Seen::Retry {
                class,
                retry_after,
                delay,
                ..
            } => Some((class, retry_after, delay)),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn vertex_retry_delay_is_slept_exactly() {
    let r = run(Script::new()
        .then(Reply::google_resource_exhausted("30s"))
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.server.request_count(), 2);
    let thirty = Duration::from_secs(30);
    assert_eq!(
        retries(&r.recorder),
        [(FailureClass::RateLimited, Some(thirty), thirty)]
    );
    assert_eq!(r.elapsed, thirty);
    assert_identical_bodies(&r.server);
    assert_eq!(r.trail.unwrap().total_attempts(), 2);
}

#[tokio::test(start_paused = true)]
async fn google_fractional_delay_in_an_array_envelope() {
    let reply = Reply::google_error(
        429,
        "RESOURCE_EXHAUSTED",
        "Resource has been exhausted (e.g. check quota).",
        None,
        Some("1.5s"),
        true,
    );
    let r = run(Script::new().then(reply).then(Reply::success())).await;
    assert_eq!(r.status, StatusCode::OK);
    let wait = Duration::from_millis(1500);
    assert_eq!(
        retries(&r.recorder),
        [(FailureClass::RateLimited, Some(wait), wait)]
    );
    assert_eq!(r.elapsed, wait);
}

#[tokio::test(start_paused = true)]
async fn bedrock_throttle_waits_its_milliseconds() {
    let r = run(Script::new()
        .then(Reply::bedrock_throttled(1500))
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.server.request_count(), 2);
    let wait = Duration::from_millis(1500);
    assert_eq!(
        retries(&r.recorder),
        [(FailureClass::RateLimited, Some(wait), wait)]
    );
    assert_eq!(r.elapsed, wait);
    assert_identical_bodies(&r.server);
}

/// A throttle is a throttle whatever its status: "Too many tokens" on a `400` is neither a
/// client error nor a context overflow.
#[tokio::test(start_paused = true)]
async fn bedrock_too_many_tokens_on_400_is_a_throttle() {
    let reply = Reply::bedrock_error(
        400,
        "ThrottlingException",
        "Too many tokens, please wait before trying again.",
    )
    .header("x-amz-retry-after", "250");
    let r = run(Script::new().then(reply).then(Reply::success())).await;
    assert_eq!(r.status, StatusCode::OK);
    let wait = Duration::from_millis(250);
    assert_eq!(
        retries(&r.recorder),
        [(FailureClass::RateLimited, Some(wait), wait)]
    );
    assert_eq!(r.elapsed, wait);
}

#[tokio::test(start_paused = true)]
async fn bedrock_unavailable_and_not_ready_are_overloads_retried() {
    let r = run(Script::new()
        .then(Reply::bedrock_error(
            503,
            "ServiceUnavailableException",
            "Bedrock is unable to process your request.",
        ))
        .then(Reply::bedrock_error(
            429,
            "ModelNotReadyException",
            "Model is not ready for inference. Wait and try your request again.",
        ))
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.server.request_count(), 3);
    let classes: Vec<_> = retries(&r.recorder).into_iter().map(|r| r.0).collect();
    assert_eq!(
        classes,
        [FailureClass::Overloaded, FailureClass::Overloaded]
    );
    // The backoff without jitter: 0.5 s, then 1 s.
    assert_eq!(r.elapsed, Duration::from_millis(1500));
}

#[tokio::test(start_paused = true)]
async fn bedrock_validation_and_access_denied_are_not_retried() {
    for (status, code, class) in [
        (400, "ValidationException", FailureClass::Client),
        (403, "AccessDeniedException", FailureClass::Client),
    ] {
        let r = run(Script::new()
            .then(Reply::bedrock_error(status, code, "No."))
            .then(Reply::success()))
        .await;
        assert_eq!(r.status.as_u16(), status, "{code}");
        assert_eq!(r.server.request_count(), 1, "{code}");
        assert_eq!(r.elapsed, Duration::ZERO, "{code}");
        let trail = r.trail.unwrap();
        assert_eq!(trail.attempts()[0].class, class, "{code}");
        assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable), "{code}");
    }
}

#[tokio::test(start_paused = true)]
async fn google_daily_quota_is_not_retried() {
    let r = run(Script::new()
        .then(Reply::google_daily_quota_exhausted())
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.server.request_count(), 1);
    assert_eq!(r.elapsed, Duration::ZERO);
    let trail = r.trail.unwrap();
    assert_eq!(trail.attempts()[0].class, FailureClass::QuotaExhausted);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::NotRetryable));
}

/// A `retryDelay` above the policy's `Retry-After` ceiling (60 s by default) gives up, as a
/// `Retry-After` would.
#[tokio::test(start_paused = true)]
async fn google_retry_delay_above_the_ceiling_gives_up() {
    let r = run(Script::new()
        .then(Reply::google_resource_exhausted("3600s"))
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.server.request_count(), 1);
    assert_eq!(r.elapsed, Duration::ZERO);
    let trail = r.trail.unwrap();
    assert_eq!(
        trail.attempts()[0].retry_after,
        Some(Duration::from_secs(3600))
    );
    assert_eq!(trail.gave_up(), Some(GiveUpReason::RetryAfterTooLong));
}

#[tokio::test(start_paused = true)]
async fn google_unavailable_overload_is_retried() {
    let r = run(Script::new()
        .then(Reply::google_error(
            503,
            "UNAVAILABLE",
            "The model is overloaded. Please try again later.",
            None,
            None,
            false,
        ))
        .then(Reply::success()))
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(r.server.request_count(), 2);
    let classes: Vec<_> = retries(&r.recorder).into_iter().map(|r| r.0).collect();
    assert_eq!(classes, [FailureClass::Overloaded]);
    assert_eq!(r.elapsed, Duration::from_millis(500));
}

/// A `413` whose body says the prompt is too long is a context overflow, for the overflow
/// repair; one that says something else stays a client error. Neither is retried.
#[tokio::test(start_paused = true)]
async fn google_413_prompt_too_long_is_a_context_overflow() {
    for (message, class) in [
        (
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
            FailureClass::ContextOverflow,
        ),
        ("Request payload size exceeds the limit.", FailureClass::Client),
    ] {
        let r = run(Script::new()
            .then(Reply::google_error(
                413,
                "INVALID_ARGUMENT",
                message,
                None,
                None,
                false,
            ))
            .then(Reply::success()))
        .await;
        assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.server.request_count(), 1);
        assert_eq!(r.trail.unwrap().attempts()[0].class, class, "{message}");
    }
}
