//! The reqwest adapter and the reqwest-middleware integration over HTTPS, on HTTP/1.1 and on
//! HTTP/2 negotiated by ALPN, against the TLS mock: the key cases through both `ReqwestService`
//! and `RetryMiddleware`, with the server-side body hash and HTTP version on every attempt, and
//! REFUSED_STREAM as reqwest reports it. Paused time; client and mock on one runtime.

#![cfg(feature = "mock")]

use std::time::Duration;

use crate::common::{
    anthropic_request, concat, exact_policy, reqwest_builder, sha256, Recorder, BODY,
};
use bytes::Bytes;
use http::{StatusCode, Version};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::{never_processed, FailureClass};
use tower_llm_retry::mock::{sse, MockServer, Protocol, Reply, Script};
use tower_llm_retry::reqwest::ReqwestService;
use tower_llm_retry::reqwest_middleware::RetryMiddleware;
use tower_llm_retry::retry::NotReplaySafe;
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Wire {
    /// HTTP/1.1 over TLS.
    H1Tls,
    /// HTTP/2 over TLS, negotiated by ALPN.
    H2Tls,
}

const WIRES: [Wire; 2] = [Wire::H1Tls, Wire::H2Tls];

impl Wire {
    fn version(self) -> Version {
        match self {
            Wire::H1Tls => Version::HTTP_11,
            Wire::H2Tls => Version::HTTP_2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Adapter {
    /// `RetryLayer` over `ReqwestService`.
    Tower,
    /// `RetryMiddleware` in a `ClientWithMiddleware`.
    Middleware,
}

const ADAPTERS: [Adapter; 2] = [Adapter::Tower, Adapter::Middleware];

/// The mock over TLS, offering by ALPN only the protocol of `wire`.
async fn serve(wire: Wire, script: Script) -> MockServer {
    let protocol = match wire {
        Wire::H1Tls => Protocol::Http1,
        Wire::H2Tls => Protocol::Http2,
    };
    MockServer::builder(script)
        .tls(true)
        .protocol(protocol)
        .start()
        .await
        .unwrap()
}

/// One client for both wires: it offers h2 and http/1.1 and takes what the server picks.
/// It trusts the mock's CA alone, and its own retries are off.
fn client(server: &MockServer) -> reqwest::Client {
    let ca = reqwest::Certificate::from_pem(server.ca_cert_pem().unwrap().as_bytes()).unwrap();
    reqwest_builder().tls_certs_only([ca]).build().unwrap()
}

fn layer(recorder: &Recorder) -> RetryLayer {
    RetryLayer::new()
        .policy(exact_policy())
        .observer(recorder.clone())
}

/// What came back, the same for both adapters.
#[derive(Debug)]
struct Outcome {
    status: StatusCode,
    version: Version,
    trail: RetryTrail,
    body: Bytes,
}

/// Sends `BODY` to the mock through `adapter`, marked not replay-safe if asked, and reads the
/// whole response body.
async fn send(adapter: Adapter, server: &MockServer, layer: RetryLayer, unsafe_: bool) -> Outcome {
    let url = server.url("/v1/messages");
    match adapter {
        Adapter::Tower => {
            let svc = ServiceBuilder::new()
                .layer(layer)
                .service(ReqwestService::new(client(server)));
            let mut req = anthropic_request(&url, BODY);
            if unsafe_ {
                req.extensions_mut().insert(NotReplaySafe);
            }
            let res = svc.oneshot(req).await.unwrap();
            Outcome {
                status: res.status(),
                version: res.version(),
                trail: res.extensions().get::<RetryTrail>().cloned().unwrap(),
                body: res.into_body().collect().await.unwrap().to_bytes(),
            }
        }
        Adapter::Middleware => {
            let client = reqwest_middleware::ClientBuilder::new(client(server))
                .with(RetryMiddleware::new(layer))
                .build();
            let mut req = client
                .post(url)
                .header("content-type", "application/json")
                .header("anthropic-version", "2023-06-01")
                .body(BODY);
            if unsafe_ {
                req = req.with_extension(NotReplaySafe);
            }
            let res = req.send().await.unwrap();
            Outcome {
                status: res.status(),
                version: res.version(),
                trail: res.extensions().get::<RetryTrail>().cloned().unwrap(),
                body: res.bytes().await.unwrap(),
            }
        }
    }
}

/// Every attempt the server saw carried the caller's bytes, on the expected protocol.
fn assert_every_attempt_identical(server: &MockServer, wire: Wire, n: usize) {
    let seen = server.requests();
    assert_eq!(seen.len(), n, "{wire:?}");
    for r in &seen {
        assert_eq!(sha256(&r.body), sha256(BODY.as_bytes()), "{wire:?}");
        assert_eq!(r.version, wire.version(), "{wire:?}");
    }
}

fn assert_ok(out: &Outcome, wire: Wire, adapter: Adapter) {
    assert_eq!(out.status, StatusCode::OK, "{wire:?} {adapter:?}");
    assert_eq!(out.version, wire.version(), "{wire:?} {adapter:?}");
}

#[tokio::test(start_paused = true)]
async fn a_429_with_retry_after_waits_exactly_then_succeeds() {
    for wire in WIRES {
        for adapter in ADAPTERS {
            let server = serve(
                wire,
                Script::new()
                    .then(Reply::rate_limited("3"))
                    .then(Reply::success()),
            )
            .await;
            let recorder = Recorder::default();
            let out = send(adapter, &server, layer(&recorder), false).await;
            assert_ok(&out, wire, adapter);
            assert_eq!(out.trail.total_attempts(), 2);
            assert_eq!(out.trail.attempts()[0].class, FailureClass::RateLimited);
            assert_eq!(recorder.delays(), [Duration::from_secs(3)], "{adapter:?}");
            let seen = server.requests();
            assert_eq!(
                seen[1].received_at - seen[0].received_at,
                Duration::from_secs(3),
                "{wire:?} {adapter:?}"
            );
            assert_every_attempt_identical(&server, wire, 2);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_529_is_retried_as_an_overload() {
    for wire in WIRES {
        for adapter in ADAPTERS {
            let server = serve(
                wire,
                Script::new()
                    .then(Reply::overloaded())
                    .then(Reply::success()),
            )
            .await;
            let recorder = Recorder::default();
            let out = send(adapter, &server, layer(&recorder), false).await;
            assert_ok(&out, wire, adapter);
            assert_eq!(out.trail.attempts()[0].class, FailureClass::Overloaded);
            assert_eq!(recorder.delays(), [Duration::from_millis(500)]);
            assert_every_attempt_identical(&server, wire, 2);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_reset_before_the_head_is_retried() {
    for wire in WIRES {
        for adapter in ADAPTERS {
            let server = serve(
                wire,
                Script::new().then(Reply::reset()).then(Reply::success()),
            )
            .await;
            let recorder = Recorder::default();
            let out = send(adapter, &server, layer(&recorder), false).await;
            assert_ok(&out, wire, adapter);
            assert_eq!(
                out.trail.attempts()[0].class,
                FailureClass::Transport,
                "{wire:?} {adapter:?}"
            );
            assert_eq!(recorder.delays(), [Duration::from_millis(500)]);
            assert_every_attempt_identical(&server, wire, 2);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_in_band_sse_error_before_output_is_retried() {
    let bad = vec![
        sse::anthropic_message(&[])[0].clone(),
        sse::anthropic_error("overloaded_error"),
    ];
    let good = sse::anthropic_message(&["over ", "TLS"]);
    for wire in WIRES {
        for adapter in ADAPTERS {
            let server = serve(
                wire,
                Script::new()
                    .then(Reply::sse(bad.clone()))
                    .then(Reply::sse(good.clone())),
            )
            .await;
            let out = send(adapter, &server, layer(&Recorder::default()), false).await;
            assert_ok(&out, wire, adapter);
            assert_eq!(
                out.trail.attempts()[0].class,
                FailureClass::Overloaded,
                "{wire:?} {adapter:?}"
            );
            // The caller sees the second stream only, byte for byte.
            assert_eq!(out.body, concat(&good), "{wire:?} {adapter:?}");
            assert_every_attempt_identical(&server, wire, 2);
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_refused_stream_is_re_sent_at_once_even_when_not_replay_safe() {
    for adapter in ADAPTERS {
        let server = serve(
            Wire::H2Tls,
            Script::new()
                .then(Reply::refused_stream())
                .then(Reply::success()),
        )
        .await;
        let recorder = Recorder::default();
        let start = Instant::now();
        let out = send(adapter, &server, layer(&recorder), true).await;
        assert_ok(&out, Wire::H2Tls, adapter);
        // At once: no backoff, and the one re-send is not a retry of the policy.
        assert_eq!(start.elapsed(), Duration::ZERO, "{adapter:?}");
        assert_eq!(out.trail.total_attempts(), 2, "{adapter:?}");
        let got: Vec<_> = out
            .trail
            .attempts()
            .iter()
            .map(|a| (a.class, a.delay))
            .collect();
        assert_eq!(
            got,
            [(FailureClass::NotProcessed, Some(Duration::ZERO))],
            "{adapter:?}"
        );
        assert_eq!(recorder.delays(), [Duration::ZERO]);
        assert_every_attempt_identical(&server, Wire::H2Tls, 2);
    }
}

#[tokio::test(start_paused = true)]
async fn reqwests_error_for_a_refused_stream_carries_the_h2_error() {
    // The proof the classifier needs is in reqwest's source chain: reqwest::Error, then
    // hyper-util's client error, hyper's, and h2's REFUSED_STREAM from the remote.
    let server = serve(Wire::H2Tls, Script::always(Reply::refused_stream())).await;
    let err = ReqwestService::new(client(&server))
        .oneshot(
            http::Request::post(server.url("/v1/messages"))
                .body(ReplayBody::new(BODY))
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert!(err.is_request(), "{err:?}");
    let mut h2 = None;
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = next {
        if let Some(found) = e.downcast_ref::<h2::Error>() {
            h2 = Some(found);
        }
        next = e.source();
    }
    let h2 = h2.unwrap_or_else(|| panic!("no h2::Error in the chain of {err:?}"));
    assert!(h2.is_remote() && h2.is_reset(), "{h2:?}");
    assert_eq!(h2.reason(), Some(h2::Reason::REFUSED_STREAM));
    assert!(never_processed(&err));
    assert_eq!(server.request_count(), 1);

    // And through the middleware chain, wrapped once more.
    let client = reqwest_middleware::ClientBuilder::new(client(&server)).build();
    let err = client
        .post(server.url("/v1/messages"))
        .body(BODY)
        .send()
        .await
        .unwrap_err();
    assert!(
        matches!(err, reqwest_middleware::Error::Reqwest(_)),
        "{err:?}"
    );
    assert!(never_processed(&err));
}

#[tokio::test(start_paused = true)]
async fn a_refused_stream_is_not_re_sent_when_the_policy_allows_no_retries() {
    for adapter in ADAPTERS {
        let server = serve(Wire::H2Tls, Script::always(Reply::refused_stream())).await;
        let layer = RetryLayer::new().policy(RetryPolicy::never());
        let url = server.url("/v1/messages");
        let sent_once = match adapter {
            Adapter::Tower => ServiceBuilder::new()
                .layer(layer)
                .service(ReqwestService::new(client(&server)))
                .oneshot(anthropic_request(&url, BODY))
                .await
                .is_err(),
            Adapter::Middleware => reqwest_middleware::ClientBuilder::new(client(&server))
                .with(RetryMiddleware::new(layer))
                .build()
                .post(url)
                .body(BODY)
                .send()
                .await
                .is_err(),
        };
        assert!(sent_once, "{adapter:?}");
        assert_eq!(server.request_count(), 1, "{adapter:?}");
    }
}
