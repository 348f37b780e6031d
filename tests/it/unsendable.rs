//! A request that cannot be sent as configured (a connector that does not speak the URL's
//! scheme, a URI that is not absolute, a scheme the client refuses) ends at once with
//! `ErrorKind::Unsendable`: one attempt, no sleep, nothing on the wire, the cause named.

use std::time::Duration;

use crate::common::*;
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::classify::{FailureClass, Unsendable};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::reqwest::ReqwestService;
use tower_llm_retry::retry::{GiveUpReason, NotReplaySafe};
use tower_llm_retry::{Error, ErrorKind, ReplayBody, RetryLayer};

/// The mock, answering 200 to anything that reaches it.
async fn server() -> MockServer {
    MockServer::start(Script::always(Reply::success()))
        .await
        .unwrap()
}

/// Asserts the error is an unsendable request after one attempt, with a cause containing
/// `cause`, and returns the chain's text.
fn assert_unsendable(err: &Error, cause: &str) -> String {
    assert_eq!(err.kind(), ErrorKind::Unsendable, "{err:?}");
    assert_eq!(err.kind().as_str(), "unsendable");
    let trail = err.trail().expect("a trail");
    assert_eq!(trail.total_attempts(), 1);
    assert_eq!(trail.attempts().len(), 1);
    assert_eq!(trail.attempts()[0].class, FailureClass::Unsendable);
    assert!(matches!(
        trail.gave_up(),
        Some(GiveUpReason::NotRetryable | GiveUpReason::NotReplaySafe)
    ));
    let source = std::error::Error::source(err).expect("a source");
    let unsendable = source.downcast_ref::<Unsendable>().expect("an Unsendable");
    assert!(
        unsendable.cause().contains(cause),
        "{:?} does not say {cause:?}",
        unsendable.cause()
    );
    let mut chain = err.to_string();
    let mut next = Some(source);
    while let Some(e) = next {
        chain.push_str(": ");
        chain.push_str(&e.to_string());
        next = e.source();
    }
    chain
}

/// hyper-util's `build_http()` client pointed at https://, as a first try often is.
/// With the default policy this was retried as a transport failure for minutes.
#[tokio::test(start_paused = true)]
async fn build_http_client_pointed_at_https_fails_at_once() {
    let server = server().await;
    let url = format!("https://{}/v1/messages", server.addr());
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client())
        .oneshot(anthropic_request(&url, BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO, "no sleep");
    let chain = assert_unsendable(&err, "HTTPS connector");
    assert!(chain.contains("invalid URL, scheme is not http"), "{chain}");
    assert!(
        chain.starts_with("the request cannot be sent as configured"),
        "{chain}"
    );
    assert_eq!(server.request_count(), 0);
}

/// Not replay-safe changes nothing: the request ends the same way, at once.
#[tokio::test(start_paused = true)]
async fn not_replay_safe_request_is_unsendable_too() {
    let server = server().await;
    let url = format!("https://{}/v1/messages", server.addr());
    let mut request = anthropic_request(&url, BODY);
    request.extensions_mut().insert(NotReplaySafe);
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client())
        .oneshot(request)
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_unsendable(&err, "HTTPS connector");
    assert_eq!(server.request_count(), 0);
}

/// A path without scheme and host: hyper-util's client refuses it before connecting.
#[tokio::test(start_paused = true)]
async fn relative_uri_fails_at_once() {
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(http_client())
        .oneshot(anthropic_request("/v1/messages", BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let chain = assert_unsendable(&err, "absolute URL");
    assert!(chain.contains("UserAbsoluteUriRequired"), "{chain}");
}

/// hyper-rustls built `https_only()` refuses http://.
#[tokio::test(start_paused = true)]
async fn https_only_connector_refuses_http_at_once() {
    let server = server().await;
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        )
        .https_only()
        .enable_http1()
        .build();
    let client = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(https);
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(client)
        .oneshot(anthropic_request(&server.url("/v1/messages"), BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let chain = assert_unsendable(&err, "https_only");
    assert!(chain.contains("unsupported scheme http"), "{chain}");
    assert_eq!(server.request_count(), 0);
}

/// hyper-rustls names the TLS server from the URL's host before it connects: a host that is
/// neither an IP address nor a valid DNS name (a mistyped address) cannot be named.
#[tokio::test(start_paused = true)]
async fn https_host_that_is_not_a_server_name_fails_at_once() {
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
        )
        .https_or_http()
        .enable_http1()
        .build();
    let client = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(https);
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(client)
        .oneshot(anthropic_request("https://999.1.1.1/v1/messages", BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let chain = assert_unsendable(&err, "host");
    assert!(chain.contains("invalid dns name"), "{chain}");
}

/// reqwest refuses a scheme other than http and https before it connects.
#[tokio::test(start_paused = true)]
async fn reqwest_refuses_a_scheme_at_once() {
    let client = reqwest_builder().build().unwrap();
    let start = Instant::now();
    let err = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .service(ReqwestService::new(client))
        .oneshot(anthropic_request("ftp://127.0.0.1:9/v1/messages", BODY))
        .await
        .unwrap_err();
    assert_eq!(start.elapsed(), Duration::ZERO);
    let chain = assert_unsendable(&err, "scheme");
    assert!(chain.contains("URL scheme is not allowed"), "{chain}");
}
