//! Failover to a second upstream with its own key, and a circuit that keeps later requests
//! off a primary that is down.
//!
//! ```text
//! cargo run --example failover --features mock
//! ```
//!
//! Two mock servers stand in for the providers: the primary answers `503` to everything, the
//! second gateway answers only requests that carry its own key. The first request fails over
//! after one failure; once the primary's circuit is open, the next ones start on the gateway
//! at once.

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::{ServiceBuilder, ServiceExt};
use tower_llm_retry::fallback::{Circuit, ModelUsed, Target};
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::{ApiKey, AuthLayer, ModelFallbackLayer, ReplayBody, RetryLayer, RetryPolicy};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let primary = MockServer::start(Script::always(Reply::status(503))).await?;
    let gateway =
        MockServer::start(Script::new().require_header("x-api-key", ["sk-gateway"])).await?;

    let fallback = ModelFallbackLayer::new([
        Target::new("claude-sonnet-4-5"),
        Target::new("claude-sonnet-4-5")
            .upstream(&gateway.url("/anthropic"))?
            .credential(ApiKey::new("sk-gateway")?),
    ])?
    .after_failures(1)?
    .circuit(Circuit::new().failures(2).cooldown(Duration::from_secs(30)))?;

    let client = Client::builder(TokioExecutor::new()).build_http::<ReplayBody>();
    let llm = ServiceBuilder::new()
        .layer(RetryLayer::new().policy(RetryPolicy::interactive()))
        .layer(fallback.clone())
        .layer(AuthLayer::new(ApiKey::new("sk-primary")?))
        .service(client);

    for i in 1..=4 {
        let request = Request::post(primary.uri("/v1/messages"))
            .header("content-type", "application/json")
            .header("anthropic-version", "2023-06-01")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"claude-sonnet-4-5","max_tokens":256,"messages":[{"role":"user","content":"Hello"}]}"#,
            )))?;
        let response = llm.clone().oneshot(request).await?;
        let used = response
            .extensions()
            .get::<ModelUsed>()
            .expect("set on every response");
        let tries: Vec<String> = used
            .attempts
            .iter()
            .map(|t| {
                let at = t
                    .upstream
                    .as_ref()
                    .map_or("own".to_owned(), |u| u.to_string());
                format!("{} at {at}: {}", t.model, t.attempts)
            })
            .collect();
        println!(
            "request {i}: {} from {} (attempts: {})",
            response.status(),
            used.upstream
                .as_ref()
                .map_or("the primary".to_owned(), |u| u.to_string()),
            if tries.is_empty() {
                "one".to_owned()
            } else {
                tries.join(", ")
            },
        );
    }
    for target in fallback.circuit_states() {
        println!(
            "{} at {}: {:?}",
            target.model,
            target
                .upstream
                .as_ref()
                .map_or("own".to_owned(), |u| u.to_string()),
            target.state
        );
    }
    println!(
        "the primary saw {} requests, the gateway {}",
        primary.request_count(),
        gateway.request_count()
    );
    Ok(())
}
