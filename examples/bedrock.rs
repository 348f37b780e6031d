//! Claude on Amazon Bedrock's Anthropic-compatible endpoint: the Messages API at
//! `…/anthropic/v1/messages`, a Bedrock API key as `authorization: Bearer`, and Bedrock's
//! throttling (`ThrottlingException`, `x-amz-retry-after` in milliseconds) waited out.
//!
//! ```text
//! cargo run --example bedrock --features mock
//! ```
//!
//! The mock stands in for `https://bedrock-runtime.us-east-1.amazonaws.com`: it throttles the
//! first request for 1.5 s, then answers. Against the real endpoint: an HTTPS client (the
//! quick start's hyper-rustls one) and the key from `AWS_BEARER_TOKEN_BEDROCK`.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::auth::CredentialHeader;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ApiKey, AuthLayer, ReplayBody, RetryLayer, RetryTrail};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let bedrock = MockServer::start(
        Script::new()
            .then(Reply::bedrock_throttled(1500))
            .then(Reply::success()),
    )
    .await?;
    let key =
        std::env::var("AWS_BEARER_TOKEN_BEDROCK").unwrap_or_else(|_| "bedrock-api-key-mock".into());

    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new())
        .layer(AuthLayer::new(ApiKey::with_header(
            &key,
            CredentialHeader::Bearer,
        )?))
        .service(Client::builder(TokioExecutor::new()).build_http::<ReplayBody>());

    let request = http::Request::post(bedrock.url("/anthropic/v1/messages"))
        .header("content-type", "application/json")
        .header("anthropic-version", "2023-06-01")
        .body(Full::new(Bytes::from_static(
            br#"{"model":"global.anthropic.claude-sonnet-4-5-20250929-v1:0","max_tokens":64,"messages":[{"role":"user","content":"Hello"}]}"#,
        )))?;
    let response = llm.oneshot(request).await?;
    let trail = response.extensions().get::<RetryTrail>().cloned();
    println!(
        "{} after {} attempts (slept {:?})",
        response.status(),
        trail.as_ref().map_or(1, RetryTrail::total_attempts),
        trail
            .as_ref()
            .map(RetryTrail::total_delay)
            .unwrap_or_default(),
    );
    let body = response.into_body().collect().await?.to_bytes();
    println!("{}", String::from_utf8_lossy(&body));
    Ok(())
}
