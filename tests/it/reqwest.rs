//! The reqwest adapter and the reqwest-middleware integration, against the mock over
//! 127.0.0.1 under paused time.

use std::time::Duration;

use crate::common::*;
use bytes::{Bytes, BytesMut};
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{sse, MockServer, Reply, Script};
use tower_llm_retry::reqwest::ReqwestService;
use tower_llm_retry::reqwest_middleware::RetryMiddleware;
use tower_llm_retry::retry::{GiveUpReason, Jitter, NoRetry, NotReplaySafe};
use tower_llm_retry::stream::StreamCommitted;
use tower_llm_retry::{Error, ErrorKind, RetryLayer, RetryPolicy, RetryTrail};

fn client() -> reqwest::Client {
    reqwest_builder().build().unwrap()
}

fn layer(recorder: &Recorder) -> RetryLayer {
    RetryLayer::new()
        .policy(RetryPolicy::default().jitter(Jitter::none()))
        .observer(recorder.clone())
}

fn gaps(server: &MockServer) -> Vec<Duration> {
    server
        .requests()
        .windows(2)
        .map(|w| w[1].received_at - w[0].received_at)
        .collect()
}

fn faults() -> Script {
    Script::new()
        .then(Reply::overloaded().header("retry-after", "3"))
        .then(Reply::rate_limited("1.5"))
        .then(Reply::reset())
        .then(Reply::success())
}

#[tokio::test(start_paused = true)]
async fn adapter_retries_with_retry_after_and_identical_bodies() {
    let server = MockServer::start(faults()).await.unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(layer(&recorder))
        .service(ReqwestService::new(client()));
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.total_attempts(), 4);
    assert_eq!(trail.attempts()[0].class, FailureClass::Overloaded);
    assert_eq!(
        gaps(&server),
        [
            Duration::from_secs(3),
            Duration::from_millis(1500),
            Duration::from_secs(2)
        ]
    );
    let reqs = server.requests();
    for r in &reqs {
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()));
        assert_eq!(r.headers["anthropic-version"], "2023-06-01");
    }
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&body)
        .unwrap()
        .contains("\"type\":\"message\""));
}

#[tokio::test(start_paused = true)]
async fn adapter_streams_sse_through_the_gate() {
    let bad = vec![
        sse::anthropic_message(&[])[0].clone(),
        sse::anthropic_error("overloaded_error"),
    ];
    let good = sse::anthropic_message(&["over ", "reqwest"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(bad))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer(&Recorder::default()))
        .service(ReqwestService::new(client()));
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(res.extensions().get::<StreamCommitted>().is_some());
    let bytes = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(bytes, concat(&good));
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn adapter_retries_refused_connections_even_when_not_replay_safe() {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            layer(&recorder).policy(RetryPolicy::default().max_retries(2).jitter(Jitter::none())),
        )
        .service(ReqwestService::new(client()));
    let mut req = anthropic_request(&format!("http://{addr}/v1/messages"), BODY);
    req.extensions_mut().insert(NotReplaySafe);
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert_eq!(err.trail().unwrap().total_attempts(), 3);
    assert_eq!(recorder.delays().len(), 2);
}

fn middleware_client(recorder: &Recorder) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(client())
        .with(RetryMiddleware::new(layer(recorder)))
        .build()
}

#[tokio::test(start_paused = true)]
async fn middleware_retries_with_retry_after_and_identical_bodies() {
    let server = MockServer::start(faults()).await.unwrap();
    let recorder = Recorder::default();
    let res = middleware_client(&recorder)
        .post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(BODY)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.url().as_str(), server.url("/v1/messages"));
    let trail = res.extensions().get::<RetryTrail>().unwrap().clone();
    assert_eq!(trail.total_attempts(), 4);
    assert_eq!(
        gaps(&server),
        [
            Duration::from_secs(3),
            Duration::from_millis(1500),
            Duration::from_secs(2)
        ]
    );
    assert_eq!(recorder.seen().last(), Some(&Seen::Recovered(4)));
    for r in server.requests() {
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()));
        assert_eq!(r.headers["content-type"], "application/json");
    }
    let text = res.text().await.unwrap();
    assert!(text.contains("\"type\":\"message\""));
}

#[tokio::test(start_paused = true)]
async fn middleware_streams_sse() {
    let bad = vec![
        sse::anthropic_message(&[])[0].clone(),
        sse::anthropic_error("overloaded_error"),
    ];
    let good = sse::anthropic_message(&["via ", "middleware"]);
    let server = MockServer::start(
        Script::new()
            .then(Reply::sse(bad))
            .then(Reply::sse(good.clone())),
    )
    .await
    .unwrap();
    let res = middleware_client(&Recorder::default())
        .post(server.url("/v1/messages"))
        .body(BODY)
        .send()
        .await
        .unwrap();
    let mut out = BytesMut::new();
    let mut res = res;
    while let Some(chunk) = res.chunk().await.unwrap() {
        out.extend_from_slice(&chunk);
    }
    assert_eq!(out.freeze(), concat(&good));
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn middleware_exhaustion_is_a_typed_error() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let client = reqwest_middleware::ClientBuilder::new(client())
        .with(RetryMiddleware::new(layer(&recorder).policy(
            RetryPolicy::default().max_retries(2).jitter(Jitter::none()),
        )))
        .build();
    let err = client
        .post(server.url("/v1/messages"))
        .body(
            Full::new(Bytes::from_static(BODY.as_bytes()))
                .collect()
                .await
                .unwrap()
                .to_bytes(),
        )
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(e) = err else {
        panic!("expected a middleware error, got {err:?}");
    };
    let ours = e.downcast_ref::<Error>().expect("the crate's error");
    assert_eq!(ours.kind(), ErrorKind::Exhausted);
    assert_eq!(ours.trail().unwrap().total_attempts(), 3);
    assert_eq!(server.request_count(), 3);
}

/// The crate's error inside a middleware error.
fn crate_error(err: &reqwest_middleware::Error) -> &Error {
    let reqwest_middleware::Error::Middleware(e) = err else {
        panic!("expected a middleware error, got {err:?}");
    };
    e.downcast_ref::<Error>().expect("the crate's error")
}

/// A not-replay-safe request reset after the server read it: the loop gave up at once, for
/// that reason, and the caller gets the chain's error.
fn assert_gave_up_after_a_reset(err: &reqwest_middleware::Error, recorder: &Recorder) {
    assert!(
        matches!(
            recorder.seen().as_slice(),
            [Seen::GaveUp(trail)] if trail.gave_up() == Some(GiveUpReason::NotReplaySafe)
        ),
        "{:?}",
        recorder.seen()
    );
    // Not retried at all, so the chain's own error comes back as it was.
    let reqwest_middleware::Error::Reqwest(e) = err else {
        panic!("expected the chain's reqwest error, got {err:?}");
    };
    assert!(
        e.is_request() && !e.is_connect() && !e.is_timeout(),
        "{e:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn middleware_not_replay_safe_extension_is_sent_once_after_a_reset() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let err = middleware_client(&recorder)
        .post(server.url("/v1/messages"))
        .body(BODY)
        .with_extension(NotReplaySafe)
        .send()
        .await
        .unwrap_err();
    assert_eq!(server.request_count(), 1);
    assert_gave_up_after_a_reset(&err, &recorder);
}

#[tokio::test(start_paused = true)]
async fn middleware_not_replay_safe_in_the_request_itself_is_sent_once_after_a_reset() {
    let server = MockServer::start(Script::always(Reply::reset()))
        .await
        .unwrap();
    let mut req = http::Request::post(server.url("/v1/messages"))
        .body(BODY)
        .unwrap();
    req.extensions_mut().insert(NotReplaySafe);
    let req = reqwest::Request::try_from(req).unwrap();
    let recorder = Recorder::default();
    let err = middleware_client(&recorder).execute(req).await.unwrap_err();
    assert_eq!(server.request_count(), 1);
    assert_gave_up_after_a_reset(&err, &recorder);
}

#[tokio::test(start_paused = true)]
async fn middleware_no_retry_extension_sends_a_503_once() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let res = middleware_client(&Recorder::default())
        .post(server.url("/v1/messages"))
        .body(BODY)
        .with_extension(NoRetry)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 1);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
}

#[tokio::test(start_paused = true)]
async fn middleware_policy_extension_replaces_the_layer_policy() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let res = middleware_client(&recorder)
        .post(server.url("/v1/messages"))
        .body(BODY)
        .with_extension(RetryPolicy::default().max_retries(1).jitter(Jitter::none()))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 2);
    assert_eq!(
        res.extensions()
            .get::<RetryTrail>()
            .unwrap()
            .total_attempts(),
        2
    );
    assert_eq!(recorder.delays(), [Duration::from_millis(500)]);
}

#[tokio::test(start_paused = true)]
async fn middleware_keeps_the_per_request_timeout_on_every_attempt() {
    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let recorder = Recorder::default();
    let client = reqwest_middleware::ClientBuilder::new(client())
        .with(RetryMiddleware::new(layer(&recorder).policy(
            RetryPolicy::default().max_retries(1).jitter(Jitter::none()),
        )))
        .build();
    let started = tokio::time::Instant::now();
    let err = client
        .post(server.url("/v1/messages"))
        .body(BODY)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .unwrap_err();
    // Each attempt waited 5 s (reqwest's timeout, not the layer's 600 s head timeout),
    // with the 0.5 s backoff between them.
    assert_eq!(server.request_count(), 2);
    assert_eq!(gaps(&server), [Duration::from_millis(5500)]);
    assert_eq!(started.elapsed(), Duration::from_millis(10_500));
    let ours = crate_error(&err);
    assert_eq!(ours.kind(), ErrorKind::Exhausted);
    let trail = ours.trail().unwrap();
    assert_eq!(trail.total_attempts(), 2);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Transport));
    let last =
        std::error::Error::source(ours).and_then(|e| e.downcast_ref::<reqwest_middleware::Error>());
    let Some(reqwest_middleware::Error::Reqwest(last)) = last else {
        panic!("expected reqwest's error as the last cause, got {ours:?}");
    };
    assert!(last.is_timeout(), "{last:?}");
}
