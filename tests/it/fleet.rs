//! Fleet behaviour over real HTTP on 127.0.0.1, under paused time: the shared retry budget,
//! the cooldown gate (Retry-After and rate-limit headers), its spread, ceiling and
//! cancellation, and the adaptive pacing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use crate::common::*;
use http::StatusCode;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_llm_retry::fleet::{BudgetConfig, Fleet, GateConfig, PacingConfig, PacingWake};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter, Random, RetryEvent, RetryObserver};
use tower_llm_retry::{ErrorKind, RetryLayer, RetryPolicy, RetryTrail};

/// Samples 0, 0.01, 0.02, … 0.99, 0, … so that each waiter's share of the spread is known.
fn stepping_random() -> Random {
    let n = Arc::new(AtomicU64::new(0));
    Random::from_fn(move || (n.fetch_add(1, Ordering::SeqCst) % 100) as f64 / 100.0)
}

fn no_jitter() -> RetryPolicy {
    RetryPolicy::default().jitter(Jitter::none())
}

/// Time from `origin` to each request the server received, sorted.
fn arrivals(server: &MockServer, origin: Instant) -> Vec<Duration> {
    let mut v: Vec<_> = server
        .requests()
        .iter()
        .map(|r| r.received_at - origin)
        .collect();
    v.sort();
    v
}

#[tokio::test(start_paused = true)]
async fn hard_outage_through_many_clones_retries_at_most_the_budget() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let budget = BudgetConfig::new(Duration::from_secs(10), 1, 0.1).unwrap();
    // 3 retries without jitter take 3.5 s: every retry falls in one 10 s window.
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().max_retries(3))
                .fleet(Fleet::builder().budget(Some(budget)).build()),
        )
        .service(http_client());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await });
    }
    let (mut retries, mut denied) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        let res = joined.unwrap().unwrap();
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        retries += trail.retries();
        if trail.gave_up() == Some(GiveUpReason::Budget) {
            denied += 1;
        }
    }
    // 1 retry a second for 10 s, plus one per 10 first attempts.
    assert_eq!(budget.max_retries(100), 20);
    assert_eq!(retries, 20);
    assert_eq!(server.request_count(), 120);
    assert!(denied >= 80, "{denied} requests were refused a retry");
}

#[tokio::test(start_paused = true)]
async fn budget_refusing_a_transport_retry_is_budget_exhausted() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new().fleet(
                Fleet::builder()
                    .budget(Some(
                        BudgetConfig::new(Duration::from_secs(1), 0, 0.0).unwrap(),
                    ))
                    .build(),
            ),
        )
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BudgetExhausted);
    let trail = err.trail().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::Budget));
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn normal_noise_is_never_denied() {
    // One 503 in a hundred, and a budget with no reserve: only deposits pay for retries.
    let mut script = Script::new();
    for i in 0..1_100 {
        script = script.then(if i % 100 == 50 {
            Reply::status(503)
        } else {
            Reply::success()
        });
    }
    let server = MockServer::start(script).await.unwrap();
    let budget = BudgetConfig::new(Duration::from_secs(10), 0, 0.1).unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().fleet(Fleet::builder().budget(Some(budget)).build()))
        .service(http_client());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let svc = svc.clone();
        let url = server.url("/v1/messages");
        tasks.spawn(async move {
            let mut retried = 0;
            for _ in 0..100 {
                let res = svc
                    .clone()
                    .oneshot(anthropic_request(&url, BODY))
                    .await
                    .unwrap();
                assert_eq!(res.status(), StatusCode::OK);
                if let Some(trail) = res.extensions().get::<RetryTrail>() {
                    assert_eq!(trail.gave_up(), None);
                    retried += trail.retries();
                }
            }
            retried
        });
    }
    let mut retried = 0;
    while let Some(n) = tasks.join_next().await {
        retried += n.unwrap();
    }
    assert_eq!(retried, 10);
    assert_eq!(server.request_count(), 1_010);
}

#[tokio::test(start_paused = true)]
async fn budget_off_retries_every_time() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().max_retries(3))
                .fleet(Fleet::builder().budget(None).build()),
        )
        .service(http_client());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
    }
    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
    }
    assert_eq!(server.request_count(), 200);
}

#[tokio::test(start_paused = true)]
async fn one_429_holds_100_first_attempts_and_releases_them_spread() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("10")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let gate = GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(0.5, Duration::from_secs(30))
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().random(stepping_random()))
                .observer(planned.clone())
                // The gate alone: its spread is the claim, and the default pacing, woken by
                // the 429, would space the release further.
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(gate))
                        .pacing(None)
                        .build(),
                ),
        )
        .service(http_client());
    let (first, origin) = close_with(&server, &svc, &planned).await;

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap() });
    }
    // Nothing reaches the server while the gate is closed.
    tokio::time::sleep(Duration::from_millis(9_999)).await;
    assert_eq!(server.request_count(), 1);

    while let Some(res) = tasks.join_next().await {
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        // Waiting at the gate is not a failed attempt.
        assert!(res.extensions().get::<RetryTrail>().is_none());
    }
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
    assert_eq!(server.request_count(), 102);

    // The first request's retry at exactly 10 s; the 100 waiters at 10 s plus their share of
    // the spread, min(50 % × 10 s, 30 s) = 5 s: 10.00, 10.05, … 14.95 s.
    let got = arrivals(&server, origin);
    assert_eq!(got[0], Duration::ZERO);
    let mut want = vec![Duration::from_secs(10)];
    want.extend((0..100).map(|k| Duration::from_millis(10_000 + 50 * k)));
    want.sort();
    for (got, want) in got[1..].iter().zip(&want) {
        // The timer wheel has millisecond resolution and rounds deadlines up.
        assert!(
            *got >= *want && *got < *want + Duration::from_millis(1),
            "{got:?} vs {want:?}"
        );
    }
    assert!(*got.last().unwrap() < Duration::from_secs(15));
}

#[tokio::test(start_paused = true)]
async fn a_529_with_retry_after_closes_the_gate_but_a_503_does_not() {
    for (reply, held) in [
        (Reply::overloaded().header("retry-after", "4"), true),
        (Reply::status(503).header("retry-after", "4"), false),
    ] {
        let server = MockServer::start(Script::new().then(reply)).await.unwrap();
        let planned = RetryPlanned::default();
        let svc = ServiceBuilder::new()
            .layer(
                RetryLayer::new()
                    .policy(no_jitter().random(Random::from_fn(|| 0.0)))
                    .observer(planned.clone())
                    .fleet(
                        Fleet::builder()
                            .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                            .build(),
                    ),
            )
            .service(http_client());
        let (first, origin) = close_with(&server, &svc, &planned).await;
        let res = svc
            .clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let waited = Instant::now() - origin;
        if held {
            assert_eq!(waited, Duration::from_secs(4));
        } else {
            assert!(waited < Duration::from_millis(1), "{waited:?}");
        }
        assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
    }
}

#[tokio::test(start_paused = true)]
async fn cancellation_while_waiting_at_the_gate_ends_at_once() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("30")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let token = CancellationToken::new();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .observer(planned.clone())
                .cancellation(token.clone())
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                        .build(),
                ),
        )
        .service(http_client());
    let (first, _) = close_with(&server, &svc, &planned).await;

    let start = Instant::now();
    let waiter = {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tokio::spawn(async move { (svc.oneshot(req).await, Instant::now()) })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    token.cancel();
    let (outcome, at) = waiter.await.unwrap();
    let err = outcome.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled);
    assert_eq!(at - start, Duration::from_secs(5));
    // It never reached the server, and neither did the first request's retry.
    assert_eq!(err.trail().unwrap().total_attempts(), 0);
    assert_eq!(first.await.unwrap(), Err(ErrorKind::Cancelled));
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn dropping_a_request_waiting_at_the_gate_sends_nothing() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("30")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().max_retries(0))
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                        .build(),
                ),
        )
        .service(http_client());
    let res = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let fut = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY));
    assert!(tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .is_err());
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_is_held_no_longer_than_its_policy_ceiling() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("50")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().random(Random::from_fn(|| 0.0)))
                .observer(planned.clone())
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                        .build(),
                ),
        )
        .service(http_client());
    let (first, origin) = close_with(&server, &svc, &planned).await;
    // This request's policy parks it for a Retry-After of at most 20 s.
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(
        RetryPolicy::interactive()
            .jitter(Jitter::none())
            .random(Random::from_fn(|| 0.0)),
    );
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_secs(20));
    // The first request's own retry still waits the 50 s it was told.
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
    assert_eq!(Instant::now() - origin, Duration::from_secs(50));
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_above_the_ceiling_closes_the_gate_only_up_to_it() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("3600")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().random(Random::from_fn(|| 0.0)))
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                        .build(),
                ),
        )
        .service(http_client());
    // Above the 60 s ceiling the default policy gives up and returns the 429 …
    let res = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let origin = server.requests()[0].received_at;
    // … and the gate holds the next request for the ceiling, not an hour.
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn rate_limit_headers_close_the_gate_before_any_429() {
    // 2026-01-01T00:00:00Z on the gate's wall clock.
    let now = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let cases = [
        (
            Reply::success()
                .header("anthropic-ratelimit-requests-remaining", "0")
                .header("anthropic-ratelimit-requests-reset", "2026-01-01T00:00:10Z"),
            Some(Duration::from_secs(10)),
        ),
        (
            Reply::success()
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "6.5s"),
            Some(Duration::from_millis(6_500)),
        ),
        (
            Reply::success()
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "6m0s"),
            // Capped at the policy's 60 s ceiling.
            Some(Duration::from_secs(60)),
        ),
        (
            Reply::success()
                .header("x-ratelimit-remaining-requests", "7")
                .header("x-ratelimit-reset-requests", "6s"),
            None,
        ),
        (
            Reply::success()
                .header("anthropic-ratelimit-requests-remaining", "0")
                .header("anthropic-ratelimit-requests-reset", "garbage"),
            None,
        ),
    ];
    for (reply, want) in cases {
        let server = MockServer::start(Script::new().then(reply)).await.unwrap();
        let gate = GateConfig::new()
            .min_close(Duration::ZERO)
            .wall_clock(move || now);
        let svc = ServiceBuilder::new()
            .layer(
                RetryLayer::new()
                    .policy(RetryPolicy::default().random(Random::from_fn(|| 0.0)))
                    .fleet(Fleet::builder().cooldown_gate(Some(gate)).build()),
            )
            .service(http_client());
        for _ in 0..2 {
            let res = svc
                .clone()
                .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
                .await
                .unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
        let got = arrivals(&server, server.requests()[0].received_at);
        match want {
            Some(wait) => assert_eq!(got[1], wait),
            None => assert!(got[1] < Duration::from_millis(1), "{got:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn rate_limit_headers_can_be_ignored() {
    let server = MockServer::start(
        Script::new().then(
            Reply::success()
                .header("x-ratelimit-remaining-requests", "0")
                .header("x-ratelimit-reset-requests", "6s"),
        ),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new().fleet(
                Fleet::builder()
                    .cooldown_gate(Some(
                        GateConfig::new()
                            .min_close(Duration::ZERO)
                            .rate_limit_headers(false),
                    ))
                    .build(),
            ),
        )
        .service(http_client());
    let start = Instant::now();
    for _ in 0..2 {
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
    }
    assert!(Instant::now() - start < Duration::from_millis(1));
}

#[tokio::test(start_paused = true)]
async fn clones_of_a_layer_share_the_gate_and_separate_layers_do_not() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let layer = RetryLayer::new()
        .policy(no_jitter().random(Random::from_fn(|| 0.0)))
        .observer(planned.clone())
        .fleet(
            Fleet::builder()
                .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                .build(),
        );
    let a = layer.clone().layer(http_client());
    let b = layer.layer(http_client());
    let separate = RetryLayer::new()
        .fleet(
            Fleet::builder()
                .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                .build(),
        )
        .layer(http_client());
    let (first, origin) = close_with(&server, &a, &planned).await;

    separate
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(Instant::now() - origin < Duration::from_millis(1));

    b.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(Instant::now() - origin, Duration::from_secs(8));
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
}

#[tokio::test(start_paused = true)]
async fn the_gate_turned_off_holds_nothing() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    // The defaults of earlier versions, explicitly: the gate is on by default now.
    let old = Fleet::builder()
        .cooldown_gate(None)
        .pacing(None)
        .per_scope(false)
        .build();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().observer(planned.clone()).fleet(old))
        .service(http_client());
    let (first, origin) = close_with(&server, &svc, &planned).await;
    svc.clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(Instant::now() - origin < Duration::from_millis(1));
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
}

#[test]
fn config_validation() {
    assert!(GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(-0.1, Duration::ZERO)
        .is_err());
    assert!(GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(f64::NAN, Duration::ZERO)
        .is_err());
    assert!(GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(11.0, Duration::ZERO)
        .is_err());
    assert!(GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(0.0, Duration::ZERO)
        .is_ok());
}

#[tokio::test(start_paused = true)]
async fn an_unbounded_ceiling_still_waits_at_the_gate() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("5")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().random(Random::from_fn(|| 0.0)))
                .observer(planned.clone())
                .fleet(
                    Fleet::builder()
                        .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                        .build(),
                ),
        )
        .service(http_client());
    let (first, origin) = close_with(&server, &svc, &planned).await;
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(
        no_jitter()
            .random(Random::from_fn(|| 0.0))
            .retry_after_max(Duration::MAX),
    );
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_secs(5));
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
}

// ---------------------------------------------------------------------------------------------
// Adaptive pacing.

fn paced(initial: f64, max: f64) -> tower_llm_retry::fleet::PacingConfig {
    tower_llm_retry::fleet::PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(initial, 1.0, max)
        .unwrap()
        .decrease(0.5)
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn pacing_spaces_attempts_by_the_rate_in_arrival_order() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(10.0, 10.0))).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..5u32 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { (i, svc.oneshot(req).await.unwrap().status()) });
        // Arrival order is the order of spawning.
        tokio::task::yield_now().await;
    }
    while let Some(j) = tasks.join_next().await {
        assert_eq!(j.unwrap().1, StatusCode::OK);
    }
    let ms: Vec<u128> = arrivals(&server, origin)
        .iter()
        .map(|d| (d.as_micros() + 500) / 1000)
        .collect();
    assert_eq!(ms, [0, 100, 200, 300, 400]);
}

#[tokio::test(start_paused = true)]
async fn a_429_slows_the_pacing_for_everyone_in_line() {
    // The first request is refused (Retry-After 0 so its retry does not sleep); the rate
    // halves from 10/s to 5/s for every attempt still in line.
    let server = MockServer::start(Script::new().then(Reply::rate_limited("0")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(10.0, 10.0))).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        tokio::task::yield_now().await;
    }
    while let Some(j) = tasks.join_next().await {
        assert_eq!(j.unwrap(), StatusCode::OK);
    }
    let ms: Vec<u128> = arrivals(&server, origin)
        .iter()
        .map(|d| (d.as_micros() + 500) / 1000)
        .collect();
    // 0: refused. The turn already scheduled (100 ms) is kept; from there the line moves at
    // 5/s, plus the default growth of 0.05/s for each success while others wait in line
    // (after 100 ms and 300 ms), and the refused request's retry, queued last, goes last.
    // (Within the timer wheel's 1 ms.)
    let third: f64 = 300.0 + 1000.0 / 5.05;
    let fourth = third + 1000.0 / 5.1;
    let want = [0, 100, 300, third.round() as u128, fourth.round() as u128];
    assert_eq!(ms.len(), want.len());
    for (got, want) in ms.iter().zip(want) {
        assert!(got.abs_diff(want) <= 1, "{ms:?} against {want:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn leaving_the_pacing_line_sends_nothing_and_frees_the_turn() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(10.0, 10.0))).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let first = tokio::spawn(
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    );
    tokio::task::yield_now().await;
    // The second waits for its turn at 100 ms, and is dropped at 50 ms.
    let second = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY));
    assert!(tokio::time::timeout(Duration::from_millis(50), second)
        .await
        .is_err());
    let third = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY));
    assert_eq!(third.await.unwrap().status(), StatusCode::OK);
    first.await.unwrap().unwrap();
    let ms: Vec<u128> = arrivals(&server, origin)
        .iter()
        .map(|d| (d.as_micros() + 500) / 1000)
        .collect();
    // The third takes the turn the second left.
    assert_eq!(ms, [0, 100]);
}

#[tokio::test(start_paused = true)]
async fn a_short_retry_after_below_min_close_leaves_the_gate_open() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("2"))
            .then(Reply::success())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let gate = GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(0.0, Duration::ZERO)
        .unwrap()
        .min_close(Duration::from_secs(5));
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().cooldown_gate(Some(gate)).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    // A 429 asking for 2 s: this request waits 2 s, the gate stays open for the others.
    let a = tokio::spawn(
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let b = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY));
    assert_eq!(b.await.unwrap().status(), StatusCode::OK);
    assert_eq!(a.await.unwrap().unwrap().status(), StatusCode::OK);
    let ms: Vec<u128> = arrivals(&server, origin)
        .iter()
        .map(|d| d.as_millis())
        .collect();
    assert_eq!(ms, [0, 1000, 2000]);
}

#[tokio::test(start_paused = true)]
async fn requests_held_at_the_gate_leave_it_at_the_pacing_rate_not_at_once() {
    // The first request is refused with Retry-After 2 s while five others wait in the pacing
    // line. Those whose turn comes while the gate is closed do not keep it: when the gate
    // reopens (no spread), all six go through the line again, one every 1 / rate.
    let server = MockServer::start(Script::new().then(Reply::rate_limited("2")))
        .await
        .unwrap();
    let gate = GateConfig::new()
        .min_close(Duration::ZERO)
        .spread(0.0, Duration::ZERO)
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new().policy(no_jitter()).fleet(
                Fleet::builder()
                    .cooldown_gate(Some(gate))
                    .pacing(Some(paced(10.0, 10.0)))
                    .build(),
            ),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..6 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        tokio::task::yield_now().await;
    }
    while let Some(j) = tasks.join_next().await {
        assert_eq!(j.unwrap(), StatusCode::OK);
    }
    let got = arrivals(&server, origin);
    assert_eq!(got.len(), 7, "{got:?}");
    // Only the refused one went before the gate closed.
    assert_eq!(got[0], Duration::ZERO);
    assert!(got[1] >= Duration::from_secs(2), "{got:?}");
    // After it, 1 / rate apart: the 429 halved the rate to 5/s; each success while others
    // wait adds 0.05/s. (Within the timer wheel's millisecond.)
    let mut rate = 5.0;
    for pair in got[1..].windows(2) {
        let gap = (pair[1] - pair[0]).as_secs_f64();
        let want = 1.0 / rate;
        assert!(
            (gap - want).abs() <= 0.0011,
            "{got:?}: {gap} against {want}"
        );
        rate += 0.05;
    }
}

#[tokio::test(start_paused = true)]
async fn cancellation_while_waiting_in_the_pacing_line_ends_at_once() {
    // At 1 request/s, the third in line would go at 2 s; the token fires at 300 ms.
    let server = MockServer::start(Script::new()).await.unwrap();
    let token = CancellationToken::new();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .cancellation(token.clone())
                .fleet(Fleet::builder().pacing(Some(paced(1.0, 1.0))).build()),
        )
        .service(http_client());
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..3 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { (svc.oneshot(req).await.map_err(|e| e.kind()), Instant::now()) });
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel();
    let mut outcomes = Vec::new();
    while let Some(j) = tasks.join_next().await {
        let (outcome, at) = j.unwrap();
        outcomes.push((outcome.map(|r| r.status()), at - start));
    }
    outcomes.sort_by_key(|(_, at)| *at);
    // The first went at once; the two in line (the head waiting on the clock, the other
    // queued behind it) end when the token fires, having sent nothing.
    assert_eq!(outcomes[0], (Ok(StatusCode::OK), Duration::ZERO));
    for waiting in &outcomes[1..] {
        assert_eq!(
            waiting,
            &(Err(ErrorKind::Cancelled), Duration::from_millis(300))
        );
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stated_request_limit_paces_the_fleet_from_the_first_answer() {
    // Every answer states 600 requests a minute (10/s); pacing starts at 50/s. The turn
    // after the first was scheduled at 50/s (20 ms); from the first answer on, the line moves
    // at 10/s, with no refusal needed to learn it.
    let server = MockServer::start(Script::always(
        Reply::success().header("x-ratelimit-limit-requests", "600"),
    ))
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(50.0, 50.0))).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        tokio::task::yield_now().await;
    }
    while let Some(j) = tasks.join_next().await {
        assert_eq!(j.unwrap(), StatusCode::OK);
    }
    let ms: Vec<u128> = arrivals(&server, origin)
        .iter()
        .map(|d| (d.as_micros() + 500) / 1000)
        .collect();
    let want = [0, 20, 120, 220, 320];
    assert_eq!(ms.len(), want.len());
    for (got, want) in ms.iter().zip(want) {
        assert!(got.abs_diff(want) <= 1, "{ms:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_pacing_line_whose_head_keeps_leaving_still_serves_everyone_left() {
    // 120 requests join a line paced at 20/s (one turn every 50 ms). Every third one, from
    // the fourth on, is dropped while it is the head of the line, waiting for its instant:
    // the one behind must be told it is the head now, or the line stops for good. Everyone
    // else is served, one every 50 ms, and nothing dropped reaches the server.
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(20.0, 20.0))).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..120u64 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        // Request k's place in line once the d earlier ones are gone is k - d; it is the head
        // from 50 ms before its turn: drop it halfway through that.
        let drop_at = (k % 3 == 0 && k > 0).then(|| {
            let d = k / 3 - 1;
            Duration::from_millis((k - d) * 50 - 25)
        });
        tasks.spawn(async move {
            let call = svc.oneshot(req);
            match drop_at {
                Some(d) => tokio::time::timeout(d, call)
                    .await
                    .ok()
                    .map(|r| r.unwrap().status()),
                None => Some(call.await.unwrap().status()),
            }
        });
        tokio::task::yield_now().await;
    }
    let mut answered = 0;
    let all = async {
        while let Some(j) = tasks.join_next().await {
            if let Some(status) = j.unwrap() {
                assert_eq!(status, StatusCode::OK);
                answered += 1;
            }
        }
    };
    // A lost wake-up would leave a request in line for ever: fail instead of hanging.
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("everyone left in line is served");
    assert_eq!(answered, 120 - 39);
    let got = arrivals(&server, origin);
    assert_eq!(got.len(), answered);
    // One turn every 50 ms, without a gap where a head left (within the timer's 1 ms).
    for (k, at) in got.iter().enumerate() {
        let want = Duration::from_millis(50 * k as u64);
        assert!(
            *at >= want && *at <= want + Duration::from_millis(1),
            "{k}: {got:?}"
        );
    }
}

/// Every answer states a request limit of `per_minute`.
fn stating(per_minute: &str) -> Reply {
    Reply::success().header("anthropic-ratelimit-requests-limit", per_minute)
}

#[tokio::test(start_paused = true)]
async fn a_stated_limit_of_one_a_minute_refuses_at_once_what_would_wait_past_the_ceiling() {
    // Every answer states 1 request a minute; the default policy lets a request wait 60 s.
    let server = MockServer::start(Script::always(stating("1")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new().policy(no_jitter()).fleet(
                Fleet::builder()
                    .pacing(Some(
                        PacingConfig::new()
                            .dormant(false)
                            .burst(Duration::ZERO)
                            .unwrap(),
                    ))
                    .build(),
            ),
        )
        .service(http_client());
    let url = server.url("/v1/messages");
    let origin = Instant::now();
    // The first goes at once, and its answer caps the rate at one a minute.
    let res = svc.clone().oneshot(anthropic_request(&url, BODY)).await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    // The second has the turn scheduled at 50/s before the limit was known (20 ms). The third
    // would go a minute after it, 60.02 s from now: refused as it joins, nothing sent.
    let second = tokio::spawn(svc.clone().oneshot(anthropic_request(&url, BODY)));
    tokio::task::yield_now().await;
    let err = svc
        .clone()
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap_err();
    assert_eq!(Instant::now() - origin, Duration::ZERO);
    assert_eq!(err.kind(), ErrorKind::PacingWaitTooLong);
    let trail = err.trail().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::PacingWaitTooLong));
    assert_eq!((trail.total_attempts(), trail.attempts().len()), (0, 0));
    assert_eq!(second.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_millis(20));
    // The next turn is at 60.02 s. A request whose deadline is 30 s away is refused at once,
    // with its deadline's error ...
    let mut req = anthropic_request(&url, BODY);
    req.extensions_mut()
        .insert(no_jitter().deadline(Some(Duration::from_secs(30))));
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded);
    assert_eq!(err.trail().unwrap().gave_up(), Some(GiveUpReason::Deadline));
    assert_eq!(Instant::now() - origin, Duration::from_millis(20));
    // ... and one that may wait the 60 s waits exactly that.
    let res = svc.clone().oneshot(anthropic_request(&url, BODY)).await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    assert_eq!(
        arrivals(&server, origin),
        [
            Duration::ZERO,
            Duration::from_millis(20),
            Duration::from_millis(60_020)
        ]
    );
}

/// Notifies like [`RetryPlanned`] and records like [`Recorder`].
#[derive(Debug, Clone, Default)]
struct PlannedAndRecorded(RetryPlanned, Recorder);

impl RetryObserver for PlannedAndRecorded {
    fn on_retry(&self, e: &RetryEvent<'_>) {
        self.1.on_retry(e);
        self.0.on_retry(e);
    }
    fn on_recovered(&self, total: u32) {
        self.1.on_recovered(total);
    }
    fn on_give_up(&self, trail: &RetryTrail) {
        self.1.on_give_up(trail);
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_whose_pacing_turn_is_past_the_ceiling_gives_up_with_its_trail() {
    // The first answer is a 503 stating 1 request a minute; the policy lets a request wait 30 s
    // for anything. Its retry is due 0.5 s later, when the next turn is 60.02 s away.
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503).header("anthropic-ratelimit-requests-limit", "1"))
            .otherwise(stating("1")),
    )
    .await
    .unwrap();
    let seen = PlannedAndRecorded::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter().retry_after_max(Duration::from_secs(30)))
                .observer(seen.clone())
                .fleet(
                    Fleet::builder()
                        .pacing(Some(
                            PacingConfig::new()
                                .dormant(false)
                                .burst(Duration::ZERO)
                                .unwrap(),
                        ))
                        .build(),
                ),
        )
        .service(http_client());
    let url = server.url("/v1/messages");
    let origin = Instant::now();
    let notified = seen.0 .0.notified();
    let first = {
        let svc = svc.clone();
        let req = anthropic_request(&url, BODY);
        tokio::spawn(async move { (svc.oneshot(req).await, Instant::now()) })
    };
    notified.await;
    // Another request takes the turn at 20 ms; the one after it is a minute later.
    let res = svc.clone().oneshot(anthropic_request(&url, BODY)).await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    let (outcome, at) = first.await.unwrap();
    let err = outcome.unwrap_err();
    // Given up when the retry joined the line, after its 0.5 s backoff.
    assert_eq!(at - origin, Duration::from_millis(500));
    assert_eq!(err.kind(), ErrorKind::PacingWaitTooLong);
    let trail = err.trail().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::PacingWaitTooLong));
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(trail.attempts().len(), 1);
    assert_eq!(
        trail.attempts()[0].status,
        Some(StatusCode::SERVICE_UNAVAILABLE)
    );
    assert_eq!(trail.attempts()[0].delay, Some(Duration::from_millis(500)));
    assert_eq!(
        seen.1.seen(),
        [
            Seen::Retry {
                attempt: 1,
                class: tower_llm_retry::classify::FailureClass::Server,
                status: Some(StatusCode::SERVICE_UNAVAILABLE),
                retry_after: None,
                delay: Duration::from_millis(500),
                max_retries: 10,
            },
            Seen::GaveUp(trail.clone()),
        ]
    );
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_request_waiting_behind_others_gives_up_at_its_own_bound() {
    // One request a second; the second answer states 6 a minute. The fifth request may wait
    // 5 s, the others 60 s. When they join, the fifth's turn is expected at 4 s, and it is
    // let in; the 6-a-minute limit then puts the fourth's turn at 12 s, and the fifth, still
    // behind it, gives up at exactly 5 s.
    let server = MockServer::start(
        Script::new()
            .then(Reply::success())
            .then(Reply::success().header("x-ratelimit-limit-requests", "6")),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new().policy(no_jitter()).fleet(
                Fleet::builder()
                    .pacing(Some(
                        PacingConfig::new()
                            .dormant(false)
                            .burst(Duration::ZERO)
                            .unwrap()
                            .rates(1.0, 1.0, 1.0)
                            .unwrap(),
                    ))
                    .build(),
            ),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..5 {
        let svc = svc.clone();
        let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
        if k == 4 {
            req.extensions_mut()
                .insert(no_jitter().retry_after_max(Duration::from_secs(5)));
        }
        tasks.spawn(async move {
            let outcome = svc.oneshot(req).await;
            (k, outcome.map(|r| r.status()), Instant::now() - origin)
        });
        tokio::task::yield_now().await;
    }
    let mut outcomes = Vec::new();
    while let Some(j) = tasks.join_next().await {
        let (k, outcome, at) = j.unwrap();
        outcomes.push((
            k,
            outcome.map_err(|e| (e.kind(), e.trail().unwrap().total_attempts())),
            at,
        ));
    }
    outcomes.sort_by_key(|o| o.0);
    let secs = Duration::from_secs;
    assert_eq!(
        outcomes,
        [
            (0, Ok(StatusCode::OK), secs(0)),
            (1, Ok(StatusCode::OK), secs(1)),
            (2, Ok(StatusCode::OK), secs(2)),
            (3, Ok(StatusCode::OK), secs(12)),
            (4, Err((ErrorKind::PacingWaitTooLong, 0)), secs(5)),
        ]
    );
    assert_eq!(
        arrivals(&server, origin),
        [secs(0), secs(1), secs(2), secs(12)]
    );
}

#[tokio::test(start_paused = true)]
async fn a_head_of_the_pacing_line_that_is_not_polled_does_not_hold_up_the_line() {
    // Four requests a second: a turn every 250 ms. The second request joins the line as its
    // head, then loses a `select!` and is kept, not polled. The two behind it go without it:
    // the third 100 ms (the grace) after the turn the head left, the fourth on schedule. The
    // stale head, polled again, takes the next turn after them.
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(no_jitter())
                .fleet(Fleet::builder().pacing(Some(paced(4.0, 4.0))).build()),
        )
        .service(http_client());
    let url = server.url("/v1/messages");
    let origin = Instant::now();
    let res = svc.clone().oneshot(anthropic_request(&url, BODY)).await;
    assert_eq!(res.unwrap().status(), StatusCode::OK);
    let stale = svc.clone().oneshot(anthropic_request(&url, BODY));
    tokio::pin!(stale);
    tokio::select! {
        biased;
        _ = &mut stale => unreachable!("its turn is 250 ms away"),
        _ = tokio::task::yield_now() => {}
    }
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..2 {
        let svc = svc.clone();
        let req = anthropic_request(&url, BODY);
        tasks.spawn(async move { svc.oneshot(req).await.unwrap().status() });
        tokio::task::yield_now().await;
    }
    let behind = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(j) = tasks.join_next().await {
            assert_eq!(j.unwrap(), StatusCode::OK);
        }
    })
    .await;
    assert!(
        behind.is_ok(),
        "the line waited for a head that was not polled"
    );
    assert_eq!(Instant::now() - origin, Duration::from_millis(500));
    assert_eq!(stale.await.unwrap().status(), StatusCode::OK);
    assert_eq!(
        arrivals(&server, origin),
        [0, 350, 500, 750].map(Duration::from_millis)
    );
}

// ---------------------------------------------------------------------------------------------
// One fleet handle shared by stacks built separately.

/// A reqwest-middleware client whose retry loop uses `layer`.
fn reqwest_stack(layer: RetryLayer) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest_builder().build().unwrap())
        .with(tower_llm_retry::reqwest_middleware::RetryMiddleware::new(
            layer,
        ))
        .build()
}

#[tokio::test(start_paused = true)]
async fn a_hyper_stack_and_a_reqwest_stack_sharing_one_fleet_share_the_gate() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    // One state for every request: the claim is read from the fleet's own. The gate alone:
    // the default pacing, woken by the 429, would space the two sent as it reopens.
    let fleet = Fleet::builder()
        .cooldown_gate(Some(
            GateConfig::new()
                .min_close(Duration::ZERO)
                .spread(0.0, Duration::ZERO)
                .unwrap(),
        ))
        .pacing(None)
        .per_scope(false)
        .build();
    let planned = RetryPlanned::default();
    let hyper_stack = RetryLayer::new()
        .policy(no_jitter())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let reqwest_client = reqwest_stack(RetryLayer::new().policy(no_jitter()).fleet(fleet.clone()));
    // An unrelated stack, with a fleet of its own, is not held.
    let other = RetryLayer::new()
        .fleet(
            Fleet::builder()
                .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
                .build(),
        )
        .layer(http_client());

    // The hyper stack's request gets the 429 with Retry-After 8 s.
    let (first, origin) = close_with(&server, &hyper_stack, &planned).await;
    assert_eq!(
        fleet.gate_closed_until(),
        Some(origin + Duration::from_secs(8))
    );

    other
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(Instant::now() - origin < Duration::from_millis(1));

    // The reqwest stack's first attempt is held until the gate reopens, to the millisecond.
    let res = reqwest_client
        .post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<RetryTrail>().is_none());
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
    // The server saw: the 429 at 0, the unrelated request at 0, then the retry and the reqwest
    // stack's first attempt at 8 s.
    let got = arrivals(&server, origin);
    assert_eq!(got.len(), 4);
    assert!(got[1] < Duration::from_millis(1), "{got:?}");
    for t in &got[2..] {
        assert!(
            *t >= Duration::from_secs(8) && *t < Duration::from_millis(8_001),
            "{got:?}"
        );
    }
    assert_eq!(fleet.gate_closed_until(), None);
    assert_eq!(fleet.gate_closings(), Some(1));
}

#[tokio::test(start_paused = true)]
async fn two_stacks_sharing_one_fleet_share_the_budget() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let budget = BudgetConfig::new(Duration::from_secs(10), 1, 0.1).unwrap();
    // One state for every request: the claim is read from the fleet's own.
    let fleet = Fleet::builder()
        .budget(Some(budget))
        .per_scope(false)
        .build();
    // 3 retries without jitter take 3.5 s: every retry falls in one 10 s window.
    let hyper_stack = RetryLayer::new()
        .policy(no_jitter().max_retries(3))
        .fleet(fleet.clone())
        .layer(http_client());
    let reqwest_client = reqwest_stack(
        RetryLayer::new()
            .policy(no_jitter().max_retries(3))
            .fleet(fleet.clone()),
    );
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..50 {
        let svc = hyper_stack.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move {
            let res = svc.oneshot(req).await.unwrap();
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
            res.extensions().get::<RetryTrail>().unwrap().clone()
        });
        let client = reqwest_client.clone();
        let url = server.url("/v1/messages");
        tasks.spawn(async move {
            let res = client.post(url).body(BODY).send().await.unwrap();
            assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
            res.extensions().get::<RetryTrail>().unwrap().clone()
        });
    }
    let (mut retries, mut denied) = (0, 0);
    while let Some(trail) = tasks.join_next().await {
        let trail = trail.unwrap();
        retries += trail.retries();
        denied += u64::from(trail.gave_up() == Some(GiveUpReason::Budget));
    }
    // One budget for both: 1 retry a second for 10 s, plus one per 10 of the 100 first
    // attempts. Two budgets would have allowed 2 × (10 + 5) = 30.
    assert_eq!(budget.max_retries(100), 20);
    assert_eq!(retries, 20);
    assert_eq!(server.request_count(), 120);
    let stats = fleet.budget_stats().unwrap();
    assert_eq!(stats.first_attempts, 100);
    assert_eq!(stats.retries, 20);
    // Each request the budget refused gave up there; at least the 80 that got no retry.
    assert_eq!(stats.refused, denied);
    assert!(denied >= 80, "{denied}");
}

#[tokio::test(start_paused = true)]
async fn a_layer_cloned_and_reconfigured_keeps_sharing_its_fleet() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("6")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let base = RetryLayer::new().fleet(
        Fleet::builder()
            .cooldown_gate(Some(
                GateConfig::new()
                    .min_close(Duration::ZERO)
                    .spread(0.0, Duration::ZERO)
                    .unwrap(),
            ))
            .build(),
    );
    // Every setter but `fleet` leaves the fleet as it is.
    let derived = base
        .clone()
        .policy(no_jitter().max_retries(2))
        .observer(planned.clone())
        .body_limit(1 << 20)
        .peek_limit(1 << 10)
        .sse_gate(false)
        .buffer_responses(Some(1 << 16));
    assert!(derived.get_fleet().ptr_eq(base.get_fleet()));
    // So does a layer with the fleet of its own it built.
    let own = RetryLayer::new();
    assert!(own
        .clone()
        .policy(no_jitter())
        .get_fleet()
        .ptr_eq(own.get_fleet()));
    assert!(!own.get_fleet().ptr_eq(base.get_fleet()));

    let derived = derived.layer(http_client());
    let base = base.layer(http_client());
    let (first, origin) = close_with(&server, &derived, &planned).await;
    base.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(Instant::now() - origin, Duration::from_secs(6));
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
}

#[tokio::test(start_paused = true)]
async fn the_read_outs_report_the_gate_deadline_the_pace_and_the_budget() {
    // A 429 with Retry-After 0 (the gate stays open, its retry does not sleep) then a 429 with
    // Retry-After 5 s.
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("0"))
            .then(Reply::rate_limited("5")),
    )
    .await
    .unwrap();
    // One state for every request: the read-outs are the fleet's own.
    let fleet = Fleet::builder()
        .cooldown_gate(Some(
            GateConfig::new()
                .min_close(Duration::ZERO)
                .min_close(Duration::from_secs(1)),
        ))
        .pacing(Some(paced(10.0, 10.0)))
        .per_scope(false)
        .build();
    assert_eq!(fleet.gate_closed_until(), None);
    assert_eq!(fleet.gate_closings(), Some(0));
    assert_eq!(fleet.pace(), Some(10.0));
    assert_eq!(fleet.pacing_refused(), Some(0));
    assert_eq!(fleet.budget_config(), Some(BudgetConfig::default()));
    assert_eq!(
        fleet.budget_stats(),
        Some(tower_llm_retry::fleet::BudgetStats::default())
    );
    assert_eq!(fleet.pacing_config(), Some(paced(10.0, 10.0)));
    assert!(fleet.gate_config().is_some());

    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(no_jitter())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let notified = planned.0.notified();
    let task = tokio::spawn(
        svc.clone()
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    );
    notified.await;
    // The first 429 halved the pace (its decrease is 0.5); its Retry-After 0 is below
    // `min_close`: the gate is still open.
    assert_eq!(fleet.pace(), Some(5.0));
    assert_eq!(fleet.gate_closed_until(), None);
    let notified = planned.0.notified();
    notified.await;
    // The retry got the 429 with Retry-After 5 s: closed until 5 s after it reached the server.
    let second = server.requests()[1].received_at;
    assert_eq!(
        fleet.gate_closed_until(),
        Some(second + Duration::from_secs(5))
    );
    assert_eq!(fleet.gate_closings(), Some(1));
    // The retry was sent after the first decrease: its refusal halves the pace again.
    assert_eq!(fleet.pace(), Some(2.5));
    let res = task.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(fleet.gate_closed_until(), None);
    let stats = fleet.budget_stats().unwrap();
    assert_eq!(
        (stats.first_attempts, stats.retries, stats.refused),
        (1, 2, 0)
    );
}

#[test]
fn a_fleet_built_with_the_gate_and_pacing_off_has_only_the_budget() {
    // The defaults of earlier versions, explicitly (the gate and pacing are on by default
    // now: see `a_fleet_built_by_default_has_the_gate_a_dormant_pacing_and_scopes`).
    let old = || {
        Fleet::builder()
            .cooldown_gate(None)
            .pacing(None)
            .per_scope(false)
            .build()
    };
    for fleet in [old(), old()] {
        assert_eq!(fleet.budget_config(), Some(BudgetConfig::default()));
        assert!(fleet.gate_config().is_none());
        assert_eq!(fleet.gate_closed_until(), None);
        assert_eq!(fleet.gate_closings(), None);
        assert_eq!(fleet.pace(), None);
        assert_eq!(fleet.pacing_refused(), None);
    }
    let off = Fleet::builder().budget(None).build();
    assert_eq!(off.budget_config(), None);
    assert_eq!(off.budget_stats(), None);
    let fleet = Fleet::default();
    assert!(fleet.clone().ptr_eq(&fleet));
    assert!(!Fleet::default().ptr_eq(&fleet));
    assert!(format!("{fleet:?}").starts_with("Fleet {"));
}

// ---------------------------------------------------------------------------------------------
// A fleet kept per scope (upstream + credential).

#[tokio::test(start_paused = true)]
async fn a_fleet_kept_per_scope_holds_only_the_scope_that_got_the_429() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    let other_upstream = MockServer::start(Script::new()).await.unwrap();
    let fleet = Fleet::builder()
        .cooldown_gate(Some(
            GateConfig::new()
                .min_close(Duration::ZERO)
                .spread(0.0, Duration::ZERO)
                .unwrap(),
        ))
        .per_scope(true)
        .build();
    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(no_jitter())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let notified = planned.0.notified();
    let first = tokio::spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    notified.await;
    let origin = server.requests()[0].received_at;

    // Key b on the same upstream, and key a on another upstream: not held.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-b"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let res = svc
        .clone()
        .oneshot(with_key(
            &other_upstream.url("/v1/messages"),
            "sk-ant-key-a",
        ))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(Instant::now() - origin < Duration::from_millis(1));

    // The read-outs, per scope.
    let a = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    let b = fleet.scope_for(&with_key(&url, "sk-ant-key-b"));
    assert_eq!(a.gate_closed_until(), Some(origin + Duration::from_secs(8)));
    assert_eq!(b.gate_closed_until(), None);
    // The fleet's own read-outs report over its scopes: the one gate that is closed.
    assert_eq!(
        fleet.gate_closed_until(),
        Some(origin + Duration::from_secs(8))
    );
    assert_eq!(
        (a.gate_closings(), b.gate_closings(), fleet.gate_closings()),
        (Some(1), Some(0), Some(1))
    );
    assert_eq!(fleet.scopes().len(), 3);
    let authority = url.trim_start_matches("http://").split('/').next().unwrap();
    assert_eq!(a.scope_upstream(), Some(authority));
    let id = a.scope_id().unwrap();
    assert_ne!(Some(id), b.scope_id());
    assert!(!id.contains("key-a"));
    assert!(!format!("{fleet:?}{a:?}").contains("key-a"));

    // Key a on the first upstream waits for its own gate, to the millisecond.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_secs(8));
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    // Each scope kept its own budget: key a's two first attempts and a retry.
    let stats = a.budget_stats().unwrap();
    assert_eq!((stats.first_attempts, stats.retries), (2, 1));
    assert_eq!(b.budget_stats().unwrap().first_attempts, 1);
}

#[tokio::test(start_paused = true)]
async fn a_fleet_not_kept_per_scope_holds_every_key() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    // Kept per scope by default now: this is the fleet that is not.
    let fleet = Fleet::builder()
        .cooldown_gate(Some(
            GateConfig::new()
                .min_close(Duration::ZERO)
                .spread(0.0, Duration::ZERO)
                .unwrap(),
        ))
        .per_scope(false)
        .build();
    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(no_jitter())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let notified = planned.0.notified();
    let first = tokio::spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    notified.await;
    let origin = server.requests()[0].received_at;
    svc.clone()
        .oneshot(with_key(&url, "sk-ant-key-b"))
        .await
        .unwrap();
    assert_eq!(Instant::now() - origin, Duration::from_secs(8));
    assert!(fleet.scopes().is_empty());
    assert!(fleet
        .scope_for(&with_key(&url, "sk-ant-key-b"))
        .ptr_eq(&fleet));
    first.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn absolute_times_are_read_against_the_servers_date_not_the_hosts_clock() {
    // The server's clock says 2020-09-13T12:26:40Z; the host's says otherwise by years.
    let date = UNIX_EPOCH + Duration::from_secs(1_600_000_000);
    let http_date = |t| httpdate::fmt_http_date(t);
    let server = MockServer::start(
        Script::new()
            .then(
                Reply::status(429)
                    .header("date", &http_date(date))
                    .header("retry-after", &http_date(date + Duration::from_secs(7))),
            )
            .then(
                Reply::success()
                    .header("date", &http_date(date))
                    .header("anthropic-ratelimit-requests-remaining", "0")
                    .header("anthropic-ratelimit-requests-reset", "2020-09-13T12:26:45Z"),
            ),
    )
    .await
    .unwrap();
    for (n, wait) in [(0, 7), (1, 5)] {
        // One state for every request: the gate read is the fleet's own.
        let fleet = Fleet::builder()
            .cooldown_gate(Some(GateConfig::new().min_close(Duration::ZERO)))
            .per_scope(false)
            .build();
        let svc = RetryLayer::new()
            .policy(no_jitter().max_retries(0))
            .fleet(fleet.clone())
            .layer(http_client());
        svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        let received = server.requests()[n].received_at;
        assert_eq!(
            fleet.gate_closed_until(),
            Some(received + Duration::from_secs(wait)),
            "reply {n}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The defaults: the gate, a dormant pacing, a state per scope.

/// The default policy without jitter, and no spread at the gate.
/// A `429` asking for 1.5 s: longer than the first retry's own backoff (500 ms) and than
/// the whole second random refusals and a token bucket's next token say, under the default
/// gate's 2 s.
fn limited_for_1500_ms() -> Reply {
    Reply::status(429).header("retry-after-ms", "1500")
}

fn exact() -> RetryPolicy {
    no_jitter().random(Random::from_fn(|| 0.0))
}

fn with_key(uri: &str, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    let mut req = anthropic_request(uri, BODY);
    req.headers_mut()
        .insert("x-api-key", http::HeaderValue::from_str(key).unwrap());
    req
}

#[test]
fn a_fleet_built_by_default_has_the_gate_a_dormant_pacing_and_scopes() {
    for fleet in [Fleet::default(), Fleet::builder().build()] {
        assert_eq!(fleet.budget_config(), Some(BudgetConfig::default()));
        assert!(fleet.gate_config().is_some());
        assert_eq!(fleet.gate_closed_until(), None);
        assert_eq!(fleet.gate_closings(), Some(0));
        let pacing = PacingConfig::new()
            .dormant(false)
            .burst(Duration::ZERO)
            .unwrap()
            .dormant(true)
            .burst(Duration::from_secs(1))
            .unwrap();
        assert_eq!(fleet.pacing_config(), Some(pacing));
        assert_eq!(pacing.get_burst(), Duration::from_secs(1));
        assert!(fleet.pacing_config().unwrap().get_dormant());
        // Dormant: no pace to report.
        assert_eq!(fleet.pace(), None);
        assert_eq!(fleet.pacing_refused(), Some(0));
        // Kept per scope.
        let req = with_key("http://127.0.0.1:1/v1/messages", "sk-ant-key-a");
        assert!(!fleet.scope_for(&req).ptr_eq(&fleet));
        assert_eq!(fleet.scopes().len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn the_default_layer_fronting_two_keys_holds_only_the_key_that_got_the_429() {
    // The first request (key a) gets a 429 with Retry-After 8 s; everything else succeeds.
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .observer(planned.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let notified = planned.0.notified();
    let first = tokio::spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    notified.await;
    let origin = server.requests()[0].received_at;

    // Key b is not held: answered at once.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-b"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::ZERO);
    // Key a is: a second request waits at its gate for the 8 s.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    let got: Vec<_> = server
        .requests()
        .iter()
        .map(|r| {
            let key = r.headers["x-api-key"].to_str().unwrap().to_owned();
            (key, r.received_at - origin)
        })
        .collect();
    let ms = |n| Duration::from_millis(n);
    assert_eq!(got.len(), 4);
    assert_eq!(got[0], ("sk-ant-key-a".into(), ms(0)));
    assert_eq!(got[1], ("sk-ant-key-b".into(), ms(0)));
    // The retry and the held request as the gate reopens at 8 s. The 429 woke key a's
    // pacing (at 50/s, its floor: it had measured one attempt), whose burst of 1 s lets
    // both go after the quiet spell.
    assert!(got[2..].iter().all(|(key, _)| key == "sk-ant-key-a"));
    for (_, at) in &got[2..] {
        assert!(*at >= ms(8_000) && *at <= ms(8_001), "{got:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_default_pacing_delays_nothing_before_a_rate_limit_signal() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let fleet = Fleet::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    // 500 at once: a pacing that paced from the start (50 requests/s in slow start) would
    // spread them over seconds.
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..500 {
        let req = with_key(&url, "sk-ant-key-a");
        tasks.spawn(svc.clone().oneshot(req));
    }
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert_eq!(server.request_count(), 500);
    assert!(arrivals(&server, origin).iter().all(|d| d.is_zero()));
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    assert_eq!(scope.pace(), None);
    assert_eq!(scope.pacing_refused(), Some(0));
}

/// The providers state their request limit on every answer: a client well within it is not
/// paced; one told its window is nearly spent (a tenth or less left) is, at the limit.
#[tokio::test(start_paused = true)]
async fn a_stated_limit_paces_the_default_fleet_only_once_its_window_is_nearly_spent() {
    let stated = |left: &str| {
        Reply::success()
            .header("anthropic-ratelimit-requests-limit", "600")
            .header("anthropic-ratelimit-requests-remaining", left)
    };
    let mut script = Script::new();
    for _ in 0..10 {
        script = script.then(stated("500"));
    }
    script = script.then(stated("60"));
    for _ in 0..5 {
        script = script.then(stated("55"));
    }
    let server = MockServer::start(script).await.unwrap();
    let fleet = Fleet::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let send_all = |n: usize| {
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..n {
            tasks.spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
        }
        tasks
    };
    let origin = Instant::now();
    // Ten at once, each told 500 of 600 are left: none waits.
    let mut tasks = send_all(10);
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert!(arrivals(&server, origin).iter().all(|d| d.is_zero()));
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    assert_eq!(scope.pace(), None);
    // The eleventh is told 60 are left (a tenth): the pacing wakes at 600 a minute.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(scope.pace(), Some(10.0));
    // Five at once now leave 100 ms apart.
    let woken = Instant::now();
    let mut tasks = send_all(5);
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    let after: Vec<Duration> = arrivals(&server, woken).into_iter().skip(11).collect();
    assert_eq!(after.len(), 5);
    for pair in after.windows(2) {
        assert!(pair[1] - pair[0] >= Duration::from_millis(99), "{after:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn after_a_429_the_default_pacing_paces_from_the_measured_rate() {
    // 400 successes, then one 429 whose Retry-After of 1.5 s, longer than the retry's own
    // backoff (500 ms) and than a whole second, shows a limit (under 2 s, the gate stays
    // open), then successes.
    let mut script = Script::new();
    for _ in 0..400 {
        script = script.then(Reply::success());
    }
    let server = MockServer::start(script.then(limited_for_1500_ms()))
        .await
        .unwrap();
    let fleet = Fleet::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    // One request every 5 ms (200/s) for 2 s, each answered at once: nothing paced.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..401 {
        tasks.spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(scope.pace().is_some(), server.request_count() > 400);
    }
    // The 401st was refused: the pacing woke at the rate it measured over the last second,
    // 200/s, halved as at the end of slow start.
    let pace = scope.pace().unwrap();
    assert!((pace - 100.0).abs() < 2.0, "{pace}");
    // From now on attempts leave 1 / pace apart: a burst of 20 (and the 429's retry, which
    // comes 1.5 s after it) is spaced.
    let origin = Instant::now();
    for _ in 0..20 {
        tasks.spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    }
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    let mut got: Vec<_> = server
        .requests()
        .iter()
        .filter(|r| r.received_at >= origin)
        .map(|r| r.received_at - origin)
        .filter(|d| *d < Duration::from_millis(400))
        .collect();
    got.sort();
    assert_eq!(got.len(), 20);
    // The turns are kept to the schedule that started with the wake, 5 ms before the
    // burst: the first goes at once, each next 1 / pace after the turn before it (the
    // successes, each +0.05/s while others wait, move that by less than the timer's
    // millisecond).
    assert_eq!(got[0], Duration::ZERO);
    let woke = origin - Duration::from_millis(5);
    let gap = 1.0 / pace;
    for (k, at) in got.iter().enumerate().skip(1) {
        let since_wake = (origin + *at - woke).as_secs_f64();
        assert!(
            (since_wake - k as f64 * gap).abs() <= 0.001,
            "{got:?}, gap {gap}"
        );
    }
    assert_eq!(server.request_count(), 422);
}

#[tokio::test(start_paused = true)]
async fn random_503s_neither_wake_nor_slow_the_default_pacing() {
    // Every 10th of the first 100 answers a 503 without Retry-After.
    let script = Script::new().when({
        let n = AtomicU64::new(0);
        move |_| {
            let n = n.fetch_add(1, Ordering::SeqCst);
            (n < 100 && n % 10 == 9).then(|| Reply::status(503))
        }
    });
    let server = MockServer::start(script).await.unwrap();
    let fleet = Fleet::default();
    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..100 {
        tasks.spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    }
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    // The first attempts all at once, the ten retries together 500 ms later: not paced.
    let got = arrivals(&server, origin);
    assert_eq!(got.len(), 110);
    assert!(got[..100].iter().all(|d| d.is_zero()));
    assert!(got[100..]
        .iter()
        .all(|d| *d >= Duration::from_millis(500) && *d <= Duration::from_millis(501)));
    assert_eq!(scope.pace(), None);

    // Woken by a 429 with a Retry-After longer than the backoff, then 503s on paced
    // attempts: the pace does not move.
    server.push(limited_for_1500_ms());
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let woken = scope.pace().unwrap();
    for i in 0..30 {
        if i % 10 == 9 {
            server.push(Reply::status(503));
        }
        let res = svc
            .clone()
            .oneshot(with_key(&url, "sk-ant-key-a"))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    // The 429 and its retry, 30 requests, and the retries of their three 503s.
    assert_eq!(server.request_count(), 110 + 2 + 30 + 3);
    assert_eq!(scope.pace(), Some(woken));
}

/// Random refusals, not correlated with the rate (4 % `429`s without Retry-After, 4 %
/// overloads), are noise the retries absorb: the default pacing stays dormant and a healthy
/// request is not held at all. A burst of `429`s, a limit the scope's rate meets, wakes it,
/// and the read-outs say why.
#[tokio::test(start_paused = true)]
async fn random_429s_and_overloads_do_not_hold_healthy_requests_a_burst_of_429s_paces() {
    let noisy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let script = Script::new().when({
        let n = AtomicU64::new(0);
        let noisy = noisy.clone();
        move |_| {
            if !noisy.load(Ordering::SeqCst) {
                return None;
            }
            match n.fetch_add(1, Ordering::SeqCst) % 25 {
                7 => Some(Reply::status(429)),
                19 => Some(Reply::overloaded()),
                _ => None,
            }
        }
    });
    let server = MockServer::start(script).await.unwrap();
    let fleet = Fleet::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    // One request every 5 ms (200/s) for 2 s.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..400 {
        let call = svc.clone().oneshot(with_key(&url, "sk-ant-key-a"));
        tasks.spawn(async move {
            let start = Instant::now();
            let res = call.await.unwrap();
            let attempts = res
                .extensions()
                .get::<RetryTrail>()
                .map_or(1, |t| t.total_attempts());
            (res.status(), attempts, Instant::now() - start)
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut healthy = 0;
    let mut retried = 0;
    let mut sent = 0;
    while let Some(res) = tasks.join_next().await {
        let (status, attempts, held) = res.unwrap();
        assert_eq!(status, StatusCode::OK);
        sent += attempts as usize;
        if attempts == 1 {
            // Answered at once: not held before it was sent.
            assert_eq!(held, Duration::ZERO);
            healthy += 1;
        } else {
            retried += 1;
        }
    }
    // The noise met 33 of the 400 requests (and two of their retries): each refused
    // attempt was retried, and the server saw every attempt.
    assert_eq!((healthy, retried), (367, 33));
    assert_eq!((sent, server.request_count()), (435, 435));
    assert_eq!(scope.pace(), None);
    assert_eq!(scope.pacing_state(), None);
    assert_eq!(fleet.paced_scopes(), 0);
    assert!(fleet.pacing_wakes().unwrap().iter().all(|(_, n)| *n == 0));

    // Now the server refuses twenty in a row, all it is sent: the scope meets a limit.
    noisy.store(false, Ordering::SeqCst);
    for _ in 0..20 {
        server.push(Reply::status(429));
    }
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..20 {
        tasks.spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    }
    while let Some(res) = tasks.join_next().await {
        assert_eq!(res.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert_eq!(scope.pacing_state(), Some(Some(PacingWake::RefusalShare)));
    assert!(scope.pace().is_some());
    assert_eq!(fleet.paced_scopes(), 1);
    let wakes = fleet.pacing_wakes().unwrap();
    assert_eq!(wakes[3], (PacingWake::RefusalShare, 1));
    assert_eq!(wakes.iter().map(|(_, n)| n).sum::<u64>(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_scope_map_is_bounded_and_scopes_past_the_bound_share_the_fleets_own_state() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let fleet = Fleet::default();
    let url = server.url("/v1/messages");
    // Every scope held (as by requests in flight).
    let held: Vec<Fleet> = (0..4_096)
        .map(|k| fleet.scope_for(&with_key(&url, &format!("sk-ant-key-{k}"))))
        .collect();
    assert!(held.iter().all(|s| !s.ptr_eq(&fleet)));
    assert_eq!(fleet.scopes().len(), 4_096);
    // A known scope is still its own; a new one gets the fleet's own state, and the map
    // stays as it is.
    let known = fleet.scope_for(&with_key(&url, "sk-ant-key-7"));
    assert!(known.ptr_eq(&held[7]));
    assert!(fleet
        .scope_for(&with_key(&url, "sk-ant-key-new"))
        .ptr_eq(&fleet));
    assert_eq!(fleet.scopes().len(), 4_096);
    // A request past the bound goes out, counted in the fleet's own budget.
    let svc = RetryLayer::new().fleet(fleet.clone()).layer(http_client());
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-new"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(fleet.budget_stats().unwrap().first_attempts, 1);
    assert_eq!(fleet.scopes().len(), 4_096);
    // Once a scope is no longer held, a new credential takes its place (rotating tokens do
    // not fill the map for good): its own state, and the map no larger.
    drop(known);
    let freed: Vec<Fleet> = held
        .into_iter()
        .enumerate()
        .filter_map(|(i, s)| (i != 9).then_some(s))
        .collect();
    let rotated = fleet.scope_for(&with_key(&url, "sk-ant-key-rotated"));
    assert!(!rotated.ptr_eq(&fleet));
    assert!(freed.iter().all(|s| !s.ptr_eq(&rotated)));
    assert_eq!(fleet.scopes().len(), 4_096);
    // The freed scope (key 9) is the one that went: asked again, it is a fresh state.
    drop(rotated);
    let nine = fleet.scope_for(&with_key(&url, "sk-ant-key-9"));
    assert!(freed.iter().all(|s| !s.ptr_eq(&nine)));
    let res = svc
        .oneshot(with_key(&url, "sk-ant-key-rotated"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_under_2_s_leaves_the_default_gate_open_and_wakes_the_pacing() {
    let server = MockServer::start(Script::new().then(limited_for_1500_ms()))
        .await
        .unwrap();
    let fleet = Fleet::default();
    let planned = RetryPlanned::default();
    let svc = RetryLayer::new()
        .policy(exact())
        .observer(planned.clone())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    let notified = planned.0.notified();
    let first = tokio::spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    notified.await;
    let origin = server.requests()[0].received_at;
    // A token bucket's next token: not a cooldown for everyone, but a rate-limit signal.
    assert_eq!(scope.gate_closed_until(), None);
    assert_eq!(scope.gate_closings(), Some(0));
    assert_eq!(scope.pace(), Some(50.0));
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-a"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::ZERO);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    // The retry after its own Retry-After of 1.5 s.
    assert_eq!(arrivals(&server, origin)[2], Duration::from_millis(1_500));
}

/// The read-outs of the default fleet (the one `RetryLayer::new()` builds, kept per scope)
/// report over its scopes: after a `429` with `Retry-After: 3`, the gate is closed and
/// counted, the pacing is awake, and the budget counts the first attempts and the retry.
#[tokio::test(start_paused = true)]
async fn the_default_fleets_read_outs_report_its_scopes_after_traffic() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("3")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let layer = RetryLayer::new().policy(exact()).observer(planned.clone());
    let fleet = layer.get_fleet().clone();
    assert_eq!(fleet.gate_closed_until(), None);
    assert_eq!(fleet.gate_closings(), Some(0));
    assert_eq!(fleet.pace(), None);
    let stats = fleet.budget_stats().unwrap();
    assert_eq!((stats.first_attempts, stats.retries), (0, 0));

    let svc = layer.layer(http_client());
    let url = server.url("/v1/messages");
    let notified = planned.0.notified();
    let first = tokio::spawn(svc.clone().oneshot(with_key(&url, "sk-ant-key-a")));
    notified.await;
    let origin = server.requests()[0].received_at;
    // Key a's scope got the 429: the fleet's read-outs say so, as the scope's do.
    assert_eq!(fleet.scopes().len(), 1);
    assert_eq!(
        fleet.gate_closed_until(),
        Some(origin + Duration::from_secs(3))
    );
    assert_eq!(fleet.gate_closings(), Some(1));
    assert_eq!(fleet.pace(), Some(50.0));
    let stats = fleet.budget_stats().unwrap();
    assert_eq!((stats.first_attempts, stats.retries), (1, 1));

    // Key b, another scope: its first attempt is counted, its pace woke with none.
    let res = svc
        .clone()
        .oneshot(with_key(&url, "sk-ant-key-b"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
    assert_eq!(Instant::now() - origin, Duration::from_secs(3));
    assert_eq!(fleet.scopes().len(), 2);
    let stats = fleet.budget_stats().unwrap();
    assert_eq!(
        (stats.first_attempts, stats.retries, stats.refused),
        (2, 1, 0)
    );
    // Summed over the scopes: each reads its own.
    let a = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    let b = fleet.scope_for(&with_key(&url, "sk-ant-key-b"));
    assert_eq!(a.budget_stats().unwrap().first_attempts, 1);
    assert_eq!(b.budget_stats().unwrap().first_attempts, 1);
    assert_eq!((a.gate_closings(), b.gate_closings()), (Some(1), Some(0)));
    assert_eq!((a.pace().is_some(), b.pace()), (true, None));
    assert_eq!(fleet.pace(), a.pace());
    assert_eq!(fleet.gate_closed_until(), None);
    assert_eq!(fleet.gate_closings(), Some(1));
}

/// A stack in front of `server` whose fleet's dormant pacing warms a new scope up for 3 s,
/// its fleet, the URL and the scope of `sk-ant-key-a`.
fn warming_stack(
    server: &MockServer,
) -> (
    tower_llm_retry::retry::Retry<HttpClient>,
    Fleet,
    String,
    Fleet,
) {
    let fleet = Fleet::builder()
        .pacing(Some(PacingConfig::new().warm_up(Duration::from_secs(3))))
        .build();
    let svc = RetryLayer::new()
        .policy(exact())
        .fleet(fleet.clone())
        .layer(http_client());
    let url = server.url("/v1/messages");
    let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
    (svc, fleet, url, scope)
}

/// `n` requests of `key` sent together at `svc`: their statuses, in the order they end.
async fn together<S, B>(svc: &S, url: &str, key: &str, n: usize) -> Vec<StatusCode>
where
    S: tower::Service<
            http::Request<http_body_util::Full<bytes::Bytes>>,
            Response = http::Response<B>,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let call = svc.clone().oneshot(with_key(url, key));
        tasks.spawn(async move { call.await.unwrap().status() });
    }
    let mut out = Vec::new();
    while let Some(status) = tasks.join_next().await {
        out.push(status.unwrap());
    }
    out
}

#[tokio::test(start_paused = true)]
async fn a_warm_up_spaces_a_new_scopes_first_burst_then_sleeps() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let (svc, fleet, url, scope) = warming_stack(&server);
    let origin = Instant::now();
    let statuses = together(&svc, &url, "sk-ant-key-a", 50).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    // Paced from the first attempt at 50/s, doubling every second while the line lasts: the
    // first at once, the next a gap (20 ms) after, the 50th when slow start has sent 49
    // more, log2(1 + 49 ln 2 / 50) = 0.75 s in.
    let at = arrivals(&server, origin);
    assert_eq!(at.len(), 50);
    assert_eq!(at[0], Duration::ZERO);
    assert_eq!(at[1], Duration::from_millis(20));
    assert!(
        at[49] >= Duration::from_millis(700) && at[49] <= Duration::from_millis(800),
        "{:?}",
        at[49]
    );
    // Paced from the start, with no evidence of a limit.
    assert_eq!(scope.pacing_state(), Some(None));
    assert_eq!(fleet.paced_scopes(), 1);
    // The warm-up over and no one in line, the next attempt finds it asleep, and a burst
    // then goes at once.
    tokio::time::sleep_until(origin + Duration::from_secs(3)).await;
    let later = Instant::now();
    let statuses = together(&svc, &url, "sk-ant-key-a", 50).await;
    assert!(statuses.iter().all(|s| *s == StatusCode::OK));
    let at = arrivals(&server, later);
    assert_eq!(at[50..], [Duration::ZERO; 50]);
    assert_eq!(scope.pacing_state(), None);
    assert_eq!(fleet.paced_scopes(), 0);
    assert_eq!(fleet.pacing_wakes().unwrap().map(|(_, n)| n), [0; 4]);
}

#[tokio::test(start_paused = true)]
async fn a_limit_met_during_the_warm_up_wakes_the_pacing_for_good_and_spares_the_first_second() {
    // A token bucket of 20 a second that holds one second's worth, as the proxy's storm
    // bench has, and 200 clients starting together: without a warm-up all 200 first attempts
    // go at once, 180 of them into refusals.
    let (mut first_second, mut second_second) = (Vec::new(), Vec::new());
    for warm_up in [Duration::ZERO, Duration::from_secs(3)] {
        let server = MockServer::start(
            Script::new().capacity(tower_llm_retry::mock::Capacity::token_bucket(20.0, 20)),
        )
        .await
        .unwrap();
        // No retry budget: every request is to end in a success, however many refusals.
        let fleet = Fleet::builder()
            .budget(None)
            .pacing(Some(PacingConfig::new().warm_up(warm_up)))
            .build();
        let svc = RetryLayer::new()
            .policy(exact().max_retries(20))
            .fleet(fleet.clone())
            .layer(http_client());
        let url = server.url("/v1/messages");
        let scope = fleet.scope_for(&with_key(&url, "sk-ant-key-a"));
        let origin = Instant::now();
        let statuses = together(&svc, &url, "sk-ant-key-a", 200).await;
        assert!(
            statuses.iter().all(|s| *s == StatusCode::OK),
            "{statuses:?}"
        );
        let at = arrivals(&server, origin);
        first_second.push(at.iter().filter(|t| **t < Duration::from_secs(1)).count());
        second_second.push(at.iter().filter(|t| t.as_secs() == 1).count());
        // Either way the burst of refusals is evidence, and the pacing stays awake.
        assert_eq!(scope.pacing_state(), Some(Some(PacingWake::RefusalShare)));
        tokio::time::sleep_until(origin + Duration::from_secs(60)).await;
        let _ = together(&svc, &url, "sk-ant-key-a", 1).await;
        assert_eq!(scope.pacing_state(), Some(Some(PacingWake::RefusalShare)));
    }
    assert_eq!(first_second[0], 200, "{first_second:?}");
    // 50/s doubling: 72 attempts in the first second, less those held behind the
    // evidence's halving.
    assert!(first_second[1] <= 72, "{first_second:?}");
    // Woken from the warm-up, the rate falls to the share of it the server admitted (about
    // a quarter, here) at once, not by half and then 5 % a round: the next second holds
    // about the capacity's worth of attempts (without a warm-up, 144).
    assert!(second_second[1] <= 25, "{second_second:?}");
}

#[tokio::test(start_paused = true)]
async fn a_random_429_during_the_warm_up_neither_wakes_nor_slows_it() {
    // The same burst twice, once with a lone 429 (no Retry-After) for its third attempt.
    let mut times = Vec::new();
    for noisy in [false, true] {
        let n = AtomicU64::new(0);
        let script = Script::new().when(move |_| {
            (noisy && n.fetch_add(1, Ordering::SeqCst) == 2).then(|| Reply::status(429))
        });
        let server = MockServer::start(script).await.unwrap();
        let (svc, _, url, scope) = warming_stack(&server);
        let origin = Instant::now();
        let statuses = together(&svc, &url, "sk-ant-key-a", 40).await;
        assert!(statuses.iter().all(|s| *s == StatusCode::OK));
        assert_eq!(scope.pacing_state(), Some(None));
        times.push(arrivals(&server, origin));
    }
    // The refused attempt's retry is one more in line; the first 40 turns are the same
    // turns: the refusal did not halve the rate.
    assert_eq!(times[1].len(), 41);
    assert_eq!(times[0][..40], times[1][..40]);
}
