//! A rig provider client whose requests go through this crate's retry loop: rig takes a
//! `reqwest_middleware::ClientWithMiddleware` as its HTTP client, and `RetryMiddleware` is
//! one of its middlewares. rig itself does not retry.
//!
//! Runs against the crate's mock server, which rate-limits the first request:
//! `cargo run --manifest-path examples/rig/Cargo.toml`. For the real API, drop the mock and
//! the `base_url`, give the key (`ANTHROPIC_API_KEY`), and build the reqwest client with a TLS
//! backend (rig's feature turns on reqwest's `rustls`).

use rig_core::client::CompletionClient;
use rig_core::completion::{AssistantContent, CompletionModel};
use rig_core::providers::anthropic;
use tower_llm_retry::mock::{MockServer, Reply, Script};
use tower_llm_retry::reqwest_middleware::RetryMiddleware;
use tower_llm_retry::{RetryLayer, RetryPolicy};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let server = MockServer::start(
        Script::new()
            .then(Reply::rate_limited("1"))
            .then(Reply::success()),
    )
    .await?;

    // reqwest's own protocol-error retry off: this crate's loop is the only one.
    let http = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .retry(reqwest::retry::never())
            .build()?,
    )
    .with(RetryMiddleware::new(
        RetryLayer::new().policy(RetryPolicy::default()),
    ))
    .build();

    let client = anthropic::Client::builder()
        .api_key("sk-ant-mock")
        .base_url(server.url(""))
        .http_client(http)
        .build()?;
    let model = client.completion_model("claude-sonnet-4-5");
    let request = model.completion_request("Hello").max_tokens(64).build();
    let response = model.completion(request).await?;
    for item in response.choice {
        if let AssistantContent::Text(text) = item {
            println!("answer: {}", text.text);
        }
    }
    println!("attempts the server saw: {}", server.request_count());
    Ok(())
}
