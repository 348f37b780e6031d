//! The retry layer over hyper-util's legacy client, over HTTPS with HTTP/1.1 and HTTP/2: the
//! most direct way to use the crate.
//!
//! ```text
//! cargo run --example hyper_client --features mock
//! ```
//!
//! The mock serves TLS with a certificate authority made at start, and the client trusts that
//! CA alone. Against a real API, trust the usual roots instead (hyper-rustls'
//! `.with_native_roots()?` or `.with_webpki_roots()`); nothing else changes: the layer only
//! needs a `Service<http::Request<ReplayBody>>`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_rustls::HttpsConnectorBuilder;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // HTTPS, offering h2 and http/1.1 by ALPN.
    let server = MockServer::builder(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::success()),
    )
    .tls(true)
    .start()
    .await?;

    // Small writes (an h2 DATA frame after its HEADERS) go out at once, not after a delayed ACK.
    let mut tcp = HttpConnector::new();
    tcp.set_nodelay(true);
    tcp.enforce_http(false);
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(server.tls_client_config().expect("the mock serves TLS"))
        .https_only()
        .enable_http1()
        .enable_http2()
        .wrap_connector(tcp);
    let client = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(https);
    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::interactive()))
        .service(client);

    let req = http::Request::post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}"#,
        )))?;
    let res = llm.oneshot(req).await?;
    let attempts = res
        .extensions()
        .get::<RetryTrail>()
        .map_or(1, RetryTrail::total_attempts);
    println!(
        "{} over {:?} after {attempts} attempts",
        res.status(),
        res.version()
    );
    let body = res.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    Ok(())
}
