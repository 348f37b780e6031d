//! The retry layer over hyper-util's legacy client: the most direct way to use the crate.
//!
//! ```text
//! cargo run --example hyper_client
//! ```
//!
//! Against a real API, give the client a TLS connector, e.g. with `hyper-rustls`:
//!
//! ```text
//! let https = hyper_rustls::HttpsConnectorBuilder::new()
//!     .with_native_roots()?
//!     .https_only()
//!     .enable_http1()
//!     .build();
//! let client = Client::builder(TokioExecutor::new()).build::<_, ReplayBody>(https);
//! ```
//!
//! Nothing else changes: the layer only needs a `Service<http::Request<ReplayBody>>`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ReplayBody, RetryLayer, RetryPolicy, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = MockServer::start(
        Script::new()
            .then(Reply::status(503))
            .then(Reply::success()),
    )
    .await?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
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
    println!("{} after {attempts} attempts", res.status());
    let body = res.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    Ok(())
}
