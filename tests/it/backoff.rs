//! Exact sleeps under paused time: the backoff sequence, jitter bands and every form of
//! Retry-After, measured both from the observer and from the server's arrival times.

use std::time::{Duration, SystemTime};

use crate::common::*;
use http::StatusCode;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::DefaultClassifier;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{Jitter, Random};
use tower_llm_retry::{RetryLayer, RetryPolicy};

fn secs(v: &[f64]) -> Vec<Duration> {
    v.iter().map(|s| Duration::from_secs_f64(*s)).collect()
}

/// Time between consecutive requests, as the server saw them.
fn gaps(server: &MockServer) -> Vec<Duration> {
    let reqs = server.requests();
    reqs.windows(2)
        .map(|w| w[1].received_at - w[0].received_at)
        .collect()
}

async fn run_with(
    layer: RetryLayer<impl tower_llm_retry::classify::Classify + Clone>,
    script: Script,
) -> (MockServer, StatusCode) {
    let server = MockServer::start(script).await.unwrap();
    let svc = ServiceBuilder::new().layer(layer).service(http_client());
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let status = res.status();
    let _ = body_bytes(res).await;
    (server, status)
}

#[tokio::test(start_paused = true)]
async fn default_sequence_without_jitter() {
    let recorder = Recorder::default();
    let mut script = Script::new();
    for _ in 0..10 {
        script = script.then(Reply::status(503));
    }
    let layer = RetryLayer::new()
        .policy(RetryPolicy::default().jitter(Jitter::none()))
        .observer(recorder.clone());
    let (server, status) = run_with(layer, script.then(Reply::success())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server.request_count(), 11);
    let want = secs(&[0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 32.0, 32.0, 32.0]);
    assert_eq!(recorder.delays(), want);
    assert_eq!(gaps(&server), want);
}

#[tokio::test(start_paused = true)]
async fn default_jitter_stays_in_band() {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(RetryPolicy::default().max_retries(8))
        .observer(recorder.clone());
    let (server, status) = run_with(layer, Script::always(Reply::status(500))).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let delays = recorder.delays();
    assert_eq!(delays.len(), 8);
    for (n, (d, gap)) in delays.iter().zip(gaps(&server)).enumerate() {
        let base = Duration::from_millis(500) * 2u32.pow(n as u32);
        let base = base.min(Duration::from_secs(32));
        assert!(*d >= base && *d <= base.mul_f64(1.25), "retry {n}: {d:?}");
        // The timer wheel has millisecond resolution and rounds deadlines up.
        assert!(
            gap >= *d && gap < *d + Duration::from_millis(1),
            "{gap:?} vs {d:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn seeded_jitter_is_reproducible() {
    let mut runs = Vec::new();
    for _ in 0..2 {
        let recorder = Recorder::default();
        let layer = RetryLayer::new()
            .policy(RetryPolicy::sdk_compatible().random(Random::seeded(42)))
            .observer(recorder.clone());
        run_with(layer, Script::always(Reply::overloaded())).await;
        runs.push(recorder.delays());
    }
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0].len(), 2);
    // The SDK band: min(0.5 s · 2^(n−1), 8 s) × [0.75, 1].
    assert!(runs[0][0] > Duration::from_millis(375) && runs[0][0] <= Duration::from_millis(500));
    assert!(runs[0][1] > Duration::from_millis(750) && runs[0][1] <= Duration::from_millis(1000));
}

async fn delay_for(reply: Reply, classifier: DefaultClassifier) -> Vec<Duration> {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(RetryPolicy::default().jitter(Jitter::none()))
        .classifier(classifier)
        .observer(recorder.clone());
    let (server, status) = run_with(layer, Script::new().then(reply).then(Reply::success())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(recorder.delays(), gaps(&server));
    recorder.delays()
}

#[tokio::test(start_paused = true)]
async fn retry_after_in_every_form() {
    let fixed_now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600); // 2026-01-01T00:00:00Z
    let clock = move || DefaultClassifier::with_clock(move || fixed_now);
    let cases: Vec<(Reply, Duration)> = vec![
        (
            Reply::status(429).header("retry-after-ms", "1500"),
            Duration::from_millis(1500),
        ),
        (Reply::rate_limited("3"), Duration::from_secs(3)),
        (Reply::rate_limited("0.25"), Duration::from_millis(250)),
        (
            Reply::status(529)
                .header("retry-after-ms", "700")
                .header("retry-after", "9"),
            Duration::from_millis(700),
        ),
        (
            Reply::rate_limited("Thu, 01 Jan 2026 00:00:07 GMT"),
            Duration::from_secs(7),
        ),
        // In the past, or garbage: absent, so the backoff applies.
        (
            Reply::rate_limited("Wed, 31 Dec 2025 23:00:00 GMT"),
            Duration::from_millis(500),
        ),
        (Reply::rate_limited("soon"), Duration::from_millis(500)),
        (Reply::rate_limited("-5"), Duration::from_millis(500)),
        (Reply::rate_limited("nan"), Duration::from_millis(500)),
        // Duplicate headers: the first value wins.
        (
            Reply::status(429)
                .header("retry-after", "2")
                .header("retry-after", "40"),
            Duration::from_secs(2),
        ),
    ];
    for (reply, want) in cases {
        let desc = format!("{reply:?}");
        assert_eq!(delay_for(reply, clock()).await, vec![want], "{desc}");
    }
}

/// An HTTP-date is read against the response's `Date`: the wait is the server's, whatever the
/// host's clock says (here the dates are months before it, so the system clock would call
/// them past and fall back to the backoff).
#[tokio::test(start_paused = true)]
async fn http_date_retry_after_is_read_against_the_servers_date() {
    let reply = Reply::rate_limited("Thu, 01 Jan 2026 00:00:07 GMT")
        .header("date", "Thu, 01 Jan 2026 00:00:03 GMT");
    assert_eq!(
        delay_for(reply, DefaultClassifier::new()).await,
        vec![Duration::from_secs(4)]
    );
    // A `Date` that does not parse leaves the system clock, for which this date is past.
    let reply = Reply::rate_limited("Thu, 01 Jan 2026 00:00:07 GMT").header("date", "now-ish");
    assert_eq!(
        delay_for(reply, DefaultClassifier::new()).await,
        vec![Duration::from_millis(500)]
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_applies_only_to_the_next_sleep() {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(RetryPolicy::default().jitter(Jitter::none()))
        .observer(recorder.clone());
    let script = Script::new()
        .then(Reply::rate_limited("5"))
        .then(Reply::status(503))
        .then(Reply::status(503))
        .then(Reply::success());
    let (server, _) = run_with(layer, script).await;
    assert_eq!(recorder.delays(), secs(&[5.0, 1.0, 2.0]));
    assert_eq!(gaps(&server), secs(&[5.0, 1.0, 2.0]));
}

#[tokio::test(start_paused = true)]
async fn sdk_compatible_ignores_an_over_long_retry_after_but_still_retries() {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(RetryPolicy::sdk_compatible().jitter(Jitter::none()))
        .observer(recorder.clone());
    let script = Script::new()
        .then(Reply::rate_limited("3600"))
        .then(Reply::rate_limited("0"))
        .then(Reply::success());
    let (server, status) = run_with(layer, script).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(server.request_count(), 3);
    assert_eq!(recorder.delays(), secs(&[0.5, 1.0]));
}

#[tokio::test(start_paused = true)]
async fn patient_clamps_retry_after() {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(RetryPolicy::patient().jitter(Jitter::none()))
        .observer(recorder.clone());
    let script = Script::new()
        .then(Reply::rate_limited("86400"))
        .then(Reply::rate_limited("1"))
        .then(Reply::success());
    let (server, _) = run_with(layer, script).await;
    assert_eq!(recorder.delays(), secs(&[60.0, 5.0]));
    assert_eq!(gaps(&server), secs(&[60.0, 5.0]));
}

#[tokio::test(start_paused = true)]
async fn backoff_floor_under_retry_after() {
    let recorder = Recorder::default();
    let layer = RetryLayer::new()
        .policy(
            RetryPolicy::default()
                .jitter(Jitter::none())
                .backoff_is_floor(true),
        )
        .observer(recorder.clone());
    let script = Script::new()
        .then(Reply::status(503))
        .then(Reply::rate_limited("0.1"))
        .then(Reply::success());
    run_with(layer, script).await;
    assert_eq!(recorder.delays(), secs(&[0.5, 1.0]));
}
