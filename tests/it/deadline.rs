//! The request deadline (`RetryPolicy::deadline`) caps every wait of the retry loop: at the
//! cooldown gate, in the pacing line, for the inner service to be ready, the backoff, and the
//! read of the start of an answer before it is judged. No
//! attempt starts after it; a request that cannot start in time ends with
//! `ErrorKind::DeadlineExceeded` and its trail. Real HTTP on 127.0.0.1, paused time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::*;
use http::{Request, StatusCode};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_llm_retry::fleet::{Fleet, GateConfig, PacingConfig};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{GiveUpReason, Jitter, Random, TimedOut};
use tower_llm_retry::{ErrorKind, ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

fn exact() -> RetryPolicy {
    RetryPolicy::default()
        .jitter(Jitter::none())
        .random(Random::from_fn(|| 0.0))
}

/// A policy for one request: exact sleeps, and a total deadline.
fn with_deadline(secs: u64) -> RetryPolicy {
    exact().deadline(Some(Duration::from_secs(secs)))
}

fn gated(gate: GateConfig, planned: &RetryPlanned) -> tower_llm_retry::retry::Retry<HttpClient> {
    ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact())
                .observer(planned.clone())
                .fleet(Fleet::builder().cooldown_gate(Some(gate)).build()),
        )
        .service(http_client())
}

/// Closes the gate with the server's first reply; the handle is that request.
async fn close_gate(
    server: &MockServer,
    svc: &tower_llm_retry::retry::Retry<HttpClient>,
    planned: &RetryPlanned,
) -> tokio::task::JoinHandle<Result<StatusCode, ErrorKind>> {
    close_with(server, svc, planned).await.0
}

fn assert_deadline_error(err: &tower_llm_retry::Error, deadline: Duration, attempts: u32) {
    assert_eq!(err.kind(), ErrorKind::DeadlineExceeded, "{err}");
    // The kind says it was the deadline; the source names the deadline.
    let source = std::error::Error::source(err).expect("the error has a source");
    assert!(source.downcast_ref::<TimedOut>().is_none());
    assert_eq!(
        source.to_string(),
        format!("request deadline of {deadline:?} reached")
    );
    let trail = err.trail().expect("the error carries the trail");
    assert_eq!(trail.gave_up(), Some(GiveUpReason::Deadline));
    assert_eq!(trail.total_attempts(), attempts);
}

#[tokio::test(start_paused = true)]
async fn a_gate_closed_past_the_deadline_ends_the_request_at_once() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("60")))
        .await
        .unwrap();
    let planned = RetryPlanned::default();
    let svc = gated(GateConfig::new().min_close(Duration::ZERO), &planned);
    let first = close_gate(&server, &svc, &planned).await;

    // The gate stays closed 60 s; this request has 10 s in all, so it cannot start in time.
    let start = Instant::now();
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(with_deadline(10));
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert_eq!(Instant::now() - start, Duration::ZERO);
    assert_deadline_error(&err, Duration::from_secs(10), 0);
    assert_eq!(server.request_count(), 1);

    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_gate_spread_never_carries_a_request_past_its_deadline() {
    // The gate closes for 8 s with a spread of 50 %: a waiter whose share of the spread is
    // 0.99 would leave at 8 s + 3.96 s, past its 10 s deadline. It leaves when the gate opens.
    let server = MockServer::start(Script::new().then(Reply::rate_limited("8")))
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
                .policy(exact().random(Random::from_fn(|| 0.99)))
                .observer(planned.clone())
                .fleet(Fleet::builder().cooldown_gate(Some(gate)).build()),
        )
        .service(http_client());
    let first = close_gate(&server, &svc, &planned).await;
    let origin = server.requests()[0].received_at;

    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut()
        .insert(with_deadline(10).random(Random::from_fn(|| 0.99)));
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.extensions().get::<RetryTrail>().is_none());
    let waited = Instant::now() - origin;
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_millis(8_002),
        "{waited:?}"
    );
    assert_eq!(first.await.unwrap(), Ok(StatusCode::OK));
}

#[tokio::test(start_paused = true)]
async fn a_retry_the_gate_would_hold_past_the_deadline_returns_the_response_in_hand() {
    // This request is in flight when another one closes the gate for 60 s. Its own answer, a
    // 503, has a backoff (0.5 s) well inside its 10 s deadline, but the retry would wait at
    // the gate past it: the 503 is returned at once, with the trail, not after a wait in vain.
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503).delay(Duration::from_secs(2)))
            .then(Reply::rate_limited("60")),
    )
    .await
    .unwrap();
    let planned = RetryPlanned::default();
    let svc = gated(GateConfig::new().min_close(Duration::ZERO), &planned);
    let start = Instant::now();
    let slow = {
        let svc = svc.clone();
        let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
        req.extensions_mut().insert(with_deadline(10));
        tokio::spawn(async move { (svc.oneshot(req).await, Instant::now()) })
    };
    while server.request_count() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let _closer = close_gate(&server, &svc, &planned).await;

    let (outcome, at) = slow.await.unwrap();
    let res = outcome.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::Deadline));
    assert_eq!(trail.total_attempts(), 1);
    let took = at - start;
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_millis(2_002),
        "{took:?}"
    );
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_wait_in_the_pacing_line_ends_at_the_deadline() {
    // One request a second; five requests in line, each with a 2.5 s deadline: the turns at
    // 0, 1 and 2 s are taken, the ones at 3 and 4 s would come too late.
    let server = MockServer::start(Script::new()).await.unwrap();
    let pacing = PacingConfig::new()
        .dormant(false)
        .burst(Duration::ZERO)
        .unwrap()
        .rates(1.0, 1.0, 1.0)
        .unwrap()
        .decrease(0.5)
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact().deadline(Some(Duration::from_millis(2_500))))
                .fleet(Fleet::builder().pacing(Some(pacing)).build()),
        )
        .service(http_client());
    let origin = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..5u32 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move { (i, svc.oneshot(req).await, Instant::now()) });
        tokio::task::yield_now().await;
    }
    let mut ended = Vec::new();
    while let Some(j) = tasks.join_next().await {
        let (i, outcome, at) = j.unwrap();
        ended.push((i, outcome.map(|r| r.status()), at - origin));
    }
    ended.sort_by_key(|e| e.0);
    for (i, outcome, at) in &ended {
        match i {
            0..=2 => assert_eq!(outcome.as_ref().unwrap(), &StatusCode::OK),
            _ => {
                let err = outcome.as_ref().unwrap_err();
                assert_deadline_error(err, Duration::from_millis(2_500), 0);
                assert!(*at <= Duration::from_millis(2_500), "{i} ended at {at:?}");
            }
        }
    }
    assert_eq!(server.request_count(), 3);
    // Nothing more is sent later.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(server.request_count(), 3);
}

/// An inner service that is ready for its first request and never again: a retry waits on
/// its `poll_ready` (it registers no waker; only the loop's own watch ends the wait).
#[derive(Clone)]
struct ReadyOnce<S> {
    inner: S,
    used: Arc<AtomicBool>,
}

impl<S> Service<Request<ReplayBody>> for ReadyOnce<S>
where
    S: Service<Request<ReplayBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.used.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReplayBody>) -> Self::Future {
        self.used.store(true, Ordering::SeqCst);
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn a_service_that_never_gets_ready_again_ends_at_the_deadline() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(with_deadline(5)))
        .service(ReadyOnce {
            inner: http_client(),
            used: Arc::default(),
        });
    let start = Instant::now();
    // Bounded, so a loop that does not watch the deadline fails here instead of hanging.
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
    )
    .await
    .expect("the deadline ends the wait")
    .unwrap_err();
    assert_eq!(Instant::now() - start, Duration::from_secs(5));
    assert_deadline_error(&err, Duration::from_secs(5), 1);
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn cancellation_ends_a_wait_for_the_service_to_be_ready() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let token = CancellationToken::new();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact())
                .cancellation(token.clone()),
        )
        .service(ReadyOnce {
            inner: http_client(),
            used: Arc::default(),
        });
    let start = Instant::now();
    let task = tokio::spawn(async move {
        // Bounded, so a loop that does not watch the token fails here instead of hanging.
        let outcome = tokio::time::timeout(
            Duration::from_secs(60),
            svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
        )
        .await
        .expect("the cancellation ends the wait");
        (outcome, Instant::now(), server)
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    token.cancel();
    let (outcome, at, server) = task.await.unwrap();
    let err = outcome.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled);
    assert_eq!(at - start, Duration::from_secs(3));
    assert_eq!(err.trail().unwrap().total_attempts(), 1);
    assert_eq!(server.request_count(), 1);
}

/// The loop reads the start of some answers before judging them: an error body, an event
/// stream up to its first output. A body that stalls there ends the request at its deadline,
/// not at the (much later) idle timeout, and the trail keeps the attempt it was reading.
#[tokio::test(start_paused = true)]
async fn a_body_that_stalls_while_the_loop_reads_it_ends_at_the_deadline() {
    use tower_llm_retry::classify::FailureClass;
    use tower_llm_retry::mock::SseFrame;
    let cases = [
        (
            Reply::stall_mid_body(503, "{\"type\":"),
            FailureClass::Server,
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (
            Reply::sse_then_stall(vec![SseFrame::new(
                "message_start",
                r#"{"type":"message_start","message":{}}"#,
            )]),
            FailureClass::Timeout,
            StatusCode::OK,
        ),
    ];
    for (reply, class, status) in cases {
        let server = MockServer::start(Script::always(reply)).await.unwrap();
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new().policy(with_deadline(10)))
            .service(http_client());
        let start = Instant::now();
        let err = tokio::time::timeout(
            Duration::from_secs(3600),
            svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY)),
        )
        .await
        .expect("the deadline ends the read")
        .unwrap_err();
        assert_eq!(Instant::now() - start, Duration::from_secs(10), "{class:?}");
        assert_deadline_error(&err, Duration::from_secs(10), 1);
        let record = &err.trail().unwrap().attempts()[0];
        assert_eq!(record.class, class);
        assert_eq!(record.status, Some(status));
        assert_eq!(server.request_count(), 1);
    }
}
