//! Every attempt sends the caller's bytes: hashed at the server, for `Full` and streamed
//! bodies; oversize and failing bodies send nothing; unsafe requests are not replayed.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{HeaderName, Request, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::retry::{
    AttemptContext, GiveUpReason, Jitter, NoRetry, NotReplaySafe, Override, TimedOut, TimeoutKind,
};
use tower_llm_retry::{ErrorKind, ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

/// A request body that arrives in chunks, with no length known up front.
struct Chunked {
    chunks: Vec<Bytes>,
    fail_at: Option<usize>,
}

impl Chunked {
    fn new(data: &[u8], chunk: usize) -> Self {
        Chunked {
            chunks: data
                .chunks(chunk)
                .rev()
                .map(Bytes::copy_from_slice)
                .collect(),
            fail_at: None,
        }
    }
}

impl Body for Chunked {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if self.fail_at == Some(self.chunks.len()) {
            return Poll::Ready(Some(Err(std::io::Error::other("client body broke"))));
        }
        Poll::Ready(self.chunks.pop().map(|c| Ok(Frame::data(c))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

fn payload(len: usize) -> Vec<u8> {
    // Not all zeroes, so a reordering or a dropped chunk changes the hash.
    (0..len).map(|i| (i * 31 % 251) as u8).collect()
}

fn faults() -> Script {
    Script::new()
        .then(Reply::status(503))
        .then(Reply::rate_limited("1"))
        .then(Reply::reset())
        .then(Reply::overloaded())
        .then(Reply::success())
}

#[tokio::test(start_paused = true)]
async fn full_body_is_byte_identical_on_every_attempt() {
    let server = MockServer::start(faults()).await.unwrap();
    let data = Bytes::from(payload(256 * 1024));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-custom", "kept")
        .body(Full::new(data.clone()))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 5);
    let want = sha256(&data);
    for (i, r) in seen.iter().enumerate() {
        assert_eq!(sha256(&r.body), want, "attempt {i}");
        assert_eq!(r.headers["x-custom"], "kept");
        assert_eq!(r.headers["content-type"], "application/json");
        assert_eq!(r.method, http::Method::POST);
        assert_eq!(r.uri.path(), "/v1/messages");
    }
}

#[tokio::test(start_paused = true)]
async fn streamed_body_is_buffered_once_and_replayed_identically() {
    let server = MockServer::start(faults()).await.unwrap();
    let data = payload(1024 * 1024 + 17);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Chunked::new(&data, 8 * 1024 + 3))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 5);
    for r in &seen {
        assert_eq!(sha256(&r.body), sha256(&data));
    }
}

#[tokio::test(start_paused = true)]
async fn body_over_the_cap_while_reading_sends_nothing() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().body_limit(64 * 1024))
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Chunked::new(&payload(64 * 1024 + 1), 4096))
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BodyTooLarge);
    assert_eq!(server.request_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn body_exactly_at_the_cap_is_buffered() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let data = payload(64 * 1024);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().body_limit(64 * 1024))
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Chunked::new(&data, 4096))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn failing_request_body_sends_nothing() {
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let mut body = Chunked::new(&payload(10_000), 1000);
    body.fail_at = Some(5);
    let req = Request::post(server.url("/v1/messages"))
        .body(body)
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BodyRead);
    assert_eq!(
        std::error::Error::source(&err).unwrap().to_string(),
        "client body broke"
    );
    assert_eq!(server.request_count(), 0);
}

#[tokio::test(start_paused = true)]
async fn body_known_to_be_over_the_cap_passes_through_once() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let data = Bytes::from(payload(100 * 1024));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().body_limit(64 * 1024))
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Full::new(data.clone()))
        .unwrap();
    let res = svc.oneshot(req).await.unwrap();
    // Not retried: a body that was never held cannot be sent again.
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(res.extensions().get::<RetryTrail>().is_none());
    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(sha256(&seen[0].body), sha256(&data));
}

#[tokio::test(start_paused = true)]
async fn a_body_too_large_to_hold_still_has_a_head_timeout() {
    // Sent once, as it streams, to a server that reads it and never answers: the head
    // timeout ends it (before, nothing did).
    let server = MockServer::start(Script::new().then(Reply::stall()))
        .await
        .unwrap();
    let data = Bytes::from(payload(100 * 1024));
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .body_limit(64 * 1024)
                .policy(RetryPolicy::default().head_timeout(Some(Duration::from_secs(30)))),
        )
        .service(http_client());
    let req = Request::post(server.url("/v1/messages"))
        .body(Full::new(data.clone()))
        .unwrap();
    let start = tokio::time::Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(3_600), svc.oneshot(req))
        .await
        .expect("the head timeout ends the request")
        .unwrap_err();
    assert_eq!(tokio::time::Instant::now() - start, Duration::from_secs(30));
    // Not retried: the kind says the failure went up as it was.
    assert_eq!(err.kind(), ErrorKind::Service);
    let timed_out = std::error::Error::source(&err)
        .and_then(|s| s.downcast_ref::<TimedOut>())
        .expect("the source is the head timeout");
    assert_eq!(timed_out.kind(), TimeoutKind::Head);
    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(sha256(&seen[0].body), sha256(&data));
}

#[tokio::test(start_paused = true)]
async fn a_body_too_large_to_hold_waits_at_the_gate_and_within_the_deadline() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("10"))
            .then(Reply::success())
            .then(Reply::stall()),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .body_limit(64 * 1024)
                .policy(RetryPolicy::default().jitter(Jitter::none()).max_retries(0))
                .fleet(
                    tower_llm_retry::fleet::Fleet::builder()
                        .cooldown_gate(Some(
                            tower_llm_retry::fleet::GateConfig::new()
                                .min_close(Duration::ZERO)
                                .spread(0.0, Duration::ZERO)
                                .unwrap(),
                        ))
                        .build(),
                ),
        )
        .service(http_client());
    // A 429 closes the gate for 10 s.
    let res = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let origin = server.requests()[0].received_at;

    // The over-cap body waits at the gate like any other first attempt.
    let data = Bytes::from(payload(100 * 1024));
    let req = Request::post(server.url("/v1/messages"))
        .body(Full::new(data.clone()))
        .unwrap();
    let res = svc.clone().oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let seen = server.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[1].received_at - origin, Duration::from_secs(10));
    assert_eq!(sha256(&seen[1].body), sha256(&data));

    // And its deadline cuts the head timeout: a stalled server ends it at the deadline.
    let mut req = Request::post(server.url("/v1/messages"))
        .body(Full::new(data.clone()))
        .unwrap();
    req.extensions_mut()
        .insert(RetryPolicy::default().deadline(Some(Duration::from_secs(7))));
    let start = tokio::time::Instant::now();
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert_eq!(tokio::time::Instant::now() - start, Duration::from_secs(7));
    assert_eq!(err.kind(), ErrorKind::Service);
    assert_eq!(server.request_count(), 3);
}

#[tokio::test(start_paused = true)]
async fn not_replay_safe_request_is_not_resent_after_the_server_got_it() {
    for reply in [Reply::reset(), Reply::status(503), Reply::overloaded()] {
        let server = MockServer::start(Script::new().then(reply).then(Reply::success()))
            .await
            .unwrap();
        let svc = ServiceBuilder::new()
            .layer(RetryLayer::new())
            .service(http_client());
        let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
        req.extensions_mut().insert(NotReplaySafe);
        let outcome = svc.oneshot(req).await;
        assert_eq!(server.request_count(), 1);
        let trail = match outcome {
            Ok(res) => res.extensions().get::<RetryTrail>().unwrap().clone(),
            Err(err) => {
                assert_eq!(err.kind(), ErrorKind::Service);
                err.trail().unwrap().clone()
            }
        };
        assert_eq!(trail.gave_up(), Some(GiveUpReason::NotReplaySafe));
    }
}

#[tokio::test(start_paused = true)]
async fn not_replay_safe_request_is_retried_when_the_connection_is_refused() {
    // A port with nothing listening: every attempt is refused before a byte is sent.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(RetryPolicy::default().max_retries(2).jitter(Jitter::none()))
                .observer(recorder.clone()),
        )
        .service(http_client());
    let mut req = anthropic_request(&format!("http://{addr}/v1/messages"), BODY);
    req.extensions_mut().insert(NotReplaySafe);
    let err = svc.oneshot(req).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    let trail = err.trail().unwrap();
    assert_eq!(trail.total_attempts(), 3);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::Transport));
    assert_eq!(recorder.delays().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn no_retry_marker_sends_once() {
    let server = MockServer::start(Script::new().then(Reply::status(503)))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(NoRetry);
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 1);
    assert_eq!(
        res.extensions().get::<RetryTrail>().unwrap().gave_up(),
        Some(GiveUpReason::MaxRetries)
    );
}

#[tokio::test(start_paused = true)]
async fn per_request_policy_overrides_the_layer() {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut()
        .insert(RetryPolicy::default().max_retries(1).jitter(Jitter::none()));
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.request_count(), 2);
}

/// Sends one request to a server that always answers `503`, with `extensions` added, and
/// returns the gaps between the attempts the server received and the trail.
async fn attempts_against_503(
    layer: RetryLayer,
    add: impl FnOnce(&mut http::Extensions),
) -> (Vec<Duration>, RetryTrail) {
    let server = MockServer::start(Script::always(Reply::status(503)))
        .await
        .unwrap();
    let svc = ServiceBuilder::new().layer(layer).service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    add(req.extensions_mut());
    let res = svc.oneshot(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let seen = server.requests();
    for r in &seen {
        assert_eq!(&r.body[..], BODY.as_bytes());
    }
    let gaps = seen
        .windows(2)
        .map(|w| w[1].received_at - w[0].received_at)
        .collect();
    (gaps, res.extensions().get::<RetryTrail>().unwrap().clone())
}

#[tokio::test(start_paused = true)]
async fn an_override_changes_the_attempt_count_and_nothing_else() {
    let layer = RetryLayer::new().policy(
        RetryPolicy::default()
            .jitter(Jitter::none())
            .initial_backoff(Duration::from_millis(200))
            .max_retries(4),
    );
    let ms = |v: &[u64]| {
        v.iter()
            .map(|m| Duration::from_millis(*m))
            .collect::<Vec<_>>()
    };

    // The layer's policy: 5 attempts, 0.2 s doubling.
    let (gaps, trail) = attempts_against_503(layer.clone(), |_| {}).await;
    assert_eq!(gaps, ms(&[200, 400, 800, 1600]));
    assert_eq!(trail.total_attempts(), 5);

    // An override of the count: 3 attempts, the layer's backoff as it was.
    let (gaps, trail) = attempts_against_503(layer.clone(), |e| {
        e.insert(Override::new().max_retries(2));
    })
    .await;
    assert_eq!(gaps, ms(&[200, 400]));
    assert_eq!(trail.total_attempts(), 3);
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));

    // Over a whole policy the request carries, the override changes only the count of that one.
    let (gaps, trail) = attempts_against_503(layer.clone(), |e| {
        e.insert(RetryPolicy::default().jitter(Jitter::none()));
        e.insert(Override::new().max_retries(1));
    })
    .await;
    assert_eq!(gaps, ms(&[500]));
    assert_eq!(trail.total_attempts(), 2);

    // `NoRetry` wins over the override's count.
    let (gaps, trail) = attempts_against_503(layer, |e| {
        e.insert(Override::new().max_retries(3));
        e.insert(NoRetry);
    })
    .await;
    assert!(gaps.is_empty());
    assert_eq!(trail.total_attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_override_of_the_deadline_ends_a_stalled_request_at_it() {
    let server = MockServer::start(Script::always(Reply::stall()))
        .await
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().max_retries(0)))
        .service(http_client());
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut()
        .insert(Override::new().deadline(Some(Duration::from_secs(7))));
    let start = tokio::time::Instant::now();
    let err = svc.oneshot(req).await.unwrap_err();
    // Without the override the attempt would wait for the 600 s head timeout.
    assert_eq!(tokio::time::Instant::now() - start, Duration::from_secs(7));
    assert_eq!(server.request_count(), 1);
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    assert_eq!(err.trail().unwrap().total_attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_count_header_counts_up_from_zero() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(500))
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .retry_count_header(HeaderName::from_static("x-stainless-retry-count")),
        )
        .service(http_client());
    svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    let counts: Vec<_> = server
        .requests()
        .iter()
        .map(|r| {
            r.headers["x-stainless-retry-count"]
                .to_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(counts, ["0", "1", "2"]);
    // Without the option, no such header is sent.
    let server = MockServer::start(Script::new()).await.unwrap();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client());
    svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert!(server.requests()[0]
        .headers
        .get("x-stainless-retry-count")
        .is_none());
}

#[tokio::test(start_paused = true)]
async fn inner_layers_see_the_attempt_context() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::overloaded())
            .then(Reply::overloaded())
            .then(Reply::status(503))
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default().jitter(Jitter::none())))
        .map_request(move |req: Request<ReplayBody>| {
            let ctx = req.extensions().get::<AttemptContext>().unwrap().clone();
            log.lock()
                .unwrap()
                .push((ctx.attempt, ctx.previous, ctx.consecutive_overloads));
            req
        })
        .service(http_client());
    svc.oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [
            (1, None, 0),
            (2, Some(FailureClass::Overloaded), 1),
            (3, Some(FailureClass::Overloaded), 2),
            (4, Some(FailureClass::Server), 0),
        ]
    );
}

/// One request to `server` under exact backoffs and a consecutive overload limit.
async fn with_overload_limit(
    limit: u32,
    server: &MockServer,
) -> http::Response<tower_llm_retry::RetryBody<hyper::body::Incoming>> {
    let policy = RetryPolicy::default()
        .jitter(Jitter::none())
        .max_consecutive_overloads(Some(limit));
    ServiceBuilder::new()
        .layer(RetryLayer::new().policy(policy))
        .service(http_client())
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn consecutive_overload_limit_stops_early() {
    let server = MockServer::start(Script::always(Reply::overloaded()))
        .await
        .unwrap();
    let res = with_overload_limit(3, &server).await;
    assert_eq!(res.status().as_u16(), 529);
    assert_eq!(server.request_count(), 3);
    assert_eq!(
        res.extensions().get::<RetryTrail>().unwrap().gave_up(),
        Some(GiveUpReason::MaxConsecutiveOverloads)
    );
}

#[tokio::test(start_paused = true)]
async fn a_consecutive_overload_limit_of_zero_stops_only_overloads() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::status(503))
            .then(Reply::overloaded())
            .then(Reply::success()),
    )
    .await
    .unwrap();
    let res = with_overload_limit(0, &server).await;
    // The two 503s are retried; the overload is not.
    assert_eq!(res.status().as_u16(), 529);
    assert_eq!(server.request_count(), 3);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxConsecutiveOverloads));
    assert_eq!(trail.total_attempts(), 3);
}
