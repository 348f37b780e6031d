//! Pacing by tokens, against the mock's input-token bucket (Anthropic's ITPM: a limit per
//! minute, refilled continuously, stated on every answer) under paused time.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fleet::{Fleet, TokenKind, TokenPacingConfig, TokenWake};
use tower_llm_retry::mock::{Capacity, MockServer, Reply, Script};
use tower_llm_retry::retry::Jitter;
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

use crate::common::*;

/// A request whose message has `chars` characters: the mock counts `chars / 4` input
/// tokens; `padding` bytes of a field it does not count make the client's estimate larger.
fn body(chars: usize, padding: usize) -> String {
    format!(
        r#"{{"model":"claude-test","max_tokens":16,"metadata":{{"user_id":"{}"}},"messages":[{{"role":"user","content":"{}"}}]}}"#,
        "p".repeat(padding),
        "a".repeat(chars),
    )
}

fn request(server: &MockServer, body: &str) -> Request<Full<Bytes>> {
    Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap()
}

/// The client's built-in estimate of `body`: a quarter of its bytes.
fn estimate(body: &str) -> f64 {
    (body.len() / 4) as f64
}

fn policy() -> RetryPolicy {
    RetryPolicy::default().jitter(Jitter::none())
}

/// Only the token pacing: the request pacing and the gate off, so waits are the tokens'.
fn fleet(tokens: TokenPacingConfig) -> Fleet {
    Fleet::builder()
        .pacing(None)
        .cooldown_gate(None)
        .token_pacing(Some(tokens))
        .build()
}

/// The one scope the tests' requests go to.
fn scope(fleet: &Fleet) -> Fleet {
    let scopes = fleet.scopes();
    assert_eq!(scopes.len(), 1);
    scopes[0].clone()
}

fn input_level(fleet: &Fleet) -> Option<f64> {
    Some(fleet.token_pacing()?.bucket(TokenKind::Input)?.level)
}

/// The requests after the first `skip`: when each came after `origin`, and its size.
fn arrivals(server: &MockServer, skip: usize, origin: Instant) -> Vec<(Duration, usize)> {
    server
        .requests()
        .iter()
        .skip(skip)
        .map(|r| (r.received_at - origin, r.body.len()))
        .collect()
}

/// A 429 for the request limit leaves the token pacing asleep, though the answer states a
/// token limit; a 429 whose message names input tokens wakes it, and the retry then waits
/// for its tokens, which the trail says.
#[tokio::test(start_paused = true)]
async fn a_token_429_wakes_token_pacing_and_a_request_429_does_not() {
    let requests_429 = Reply::anthropic_error(
        429,
        "rate_limit_error",
        "Number of requests has exceeded your rate limit. Please try again later.",
    )
    .header("retry-after", "0")
    .header("anthropic-ratelimit-requests-remaining", "0")
    .header("anthropic-ratelimit-input-tokens-limit", "6000")
    .header("anthropic-ratelimit-input-tokens-remaining", "6000");
    let server = MockServer::start(
        Script::new()
            .when(move |r| (r.body.len() < 100).then(|| requests_429.clone()))
            .capacity(Capacity::input_tokens_per_minute(6000)),
    )
    .await
    .unwrap();
    let fleet = fleet(TokenPacingConfig::new());
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(fleet.clone()))
        .service(http_client());
    // A request 429 (the rule answers the tiny body), retried at once: it wakes nothing.
    let tiny = r#"{"model":"m","messages":[]}"#;
    let res = svc
        .clone()
        .oneshot(request(&server, tiny).map(|b| b))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(scope(&fleet).token_pacing_state(), None);
    assert_eq!(fleet.token_pacing().unwrap().awake, 0);
    // 3,000 tokens taken of 6,000: plenty left, still asleep.
    let first = body(12_000, 0);
    let res = svc.clone().oneshot(request(&server, &first)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    drop(body_bytes(res).await);
    assert_eq!(scope(&fleet).token_pacing_state(), None);
    // 3,500 tokens with 3,000 left: a 429 naming input tokens (retry-after 5 s). It wakes the
    // token pacing at what the server says is left.
    let (skip, origin) = (server.request_count(), Instant::now());
    let second = body(14_000, 0);
    let res = svc
        .clone()
        .oneshot(request(&server, &second))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        scope(&fleet).token_pacing_state(),
        Some(TokenWake::TokenRefusal)
    );
    // The retry slept its 5 s, then waited for the rest of its estimate, a little above the
    // 3,500 the server counts, at 100 tokens a second.
    let want = Duration::from_secs_f64((estimate(&second) - 3_500.0) / 100.0);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    let waited = trail.token_wait().unwrap();
    assert!(
        waited.abs_diff(want) <= Duration::from_millis(1),
        "{waited:?} against {want:?}"
    );
    let at = arrivals(&server, skip, origin);
    assert_eq!(at.len(), 2);
    assert_eq!(at[0].0, Duration::ZERO);
    assert!(at[1].0.abs_diff(Duration::from_secs(5) + want) <= Duration::from_millis(1));
    assert_eq!(fleet.token_pacing().unwrap().waited, 1);
}

/// The estimate (a quarter of the body's bytes, padding included) is charged when the
/// request goes, then corrected by the usage the answer reports once its body is read.
#[tokio::test(start_paused = true)]
async fn the_estimate_is_corrected_by_the_usage_reported() {
    let server =
        MockServer::start(Script::new().capacity(Capacity::input_tokens_per_minute(60_000)))
            .await
            .unwrap();
    let fleet = fleet(TokenPacingConfig::new().dormant(false));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(fleet.clone()))
        .service(http_client());
    // The first answer states the limit: 59,000 left after its 1,000.
    let b = body(4_000, 4_000);
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    drop(body_bytes(res).await);
    assert_eq!(input_level(&fleet), Some(59_000.0));
    // The second is charged its estimate, about 2,000; the server counts 1,000.
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(input_level(&fleet), Some(59_000.0 - estimate(&b)));
    let bytes = body_bytes(res).await;
    assert!(std::str::from_utf8(&bytes)
        .unwrap()
        .contains(r#""input_tokens":1000"#));
    // Read: the over-estimate came back, the bucket is where the server's is.
    assert_eq!(input_level(&fleet), Some(58_000.0));
    // A caller's own counter replaces the estimate.
    let counted = fleet_with_counter();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(counted.clone()))
        .service(http_client());
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    drop(body_bytes(res).await);
    let before = input_level(&counted).unwrap();
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    assert_eq!(input_level(&counted), Some(before - 1_500.0));
    drop(body_bytes(res).await);
    assert_eq!(input_level(&counted), Some(before - 1_000.0));
}

fn fleet_with_counter() -> Fleet {
    fleet(
        TokenPacingConfig::new()
            .dormant(false)
            .input_counter(|_| Some(1_500)),
    )
}

/// A request larger than the whole limit is not held forever: it waits for a full bucket
/// and goes alone, the requests behind it after it; the server's refusal comes back to the
/// caller.
#[tokio::test(start_paused = true)]
async fn a_request_larger_than_the_limit_goes_alone_when_the_bucket_is_full() {
    let server =
        MockServer::start(Script::new().capacity(Capacity::input_tokens_per_minute(6_000)))
            .await
            .unwrap();
    let fleet = fleet(TokenPacingConfig::new().dormant(false));
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(policy().max_retries(0))
                .fleet(fleet.clone()),
        )
        .service(http_client());
    // 1,000 tokens: 5,000 left, stated; awake.
    let small = body(4_000, 0);
    let res = svc.clone().oneshot(request(&server, &small)).await.unwrap();
    drop(body_bytes(res).await);
    assert_eq!(input_level(&fleet), Some(5_000.0));
    let (skip, origin) = (server.request_count(), Instant::now());
    let huge = body(40_000, 0);
    let big = tokio::spawn(svc.clone().oneshot(request(&server, &huge)));
    tokio::task::yield_now().await;
    let after = tokio::spawn(svc.clone().oneshot(request(&server, &small)));
    let res = big.await.unwrap().unwrap();
    // It can never fit: the server refuses it, and the caller hears so at once.
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let res = after.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let at = arrivals(&server, skip, origin);
    // The full bucket came after 10 s (1,000 tokens at 100 a second); the small one behind
    // it went next, not before.
    assert_eq!(at.len(), 2);
    assert_eq!(at[0], (Duration::from_secs(10), huge.len()));
    assert_eq!(at[1].1, small.len());
    assert!(at[1].0 >= at[0].0);
}

/// Head of line: a large request is not passed over by the small ones that came after it,
/// though the bucket holds enough for each of them long before it holds enough for it.
#[tokio::test(start_paused = true)]
async fn a_large_request_is_not_starved_by_small_ones() {
    let server =
        MockServer::start(Script::new().capacity(Capacity::input_tokens_per_minute(6_000)))
            .await
            .unwrap();
    let fleet = fleet(TokenPacingConfig::new());
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(fleet.clone()))
        .service(http_client());
    // 5,900 of 6,000 taken: at most a tenth left wakes it.
    let res = svc
        .clone()
        .oneshot(request(&server, &body(23_600, 0)))
        .await
        .unwrap();
    drop(body_bytes(res).await);
    assert_eq!(
        scope(&fleet).token_pacing_state(),
        Some(TokenWake::NearlySpent)
    );
    assert_eq!(input_level(&fleet), Some(100.0));
    let (skip, origin) = (server.request_count(), Instant::now());
    let large = body(8_000, 0);
    let small = body(40, 0);
    let mut tasks = tokio::task::JoinSet::new();
    let svc2 = svc.clone();
    let req = request(&server, &large);
    tasks.spawn(async move { svc2.oneshot(req).await.unwrap() });
    tokio::task::yield_now().await;
    for _ in 0..10 {
        let svc = svc.clone();
        let req = request(&server, &small);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert_eq!(fleet.token_pacing().unwrap().waiting, 11);
    let mut trails = Vec::new();
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        trails.push(res.extensions().get::<RetryTrail>().unwrap().clone());
    }
    let at = arrivals(&server, skip, origin);
    assert_eq!(at.len(), 11);
    // The large one first, when its ~2,000 tokens had come (from 100 in hand, at 100 a
    // second); every small one after it.
    let want = Duration::from_secs_f64((estimate(&large) - 100.0) / 100.0);
    assert_eq!(at[0].1, large.len());
    assert!(at[0].0.abs_diff(want) <= Duration::from_millis(1), "{at:?}");
    assert!(at[1..]
        .iter()
        .all(|(t, len)| *len == small.len() && *t >= at[0].0));
    assert!(trails.iter().all(|t| t.token_wait().is_some()));
    assert_eq!(fleet.token_pacing().unwrap().waiting, 0);
}

/// A stream settles its charge from its events: the input from its first (`message_start`),
/// the output reserved from `max_tokens` given back but for what its last
/// (`message_delta`) reports, once the stream was read to its end.
#[tokio::test(start_paused = true)]
async fn a_stream_settles_input_and_output_from_its_first_and_last_events() {
    let stating = |reply: Reply| {
        reply
            .header("anthropic-ratelimit-input-tokens-limit", "60000")
            .header("anthropic-ratelimit-input-tokens-remaining", "59000")
            .header("anthropic-ratelimit-output-tokens-limit", "8000")
            .header("anthropic-ratelimit-output-tokens-remaining", "8000")
    };
    let events = tower_llm_retry::mock::sse::anthropic_message(&["Hel", "lo"]);
    let server = MockServer::start(
        Script::new()
            .then(stating(Reply::success()))
            .otherwise(stating(Reply::sse(events))),
    )
    .await
    .unwrap();
    let fleet = fleet(TokenPacingConfig::new().dormant(false));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy()).fleet(fleet.clone()))
        .service(http_client());
    let b = body(4_000, 0);
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    drop(body_bytes(res).await);
    let output_level = |f: &Fleet| {
        f.token_pacing()
            .and_then(|t| t.bucket(TokenKind::Output))
            .map(|b| b.level)
    };
    assert_eq!(input_level(&fleet), Some(59_000.0));
    assert_eq!(output_level(&fleet), Some(8_000.0));
    // Charged: the estimate of input, 16 (`max_tokens`) of output.
    let res = svc.clone().oneshot(request(&server, &b)).await.unwrap();
    assert_eq!(input_level(&fleet), Some(59_000.0 - estimate(&b)));
    assert_eq!(output_level(&fleet), Some(8_000.0 - 16.0));
    drop(body_bytes(res).await);
    // The stream said 10 in and 2 out.
    assert_eq!(input_level(&fleet), Some(59_000.0 - 10.0));
    assert_eq!(output_level(&fleet), Some(8_000.0 - 2.0));
}
