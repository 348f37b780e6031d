//! The retry loop over HTTPS and HTTP/2 as the real APIs speak them, against the mock over
//! TLS (ALPN) and h2c: the key cases on h1+TLS and h2+TLS with the server-side body hash on
//! every attempt, and the HTTP/2 proofs that a request was never processed (REFUSED_STREAM, a
//! stream above a GOAWAY's last stream id), which re-send even a `NotReplaySafe` request once,
//! at once. Paused time; client and mock on one runtime.

#![cfg(feature = "mock")]

use std::time::Duration;

use crate::common::{anthropic_request, concat, drain, exact_policy, sha256, Recorder, Seen, BODY};
use bytes::Bytes;
use http::{StatusCode, Version};
use http_body_util::Full;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::FailureClass;
use tower_llm_retry::mock::{MockServer, Protocol, Reply, Script, SseFrame};
use tower_llm_retry::retry::{GiveUpReason, NotReplaySafe};
use tower_llm_retry::{ErrorKind, ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

/// TCP with `TCP_NODELAY`: without it a request's second small write (an h2 `DATA` frame after
/// its `HEADERS`) waits for the server's delayed ACK in real time, which paused time skips.
fn tcp() -> HttpConnector {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.enforce_http(false);
    tcp
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Wire {
    /// HTTP/1.1 over TLS.
    H1Tls,
    /// HTTP/2 over TLS, negotiated by ALPN.
    H2Tls,
    /// HTTP/2 with prior knowledge over plain TCP.
    H2c,
}

type Https = Client<HttpsConnector<HttpConnector>, ReplayBody>;

/// A client for `wire`, and the mock serving `script` on it. hyper-util's own re-send of
/// requests it knows were not processed (`retry_canceled_requests`) is off, so every send is
/// the retry loop's; [`hyper_utils_own_re_send_does_not_double_count_a_refused_stream`] runs
/// with the default.
async fn serve(wire: Wire, script: Script) -> (MockServer, Https) {
    serve_with(wire, script, false).await
}

async fn serve_with(wire: Wire, script: Script, client_retries: bool) -> (MockServer, Https) {
    let (tls, protocol) = match wire {
        Wire::H1Tls => (true, Protocol::Http1),
        Wire::H2Tls => (true, Protocol::Http2),
        Wire::H2c => (false, Protocol::Http2),
    };
    let server = MockServer::builder(script)
        .tls(tls)
        .protocol(protocol)
        .start()
        .await
        .unwrap();
    let builder = match server.tls_client_config() {
        Some(config) => HttpsConnectorBuilder::new()
            .with_tls_config(config)
            .https_only(),
        // h2c: plain TCP through the same connector type (it trusts nothing, and is never
        // asked to).
        None => HttpsConnectorBuilder::new()
            .with_tls_config(
                rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
            )
            .https_or_http(),
    };
    let connector = match wire {
        Wire::H1Tls => builder.enable_http1().wrap_connector(tcp()),
        _ => builder.enable_http2().wrap_connector(tcp()),
    };
    let mut client = Client::builder(TokioExecutor::new());
    client.retry_canceled_requests(client_retries);
    if wire == Wire::H2c {
        client.http2_only(true);
    }
    (server, client.build(connector))
}

fn expect_version(wire: Wire) -> Version {
    match wire {
        Wire::H1Tls => Version::HTTP_11,
        _ => Version::HTTP_2,
    }
}

fn layer(recorder: &Recorder) -> RetryLayer {
    RetryLayer::new()
        .policy(exact_policy())
        .observer(recorder.clone())
}

/// Every attempt the server saw carried the caller's bytes, on the expected protocol.
fn assert_every_attempt_identical(server: &MockServer, wire: Wire, n: usize) {
    let seen = server.requests();
    assert_eq!(seen.len(), n, "{wire:?}");
    for r in &seen {
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()), "{wire:?}");
        assert_eq!(r.version, expect_version(wire), "{wire:?}");
    }
}

const WIRES: [Wire; 2] = [Wire::H1Tls, Wire::H2Tls];

#[tokio::test(start_paused = true)]
async fn a_429_with_retry_after_waits_then_succeeds() {
    for wire in WIRES {
        let (server, client) = serve(
            wire,
            Script::new()
                .then(Reply::rate_limited("3"))
                .then(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let res = svc
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{wire:?}");
        assert_eq!(res.version(), expect_version(wire));
        assert_eq!(recorder.delays(), [Duration::from_secs(3)], "{wire:?}");
        let seen = server.requests();
        assert_eq!(
            seen[1].received_at - seen[0].received_at,
            Duration::from_secs(3)
        );
        assert_every_attempt_identical(&server, wire, 2);
    }
}

#[tokio::test(start_paused = true)]
async fn a_529_is_retried_as_an_overload() {
    for wire in WIRES {
        let (server, client) = serve(
            wire,
            Script::new()
                .then(Reply::overloaded())
                .then(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let res = svc
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        assert_eq!(
            trail.attempts()[0].class,
            FailureClass::Overloaded,
            "{wire:?}"
        );
        assert_eq!(recorder.delays(), [Duration::from_millis(500)]);
        assert_every_attempt_identical(&server, wire, 2);
    }
}

#[tokio::test(start_paused = true)]
async fn a_reset_before_the_head_is_retried() {
    for wire in WIRES {
        let (server, client) = serve(
            wire,
            Script::new().then(Reply::reset()).then(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let res = svc
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{wire:?}");
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        assert_eq!(
            trail.attempts()[0].class,
            FailureClass::Transport,
            "{wire:?}"
        );
        assert_every_attempt_identical(&server, wire, 2);
    }
}

#[tokio::test(start_paused = true)]
async fn an_in_band_sse_error_before_output_is_retried() {
    let good = vec![
        SseFrame::new("message_start", r#"{"type":"message_start"}"#),
        SseFrame::new("content_block_delta", r#"{"type":"content_block_delta"}"#),
        SseFrame::new("message_stop", r#"{"type":"message_stop"}"#),
    ];
    for wire in WIRES {
        let (server, client) = serve(
            wire,
            Script::new()
                .then(Reply::sse(vec![
                    SseFrame::new("message_start", r#"{"type":"message_start"}"#),
                    SseFrame::new(
                        "error",
                        r#"{"type":"error","error":{"type":"overloaded_error"}}"#,
                    ),
                ]))
                .then(Reply::sse(good.clone())),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let res = svc
            .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
            .await
            .unwrap();
        let trail = res.extensions().get::<RetryTrail>().cloned().unwrap();
        assert_eq!(
            trail.attempts()[0].class,
            FailureClass::Overloaded,
            "{wire:?}"
        );
        let (bytes, err) = drain(res.into_body()).await;
        assert!(err.is_none(), "{wire:?}: {err:?}");
        assert_eq!(sha256(&bytes), sha256(&concat(&good)), "{wire:?}");
        assert_every_attempt_identical(&server, wire, 2);
    }
}

/// HTTP/2 says a body has ended once its last `DATA` frame carried `END_STREAM`, before the
/// next poll. A stream cut cleanly before its terminal event must still not report its end
/// early: `is_end_stream()` true means the next poll is `None` (hyper, and the proxy on it,
/// end the response there and the cut would never reach the caller).
#[tokio::test(start_paused = true)]
async fn a_clean_cut_over_http2_never_reports_its_end_before_the_error() {
    use http_body::Body as _;
    use http_body_util::BodyExt as _;
    let cut = vec![
        SseFrame::new("message_start", r#"{"type":"message_start"}"#),
        SseFrame::new("content_block_delta", r#"{"type":"content_block_delta"}"#),
    ];
    for wire in [Wire::H2Tls, Wire::H2c] {
        for gate in [true, false] {
            let (server, client) = serve(wire, Script::always(Reply::sse(cut.clone()))).await;
            let svc = ServiceBuilder::new()
                .layer(RetryLayer::new().policy(exact_policy()).sse_gate(gate))
                .service(client);
            let res = svc
                .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
                .await
                .unwrap();
            assert_eq!(res.version(), Version::HTTP_2);
            let mut body = res.into_body();
            let mut bytes = Vec::new();
            let err = loop {
                let said_end = body.is_end_stream();
                match body.frame().await {
                    Some(Ok(frame)) => {
                        assert!(!said_end, "{wire:?} gate {gate}: a frame after the end");
                        if let Ok(data) = frame.into_data() {
                            bytes.extend_from_slice(&data);
                        }
                    }
                    Some(Err(e)) => {
                        assert!(!said_end, "{wire:?} gate {gate}: an error after the end");
                        break e;
                    }
                    None => panic!("{wire:?} gate {gate}: the cut ended cleanly"),
                }
            };
            assert_eq!(
                err.kind(),
                ErrorKind::IncompleteStream,
                "{wire:?} gate {gate}"
            );
            assert_eq!(sha256(&bytes), sha256(&concat(&cut)));
            assert_eq!(server.request_count(), 1);
        }
    }
}

/// A request the caller marked not replay-safe.
fn unsafe_request(server: &MockServer) -> http::Request<Full<Bytes>> {
    let mut req = anthropic_request(&server.url("/v1/messages"), BODY);
    req.extensions_mut().insert(NotReplaySafe);
    req
}

#[tokio::test(start_paused = true)]
async fn a_refused_stream_is_re_sent_at_once_even_when_not_replay_safe() {
    for wire in [Wire::H2Tls, Wire::H2c] {
        let (server, client) = serve(
            wire,
            Script::new()
                .then(Reply::refused_stream())
                .then(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let start = Instant::now();
        let res = svc.oneshot(unsafe_request(&server)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "{wire:?}");
        // At once: no backoff.
        assert_eq!(Instant::now() - start, Duration::ZERO, "{wire:?}");
        let trail = res.extensions().get::<RetryTrail>().unwrap();
        assert_eq!(trail.total_attempts(), 2);
        assert_eq!(trail.attempts().len(), 1);
        assert_eq!(trail.attempts()[0].class, FailureClass::NotProcessed);
        assert_eq!(trail.attempts()[0].delay, Some(Duration::ZERO));
        // The same attempt again: not a retry of the policy.
        assert!(matches!(
            recorder.seen()[0],
            Seen::Retry {
                attempt: 1,
                class: FailureClass::NotProcessed,
                ..
            }
        ));
        assert_every_attempt_identical(&server, wire, 2);
    }
}

#[tokio::test(start_paused = true)]
async fn a_proof_re_sends_once_per_attempt_then_ordinary_rules_apply() {
    // Refused on every stream: per attempt one re-send at once, then the ordinary backoff
    // (a refusal proves nothing was processed, so even a not-replay-safe request may wait
    // and try again), until the policy's retries are spent. The last attempt keeps no copy,
    // so it is not re-sent.
    let (server, client) = serve(Wire::H2c, Script::always(Reply::refused_stream())).await;
    let recorder = Recorder::default();
    let svc = ServiceBuilder::new()
        .layer(
            RetryLayer::new()
                .policy(exact_policy().max_retries(2))
                .observer(recorder.clone()),
        )
        .service(client);
    let err = svc.oneshot(unsafe_request(&server)).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Exhausted);
    let trail = err.trail().unwrap();
    // Attempts 0 and 1 sent twice each, attempt 2 once.
    assert_eq!(trail.total_attempts(), 5);
    assert_eq!(server.request_count(), 5);
    assert!(trail
        .attempts()
        .iter()
        .all(|a| a.class == FailureClass::NotProcessed));
    assert_eq!(
        recorder.delays(),
        [
            Duration::ZERO,
            Duration::from_millis(500),
            Duration::ZERO,
            Duration::from_secs(1),
        ]
    );
    assert_eq!(trail.gave_up(), Some(GiveUpReason::MaxRetries));
}

#[tokio::test(start_paused = true)]
async fn a_request_allowed_no_retries_is_sent_exactly_once_even_when_refused() {
    let (server, client) = serve(Wire::H2c, Script::always(Reply::refused_stream())).await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::never()))
        .service(client);
    let err = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(server.request_count(), 1);
    assert_eq!(err.trail().unwrap().total_attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn streams_above_a_goaway_are_re_sent_and_the_one_below_completes() {
    // Three requests on one h2 connection: the first is answered after 2 s; the second
    // triggers a GOAWAY naming the first as the last stream processed, so the second and
    // the third (above it) were never processed and are re-sent at once on a new connection,
    // though not replay-safe.
    for wire in [Wire::H2Tls, Wire::H2c] {
        let (server, client) = serve(
            wire,
            Script::new()
                .then(Reply::success().delay(Duration::from_secs(2)))
                .then(Reply::goaway().delay(Duration::from_secs(1)))
                .then(Reply::success().delay(Duration::from_secs(5)))
                .otherwise(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let svc = ServiceBuilder::new()
            .layer(layer(&recorder))
            .service(client);
        let origin = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..3 {
            let svc = svc.clone();
            let req = unsafe_request(&server);
            tasks.push(tokio::spawn(async move {
                let res = svc.oneshot(req).await;
                (
                    res.map(|r| (r.status(), r.extensions().get::<RetryTrail>().cloned())),
                    Instant::now(),
                )
            }));
            // One at a time onto the connection, in order.
            while server.request_count() < tasks.len() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let mut outcomes = Vec::new();
        for t in tasks {
            outcomes.push(t.await.unwrap());
        }
        let mut outcomes = outcomes.into_iter();
        let (first, at) = outcomes.next().unwrap();
        let (status, trail) = first.unwrap();
        assert_eq!(status, StatusCode::OK, "{wire:?}");
        assert!(trail.is_none(), "{wire:?}: the first stream was processed");
        assert!(at - origin >= Duration::from_secs(2));
        for (outcome, _) in outcomes {
            let (status, trail) = outcome.unwrap();
            assert_eq!(status, StatusCode::OK, "{wire:?}");
            let trail = trail.unwrap();
            // Re-sent at once, it meets the same connection on its way out, which hyper
            // cancels before writing a byte (proof again); the ordinary retry then goes out on
            // a new connection.
            let got: Vec<_> = trail
                .attempts()
                .iter()
                .map(|a| (a.class, a.delay))
                .collect();
            assert_eq!(
                got,
                [
                    (FailureClass::NotProcessed, Some(Duration::ZERO)),
                    (FailureClass::NotProcessed, Some(Duration::from_millis(500))),
                ],
                "{wire:?}"
            );
            assert_eq!(trail.total_attempts(), 3, "{wire:?}");
        }
        // The three first sends and the two retries that went out; the canceled re-sends
        // never reached the server.
        assert_eq!(server.request_count(), 5, "{wire:?}");
        for r in server.requests() {
            assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()));
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_internal_error_reset_after_the_head_proves_nothing() {
    // The server sent the head, then reset the stream: it may have processed the request.
    let (server, client) = serve(
        Wire::H2c,
        Script::new()
            .then(Reply::reset_stream_after_head(200))
            .then(Reply::success()),
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(client);
    let outcome = svc.oneshot(unsafe_request(&server)).await;
    assert_eq!(server.request_count(), 1);
    // The head came: the caller gets the response and its body fails.
    let res = outcome.unwrap();
    let (_, err) = drain(res.into_body()).await;
    assert_eq!(err.unwrap().kind(), ErrorKind::ResponseBody);
}

#[tokio::test(start_paused = true)]
async fn hyper_utils_own_re_send_does_not_double_count_a_refused_stream() {
    // With hyper-util's default (`retry_canceled_requests(true)`) the client re-sends by
    // itself only requests it never started to write; a refused stream was written, so it
    // reaches the loop, which re-sends it once: the server sees each send once, and the trail
    // counts exactly the sends the loop made.
    let (server, client) = serve_with(
        Wire::H2c,
        Script::new()
            .then(Reply::success())
            .then(Reply::refused_stream())
            .then(Reply::success()),
        true,
    )
    .await;
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(exact_policy()))
        .service(client);
    let first = svc
        .clone()
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let res = svc.oneshot(unsafe_request(&server)).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let trail = res.extensions().get::<RetryTrail>().unwrap();
    assert_eq!(trail.total_attempts(), 2);
    assert_eq!(trail.attempts()[0].class, FailureClass::NotProcessed);
    assert_eq!(server.request_count(), 3);
}

/// The layer over `client` with a fleet of one scope, and the fleet to read.
fn with_fleet(
    client: Https,
) -> (
    tower_llm_retry::fleet::Fleet,
    tower_llm_retry::retry::Retry<Https>,
) {
    let fleet = tower_llm_retry::fleet::Fleet::builder()
        .per_scope(false)
        .build();
    let layer = RetryLayer::new()
        .policy(exact_policy())
        .fleet(fleet.clone());
    (fleet, ServiceBuilder::new().layer(layer).service(client))
}

/// A re-send HTTP/2 proved never processed is the same attempt: it does not pay into the
/// fleet's budget a second time.
#[tokio::test(start_paused = true)]
async fn a_proofs_re_send_pays_into_the_budget_once() {
    let (server, client) = serve(
        Wire::H2c,
        Script::new()
            .then(Reply::refused_stream())
            .then(Reply::success()),
    )
    .await;
    let (fleet, svc) = with_fleet(client);
    let res = svc
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
    let stats = fleet.budget_stats().unwrap();
    assert_eq!(stats.first_attempts, 1, "{stats:?}");
    assert_eq!(stats.retries, 0, "{stats:?}");
}

/// ... and goes out at once: a cooldown gate another request closed while this attempt was
/// in flight does not hold it.
#[tokio::test(start_paused = true)]
async fn a_proofs_re_send_is_not_held_at_a_gate_closed_meanwhile() {
    let (server, client) = serve(
        Wire::H2c,
        Script::new()
            .then(Reply::refused_stream().delay(Duration::from_secs(1)))
            .then(Reply::rate_limited("30"))
            .otherwise(Reply::success()),
    )
    .await;
    let (fleet, svc) = with_fleet(client);
    let start = Instant::now();
    let a = {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tokio::spawn(async move { svc.oneshot(req).await.map(|r| r.status()) })
    };
    while server.request_count() < 1 {
        tokio::task::yield_now().await;
    }
    // The second request's 429 closes the gate for 30 s, at once.
    let b = {
        let svc = svc.clone();
        let req = anthropic_request(&server.url("/v1/messages"), BODY);
        tokio::spawn(async move { svc.oneshot(req).await.map(|r| r.status()) })
    };
    while fleet.gate_closed_until().is_none() {
        tokio::task::yield_now().await;
    }
    assert!(Instant::now() - start < Duration::from_secs(1));
    assert_eq!(a.await.unwrap().unwrap(), StatusCode::OK);
    // Refused at 1 s and re-sent at once, under the closed gate.
    assert_eq!(Instant::now() - start, Duration::from_secs(1));
    let seen = server.requests();
    assert_eq!(
        seen[2].received_at - seen[0].received_at,
        Duration::from_secs(1)
    );
    b.abort();
}
