//! The fake provider over TLS and HTTP/2: ALPN, h2c, and the HTTP/2 faults, observed through
//! a real hyper client (with `hyper-rustls` for TLS) on the same paused-time runtime.

#![cfg(feature = "mock")]

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::{Connect, HttpConnector};
use hyper_util::client::legacy::{Client, Error as ClientError};
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower_llm_retry::mock::{sse, MockServer, Protocol, Reply, Script, SseFrame};

type HttpsClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;
type H2cClient = Client<HttpConnector, Full<Bytes>>;

/// TCP for the clients. Without `TCP_NODELAY`, Nagle's algorithm holds a
/// request's second small write (an HTTP/2 `DATA` frame after its `HEADERS`)
/// until the server's delayed ACK, about 40 ms of real time, which paused
/// time never waits for.
fn tcp() -> HttpConnector {
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.enforce_http(false);
    tcp
}

/// A client trusting only `server`'s CA, offering `h2` and `http/1.1` by ALPN.
fn https_client(server: &MockServer) -> HttpsClient {
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(server.tls_client_config().expect("a TLS server"))
        .https_only()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tcp());
    Client::builder(TokioExecutor::new()).build(connector)
}

/// A client trusting only `server`'s CA, offering no ALPN: `hyper-rustls`
/// names no protocol when HTTP/1.1 is the only one enabled.
fn https_h1_client(server: &MockServer) -> HttpsClient {
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config(server.tls_client_config().expect("a TLS server"))
        .https_only()
        .enable_http1()
        .wrap_connector(tcp());
    Client::builder(TokioExecutor::new()).build(connector)
}

/// HTTP/2 with prior knowledge over plain TCP.
fn h2c_client() -> H2cClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build(tcp())
}

async fn tls_server(script: Script) -> MockServer {
    MockServer::builder(script).tls(true).start().await.unwrap()
}

fn post<C>(
    client: &Client<C, Full<Bytes>>,
    server: &MockServer,
    body: &'static str,
) -> impl Future<Output = Result<Response<Incoming>, ClientError>>
where
    C: Connect + Clone + Send + Sync + 'static,
{
    let request = Request::post(server.uri("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-test")
        .body(Full::from(body))
        .unwrap();
    client.request(request)
}

async fn body_bytes(response: Response<Incoming>) -> Bytes {
    response.into_body().collect().await.unwrap().to_bytes()
}

/// The `T` somewhere in `err`'s source chain, `err` included.
fn find_source<'a, T: StdError + 'static>(err: &'a (dyn StdError + 'static)) -> &'a T {
    let mut next = Some(err);
    while let Some(err) = next {
        if let Some(found) = err.downcast_ref::<T>() {
            return found;
        }
        next = err.source();
    }
    panic!("no {} in {}", std::any::type_name::<T>(), error_chain(err));
}

fn h2_error<'a>(err: &'a (dyn StdError + 'static)) -> &'a h2::Error {
    find_source(err)
}

fn error_chain(err: &dyn StdError) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(err) = source {
        text.push_str(": ");
        text.push_str(&err.to_string());
        source = err.source();
    }
    text
}

/// Reads `response`'s body to its end or its error.
async fn read_body(response: Response<Incoming>) -> (Vec<u8>, Option<hyper::Error>) {
    let mut body = response.into_body();
    let mut received = Vec::new();
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => received.extend_from_slice(&frame.into_data().unwrap()),
            Err(err) => return (received, Some(err)),
        }
    }
    (received, None)
}

async fn wait_for_requests(server: &MockServer, n: usize) {
    for _ in 0..5000 {
        if server.request_count() >= n {
            return;
        }
        tokio::task::yield_now().await;
    }
    panic!("expected {n} requests, got {}", server.request_count());
}

#[tokio::test(start_paused = true)]
async fn http1_over_tls() {
    let server = MockServer::builder(Script::new())
        .tls(true)
        .protocol(Protocol::Http1)
        .start()
        .await
        .unwrap();
    assert!(server.url("/v1/messages").starts_with("https://127.0.0.1:"));

    // Offering h2 too, the client gets the only protocol the server offers.
    let response = post(&https_client(&server), &server, r#"{"model":"claude-x"}"#)
        .await
        .unwrap();
    assert_eq!(response.version(), Version::HTTP_11);
    assert_eq!(response.status(), StatusCode::OK);
    let message: Value = serde_json::from_slice(&body_bytes(response).await).unwrap();
    assert_eq!(message["model"], "claude-x");

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(requests[0].version, Version::HTTP_11);
    assert_eq!(requests[0].body, r#"{"model":"claude-x"}"#);
    assert_eq!(requests[0].headers["x-api-key"], "sk-test");
}

#[tokio::test(start_paused = true)]
async fn http2_over_tls_by_alpn() {
    let server = tls_server(Script::new().then(Reply::rate_limited("7"))).await;
    let client = https_client(&server);

    let response = post(&client, &server, r#"{"n":1}"#).await.unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(response.headers()["retry-after"], "7");
    let body = body_bytes(response).await;
    assert_eq!(
        body,
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"Number of requests has exceeded your rate limit. Please try again later."}}"#
    );

    let response = post(&client, &server, r#"{"n":2}"#).await.unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    let content_length: usize = response.headers()["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(body_bytes(response).await.len(), content_length);

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    for (request, body) in requests.iter().zip([r#"{"n":1}"#, r#"{"n":2}"#]) {
        assert_eq!(request.version, Version::HTTP_2);
        assert_eq!(request.method, http::Method::POST);
        assert_eq!(request.uri.path(), "/v1/messages");
        assert_eq!(request.headers["x-api-key"], "sk-test");
        assert_eq!(request.body, body);
    }
}

#[tokio::test(start_paused = true)]
async fn auto_over_tls_serves_a_client_that_offers_only_http1() {
    let server = tls_server(Script::new()).await;

    let response = post(&https_h1_client(&server), &server, "{}")
        .await
        .unwrap();
    assert_eq!(response.version(), Version::HTTP_11);
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.requests()[0].version, Version::HTTP_11);
}

/// A TLS handshake with `server` naming `host`, offering `alpn`.
async fn handshake(
    server: &MockServer,
    host: &'static str,
    alpn: &[&[u8]],
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut config = server.tls_client_config().unwrap();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(server.addr()).await?;
    let name = rustls::pki_types::ServerName::try_from(host).unwrap();
    connector.connect(name, tcp).await
}

/// The TLS error a failed handshake carries (`io::Error::source` skips it).
fn rustls_error(err: &std::io::Error) -> &rustls::Error {
    err.get_ref()
        .and_then(|e| e.downcast_ref())
        .unwrap_or_else(|| panic!("not a TLS error: {err:?}"))
}

#[tokio::test(start_paused = true)]
async fn alpn_offers_what_the_protocol_allows_for_localhost_and_127_0_0_1() {
    let auto = tls_server(Script::new()).await;
    let http2 = MockServer::builder(Script::new())
        .tls(true)
        .protocol(Protocol::Http2)
        .start()
        .await
        .unwrap();
    let http1 = MockServer::builder(Script::new())
        .tls(true)
        .protocol(Protocol::Http1)
        .start()
        .await
        .unwrap();
    let both: &[&[u8]] = &[b"h2", b"http/1.1"];

    for host in ["localhost", "127.0.0.1"] {
        let tls = handshake(&auto, host, both).await.unwrap();
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "{host}");
        let tls = handshake(&http1, host, both).await.unwrap();
        assert_eq!(
            tls.get_ref().1.alpn_protocol(),
            Some(&b"http/1.1"[..]),
            "{host}"
        );
    }

    // A client that speaks only HTTP/1.1 is refused by an HTTP/2-only server.
    let err = handshake(&http2, "localhost", &[b"http/1.1"])
        .await
        .unwrap_err();
    let tls = rustls_error(&err);
    assert!(
        matches!(
            tls,
            rustls::Error::AlertReceived(rustls::AlertDescription::NoApplicationProtocol)
        ),
        "{tls:?}"
    );

    // A name the certificate does not carry is refused by the client.
    let err = handshake(&auto, "example.com", both).await.unwrap_err();
    let tls = rustls_error(&err);
    assert!(
        matches!(tls, rustls::Error::InvalidCertificate(_)),
        "{tls:?}"
    );
    assert_eq!(
        auto.request_count() + http1.request_count() + http2.request_count(),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn the_ca_is_handed_out_in_every_form() {
    let server = tls_server(Script::new()).await;
    let pem = server.ca_cert_pem().unwrap();
    assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
    let der = server.ca_cert_der().unwrap();
    // The PEM is the DER, armoured.
    let from_pem = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
    assert_eq!(&from_pem, der);
    let roots = server.root_cert_store().unwrap();
    assert_eq!(roots.len(), 1);
    let config = server.tls_client_config().unwrap();
    assert!(config.alpn_protocols.is_empty(), "left to the connector");

    let plain = MockServer::start(Script::new()).await.unwrap();
    assert!(plain.ca_cert_pem().is_none());
    assert!(plain.ca_cert_der().is_none());
    assert!(plain.root_cert_store().is_none());
    assert!(plain.tls_client_config().is_none());
    assert!(plain.url("/x").starts_with("http://"));
}

#[tokio::test(start_paused = true)]
async fn h2c_with_prior_knowledge_and_http1_share_a_plain_server() {
    let server = MockServer::start(Script::new()).await.unwrap();

    let response = post(&h2c_client(), &server, r#"{"via":"h2c"}"#)
        .await
        .unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.status(), StatusCode::OK);
    body_bytes(response).await;

    let http1: H2cClient = Client::builder(TokioExecutor::new()).build(tcp());
    let response = post(&http1, &server, r#"{"via":"h1"}"#).await.unwrap();
    assert_eq!(response.version(), Version::HTTP_11);
    body_bytes(response).await;

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].version, Version::HTTP_2);
    assert_eq!(requests[0].body, r#"{"via":"h2c"}"#);
    assert_eq!(requests[1].version, Version::HTTP_11);
    assert_eq!(requests[1].body, r#"{"via":"h1"}"#);
}

#[tokio::test(start_paused = true)]
async fn plain_http2_only_serves_h2c() {
    let server = MockServer::builder(Script::new())
        .protocol(Protocol::Http2)
        .start()
        .await
        .unwrap();
    let response = post(&h2c_client(), &server, "{}").await.unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(server.requests()[0].version, Version::HTTP_2);
}

#[tokio::test(start_paused = true)]
async fn sse_over_h2_and_tls_arrives_byte_identical() {
    let events: Vec<SseFrame> = sse::anthropic_message(&["Hel", "lo", ", wor", "ld"])
        .into_iter()
        .enumerate()
        .map(|(i, event)| event.after(Duration::from_millis(50 * i as u64)))
        .collect();
    let expected: Vec<u8> = events.iter().flat_map(|e| e.bytes()).collect();
    let total_delay: Duration = (0..events.len())
        .map(|i| Duration::from_millis(50 * i as u64))
        .sum();
    let server = tls_server(Script::new().then(Reply::sse(events))).await;

    let start = Instant::now();
    let response = post(&https_client(&server), &server, "{}").await.unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let (received, err) = read_body(response).await;
    assert!(err.is_none(), "{err:?}");
    assert_eq!(start.elapsed(), total_delay);
    assert_eq!(
        Sha256::digest(&received),
        Sha256::digest(&expected),
        "{}",
        String::from_utf8_lossy(&received)
    );
    assert_eq!(received, expected);
}

#[tokio::test(start_paused = true)]
async fn refused_stream_is_rst_stream_refused_stream() {
    let server = tls_server(Script::new().then(Reply::refused_stream())).await;
    let client = https_client(&server);

    let err = post(&client, &server, r#"{"n":1}"#).await.unwrap_err();
    let h2 = h2_error(&err);
    assert!(h2.is_reset(), "{}", error_chain(&err));
    assert!(h2.is_remote(), "{}", error_chain(&err));
    assert_eq!(h2.reason(), Some(h2::Reason::REFUSED_STREAM));

    // The connection carries on: the next request is the next stream on it.
    let response = post(&client, &server, r#"{"n":2}"#).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].body, r#"{"n":1}"#);
    assert_eq!(requests[1].body, r#"{"n":2}"#);
    assert!(requests.iter().all(|r| r.version == Version::HTTP_2));
}

#[tokio::test(start_paused = true)]
async fn reset_stream_after_head_fails_the_body_with_internal_error() {
    let server = tls_server(Script::new().then(Reply::reset_stream_after_head(200))).await;
    let client = https_client(&server);

    let response = post(&client, &server, r#"{"n":1}"#).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let (received, err) = read_body(response).await;
    assert!(received.is_empty());
    let err = err.expect("the body fails");
    let h2 = h2_error(&err);
    assert!(h2.is_reset(), "{}", error_chain(&err));
    assert_eq!(h2.reason(), Some(h2::Reason::INTERNAL_ERROR));

    let response = post(&client, &server, r#"{"n":2}"#).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0].body, r#"{"n":1}"#);
}

#[tokio::test(start_paused = true)]
async fn sse_then_reset_stream_fails_one_stream_only() {
    let events = sse::openai_chat(&["Hi"]);
    let sent: Vec<SseFrame> = events[..2].to_vec();
    let expected: Vec<u8> = sent.iter().flat_map(|e| e.bytes()).collect();
    let server = tls_server(
        Script::new()
            // A slow neighbour on the same connection.
            .then(Reply::success().delay(Duration::from_secs(2)))
            .then(Reply::sse_then_reset_stream(sent).delay(Duration::from_secs(1))),
    )
    .await;
    let client = https_client(&server);

    let slow = tokio::spawn(post(&client, &server, r#"{"n":1}"#));
    wait_for_requests(&server, 1).await;
    let response = post(&client, &server, r#"{"n":2}"#).await.unwrap();
    let (received, err) = read_body(response).await;
    assert_eq!(received, expected);
    let err = err.expect("the stream is reset");
    assert_eq!(h2_error(&err).reason(), Some(h2::Reason::INTERNAL_ERROR));

    let response = slow.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    body_bytes(response).await;
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn goaway_fails_the_streams_above_its_last_stream_id() {
    let server = tls_server(
        Script::new()
            // Stream 1: at the last-stream-id, so it completes.
            .then(Reply::success().delay(Duration::from_secs(2)))
            // Stream 3: sends GOAWAY with last-stream-id 1 after a second.
            .then(Reply::goaway().delay(Duration::from_secs(1)))
            // Stream 5: in flight above the last-stream-id, so it fails.
            .then(Reply::success().delay(Duration::from_secs(2))),
    )
    .await;
    let client = https_client(&server);

    let start = Instant::now();
    let first = tokio::spawn(post(&client, &server, r#"{"stream":1}"#));
    wait_for_requests(&server, 1).await;
    let second = tokio::spawn(post(&client, &server, r#"{"stream":3}"#));
    wait_for_requests(&server, 2).await;
    let third = tokio::spawn(post(&client, &server, r#"{"stream":5}"#));
    wait_for_requests(&server, 3).await;

    for refused in [second, third] {
        let err = refused.await.unwrap().unwrap_err();
        let h2 = h2_error(&err);
        assert!(h2.is_go_away(), "{}", error_chain(&err));
        assert!(h2.is_remote(), "{}", error_chain(&err));
        assert_eq!(h2.reason(), Some(h2::Reason::NO_ERROR));
    }
    assert_eq!(start.elapsed(), Duration::from_secs(1));

    let response = first.await.unwrap().unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.version(), Version::HTTP_2);
    let message: Value = serde_json::from_slice(&body_bytes(response).await).unwrap();
    assert_eq!(message["type"], "message");
    assert_eq!(start.elapsed(), Duration::from_secs(2));

    // The client moves to a new connection; the server answers it.
    let response = post(&client, &server, r#"{"stream":"new"}"#).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    let bodies: Vec<Bytes> = server.requests().into_iter().map(|r| r.body).collect();
    assert_eq!(
        bodies,
        [
            r#"{"stream":1}"#,
            r#"{"stream":3}"#,
            r#"{"stream":5}"#,
            r#"{"stream":"new"}"#
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn goaway_on_the_first_stream_refuses_everything() {
    let server = MockServer::start(Script::new().then(Reply::goaway()))
        .await
        .unwrap();
    let client = h2c_client();

    let err = post(&client, &server, "{}").await.unwrap_err();
    let h2 = h2_error(&err);
    assert!(h2.is_go_away(), "{}", error_chain(&err));
    assert_eq!(server.request_count(), 1);

    let response = post(&client, &server, "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.request_count(), 2);
}

#[tokio::test(start_paused = true)]
async fn connection_dropped_mid_stream_fails_every_stream_on_it() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::stall_mid_body(200, "partial"))
            .then(Reply::sse_then_reset(vec![SseFrame::data("one")])),
    )
    .await
    .unwrap();
    let client = h2c_client();

    let stalled = post(&client, &server, r#"{"n":1}"#).await.unwrap();
    assert_eq!(stalled.version(), Version::HTTP_2);
    let mut stalled = stalled.into_body();
    let first = stalled.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "partial");

    let response = post(&client, &server, r#"{"n":2}"#).await.unwrap();
    let (received, err) = read_body(response).await;
    assert_eq!(received, b"data: one\n\n");
    let err = err.expect("the connection is dropped");
    let h2 = h2_error(&err);
    assert!(h2.is_io(), "{}", error_chain(&err));

    // The stalled neighbour goes down with the connection.
    let err = tokio::time::timeout(Duration::from_secs(1), stalled.frame())
        .await
        .expect("the stalled stream ends with the connection")
        .unwrap()
        .unwrap_err();
    assert!(h2_error(&err).is_io(), "{}", error_chain(&err));

    let requests = server.requests();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].body, r#"{"n":2}"#);
}

#[tokio::test(start_paused = true)]
async fn http2_faults_degrade_on_http1() {
    let server = MockServer::builder(
        Script::new()
            .then(Reply::refused_stream())
            .then(Reply::goaway())
            .then(Reply::reset_stream_after_head(200)),
    )
    .protocol(Protocol::Http1)
    .start()
    .await
    .unwrap();
    let client: H2cClient = Client::builder(TokioExecutor::new()).build(tcp());

    for body in [r#"{"n":1}"#, r#"{"n":2}"#] {
        let err = post(&client, &server, body).await.unwrap_err();
        let hyper_err: &hyper::Error = find_source(&err);
        assert!(hyper_err.is_incomplete_message(), "{}", error_chain(&err));
    }

    let response = post(&client, &server, r#"{"n":3}"#).await.unwrap();
    assert_eq!(response.version(), Version::HTTP_11);
    assert_eq!(response.status(), StatusCode::OK);
    let (received, err) = read_body(response).await;
    assert!(received.is_empty());
    assert!(err.is_some(), "the body fails");

    let requests = server.requests();
    assert_eq!(requests.len(), 3);
    assert!(requests.iter().all(|r| r.version == Version::HTTP_11));
    assert_eq!(requests[2].body, r#"{"n":3}"#);
}

#[tokio::test(start_paused = true)]
async fn shutdown_fails_in_flight_h2_streams() {
    let server = tls_server(
        Script::new()
            .then(Reply::stall())
            .then(Reply::sse_then_stall(vec![SseFrame::data("one")])),
    )
    .await;
    let client = https_client(&server);

    let stalled = tokio::spawn(post(&client, &server, "{}"));
    wait_for_requests(&server, 1).await;
    let response = post(&client, &server, "{}").await.unwrap();
    assert_eq!(response.version(), Version::HTTP_2);
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(first, "data: one\n\n");

    server.shutdown();
    let err = tokio::time::timeout(Duration::from_secs(1), stalled)
        .await
        .expect("shutdown closes the connection")
        .unwrap()
        .unwrap_err();
    assert!(!err.is_connect(), "{}", error_chain(&err));
    let next = tokio::time::timeout(Duration::from_secs(1), body.frame())
        .await
        .expect("shutdown ends the stream");
    assert!(matches!(next, Some(Err(_))), "{next:?}");
}

#[tokio::test(start_paused = true)]
async fn bodiless_statuses_carry_no_content_length_on_h2() {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(204))
            .then(Reply::status(200)),
    )
    .await
    .unwrap();
    let client = h2c_client();

    let response = post(&client, &server, "{}").await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    assert!(response.headers().get("content-length").is_none());
    assert!(body_bytes(response).await.is_empty());

    let response = post(&client, &server, "{}").await.unwrap();
    assert_eq!(response.headers()["content-length"], "0");
    assert!(body_bytes(response).await.is_empty());
}
