//! The whole stack on top of a `reqwest::Client` (feature `reqwest`), over HTTPS with HTTP/2
//! negotiated by ALPN.
//!
//! ```text
//! cargo run --example reqwest_client --features mock,reqwest
//! ```
//!
//! This crate leaves reqwest's TLS to the application. The example enables reqwest's
//! `rustls-no-provider` and `http2` features and installs `ring` as the rustls provider; with
//! reqwest's `rustls` feature (aws-lc-rs) that line goes. The mock's certificate authority,
//! made at start, is the only root trusted; against a real API, leave `tls_certs_only` out.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::reqwest::ReqwestService;
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = MockServer::builder(
        Script::new()
            .then(Reply::overloaded().header("retry-after-ms", "250"))
            .then(Reply::success()),
    )
    .tls(true)
    .start()
    .await?;
    // rustls' provider for reqwest (built with `rustls-no-provider`): ring, as the mock uses.
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The mock's certificate authority, and no other root.
    let ca = server.ca_cert_pem().expect("the mock serves TLS");
    let ca = reqwest::Certificate::from_pem(ca.as_bytes())?;

    // reqwest's own retry is turned off: this layer is the one retry authority, otherwise
    // attempts multiply (reqwest 0.13 retries some HTTP/2 protocol errors by default).
    let client = reqwest::Client::builder()
        .tls_certs_only([ca])
        .retry(reqwest::retry::never())
        .timeout(Duration::from_secs(600))
        .build()?;
    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::default()))
        .service(ReqwestService::new(client));

    let req = http::Request::post(server.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"gpt-4.1","messages":[{"role":"user","content":"Hi"}]}"#,
        )))?;
    let res = llm.oneshot(req).await?;
    let trail = res.extensions().get::<RetryTrail>().cloned();
    println!(
        "{} over {:?} after {} attempts (slept {:?})",
        res.status(),
        res.version(),
        trail.as_ref().map_or(1, RetryTrail::total_attempts),
        trail
            .as_ref()
            .map(RetryTrail::total_delay)
            .unwrap_or_default()
    );
    let body = res.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    Ok(())
}
