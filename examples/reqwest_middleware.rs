//! Using the crate as a `reqwest_middleware::Middleware` (feature `reqwest-middleware`),
//! where `reqwest-retry`'s `RetryTransientMiddleware` would go.
//!
//! ```text
//! cargo run --example reqwest_middleware --features mock,reqwest-middleware
//! ```

use reqwest_middleware::ClientBuilder;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::reqwest_middleware::RetryMiddleware;
use tower_llm_retry::{RetryLayer, RetryPolicy, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("1"))
            .then(Reply::success()),
    )
    .await?;

    // rustls' provider for reqwest, built here with `rustls-no-provider` (see reqwest_client).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = ClientBuilder::new(
        reqwest::Client::builder()
            .retry(reqwest::retry::never())
            .build()?,
    )
    .with(RetryMiddleware::new(
        RetryLayer::new().policy(RetryPolicy::sdk_compatible()),
    ))
    .build();

    let res = client
        .post(server.url("/v1/messages"))
        .header("content-type", "application/json")
        .body(r#"{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}"#)
        .send()
        .await?;
    let attempts = res
        .extensions()
        .get::<RetryTrail>()
        .map_or(1, RetryTrail::total_attempts);
    println!("{} after {attempts} attempts", res.status());
    println!("{}", res.text().await?);
    Ok(())
}
