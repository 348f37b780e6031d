//! Dropping the future or firing the shutdown token ends a retrying request at once, and no
//! further request reaches the server.

use std::time::Duration;

use crate::common::*;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::GiveUpReason;
use tower_llm_retry::{ErrorKind, RetryLayer};

#[tokio::test(start_paused = true)]
async fn dropping_the_future_mid_sleep_stops_everything() {
    let server = MockServer::start(Script::new().then(Reply::rate_limited("30")))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let fut = svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY));
    let outcome = tokio::time::timeout(Duration::from_secs(10), fut).await;
    assert!(outcome.is_err(), "still sleeping at 10 s");
    // Well past the 30 s the server asked for: nothing more arrives.
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(server.request_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn shutdown_token_ends_every_sleeping_retry_at_once() {
    let server = MockServer::start(Script::always(Reply::rate_limited("30")))
        .await
        .unwrap();
    let token = CancellationToken::new();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().cancellation(token.clone()))
        .service(http_client());
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..10 {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tasks.spawn(async move {
            let r = svc.oneshot(req).await;
            (r, Instant::now())
        });
    }
    let canceller = token.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        canceller.cancel();
    });
    let mut n = 0;
    while let Some(joined) = tasks.join_next().await {
        let (outcome, at) = joined.unwrap();
        let err = outcome.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Cancelled);
        assert_eq!(
            err.trail().unwrap().gave_up(),
            Some(GiveUpReason::Cancelled)
        );
        assert_eq!(err.trail().unwrap().total_attempts(), 1);
        assert_eq!(at - start, Duration::from_secs(5));
        n += 1;
    }
    assert_eq!(n, 10);
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert_eq!(server.request_count(), 10);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_token_prevents_new_retries() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let token = CancellationToken::new();
    token.cancel();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().cancellation(token))
        .service(http_client());
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled);
    assert_eq!(server.request_count(), 1);
}
